"""`tt.shard` and `tt.sharding_plan`: placing every leaf of a tree by ordered rules over its
flat state names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._problems import StateProblem
from ..arrays import ambient_mesh, as_spec, mesh_text, put, spec_problems
from ..quant import part_names
from ..state import (
    Match,
    Rules,
    SelectionError,
    Spec,
    compile_pattern,
    customs,
    flatten,
    match,
    placeable,
    rule_list,
    rule_problems,
    unmatched,
    unreached,
)


class ShardingPlan(NamedTuple):
    """What ordered sharding rules give a tree; see :func:`sharding_plan`.

    Attributes:
        shardings: the tree's structure with a ``NamedSharding`` at each leaf (the leaves
            no rule matched are replicated), for ``jax.jit``'s ``in_shardings`` and
            ``out_shardings`` or ``jax.device_put``.
        specs: each flat state name with its PartitionSpec, in leaf order.
        unmatched: the names no rule matched (replicated).
    """

    shardings: Any
    specs: dict[str, PartitionSpec]
    unmatched: tuple[str, ...]

    def __repr__(self) -> str:
        rows = "".join(f"\n  {name}: {spec}" for name, spec in self.specs.items())
        return f"ShardingPlan({len(self.specs)} leaves, {len(self.unmatched)} unmatched){rows}"


def _concrete_mesh(mesh: Mesh | None, caller: str) -> Mesh:
    if mesh is not None:
        return mesh
    found = ambient_mesh()
    if found is None:
        raise ValueError(
            f"{caller} needs a mesh: pass mesh=..., or call it inside `with jax.set_mesh(mesh):`."
        )
    return found if isinstance(found, Mesh) else jax.sharding.get_mesh()


def sharding_plan(
    tree: Any, rules: Rules, mesh: Mesh | None = None, *, strict: bool = False
) -> ShardingPlan:
    """The sharding of each leaf of `tree` by ordered rules over its flat state names.

    Each rule is ``(pattern, spec)``: the first rule whose pattern matches a leaf's name
    (the names of :meth:`~taktiny.nn.Module.flat_state_dict`, such as
    ``"encoder.layers.*.kernel"``; ``*`` matches within one part, a ``**`` part any number
    of parts) gives its spec, a ``PartitionSpec`` or a tuple of mesh axis names. A leaf
    no rule matches is replicated (with ``strict=True``, an error). A rule that matches no
    leaf is an error: it is usually a typo, or a group named without ``.**``, and the
    error suggests the closest name. A rule may also name a quantized weight
    (:class:`~taktiny.QArray`) whole: its value takes the spec, its scale the spec's
    entries on the axes it shares with the value (the output axis). A low-rank adapter
    (:func:`taktiny.lora`) follows its layer's weight: ``<layer>.lora_a`` takes the
    entry of the weight's first axis, ``<layer>.lora_b`` that of its second, the rank
    axis unsplit, unless a rule naming the factor comes before the first naming the
    weight.
    In a stack of layers (:class:`taktiny.nn.Stack`) a rule gives the spec of one
    layer's array (``"layers.*.attention.query.kernel"`` matches the stacked name
    ``layers.block.attention.query.kernel``), and the stack's ``layer_axis`` (None: not
    split) is prepended for the layer axis.

    Args:
        tree: a module or any PyTree of arrays (or of ``jax.ShapeDtypeStruct``).
        rules: a dict ``{pattern: spec}`` or a list of ``(pattern, spec)`` pairs.
        mesh: the mesh; by default the one of the enclosing ``jax.set_mesh``.
        strict: also raise when some leaf is matched by no rule (otherwise it is
            replicated, and listed in the plan's ``unmatched``).

    Returns:
        A :class:`ShardingPlan`.

    Raises:
        taktiny.SelectionError: (a ``ValueError``) listing every rule whose pattern or
            spec is not valid; every rule that matches no leaf, with the closest name;
            every leaf whose spec names an axis the mesh lacks, has more entries than
            the leaf has axes, or splits an axis that does not divide evenly, with the
            leaf's shape, the spec and the mesh; and, with `strict`, the leaves no rule
            matches.
        ValueError: no `mesh` is given and no ``jax.set_mesh`` encloses the call.
    """
    return _plan(tree, rules, mesh, strict)[0]


def _plan(
    tree: Any, rules: Rules, mesh: Mesh | None, strict: bool
) -> tuple[ShardingPlan, list[Any], Any, list[NamedSharding]]:
    """The plan, with the tree's leaves, its treedef and each leaf's sharding."""
    caller = "taktiny.sharding_plan" if not strict else "taktiny.sharding_plan(strict=True)"
    where = f"{caller} on {type(tree).__name__}"
    pairs = rule_list(rules, "taktiny.sharding_plan")
    problems = []
    checked = []
    for pattern, spec in pairs:
        try:
            compile_pattern(pattern)
            checked.append((pattern, as_spec(spec, "its spec")))
        except (ValueError, TypeError) as error:
            problems.append(bad_rule(str(pattern), str(error)))
    if problems:
        raise SelectionError(where, problems)
    mesh = _concrete_mesh(mesh, caller)
    leaves, treedef, names = flatten(tree)
    found = match(checked, names.names, PartitionSpec())
    found, shadowed = _whole_parameters(checked, names, leaves, found)
    found = _adapters(checked, names.names, found)
    found = _layer_axes(names, found)
    # a rule that matches nothing is a typo, most often: never silently left out
    problems = [
        shadowed.get(p.name, p) if p.kind == "unmatched" else p
        for p in rule_problems(found, checked, names.names, None)
    ]
    # models repeat a few shapes and specs: each pair is checked, and each spec made into a
    # sharding, once (PartitionSpecs are hashable; the rules hold the same few objects)
    checks: dict[tuple[Any, ...], list[str]] = {}
    text = mesh_text(mesh)
    for name, leaf, spec in zip(names.names, leaves, found.values, strict=True):
        shape = tuple(np.shape(leaf))
        key = (shape, spec)
        if key not in checks:
            checks[key] = spec_problems(shape, spec, mesh)
        problems += [unplaceable(name, shape, spec, text, why) for why in checks[key]]
    if strict:
        fix = "add a rule for it (a last rule '**' matches everything), or pass strict=False"
        problems += [unreached(name, f"{fix} to replicate it") for name in found.unmatched]
    if problems:
        raise SelectionError(where, problems)
    made: dict[PartitionSpec, NamedSharding] = {}
    shardings = [
        made.get(spec) or made.setdefault(spec, NamedSharding(mesh, spec)) for spec in found.values
    ]
    plan = ShardingPlan(
        shardings=treedef.unflatten(shardings),
        specs=dict(zip(names.names, found.values, strict=True)),
        unmatched=tuple(found.unmatched),
    )
    return plan, leaves, treedef, shardings


def shadowed_rule(pattern: str, leaf: str, taker: str, param: str) -> StateProblem:
    """A rule for `leaf`, which the earlier rule `taker` took by naming its parameter
    `param` whole."""
    return unmatched(
        pattern,
        "name",
        f"the names it would match ({leaf!r}) go to the earlier rule {taker!r}, which names "
        f"their parameter {param!r} whole; put the more specific rule first",
    )


def bad_rule(pattern: str, why: str) -> StateProblem:
    """A rule whose pattern or value is not one (`why`: the error that says so)."""
    return StateProblem("rule", pattern, None, None, why)


def unplaceable(name: str, shape: tuple[int, ...], spec: Any, mesh: str, why: str) -> StateProblem:
    """A leaf of `shape` that the spec its rule gives cannot place on the mesh (`mesh`: its
    text), and `why`."""
    return StateProblem(
        "sharding", name, spec, shape, f"shape {shape} by {spec} on the mesh {mesh}: {why}."
    )


def _whole_parameters(
    rules: list[tuple[str, PartitionSpec]],
    names: Spec,
    leaves: list[Any],
    found: Match,
) -> tuple[Match, dict[str, StateProblem]]:
    """`found` with the rules that name a custom parameter whole (``"*.kernel"`` for a
    QArray's ``kernel.value`` and ``kernel.scale``) applied to its leaves. For each leaf the
    first rule naming either the leaf or its parameter wins; a parameter's spec splits a
    leaf's axes that have the parameter's size (a QArray's value wholly; its scale on the
    axes it shares with the value, such as the output axis), and the others not at all.
    In a stack of layers the spec is one layer's, so one layer's shapes are compared (the
    layer axis, which `_layer_axes` adds, left out). A rule for a leaf that an earlier rule
    took by naming its parameter whole is unused, with the problem that says so (by
    pattern)."""
    params = list(customs(names.template))
    if not params:
        return found, {}
    compiled = [compile_pattern(pattern) for pattern, _ in rules]
    values, unmatched, firsts = list(found.values), set(found.unmatched), list(found.firsts)
    shadowed: dict[str, tuple[str, str, str]] = {}  # pattern: (leaf, earlier rule, parameter)
    for name, node in params:
        cut = 0 if names.stack_of(name) is None else 1  # (a stack's: one layer's shapes)
        shape = tuple(np.shape(node.treedef.unflatten(leaves[node.start : node.stop])))[cut:]
        for i in range(node.start, node.stop):
            for k, (regex, (_, spec)) in enumerate(zip(compiled, rules, strict=True)):
                if regex.fullmatch("." + names.names[i]):
                    break  # a rule for the leaf itself came first: as matched
                if regex.fullmatch("." + name):
                    values[i] = _follow(spec, tuple(np.shape(leaves[i]))[cut:], shape)
                    unmatched.discard(names.names[i])
                    before, firsts[i] = firsts[i], k
                    if before is not None:  # (that rule, silently ignored, would mislead)
                        leaf, taker = names.names[i], rules[k][0]
                        shadowed.setdefault(rules[before][0], (leaf, taker, name))
                    break
    taken = set(firsts)  # (a rule no leaf takes first is unused)
    unused = [pattern for k, (pattern, _) in enumerate(rules) if k not in taken]
    found = Match(values, [n for n in found.unmatched if n in unmatched], unused, tuple(firsts))
    return found, {p: shadowed_rule(p, *shadowed[p]) for p in unused if p in shadowed}


# A low-rank adapter's factors (``nn.LoRALinear``, ``nn.LoRAEmbed``) and the axis of their
# layer's weight that each follows: ``lora_a`` [in, rank] the weight's first, ``lora_b``
# [rank, out] its second; the rank axis is never split.
_ADAPTER_AXES = {"lora_a": 0, "lora_b": 1}
_ADAPTED_WEIGHTS = ("kernel", "embedding")


def _adapters(rules: list[tuple[str, PartitionSpec]], names: Sequence[str], found: Match) -> Match:
    """`found` with each adapter factor (``<layer>.lora_a``, ``<layer>.lora_b``) placed as
    its layer's weight (``<layer>.kernel`` or ``<layer>.embedding``, a QArray's value for a
    quantized one) on the axis it shares with it, when the first rule naming the weight
    comes before the first naming the factor (a rule written for the factor itself, placed
    earlier, wins). So rules written for a base model place its adapters too."""
    index = {name: i for i, name in enumerate(names)}
    factors = [(i, n) for i, n in enumerate(names) if n.rsplit(".", 1)[-1] in _ADAPTER_AXES]
    if not factors:
        return found
    compiled = [compile_pattern(pattern) for pattern, _ in rules]

    def first(*candidates: str) -> int:  # the first rule matching any of them
        dotted = ["." + c for c in candidates]
        hits = (k for k, r in enumerate(compiled) if any(r.fullmatch(d) for d in dotted))
        return next(hits, len(compiled))

    values, unmatched = list(found.values), set(found.unmatched)
    for i, name in factors:
        layer, _, part = name.rpartition(".")
        for weight in (f"{layer}.{w}" if layer else w for w in _ADAPTED_WEIGHTS):
            leaf = next((n for n in (weight, part_names(weight)[0]) if n in index), None)
            if leaf is not None:
                break
        else:
            continue
        if first(weight, leaf) >= first(name):
            continue
        axis = _ADAPTER_AXES[part]
        entry = (*values[index[leaf]], None, None)[axis]
        values[i] = PartitionSpec(*((entry, None) if axis == 0 else (None, entry)))
        unmatched.discard(name)
    return Match(values, [n for n in found.unmatched if n in unmatched], found.unused)


def _layer_axes(names: Spec, found: Match) -> Match:
    """`found` with the layer axis of each leaf of a stack of layers (``nn.Stack``)
    prepended to its spec: a rule gives one layer's spec, the stack its ``layer_axis``
    (None: the layer axis unsplit)."""
    if not names.stacks:
        return found
    values = list(found.values)
    for i, name in enumerate(names.names):
        stack = names.stack_of(name)
        if stack is not None:
            values[i] = PartitionSpec(stack.axis, *values[i])
    return Match(values, found.unmatched, found.unused)


def _follow(spec: PartitionSpec, shape: tuple[int, ...], whole: tuple[int, ...]) -> PartitionSpec:
    """The spec of a parameter of shape `whole` for one of its leaves, of `shape`: its
    entries on the axes of the same size, none elsewhere (or on a leaf of another rank)."""
    if shape == whole:
        return spec  # as given, so that a spec the leaf cannot take is reported
    if len(shape) != len(whole) or len(spec) > len(whole):
        return PartitionSpec()
    entries = (*spec, *(None,) * (len(whole) - len(spec)))
    kept = [
        e if size == full else None for e, size, full in zip(entries, shape, whole, strict=False)
    ]
    return PartitionSpec(*kept)


def shard(tree: Any, rules: Rules, mesh: Mesh | None = None, *, strict: bool = False) -> Any:
    """Returns `tree` with every leaf placed by ordered rules over its flat state names.

    The rules are those of :func:`sharding_plan`: leaves no rule matches are replicated
    (with ``strict=True``, an error), and a rule that matches no leaf is an error.
    Arrays move in one batched ``jax.device_put``, every bit kept (a bfloat16 NaN's
    payload too, which a reshard's program on the CPU would make canonical);
    ``jax.ShapeDtypeStruct`` leaves (an abstract model) come back as ``ShapeDtypeStruct``
    carrying their sharding, ready as an Orbax restore target. Any problem raises before
    anything moves; `tree` is never changed.

    Args:
        tree: a module or any PyTree of arrays.
        rules: a dict ``{pattern: spec}`` or a list of ``(pattern, spec)`` pairs.
        mesh: the mesh; by default the one of the enclosing ``jax.set_mesh``.
        strict: also raise when some leaf is matched by no rule.

    Returns:
        A new tree of the same structure.

    Raises:
        taktiny.SelectionError: as :func:`sharding_plan` raises it, before anything moves.
    """
    _, leaves, treedef, shardings = _plan(tree, rules, mesh, strict)
    moving = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, jax.ShapeDtypeStruct)]
    moved = put([placeable(leaves[i]) for i in moving], [shardings[i] for i in moving])
    out = [
        jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        for leaf, sharding in zip(leaves, shardings, strict=True)
    ]
    for i, array in zip(moving, moved, strict=True):
        out[i] = array
    return treedef.unflatten(out)
