"""The two forms of a stack's state: stacked (``layers.block.<rest>``, one leaf
``[count, ...]``) and per layer (``layers.<i>.<rest>``, one slice per layer).

Reading per layer slices each stacked leaf; a load given per-layer names (all layers of a
leaf, or some) turns them into the stacked leaf before the one resolution, checking each
slice as the leaf it stands for: a load of every layer stacks them, a load of some writes
their slices into a copy of the leaf (JAX arrays are immutable: the floor is one new
array per leaf touched; the model's other leaves are kept as they are).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import taktiny.state._problems as err

from ._names import Spec, flatten
from ._problems import Problems, StateDictError
from ._values import checked_value


def unstacked(spec: Spec, leaves: list[Any]) -> dict[str, Any]:
    """The flat state with every stacked leaf given per layer, its slices in layer order,
    each layer's leaves together (as a list of blocks orders them), where the stack's
    first leaf stands."""
    out: dict[str, Any] = {}
    done: set[str] = set()
    for name, leaf in zip(spec.names, leaves, strict=True):
        stack = spec.stack_of(name)
        if stack is None:
            out[name] = leaf
            continue
        if stack.block in done:
            continue
        done.add(stack.block)
        group = [(n, spec.index[n]) for n in spec.names if n.startswith(stack.block + ".")]
        for i in range(stack.count):
            for stacked, position in group:
                leaf = leaves[position]
                one = layer_sharded(leaf) if isinstance(leaf, jax.ShapeDtypeStruct) else leaf[i]
                out[stack.layer_name(stacked, i)] = one
    return out


def layer_sharding(sharding: Any, ndim: int) -> Any:
    """The sharding of one layer of a stacked leaf of `ndim` axes on `sharding`: a
    NamedSharding without its layer axis (replicated along a mesh axis that split the
    layers); any other sharding as it is."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = (*sharding.spec, *(None,) * (ndim - len(sharding.spec)))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]))


def layer_sharded(leaf: Any) -> jax.ShapeDtypeStruct:
    """One layer of an abstract stacked leaf (a ``jax.ShapeDtypeStruct``)."""
    sharding = layer_sharding(getattr(leaf, "sharding", None), len(leaf.shape))
    return jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype, sharding=sharding)


def per_layer(spec: Spec, names: Any) -> bool:
    """Whether any of the flat `names` is a per-layer name of a stack of `spec`."""
    return bool(spec.stacks) and any(spec.split_layer(n) is not None for n in names)


def restacked(
    spec: Spec, leaves: list[Any], flat: Mapping[str, Any], caller: str
) -> dict[str, Any]:
    """`flat` with its per-layer names turned into the stacked leaves they are slices of:
    every layer given, the slices stacked; some, written into a copy of the leaf. Raises
    StateDictError for a slice of the wrong shape or kind (named per layer), for a leaf
    given both whole and per layer, and for some layers of an abstract leaf (the others
    have no value)."""
    out: dict[str, Any] = {}
    groups: dict[str, dict[int, tuple[str, Any]]] = {}
    for name, value in flat.items():
        hit = spec.split_layer(name)
        if hit is None or hit[0] not in spec.index:
            out[name] = value  # (an unknown name: the resolution reports it)
        else:
            groups.setdefault(hit[0], {})[hit[1]] = (name, value)
    problems = Problems()
    for stacked, slices in groups.items():
        old = leaves[spec.index[stacked]]
        if stacked in out:
            problems.append(err.both_forms(stacked, [n for n, _ in slices.values()]))
            continue
        layer = jax.ShapeDtypeStruct(tuple(old.shape[1:]), old.dtype)
        checked = {i: checked_value(n, v, layer, problems) for i, (n, v) in slices.items()}
        if any(v is None for v in checked.values()):
            continue
        count = old.shape[0]
        if len(checked) == count:
            parts = [checked[i] for i in range(count)]
            host = all(isinstance(p, np.ndarray) for p in parts)
            out[stacked] = np.stack(parts) if host else jnp.stack(parts)
        elif isinstance(old, jax.ShapeDtypeStruct):
            stack = spec.stack_of(stacked)
            assert stack is not None  # (a per-layer name's leaf is a stack's)
            for i in range(count):
                if i not in checked:
                    name = stack.layer_name(stacked, i)
                    problems.append(err.layer_without_value(name, stacked, sorted(checked)))
        else:
            index = np.array(sorted(checked))
            out[stacked] = old.at[index].set(jnp.stack([checked[i] for i in sorted(checked)]))
    if problems:
        raise StateDictError(caller, problems)
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Nested dicts of dotted names: ``{"a.b": x}`` -> ``{"a": {"b": x}}``."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        *groups, last = name.split(".")
        node = out
        for key in groups:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def _dotted(node: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            _dotted(value, name, out)  # pyright: ignore[reportUnknownArgumentType]
        else:
            out[name] = value


def _has_digits(state: Mapping[Any, Any], flat: bool) -> bool:
    """Whether any name of `state` has a part that is a number (a per-layer name may)."""
    if flat:
        return any(any(p.isdigit() for p in str(n).split(".")) for n in state)
    return any(
        (type(k) is str and k.isdigit()) or (isinstance(v, Mapping) and _has_digits(v, False))  # pyright: ignore[reportUnknownArgumentType]
        for k, v in state.items()
    )


def stacked_state(
    tree: Any, state: Mapping[Any, Any], flat: bool, caller: Any
) -> Mapping[Any, Any]:
    """`state` with per-layer names of the tree's stacks turned into their stacked leaves
    (:func:`restacked`); `state` itself when it has none. `caller()` names the load."""
    if not _has_digits(state, flat):
        return state
    leaves, _, spec = flatten(tree)
    if not spec.stacks:
        return state
    if flat:
        if not per_layer(spec, state):
            return state
        return restacked(spec, leaves, state, caller())
    out: dict[Any, Any] = dict(state)
    for stack in spec.stacks:  # each stack's subtree given per layer: made stacked
        path = stack.path.split(".") if stack.path else []
        node: Any = out
        parents: list[tuple[Any, Any]] = []
        for key in path:
            if not isinstance(node, Mapping) or key not in node:
                break
            parents.append((cast("Mapping[Any, Any]", node), key))
            node = cast("Mapping[Any, Any]", node)[key]
        else:
            if not isinstance(node, Mapping):
                continue
            if not any(type(k) is str and k.isdigit() for k in cast("Mapping[Any, Any]", node)):
                continue
            dotted: dict[str, Any] = {}
            _dotted(node, stack.path, dotted)  # pyright: ignore[reportUnknownArgumentType]
            made = nest(restacked(spec, leaves, dotted, caller()))
            for key in path:
                made = made[key]
            rebuilt: Any = made  # copies along the path: the caller's dicts are not changed
            for parent, key in reversed(parents):
                rebuilt = {**parent, key: rebuilt}
            out = rebuilt
    return out
