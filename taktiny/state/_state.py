"""The state walk: reading a tree's leaves as dicts, and loading dicts back into a new tree.

A load resolves names to leaves (`_resolve`), checks each value against the leaf it
replaces (`_values`), places the checked values in one batched transfer, and writes them
into a new tree. A load that names a few leaves walks to them and rebuilds only the nodes
on their paths; one that names many, or a stack's layers, flattens the tree once
(`_views`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding

import taktiny.state._layers as _layers
import taktiny.state._names as _names
import taktiny.state._problems as err
import taktiny.state._represent as _represent
import taktiny.state._values as _values

from .._problems import Problems, StateProblem
from ..arrays import put
from ._layers import Layers
from ._problems import StateDictError
from ._represent import Other
from ._resolve import Resolved, resolve
from ._stacker import Stacker
from ._views import Flat, View, Walk

# Loads that name at most this many leaves walk to them instead of flattening the tree: a
# walk costs a few microseconds per leaf named, a flatten and unflatten about two per leaf
# of the whole tree, so up to this many the walk is as fast on small models and far faster
# on large ones.
WALK_LIMIT = 64
# A nested state deeper than this is not counted to the end (it may contain itself): it is
# loaded by flattening the tree, whose resolution follows the tree, and tells what's wrong.
_DEEPEST = 100


class _Move(NamedTuple):
    """A checked value still to be placed like the leaf it replaces."""

    where: Any
    value: Any
    target: Any  # the leaf's sharding; None: the default device


class _Checked(NamedTuple):
    """What checking the supplied values gives."""

    new: Any  # the view's container of new leaves, with the checked values written in
    moves: list[_Move]  # values still to place
    traced: list[tuple[Any, ...]]  # traced values still to constrain (once nothing is wrong)
    other: list[Other]  # quantized values given for arrays (see `_represent`)


def _check(
    view: View[Any],
    supplied: Iterable[tuple[Any, Any]],
    problems: Problems,
    into: _Checked | None = None,
) -> _Checked:
    """Checks each supplied value against the leaf it replaces, adding to `into`."""
    olds = view.olds
    if into is None:
        into = _Checked(view.new(), [], [], [])
    new, moves, traced = into.new, into.moves, into.traced
    array = _values.array_type()
    # Arrays share a few sharding objects, so each pair is compared once. They are keyed by
    # id: the arrays hold them, so they live (and keep their ids) for the whole loop. Two
    # shardings that place alike (P("x") and P("x", None)) count as the same: no copy.
    same: dict[tuple[int, int], bool] = {}
    # Each array taken as it is is asked whether it was deleted (by .delete(), or donated)
    # at once after the loop, in one pass in C: asking in the loop costs twice as much.
    kept: list[Any] = []
    for where, value in supplied:
        old = olds[where]
        if type(value) is array and type(old) is array and value.aval == old.aval:
            have, want = value.sharding, old.sharding  # the common case: same shape and dtype
            pair = (id(have), id(want))
            placed = same.get(pair)
            if placed is None:
                placed = same[pair] = have is want or have == want
            kept.append(value)
            if placed or have.is_equivalent_to(want, value.ndim):
                new[where] = value
            elif _outside(value, want):
                problems.append(err.devices(view.name(where), old.shape, have, want))
            else:
                moves.append(_Move(where, value, want))
            continue
        if _represent.is_quantized(value):  # set aside, to be converted or told
            into.other.append(Other(view.name(where), old, (where,), value))
            continue
        found = Problems()
        given, value = value, _values.checked_value(view.name(where), value, old, found)
        if value is None:
            problems.extend(_represent.in_quantized(view, where, found))
            continue
        target = getattr(old, "sharding", None)
        if isinstance(old, Tracer) or isinstance(value, Tracer):  # inside jit
            traced.append((where, jnp.asarray(value), cast(Any, old), target))  # pyright: ignore[reportUnknownMemberType]  (its device: jaxlib's Device, which has no type stubs)
        elif isinstance(value, jax.Array) and value.sharding == target:
            new[where] = value
        elif isinstance(value, jax.Array) and _outside(value, target):
            problems.append(err.devices(view.name(where), old.shape, value.sharding, target))
        else:
            copy = _values.shares_memory(value, given, target)
            moves.append(_Move(where, value.copy() if copy else value, target))
    if any(map(array.is_deleted, kept)):
        _deleted(view, new, moves, problems)
    return into


def _deleted(view: View[Any], new: Any, moves: list[_Move], problems: Problems) -> None:
    """Tells the deleted arrays among the supplied values kept as they are (in `new` where
    the tree's own leaf is not that array, or in `moves`); none of them is loaded."""
    olds: Any = view.olds  # (a list or a dict, as `new` is)
    pairs: Iterable[tuple[Any, Any]] = (
        enumerate(cast("list[Any]", new)) if isinstance(new, list) else new.items()
    )
    found: list[tuple[Any, Any]] = [(w, v) for w, v in pairs if v is not olds[w]]
    found += [(m.where, m.value) for m in moves]
    for where, value in found:
        if isinstance(value, jax.Array) and not isinstance(value, Tracer) and value.is_deleted():
            problems.append(err.deleted(view.name(where), value))


def _outside(value: jax.Array, target: Any) -> bool:
    """Whether `value` sits on devices outside the mesh of `target` (a NamedSharding)."""
    if not isinstance(target, NamedSharding):
        return False
    return not value.sharding.device_set <= target.device_set  # pyright: ignore[reportUnknownMemberType]  (sets of jaxlib's Device, which has no type stubs)


def _constrain(value: Any, old: Any, target: Any) -> Any:
    """`value`, traced, kept on the sharding of the leaf `old` it replaces: a concrete
    leaf's own sharding, or the sharding in a traced leaf's type (Explicit mesh axes).
    A traced leaf on Auto axes has none to keep; jit's out_shardings place it. On
    Explicit axes a value is resharded only from the leaf's own mesh, or under
    ``jax.set_mesh`` of it (JAX refuses it otherwise)."""
    have = jax.typeof(value).sharding.mesh
    if isinstance(target, NamedSharding):  # a concrete leaf, closed over by the jitted code
        if not target.mesh.are_all_axes_explicit:
            return jax.lax.with_sharding_constraint(value, target)  # pyright: ignore[reportUnknownMemberType]  (JAX leaves its parameters unannotated)
        want = target.mesh.abstract_mesh
        if want in (have, jax.sharding.get_abstract_mesh()):
            return jax.sharding.reshard(value, target)  # pyright: ignore[reportUnknownMemberType]  (JAX leaves its parameters unannotated)
        return value
    if isinstance(old, Tracer):
        want = jax.typeof(old).sharding
        explicit = not want.mesh.empty and want.mesh.are_all_axes_explicit
        if explicit and want.mesh in (have, jax.sharding.get_abstract_mesh()):
            return jax.sharding.reshard(value, NamedSharding(want.mesh, want.spec))  # pyright: ignore[reportUnknownMemberType]  (as above)
    return value


def _place(moves: list[_Move], new: Any) -> None:
    """Places the moves into `new`: one batched transfer onto the leaves' shardings, one
    onto the default device (for leaves that have no sharding: Python numbers)."""
    placed = [m for m in moves if m.target is not None]
    default = [m for m in moves if m.target is None]
    for group, targets in ((placed, [m.target for m in placed]), (default, None)):
        if not group:
            continue
        sources = [_values.placeable(m.value) for m in group]
        arrays = _values.placement.device_put(sources) if targets is None else put(sources, targets)
        for move, array in zip(group, arrays, strict=True):
            new[move.where] = array


def _few(state: Mapping[Any, Any], flat: bool) -> bool:
    """Whether `state` names at most WALK_LIMIT leaves (counted without resolving)."""
    if flat:
        return len(state) <= WALK_LIMIT
    budget = WALK_LIMIT
    below: list[tuple[Mapping[Any, Any], int]] = [(state, 0)]  # dicts still to count
    while below:
        node, depth = below.pop()
        if depth > _DEEPEST:  # (or it contains itself): left to the resolution to tell
            return False
        for value in node.values():
            if type(value) is dict or isinstance(value, Mapping):
                below.append((cast("Mapping[Any, Any]", value), depth + 1))
            else:
                budget -= 1
                if budget < 0:
                    return False
    return True


def _in_order(view: Flat, state: Mapping[Any, Any], flat: bool) -> list[Any] | None:
    """The values of `state` in leaf order when it names every leaf exactly as the tree's own
    state does (a full load); None otherwise, or when unsure."""
    spec = view.spec
    if flat:
        if len(state) == len(spec.names) and tuple(state) == spec.names:
            return list(state.values())
        return None
    if spec.plan is None or spec.plan[0] != len(state):
        return None
    values: list[Any] = []
    try:
        _names.gather(spec.plan, state, values)
    except (LookupError, TypeError, AttributeError):
        return None
    return values


def load(
    tree: Any,
    state: Any,
    *,
    strict: bool,
    flat: bool,
    caller: str | None = None,
    match_quantization: bool = False,
) -> Any:
    """Returns `tree` with the leaves that `state` names replaced; see
    `taktiny.load_state_dict`. `caller` names the call in errors (by default
    ``Type.load_state_dict()`` for a module, ``taktiny.load_state_dict(type)`` for another
    tree)."""
    named = lambda: caller or _caller(tree, flat)  # (formatted only for an error)
    if not isinstance(state, Mapping):
        raise TypeError(f"{named()} expects a dict, got {type(state).__name__}.")
    state = cast("Mapping[Any, Any]", state)
    match = match_quantization
    view: View[Any]
    few = not strict and _few(state, flat)
    layered = few and _layers.names_layers(tree, state, flat)
    if few and not layered:
        view = Walk(tree, flat)
    else:
        view = Flat(tree)
        values = _in_order(view, state, flat)  # every leaf, in leaf order: the fast path
        if values is not None:
            return _finish(view, enumerate(values), None, named, match)
        if view.spec.stacks and (layered or _layers.names_layers(tree, state, flat)):
            return _into_stacks(Layers(tree, view), state, strict, flat, named, match)
    found = resolve(view, state, flat, match)
    unfilled = _unfilled(view, found, strict)
    if unfilled:
        found = found._replace(problems=(*found.problems, *unfilled))
    in_order = functools.partial(_in_state_order, found.problems, state=state, flat=flat)
    return _finish(view, found.supplied.items(), found, named, match, in_order)


def _into_stacks(
    layers: Layers,
    state: Mapping[Any, Any],
    strict: bool,
    flat: bool,
    caller: Callable[[], str],
    match: bool,
) -> Any:
    """The load of a state that names layers of the tree's stacks (and maybe other
    leaves): resolved and checked against the tree's per-layer twin, as the streamed load
    resolves a checkpoint (a stacked leaf given whole cut into its layers), then each
    layer written into its stacked leaf by the one fill (`Stacker`)."""
    twin = Flat(layers.twin)
    spec = layers.view.spec
    found = resolve(twin, state, flat, match, stacks=spec.stacks, cut=True)
    problems = Problems(found.problems)
    supplied, other = dict(found.supplied), dict(found.other)
    for name, cut in found.whole.items():  # checked as the stacked leaf, cut, resolved
        value, leaf = _given(state, flat, name), spec.index.get(name)
        if leaf is not None:
            value = _values.checked_value(name, value, layers.stacked_leaf(name), problems)
        else:  # a stacked custom parameter's: as its logical array
            first = next(i for i, n in enumerate(spec.names) if n.startswith(f"{name}."))
            param = cast("tuple[str, Any]", layers.view.quantized(first))[1]
            value = value if hasattr(value, "shape") else np.asarray(value)
            want = jax.ShapeDtypeStruct(param.shape, param.dtype)
            if (problem := _values.spec_problem(name, value, want)) is not None:
                problems.append(problem)
                value = None
        if value is not None:
            pieces = {n: _layers.layer_of(value, i) for i, n in enumerate(cut)}
            more = resolve(twin, pieces, True, match)
            supplied.update(more.supplied)
            other.update(more.other)
            problems.extend(more.problems)
    found = found._replace(supplied=supplied, other=other, problems=tuple(problems))
    found = found._replace(problems=(*found.problems, *_unfilled(twin, found, strict, spec.stacks)))
    in_order = functools.partial(_in_state_order, found.problems, state=state, flat=flat)

    def write(new: list[Any]) -> Any:  # the twin's new leaves, into the tree's stacks
        olds, names = twin.olds, twin.spec.names
        placed = [(names[i], v) for i, v in enumerate(new) if v is not olds[i]]
        stacker = Stacker(layers, layers.covered(n for n, _ in placed))
        stacker.update(placed)
        return load_resolved(layers.view, stacker.leaves())

    return _finish(twin, supplied.items(), found, caller, match, in_order, write)


def _given(state: Mapping[Any, Any], flat: bool, name: str) -> Any:
    """The value `state` gives under the flat `name` (a nested state's, key by key)."""
    if flat:
        return state[name]
    node: Any = state
    for key in name.split("."):
        node = node[key]
    return node


class Sources(NamedTuple):
    """Where each leaf of a load of abstract values takes its value from (see
    :func:`resolve_sources`): the names of the state, resolved and checked as a load of
    values resolves and checks them, no value read.

    Attributes:
        leaves: each leaf's name -> the entry whose value it takes (cast within its
            dtype kind), in the state's order.
        floats: each quantized parameter's name -> the float entry it is made from (as
            `Parameter.from_float` makes it), in the state's order.
        problems: every problem: names that name nothing, shapes, dtype kinds, values in
            another representation that cannot be loaded, leaves left unfilled.
        whole: each stacked leaf given whole to a view of a model's per-layer twin -> the
            per-layer leaves it fills, in layer order (its shape and dtype kind checked
            as the stacked leaf's).
    """

    leaves: dict[str, str]
    floats: dict[str, str]
    problems: list[StateProblem]
    whole: dict[str, tuple[str, ...]]


def resolve_sources(
    view: Flat,
    state: Mapping[str, Any],
    *,
    strict: bool,
    records: Mapping[str, Any],
    source: str = "checkpoint",
    stacks: Iterable[_names.Stacked] | None = None,
) -> Sources:
    """The load of `state` into the tree `view` flattened, abstract: `state`'s values
    need only a shape and a dtype (a checkpoint's tensors, read from its headers), and
    each is resolved to the leaf it names (`_resolve`, as a load of values), its shape and
    dtype kind checked (`_values.spec_problem`), its representation settled
    (`_represent.settled_sources`: the parts of a quantized parameter against their
    `records`, a float array made into one), and the leaves left unfilled told, once.
    `source` names the state in messages; `stacks`, the stacks whose other form a name
    may give (None: the view's own)."""
    found = resolve(view, state, True, match=True, source=source, stacks=stacks)
    problems = Problems(found.problems)
    settled = _represent.settled_sources(
        view, found.supplied, found.other.values(), state, records, problems
    )
    other = {w: o for w, o in found.other.items() if w not in settled.unnamed}
    found = found._replace(other=other, covered=found.covered | settled.covered)
    problems.extend(_unfilled(view, found, strict, () if stacks is None else stacks))
    whole: dict[str, tuple[str, ...]] = {}
    for name, layers in found.whole.items():  # as the stacked leaf: its layers' leaf, one axis more
        layer = view.olds[view.spec.index[layers[0]]]
        stacked = jax.ShapeDtypeStruct((len(layers), *layer.shape), layer.dtype)
        problem = _values.spec_problem(name, state[name], stacked)
        if problem is None:
            whole[name] = layers
        else:
            problems.append(problem)
    return Sources(settled.taken, settled.floats, list(problems), whole)


def load_resolved(view: Flat, supplied: Iterable[tuple[int, Any]]) -> Any:
    """The tree `view` flattened, with the leaf at each position in `supplied` replaced by
    its value and the others kept: the one unflatten of a load whose caller has resolved
    every name against the view's own (``view.spec.names``) and made every value as its
    leaf is: its shape, its dtype, placed on its sharding (the safetensors load checks
    them from a checkpoint's headers, then places what it reads). Nothing is resolved or
    checked again."""
    new = view.new()
    for where, value in supplied:
        new[where] = value
    return view.write(new)


def _in_state_order(
    resolved: tuple[StateProblem, ...],
    problems: Iterable[StateProblem],
    state: Mapping[Any, Any],
    flat: bool,
) -> list[StateProblem]:
    """`problems` in the order of the entries of `state` they are about, as
    `StateDictError` promises within each group. Those resolving found (`resolved`, the
    first ones, unsupplied names last) are in that order already and keep it; the checks
    of values and representations come after, and each is put at the entry it is about
    (one named as the problem is, the first inside it, or the one it is inside)."""
    problems = list(problems)
    entries: dict[str, int] = {}
    below: dict[str, int] = {}  # each prefix of an entry's name: the first entry under it
    for i, keys in enumerate(_entry_names(state, flat, (), set())):
        entries.setdefault(".".join(keys), i)
        for n in range(1, len(keys) + 1):
            below.setdefault(".".join(keys[:n]), i)

    def position(name: str) -> int:
        if name in below:
            return below[name]
        keys = name.split(".")  # (an entry this name is inside)
        inside = (entries.get(".".join(keys[:n])) for n in range(1, len(keys)))
        return min((i for i in inside if i is not None), default=len(entries))

    at = 0  # (resolving's: never before the one before, so they keep their order)
    positions: list[int] = []
    for problem in problems[: len(resolved)]:
        unsupplied = problem.kind in ("missing", "abstract")
        at = max(at, len(entries) if unsupplied else position(problem.name))
        positions.append(at)
    positions += [position(problem.name) for problem in problems[len(resolved) :]]
    order = sorted(range(len(problems)), key=positions.__getitem__)
    return [problems[i] for i in order]


def _entry_names(
    state: Mapping[Any, Any], flat: bool, path: tuple[str, ...], above: set[int]
) -> Iterator[tuple[str, ...]]:
    """The keys of each entry of `state` in its order, named as problems name them (a key
    that is not a string by its repr): a nested state's dicts, each followed by what it
    holds (a dict that contains itself, once; none deeper than any load looks)."""
    above.add(id(state))
    for key, value in state.items():
        keys = (*path, key if type(key) is str else repr(key))
        yield keys
        deeper = not flat and len(keys) < _DEEPEST and id(value) not in above
        if deeper and isinstance(value, Mapping):
            yield from _entry_names(cast("Mapping[Any, Any]", value), flat, keys, above)
    above.discard(id(state))


def _caller(tree: Any, flat: bool) -> str:
    """How errors name a load: ``Type.load_state_dict()`` for a module,
    ``taktiny.load_state_dict(type)`` for another tree."""
    method = "load_flat_state_dict" if flat else "load_state_dict"
    kind = type(tree).__name__
    return f"{kind}.{method}()" if _names.fields(tree) is not None else f"taktiny.{method}({kind})"


def _unfilled(
    view: View[Any], found: Resolved, strict: bool, stacks: Iterable[_names.Stacked] = ()
) -> list[StateProblem]:
    """The leaves a load must fill but the state does not name: every one under `strict`,
    else those of an abstract tree, which have no value to keep (the layers of `stacks`
    told as `unfilled` tells them). A view that has seen only the paths named takes the
    tree as concrete when every leaf it has seen is."""
    wheres = [*found.supplied, *(w for other in found.other.values() for w in other.wheres)]
    if not view.sees_all and not strict and wheres:
        olds = view.olds
        if not any(isinstance(olds[w], jax.ShapeDtypeStruct) for w in wheres):
            return []
    leaves, spec = view.flattened()
    named = {view.name(w) for w in wheres} | found.covered
    return unfilled(zip(spec.names, leaves, strict=True), named, strict, stacks)


def unfilled(
    leaves: Iterable[tuple[str, Any]],
    named: Container[str],
    strict: bool,
    stacks: Iterable[_names.Stacked] = (),
) -> list[StateProblem]:
    """The leaves (name and leaf) a load leaves unfilled, not `named`, that it must fill:
    every one under `strict`, else those of an abstract tree (a ``ShapeDtypeStruct``),
    which have no value to keep. Leaves that are layers of `stacks` (a model's per-layer
    twin's) whose stacked leaf the load fills in other layers are told as a load of values
    tells them (`_layers.unfilled_layers`)."""
    absent = [
        (name, isinstance(leaf, jax.ShapeDtypeStruct)) for name, leaf in leaves if name not in named
    ]
    layers = _layers.unfilled_layers(absent, named, stacks)
    if strict:
        return [layers.get(name) or err.missing(name, abstract) for name, abstract in absent]
    return [layers.get(name) or err.abstract(name) for name, abstract in absent if abstract]


def _finish(
    view: View[Any],
    supplied: Iterable[tuple[Any, Any]],
    found: Resolved | None,
    caller: Callable[[], str],
    match: bool,
    in_order: Callable[[Problems], Iterable[StateProblem]] = iter,
    write: Callable[[Any], Any] | None = None,
) -> Any:
    """Checks and places the `supplied` values and writes them into a new tree (`write`:
    by default the view's own write); raises every problem found (resolving's, the
    checks', the representations'), told in the state's order by `in_order`."""
    problems = Problems(() if found is None else found.problems)
    checked = _check(view, supplied, problems)
    other = [*(found.other.values() if found is not None else ()), *checked.other]
    if other:  # values in another representation than the model's: converted, or told
        converted = _represent.settle(view, other, match, problems)
        _check(view, converted, problems, into=checked)
    if problems:
        matched = None
        if found is not None:  # (the names of leaves, each value given once)
            matched = len(found.supplied) + sum(len(o.wheres) for o in found.other.values())
        raise StateDictError(caller(), in_order(problems), matched=matched)
    new = checked.new
    if checked.moves:
        _place(checked.moves, new)
    for where, value, old, target in checked.traced:
        new[where] = _constrain(value, old, target)
    return (write or view.write)(new)
