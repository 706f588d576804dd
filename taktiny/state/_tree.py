"""The state functions, for a module or any PyTree (an optimizer state, a dict of models),
and values chosen by name. A module's state methods are these functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import taktiny.state._layers as _layers
import taktiny.state._names as _names
import taktiny.state._patterns as _patterns
import taktiny.state._state as _state

from ._selection import SelectionError, rule_problems

MISSING: Any = dataclasses.MISSING  # no default given


def state_dict(tree: Any, *, unstacked: bool = False) -> dict[str, Any]:
    """The leaves of any PyTree as nested dicts, named as a module's state is named.

    Modules and the lists, tuples (named tuples too) and dicts that hold them are walked
    into; their keys are attribute names, positions ("0", "1", ...) and dict keys. So the
    state of ``optax.adam``'s optimizer state reads
    ``{"0": {"count": ..., "mu": {"encoder": ...}, "nu": {...}}}``. For a module this is
    ``tree.state_dict()``.

    Args:
        tree: a module, or a container of arrays and modules.
        unstacked: give each stack of layers (:class:`taktiny.nn.Stack`) per layer, under
            the stack's name and the layer's index (``{"layers": {"0": ...}}``) instead of
            its block's stacked arrays (``{"layers": {"block": ...}}``), as a list of the
            same blocks gives them: a stacked :class:`~taktiny.QArray` as one QArray a
            layer; see :func:`flat_state_dict`.

    Returns:
        Nested dicts whose leaves are the tree's own arrays and custom parameters (no
        copies; with `unstacked`, a stack's leaves are slices, which are copies).
    """
    leaves, _, spec = _names.flatten(tree)
    if unstacked and spec.stacks:
        return _layers.nest(_layers.unstacked(spec, leaves, params=True))
    return _names.nested(spec.template, leaves)


def flat_state_dict(tree: Any, *, unstacked: bool = False) -> dict[str, Any]:
    """The leaves of any PyTree under dotted names (``"0.mu.encoder.kernel"``), in the
    order JAX flattens the tree; see :func:`state_dict`.

    A stack of layers (:class:`taktiny.nn.Stack`) at ``layers`` reads stacked: its
    block's leaves, ``layers.block.attention.query.kernel`` of shape ``[count, ...]``.
    With ``unstacked=True`` it reads per layer, as a list of blocks would:
    ``layers.0.attention.query.kernel``, ``layers.1...``, each a slice ``[...]``, the
    layers in order. Every load takes either form.

    Args:
        tree: a module, or a container of arrays and modules.
        unstacked: give each stack's leaves per layer.

    Returns:
        One flat dict from each leaf's dotted name to the leaf itself (no copies; with
        `unstacked`, a stack's slices, which are copies).
    """
    leaves, _, spec = _names.flatten(tree)
    if unstacked and spec.stacks:
        return _layers.unstacked(spec, leaves)
    return dict(zip(spec.names, leaves, strict=True))


def load_state_dict(
    tree: Any, state: Mapping[str, Any], *, strict: bool = False, match_quantization: bool = False
) -> Any:
    """Returns a copy of `tree` with the leaves the nested `state` names replaced.

    The same load as :meth:`Module.load_state_dict <taktiny.nn.Module.load_state_dict>`,
    for any PyTree: names not given keep their values, every value is checked against
    the leaf it replaces, and any problem raises one :class:`~taktiny.StateDictError`
    with nothing loaded. With it, part of an optimizer state can be restored (a new
    head keeps its fresh moments while the encoder's come from a checkpoint).
    ``match_quantization=True`` converts float values for :class:`~taktiny.QArray` leaves
    and quantized values for float leaves, as the method does.

    Args:
        tree: a module, or any PyTree holding arrays and modules; it is not changed.
        state: nested dicts of arrays, as :func:`state_dict` gives, for all or part of
            `tree`'s leaves.
        strict: whether `state` must name every leaf.
        match_quantization: convert a float value for a :class:`~taktiny.QArray` leaf
            (quantizing it as the leaf is) and a QArray for a float leaf (dequantizing
            it), instead of refusing them.

    Returns:
        A new tree of `tree`'s structure, each value cast to the dtype of the leaf it
        replaces.

    Raises:
        taktiny.StateDictError: naming every unknown, missing (with `strict`),
            misshapen or mistyped name; nothing is loaded.
    """
    return _state.load(
        tree, state, strict=strict, flat=False, match_quantization=match_quantization
    )


def load_flat_state_dict(
    tree: Any, flat: Mapping[str, Any], *, strict: bool = False, match_quantization: bool = False
) -> Any:
    """As :func:`load_state_dict`, for a dict of dotted names as :func:`flat_state_dict`
    gives.

    Args:
        tree: a module, or any PyTree holding arrays and modules; it is not changed.
        flat: ``{dotted name: array}`` for all or part of `tree`'s leaves.
        strict: whether `flat` must name every leaf.
        match_quantization: as for :func:`load_state_dict`.

    Returns:
        A new tree, as :func:`load_state_dict` returns.

    Raises:
        taktiny.StateDictError: as :func:`load_state_dict` raises it.
    """
    return _state.load(tree, flat, strict=strict, flat=True, match_quantization=match_quantization)


class by_name:  # a class used as a function: tt.by_name(rules)(model)
    """Values for the leaves of a tree chosen by their flat state names: labels for
    ``optax.multi_transform``, masks for freezing, a dtype per parameter.

    ``tt.by_name(rules, default=...)`` is a function from a tree to a tree of the same
    structure holding, at each leaf, the value of the first rule whose pattern matches
    the leaf's name (``"encoder.**"``, ``"*.bias"``, ``"layers.*.kernel"``: ``*``
    matches within one part of a name, a ``**`` part matches any number of parts).
    Pass the function itself to optax, which calls it with the parameters::

        labels = tt.by_name({"encoder.**": "frozen"}, default="train")
        optax.multi_transform({"train": optax.adam(1e-3), "frozen": optax.set_to_zero()},
                              labels)

    A tree whose names some rule does not reach needs `default`; a rule that matches no
    name is an error (it is usually a typo, or a group named without ``.**``).

    Args:
        rules: a dict ``{pattern: value}`` or a list of ``(pattern, value)`` pairs, tried
            in order.
        default: the value of leaves no rule matches.

    Raises:
        TypeError: `rules` is neither a dict nor a list of pairs.
        ValueError: a pattern is empty or not valid.
    """

    def __init__(self, rules: _patterns.Rules, *, default: Any = MISSING):
        self.rules = _patterns.rule_list(rules, "taktiny.by_name")
        for pattern, _ in self.rules:
            _patterns.compile_pattern(pattern)
        self.default = default

    def __call__(self, tree: Any) -> Any:
        """`tree` with each leaf replaced by the value its name selects.

        Args:
            tree: a module or any PyTree, concrete or abstract.

        Returns:
            `tree`'s structure with the value of the first matching rule (or `default`)
            at each leaf.

        Raises:
            taktiny.SelectionError: listing every rule that matches no name, with the
                closest names, and (without `default`) every name no rule matches; a
                ``ValueError``.
        """
        _, treedef, spec = _names.flatten(tree)
        found = _patterns.match(self.rules, spec.names, self.default)
        fix = None
        if self.default is MISSING:
            fix = (
                "add a rule for it (a last rule '**' matches everything), or pass default= "
                "(the value of the names no rule matches)"
            )
        problems = rule_problems(found, self.rules, spec.names, fix)
        if problems:
            raise SelectionError(f"taktiny.by_name on {type(tree).__name__}", problems)
        return treedef.unflatten(found.values)

    def __repr__(self) -> str:
        default = "" if self.default is MISSING else f", default={self.default!r}"
        return f"by_name({dict(self.rules)!r}{default})"
