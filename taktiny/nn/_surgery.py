"""Model surgery: choosing layers by name and swapping them, as `tt.lora`, `tt.merge_lora`,
`tt.quantize` and `tt.dequantize` do.

Each call names the layer classes it can change (its candidates: ``Linear`` and ``Embed``
for `quantize`) and takes one selection, ``where``: a pattern over the layers' flat names
in the language of `tt.by_name` and `tt.shard` (``state/_patterns.py``), a list of
them, or a function ``(name, layer) -> bool``; None chooses every candidate. A pattern
must match at least one candidate: one that matches none is a problem saying what it
matches instead (a module of another kind, a parameter) or naming the closest candidates,
and every such problem is raised at once, as one `SelectionError`. A function chooses
what it chooses, none included. The swap then replaces the chosen layers, each found by
its name; every other layer stays the very object it was.

The keyword is ``where`` in all four calls, as equinox's ``tree_at(where, ...)`` names
the parts of a model to replace: the calls read as a clause, ``tt.quantize(model,
where="encoder.**")``. `tt.by_name` and `tt.shard` take ``{pattern: value}`` rules
instead, whose patterns are the same language, matched and reported by the same code.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..module import Module, Rngs, fields_of
from ..quant import QArray, quantize_like, quantized
from ..state import (
    SelectionError,
    compile_pattern,
    flatten,
    key_name,
    layer_sharded,
    layer_slice,
    select,
    unmatched,
    unused_hint,
)
from ._embed import Embed
from ._linear import Linear
from ._lora import _ADAPTABLE, _ADAPTED, _EMBEDS, _LINEARS, LoRAEmbed, LoRALinear, _base, _scale
from ._quantized import QuantizedEmbed, QuantizedLinear, build

Selection = str | Sequence[str] | Callable[[str, Any], bool]
_LAYERS = (Linear, Embed, QuantizedLinear, QuantizedEmbed, LoRALinear, LoRAEmbed)


def renamed(where: Any, old: Any, old_name: str, caller: str) -> Any:
    """The selection passed as `where`, or under its deprecated keyword `old_name`, with a
    ``FutureWarning`` naming ``where``: a warning Python shows by default, wherever the
    call is (a ``DeprecationWarning`` is hidden unless the call is in ``__main__``)."""
    if old is None:
        return where
    if where is not None:
        raise TypeError(
            f"{caller}: pass the selection once, as where=; {old_name}= is its old name."
        )
    warnings.warn(
        f"{caller}: {old_name}= is now where= (the same patterns, or a function "
        f"(name, layer) -> bool); {old_name}= goes in the next release.",
        FutureWarning,
        stacklevel=3,
    )
    return old


def _is_layer(x: Any) -> bool:
    """Whether `x` is a layer of a family the surgery swaps: such a layer holds no module,
    so no walk goes into it, and one left alone stays the same object."""
    return isinstance(x, Module) and type(x)._taktiny_base in _LAYERS


def swap(model: Any, chosen: Mapping[str, Module], make: Callable[[str, Any, Any], Any]) -> Any:
    """`model` with each `chosen` layer (by flat name) replaced by ``make(name, layer,
    None)``; a layer in a stack of layers (:class:`~taktiny.nn.Stack`), whose arrays have
    the leading layer axis, by ``make(name, layer_i, i)`` for each layer ``i`` at once
    (``jax.vmap``, ``i`` traced), so that each layer is made as a layer of its own is."""
    spec = flatten(model)[2]

    def replace(path: Any, layer: Any) -> Any:
        if not _is_layer(layer):
            return layer
        name = ".".join(map(key_name, path))
        if name not in chosen:
            return layer
        stack = spec.stack_of(f"{name}.")  # (its leaves' names start so; a block's too)
        if stack is None:
            return make(name, layer, None)
        each = jax.vmap(lambda one, i: make(name, one, i), spmd_axis_name=stack.axis)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(layer)):
            return jax.eval_shape(each, layer, jnp.arange(stack.count))
        shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(layer)]
        meshes = [s.mesh for s in shardings if isinstance(s, NamedSharding)]
        if not meshes:
            return each(layer, jnp.arange(stack.count))
        # the layers' indices split as their layer axis is (vmap maps both alike); each
        # leaf the layer did not hold (an adapter drawn from a key: computed from nothing
        # placed) placed as one layer, made alone and abstract, places it, with the layer
        # axis the stack gives, as the leaves computed from the layer's are
        index = jax.device_put(jnp.arange(stack.count), NamedSharding(meshes[0], P(stack.axis)))
        made = each(layer, index)
        had = {path for path, _ in jax.tree_util.tree_flatten_with_path(layer)[0]}
        pairs, treedef = jax.tree_util.tree_flatten_with_path(made)
        if all(path in had for path, _ in pairs):
            return made
        alone = jax.tree.leaves(make(name, jax.tree.map(layer_sharded, layer), 0))
        placed = [
            x if path in had else _with_layer_axis(x, like, stack.axis)
            for (path, x), like in zip(pairs, alone, strict=True)
        ]
        return treedef.unflatten(placed)

    return jax.tree_util.tree_map_with_path(replace, model, is_leaf=_is_layer)


def _with_layer_axis(x: Any, like: Any, axis: str | None) -> Any:
    """The stacked `x` placed as one layer's `like` is, `axis` splitting the layer axis
    (as it is, where `like` is on no mesh)."""
    sharding = getattr(like, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return x
    return jax.device_put(x, NamedSharding(sharding.mesh, P(axis, *sharding.spec)))


def layer_of(layer: Any, index: int) -> Any:
    """Layer `index` of a layer whose arrays have the leading layer axis of a stack."""
    return jax.tree.map(lambda x: layer_slice(x, index), layer)


def choose(
    model: Any,
    where: Selection | None,
    candidates: Sequence[type[Module]],
    caller: str,
    others: Mapping[Any, str] | None = None,  # {layer class: what is wrong with it}
    *,
    what: str | None = None,
    takes: Callable[[Any], bool] = lambda layer: True,
) -> dict[str, Module]:
    """The layers of `model` of the `candidates` classes (or their subclasses) that
    `takes` and `where` choose, by flat name in the order of the tree. `others` says, for
    a layer class a pattern may match instead, what is wrong with it (``"already has an
    adapter; ..."``); `what` names the candidates in problems (by default their classes).
    Raises a TypeError for a `where` that is no selection, and one SelectionError naming
    each pattern that matches no candidate, or, for `where` None, saying that the model
    has no candidate (a call that would change nothing)."""
    bases = tuple(candidates)
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)[0]
    layers = {
        ".".join(map(key_name, p)): x
        for p, x in found
        if _is_layer(x) and type(x)._taktiny_base in bases and takes(x)
    }
    what = what or _kinds(bases)
    if where is None:
        if not layers:
            why = _none_there(model, others or {})
            raise SelectionError(
                f"{caller} on {type(model).__name__}",
                [unmatched("**", what, f"where=None chooses every one, and {why}")],
            )
        return layers
    if not isinstance(where, str) and callable(where):
        return {name: layer for name, layer in layers.items() if where(name, layer)}
    patterns = [where] if isinstance(where, str) else where
    if (
        not isinstance(patterns, Sequence)
        or not patterns
        or not all(isinstance(p, str) for p in patterns)
    ):
        raise TypeError(
            f"{caller}: where is a pattern over layer names ('**.attention.*'), a non-empty "
            f"list of them, or a function (name, layer) -> bool; got {where!r:.80}."
        )
    selected = select(patterns, list(layers))
    if selected.unused:
        why = _Why(model, layers, others or {})
        problems = [unmatched(p, what, why(p)) for p in dict.fromkeys(selected.unused)]
        raise SelectionError(f"{caller} on {type(model).__name__}", problems)
    hits = zip(layers.items(), selected.values, strict=True)
    return {name: layer for (name, layer), hit in hits if hit}


def _kinds(bases: Sequence[type]) -> str:
    """``"Linear or Embed layer"``, ``"A, B, C or D layer"``."""
    names = [b.__name__ for b in bases]
    return f"{', '.join(names[:-1])} or {names[-1]} layer" if len(names) > 1 else names[0]


def _none_there(model: Any, others: Mapping[type, str]) -> str:
    """Why a model has no candidate for a call: ``"the model has none, so this call would
    change nothing"``, and what its layers of the `others` kinds are (``"its Linear
    layers 'a' and 'b' have no adapter"``), so that the call says what it found instead."""
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)[0]
    by_kind: dict[type, list[str]] = {}
    for path, layer in found:
        if _is_layer(layer) and type(layer)._taktiny_base in others:
            name = ".".join(map(key_name, path))
            by_kind.setdefault(type(layer)._taktiny_base, []).append(repr(name))
    said = [
        f"its {kind.__name__} layer {names[0]} {others[kind]}"
        if len(names) == 1
        else f"its {kind.__name__} layers {_listed(names)} {_plural(others[kind])}"
        for kind, names in by_kind.items()
    ]
    return "the model has none, so this call would change nothing" + "".join(f"; {s}" for s in said)


def _listed(names: Sequence[str]) -> str:
    """``"'a', 'b' and 'c'"``; past four, ``"'a', 'b', 'c', 'd' and 5 more"``."""
    if len(names) > 4:
        return f"{', '.join(names[:4])} and {len(names) - 4} more"
    return f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]


def _plural(clause: str) -> str:
    """`clause` said of several layers: ``"is not quantized"`` -> ``"are not
    quantized"``, ``"has no adapter"`` -> ``"have no adapter"``."""
    verb, _, rest = clause.partition(" ")
    return f"{_PLURALS.get(verb, verb)} {rest}"


_PLURALS = {"is": "are", "has": "have"}


class _Why:
    """Why a pattern matches no candidate layer: what it matches instead (a module of
    another kind, a parameter), or the closest candidates."""

    def __init__(self, model: Any, layers: Mapping[str, Module], others: Mapping[type, str]):
        self.model, self.layers, self.others = model, layers, others
        self.modules = dict(_modules(model))

    def __call__(self, pattern: str) -> str:
        regex = compile_pattern(pattern)
        for name, module in self.modules.items():
            if name and regex.fullmatch("." + name):  # (not the root: only "**" matches it)
                kind = type(module)._taktiny_base
                if kind in self.others:
                    return f"it matches {name!r}, a {kind.__name__}, which {self.others[kind]}"
                inside = any(n.startswith(f"{name}.") for n in self.layers)
                tail = f"; name the layers inside it ('{pattern}.*' or '{pattern}.**')"
                return f"it matches {name!r}, a {kind.__name__}{tail if inside else ''}"
        if not self.layers:
            return "the model has none"
        leaves = flatten(self.model)[2].names
        leaf = next((n for n in leaves if regex.fullmatch("." + n)), None)
        if leaf is not None:
            if "." not in leaf:
                return f"it matches the parameter {leaf!r} of the model, a layer itself ('**')"
            layer = leaf.rsplit(".", 1)[0]
            return f"it matches the parameter {leaf!r}, not a layer; name the layer ({layer!r})"
        names = list(self.layers)
        hint = unused_hint(pattern, names)
        if hint.startswith("no name is close"):  # then the names it may choose from
            hint += f"; the layers it may name: {_listed(list(map(repr, names)))}"
        return hint


def _modules(tree: Any, prefix: str = "") -> Iterator[tuple[str, Module]]:
    """Every module in `tree` with its flat name, outer ones first."""
    is_module = lambda x: isinstance(x, Module)
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_module)[0]:
        if isinstance(node, Module):
            name = ".".join([*([prefix] if prefix else []), *map(key_name, path)])
            yield name, node
            for field_name, value in fields_of(node).items():
                yield from _modules(value, f"{name}.{field_name}" if name else field_name)


# --- Adapters -----------------------------------------------------------------

_ADAPTED_ALREADY = (
    "already has an adapter; merge it first (taktiny.merge_lora) or leave it out of where"
)
_NO_ADAPTER = "has no adapter"


def lora(
    model: Any,
    rank: int,
    *,
    where: Selection | None = None,
    alpha: float | int | None = None,
    rngs: Rngs,
    targets: Selection | None = None,
) -> Any:
    """`model` with a low-rank adapter on every layer that `where` chooses: each
    :class:`~taktiny.nn.Linear` and :class:`~taktiny.nn.QuantizedLinear` becomes a
    :class:`~taktiny.nn.LoRALinear`, each :class:`~taktiny.nn.Embed` and
    :class:`~taktiny.nn.QuantizedEmbed` a :class:`~taktiny.nn.LoRAEmbed`. In a stack of
    layers (:class:`~taktiny.nn.Stack`) each layer gets its own adapter, stacked, its
    ``lora_a`` drawn from its own key.

    The base weights keep their flat names and are not trained; each adapted layer gains
    ``<layer>.lora_a`` and ``<layer>.lora_b``, with ``lora_b`` zeros, so the model's
    output is unchanged until it is trained. The adapters are placed as their base weights
    are (``lora_a`` split as the weight's first axis, ``lora_b`` as its second). Layers
    are adapted in the order of their names, each drawing one key from `rngs`. Works on
    an abstract model (from ``jax.eval_shape``), whose adapters are then abstract too.

    Args:
        model: a module, or any PyTree holding modules; it is not changed.
        rank: the rank of every adapter.
        where: the layers to adapt (required): a pattern over their flat names, in the
            language of :func:`taktiny.shard` and :class:`taktiny.by_name`
            (``"layers.*.attention.query"``, ``"**.attention.*"``), or a list of them,
            each of which must match at least one adaptable layer; or a function
            ``(name, layer) -> bool``, called with each adaptable layer.
        alpha: the scale's numerator, ``scale = alpha / rank``; None for ``alpha = rank``.
        rngs: the key stream the adapters are drawn from.
        targets: the old name of `where` (deprecated: it warns, and goes in the next
            release).

    Returns:
        The adapted model.

    Raises:
        taktiny.SelectionError: (a ``ValueError``) naming every pattern that matches no
            adaptable layer, and what it matches instead: a module of another kind, a
            parameter, an adapted layer, or the closest names.
        ValueError: a pattern is not valid, or `rank` is not a positive int.
        TypeError: `where` is missing, or is no pattern, list of them or function; or
            `alpha` is not a number.
    """
    where = renamed(where, targets, "targets", "taktiny.lora")
    if where is None:
        raise TypeError(
            "taktiny.lora: where= names the layers to adapt: a pattern over their names "
            "('**.attention.*'), a list of them, or a function (name, layer) -> bool."
        )
    _scale(rank, alpha, "taktiny.lora")
    others = dict.fromkeys(_ADAPTED, _ADAPTED_ALREADY)
    chosen = choose(model, where, list(_ADAPTABLE), "taktiny.lora", others)
    keys = {name: rngs() for name in sorted(chosen)}

    def adapt(name: str, layer: Any, index: Any) -> Any:
        adapter = _ADAPTABLE[type(layer)._taktiny_base]
        key = keys[name] if index is None else jax.random.fold_in(keys[name], index)
        return adapter(layer, rank, alpha=alpha, rngs=Rngs(key))

    return swap(model, chosen, adapt)


def _merged(layer: LoRALinear | LoRAEmbed, name: str) -> tuple[Module, Any, Any]:
    """The plain layer with ``scale * lora_a @ lora_b`` added to its weight (in float32),
    placed as the weight was; the weight it held, and the one it now holds."""
    base = _base(layer)
    field_name, weight = _weight(layer)
    delta = jnp.matmul(
        layer.lora_a.astype(jnp.float32),
        layer.lora_b.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    if isinstance(weight, QArray):
        summed = jnp.asarray(weight.dequantize(jnp.float32)) + layer.scale * delta
        new = _placed_like(quantize_like(summed, weight, name=f"{name}.{field_name}"), weight)
    else:
        summed = weight.astype(jnp.float32) + layer.scale * delta
        new = _placed_like(summed.astype(weight.dtype), weight)
    return base.replace(**{field_name: new}), weight, new


def _on_host(weight: Any) -> np.ndarray:
    """`weight`'s values in float64 on the host: a QArray's integers times its scales,
    which float64 holds exactly."""
    if not isinstance(weight, QArray):
        return np.asarray(weight).astype(np.float64)
    value, scale = (np.asarray(p).astype(np.float64) for p in (weight.value, weight.scale))
    if weight.group_size is not None:  # each scale over its group of entries along `axis`
        scale = np.repeat(scale, weight.group_size, axis=weight.axis)
    return value * scale


def _merge_error(layer: LoRALinear | LoRAEmbed, weight: Any, new: Any, name: str) -> float:
    """The largest absolute difference between `new`, the weight merged from `layer`
    (whose base weight is `weight`), and ``weight + scale * lora_a @ lora_b`` computed
    exactly (in float64 on the host)."""
    parts = (layer.lora_a, layer.lora_b, *jax.tree.leaves((weight, new)))
    if any(isinstance(p, Tracer) for p in parts):
        raise TypeError(
            f"taktiny.merge_lora(report=True): {name!r} holds traced values; the report "
            f"compares each merged weight with the exact sum computed with NumPy on the "
            f"host, so it takes concrete arrays. Call it outside jax.jit, or with "
            f"report=False inside."
        )
    a, b = (np.asarray(f).astype(np.float64) for f in (layer.lora_a, layer.lora_b))
    exact = _on_host(weight) + layer.scale * (a @ b)
    return float(np.max(np.abs(_on_host(new) - exact), initial=0.0))


def _placed_like(new: Any, old: Any) -> Any:
    """`new` (an array or a QArray) with each leaf placed as the same leaf of `old` is,
    where that is a ``NamedSharding`` (inside a trace, as the computation placed it)."""

    def place(n: Any, o: Any) -> Any:
        sharding = getattr(o, "sharding", None)
        if isinstance(sharding, NamedSharding) and not isinstance(n, Tracer):
            return jax.device_put(n, sharding)
        return n

    return jax.tree.map(place, new, old)


@overload
def merge_lora(
    model: Any, *, where: Selection | None = None, report: Literal[False] = False
) -> Any: ...
@overload
def merge_lora(
    model: Any, *, where: Selection | None = None, report: Literal[True]
) -> tuple[Any, dict[str, float]]: ...
def merge_lora(model: Any, *, where: Selection | None = None, report: bool = False) -> Any:
    """`model` with the adapters `where` chooses (all, by default) merged into their base
    weights: each such :class:`~taktiny.nn.LoRALinear` and :class:`~taktiny.nn.LoRAEmbed`
    becomes the plain layer it was made from, holding ``W + scale * lora_a @ lora_b``.

    Merging every adapter gives exactly the flat names and tree structure of the model
    before :func:`lora`. The sum is computed in float32 (at full matmul precision) and
    stored in the weight's dtype, placed as the weight was; a quantized weight (QLoRA) is
    dequantized, summed and quantized again with its own bits, axis, group size and scale
    dtype. Both round: ask for ``report=True`` to see by how much. For a float model out
    of a quantized one, dequantize first: ``merge_lora(dequantize(model))`` adds the
    adapters to the dequantized weights and rounds only into their float dtype.

    Args:
        model: a module, or any PyTree holding modules; it is not changed.
        where: the adapted layers to merge, chosen as :func:`lora` chooses (a pattern
            over their flat names, or a list of them, each of which must match at least
            one adapted layer; or a function ``(name, layer) -> bool``); None: all of
            them, of which the model must hold at least one. The others keep their
            adapters.
        report: also return, for each merged layer's name, how far the merged layer is
            from the adapted one: the largest absolute difference, entry by entry,
            between the weight it now holds (dequantized exactly, for a quantized one)
            and the weight the adapted layer stands for, ``W + scale * lora_a @ lora_b``
            computed exactly (NumPy, float64, on the host; ``W`` dequantized exactly).
            Float32 rounding for a float32 weight (a few units in the last place of its
            largest entries), bfloat16 rounding for a bfloat16 one, up to about half a
            quantization step for a quantized one. For an input ``x`` the outputs of the
            two layers then differ by at most this times ``sum(abs(x))`` (plus the
            rounding of the products themselves). The report takes concrete arrays (not
            inside ``jax.jit``) and copies each weight to the host.

    Returns:
        The merged model; with `report`, ``(model, {layer name: float})``.

    Raises:
        taktiny.SelectionError: (a ``ValueError``) naming every pattern of `where` that
            matches no adapted layer, and what it matches instead; or, for `where` None,
            saying that the model holds no adapter (the call would change nothing).
        ValueError: a pattern is not valid.
        TypeError: `where` is no pattern, list of them or function; or `report` is true
            and the model holds traced values (inside ``jax.jit``).
    """
    others = dict.fromkeys(_LINEARS + _EMBEDS, _NO_ADAPTER)
    chosen = choose(model, where, _ADAPTED, "taktiny.merge_lora", others)
    errors: dict[str, float] = {}

    def merge(name: str, layer: Any, index: Any) -> Any:
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(layer)):
            if report:
                raise TypeError(
                    f"taktiny.merge_lora(report=True): {name!r} is abstract (jax.eval_shape); "
                    f"the report compares each merged weight with the exact sum, so it takes "
                    f"concrete arrays. Merge with report=False, or load the model first."
                )
            return jax.eval_shape(lambda one: _merged(one, name)[0], layer)
        merged, weight, new = _merged(layer, name)
        if report and index is None:
            errors[name] = _merge_error(layer, weight, new, name)
        return merged

    merged = swap(model, chosen, merge)
    if report:  # a stack's layers: each layer's merge told, the largest kept
        spec = flatten(model)[2]
        for name, layer in chosen.items():
            stack = spec.stack_of(f"{name}.")
            if stack is not None:
                each = (layer_of(layer, i) for i in range(stack.count))
                errors[name] = max(_merge_error(one, *_merged(one, name)[1:], name) for one in each)
        errors = {name: errors[name] for name in chosen}
    return (merged, errors) if report else merged


# --- Quantization -------------------------------------------------------------

_QUANTIZED_ALREADY = "is quantized already"
_NOT_QUANTIZED = "is not quantized"


def quantize(
    model: Any,
    *,
    bits: int = 8,
    group_size: int | None = None,
    where: Selection | None = None,
    filter: Selection | None = None,
) -> Any:
    """`model` with the :class:`~taktiny.nn.Linear` and :class:`~taktiny.nn.Embed` layers
    `where` chooses (all, by default) replaced by :class:`~taktiny.nn.QuantizedLinear` and
    :class:`~taktiny.nn.QuantizedEmbed` holding their weights quantized.

    A ``Linear`` kernel ``[in, out]`` is quantized along its input axis (scales ``[1, out]``,
    or ``[in // group_size, out]``), an ``Embed`` table ``[num, features]`` per row (scales
    ``[num, 1]`` or ``[num, features // group_size]``); biases stay as they are, and so
    do the shardings (each scale split as its weight on the other axis). Works on
    abstract models (from ``jax.eval_shape``) too. The model given is not changed. In a
    stack of layers (:class:`~taktiny.nn.Stack`) each layer is quantized as it would be
    alone: the QArrays hold the leading layer axis on their values and scales.

    Args:
        model: a module, or any PyTree holding modules.
        bits: 8 (int8) or 4 (``jnp.int4``).
        group_size: entries per scale along the quantized axis; None for one per channel.
        where: the layers to quantize: a pattern over their flat names (``"encoder.**"``,
            ``"blocks.*.mlp.*"``, in the language of :class:`taktiny.by_name`), or a list
            of them, each of which must match at least one ``Linear`` or ``Embed``; or a
            function ``(name, layer) -> bool``, called with each of them
            (``lambda name, layer: name != "head"``). None: all of them, of which the
            model must hold at least one.
        filter: the old name of `where` (deprecated: it warns, and goes in the next
            release).

    Returns:
        The quantized model.

    Raises:
        taktiny.SelectionError: (a ``ValueError``) naming every pattern that matches no
            ``Linear`` or ``Embed`` layer, and what it matches instead; or, for `where`
            None, saying that the model holds none (the call would change nothing).
        TypeError: `where` is no pattern, list of them or function; or a weight is not a
            float array.
        ValueError: a pattern is not valid, `bits` is not 8 or 4, or `group_size` does
            not divide the quantized axis (or would split a group across devices).
    """
    where = renamed(where, filter, "filter", "taktiny.quantize")
    others = {QuantizedLinear: _QUANTIZED_ALREADY, QuantizedEmbed: _QUANTIZED_ALREADY}
    chosen = choose(model, where, (Linear, Embed), "taktiny.quantize", others)
    how = {"bits": bits, "group_size": group_size}

    def quantized_layer(name: str, layer: Any, index: Any) -> Any:
        prefix = f"{name}." if name else ""
        config = {"dtype": layer.dtype, "precision": layer.precision}
        if isinstance(layer, Linear):
            kernel = quantized(layer.kernel, axis=0, name=f"{prefix}kernel", **how)
            return build(QuantizedLinear, kernel=kernel, bias=layer.bias, **config)
        table = quantized(layer.embedding, axis=1, name=f"{prefix}embedding", **how)
        return build(QuantizedEmbed, embedding=table, **config)

    return swap(model, chosen, quantized_layer)


def dequantize(model: Any, *, where: Selection | None = None) -> Any:
    """`model` with the quantized weights of the layers `where` chooses (all, by default)
    dequantized: each :class:`~taktiny.nn.QuantizedLinear` and
    :class:`~taktiny.nn.QuantizedEmbed` becomes the :class:`~taktiny.nn.Linear` or
    :class:`~taktiny.nn.Embed` it stands for, and an adapted layer on a quantized base
    (a :class:`~taktiny.nn.LoRALinear` or :class:`~taktiny.nn.LoRAEmbed` holding a
    :class:`~taktiny.QArray`, as QLoRA trains) keeps its adapter over the dequantized
    weight, so that ``tt.merge_lora(tt.dequantize(model))`` is the merged float model.
    Each weight becomes ``value * scale`` in the scales' dtype, split as the quantized
    values were; in a stack of layers (:class:`~taktiny.nn.Stack`) each layer's. The
    reverse of :func:`quantize`, up to the rounding it did.

    Args:
        model: a module, or any PyTree holding modules; it is not changed.
        where: the layers to dequantize, chosen as :func:`quantize` chooses (a pattern
            over their flat names, or a list of them, each of which must match at least
            one layer with a quantized weight; or a function ``(name, layer) -> bool``);
            None: all of them, of which the model must hold at least one.

    Returns:
        The model with float weights in place of the quantized ones.

    Raises:
        taktiny.SelectionError: (a ``ValueError``) naming every pattern that matches no
            layer with a quantized weight, and what it matches instead; or, for `where`
            None, saying that the model holds no quantized weight (the call would change
            nothing).
        ValueError: a pattern is not valid.
        TypeError: `where` is no pattern, list of them or function.
    """
    others = {Linear: _NOT_QUANTIZED, Embed: _NOT_QUANTIZED}
    others |= dict.fromkeys(_ADAPTED, "adapts a float weight, which " + _NOT_QUANTIZED)
    chosen = choose(
        model,
        where,
        (QuantizedLinear, QuantizedEmbed, *_ADAPTED),
        "taktiny.dequantize",
        others,
        what=_DEQUANTIZABLE,
        takes=lambda layer: isinstance(_weight(layer)[1], QArray),
    )

    def float_layer(name: str, layer: Any, index: Any) -> Any:
        field_name, weight = _weight(layer)
        if isinstance(layer, _ADAPTED):
            return layer.replace(**{field_name: weight.dequantize()})
        config = {"dtype": layer.dtype, "precision": layer.precision}
        if isinstance(layer, QuantizedLinear):
            return build(Linear, kernel=weight.dequantize(), bias=layer.bias, **config)
        return build(Embed, embedding=weight.dequantize(), **config)

    return swap(model, chosen, float_layer)


_DEQUANTIZABLE = "QuantizedLinear or QuantizedEmbed layer, nor LoRA layer on a quantized weight"


def _weight(layer: Any) -> tuple[str, Any]:
    """The name and value of the weight of a linear or embedding layer, plain, quantized
    or adapted: its ``kernel`` or its ``embedding``."""
    name = "kernel" if hasattr(layer, "kernel") else "embedding"
    return name, getattr(layer, name)
