"""The state walk: reading a tree's leaves as dicts, and loading dicts back into a new tree.

A load resolves names to leaves (`_resolve`), checks each value against the leaf it
replaces (`_values`), places the checked values in one batched transfer, and writes them
into a new tree. A load that names a few leaves walks to them and rebuilds only the nodes
on their paths; one that names many flattens the tree once (`_views`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from . import _errors as err
from . import _names, _values
from ._errors import StateDictError, StateProblem
from ._names import Nodes
from ._resolve import resolve
from ._views import Flat, Walk

# Loads that name at most this many leaves walk to them instead of flattening the tree: a
# walk costs a few microseconds per leaf named, a flatten and unflatten about two per leaf
# of the whole tree, so up to this many the walk is as fast on small models and far faster
# on large ones.
WALK_LIMIT = 64


@functools.cache
def _array_type() -> type:
    """The concrete class of JAX arrays, for an exact-type fast path (made concretely even
    when first asked for inside a jit trace)."""
    with jax.ensure_compile_time_eval():
        return type(jnp.zeros(()))


def state_dict(tree: Any, nodes: Nodes) -> dict[str, Any]:
    leaves, _, spec = _names.flatten(tree, nodes)
    return _names.nested(spec.template, leaves)


def flat_state_dict(tree: Any, nodes: Nodes) -> dict[str, Any]:
    leaves, _, spec = _names.flatten(tree, nodes)
    return dict(zip(spec.names, leaves, strict=True))


def _check(
    view: Flat | Walk, supplied: Iterable[tuple[Any, Any]], problems: list[StateProblem]
) -> tuple[Any, list[tuple[Any, Any, Any]]]:
    """Checks each supplied value against the leaf it replaces. Returns the new leaves (the
    view's container, with the checked values written in) and the moves (where, value,
    sharding) that still need placing."""
    olds, new = view.olds, view.new()
    moves: list[tuple[Any, Any, Any]] = []
    array_type = _array_type()
    seen: tuple[Any, Any, bool] = (None, None, False)  # the last two shardings compared
    for where, value in supplied:
        old = olds[where]
        if type(value) is array_type and type(old) is array_type and value.aval == old.aval:
            have, want = value.sharding, old.sharding  # the common case: same shape and dtype
            if have is not seen[0] or want is not seen[1]:  # arrays share few sharding objects
                seen = (have, want, have is want or have == want)
            if seen[2]:
                new[where] = value
            else:
                moves.append((where, value, want))
            continue
        given, value = value, _values.convert(view.name(where), value, old, problems)
        if value is None:
            continue
        target = getattr(old, "sharding", None)
        if isinstance(old, Tracer) or isinstance(value, Tracer):  # inside jit: jit places it
            new[where] = jnp.asarray(value)
        elif isinstance(value, jax.Array) and value.sharding == target:
            new[where] = value
        else:
            copy = _values.shares_memory(value, given, target)
            moves.append((where, value.copy() if copy else value, target))
    return new, moves


def _place(moves: list[tuple[Any, Any, Any]], new: Any) -> None:
    """Places the moves into `new`, one batched transfer per kind of target (a None target
    means the default device)."""
    for placed in ([m for m in moves if m[2] is not None], [m for m in moves if m[2] is None]):
        if not placed:
            continue
        targets = [t for _, _, t in placed] if placed[0][2] is not None else None
        # a zero-size value holds no data, so it is placed afresh: JAX 0.10's device_put of a
        # zero-size array onto a mesh of another device order makes misshapen shards
        sources = [np.zeros(v.shape, v.dtype) if v.size == 0 else v for _, v, _ in placed]
        for (where, _, _), array in zip(placed, jax.device_put(sources, targets), strict=True):
            new[where] = array


def _few(state: Mapping[Any, Any], flat: bool) -> bool:
    """Whether `state` names at most WALK_LIMIT leaves (counted without resolving)."""
    if flat:
        return len(state) <= WALK_LIMIT
    budget = [WALK_LIMIT]

    def count(node: Mapping[Any, Any]) -> bool:
        for value in node.values():
            if isinstance(value, Mapping):
                if not count(value):
                    return False
            else:
                budget[0] -= 1
                if budget[0] < 0:
                    return False
        return True

    return count(state)


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
    tree: Any, state: Any, *, strict: bool, flat: bool, nodes: Nodes, caller: str | None = None
) -> Any:
    """Returns `tree` with the leaves that `state` names replaced; see `Module.load_state_dict`.
    `caller` names the call in errors (by default ``Type.load_state_dict()``)."""
    method = "load_flat_state_dict" if flat else "load_state_dict"
    caller = caller or f"{type(tree).__name__}.{method}()"
    if not isinstance(state, Mapping):
        raise TypeError(f"{caller} expects a dict, got {type(state).__name__}.")
    if not strict and _few(state, flat):
        walk = Walk(tree, nodes)
        found = resolve(walk, state, flat)
        olds = walk.olds.values()
        if olds and not any(isinstance(old, jax.ShapeDtypeStruct) for old in olds):
            return _finish(walk, found.supplied.items(), found.problems, caller)
        # an abstract tree (or an empty state): naming every leaf left unfilled needs them all
    view = Flat(tree, nodes)
    values = _in_order(view, state, flat)  # every leaf, in leaf order: the fast path
    if values is not None:
        return _finish(view, enumerate(values), [], caller)
    found = resolve(view, state, flat)
    absent = [i for i in range(len(view.olds)) if i not in found.supplied]
    if strict:
        found.problems.extend(err.missing(view.spec.names[i]) for i in absent)
    else:
        abstract = [i for i in absent if isinstance(view.olds[i], jax.ShapeDtypeStruct)]
        found.problems.extend(err.abstract(view.spec.names[i]) for i in abstract)
    return _finish(view, found.supplied.items(), found.problems, caller)


def _finish(
    view: Flat | Walk,
    supplied: Iterable[tuple[Any, Any]],
    problems: list[StateProblem],
    caller: str,
) -> Any:
    new, moves = _check(view, supplied, problems)
    if problems:
        raise StateDictError(caller, problems)
    _place(moves, new)
    return view.write(new)
