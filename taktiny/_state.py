"""The state walk: reading a module's parameters as dicts, and loading them back.

Reading is one ``tree_flatten`` plus a description of the tree (the names of its
leaves and a nested template) cached by tree structure. Loading is one dict
lookup per supplied value, a check per value (cast and placed only when it
must be), and one unflatten.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import operator
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from . import _errors as err
from ._errors import StateDictError, StateProblem

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
_SINGLE = jax.sharding.SingleDeviceSharding


@dataclasses.dataclass(frozen=True)
class _Custom:
    """A custom PyTree parameter (a quantized weight): whole in the nested form."""

    treedef: Any
    start: int
    stop: int


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
    names: tuple[str, ...]  # the flat name of each leaf, in flatten order
    index: dict[str, int]  # name -> leaf position
    template: dict[str, Any]  # nested: key -> leaf position | sub-template | _Custom
    plan: Any  # how to gather a full nested state's values in leaf order (None: can't)


_SPECS: dict[Any, _Spec] = {}


@functools.cache
def _array_type() -> type:
    """The concrete class of JAX arrays, for an exact-type fast path (made concretely even
    when first asked for inside a jit trace)."""
    with jax.ensure_compile_time_eval():
        return type(jnp.zeros(()))


def _key(key: Any) -> str:
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, (DictKey, FlattenedIndexKey)):
        return str(key.key)
    return str(key)


def _make_spec(model: Any) -> _Spec:
    from ._module import Module

    def is_param(x: Any) -> bool:
        return x is not None and not isinstance(x, (Module, list, tuple, dict))

    template: dict[str, Any] = {}
    names: list[str] = []
    for path, value in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_param)[0]:
        keys = [_key(k) for k in path]
        node = template
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        inner, treedef = jax.tree_util.tree_flatten_with_path(value)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # an array
            node[keys[-1]] = len(names)
        elif inner:
            node[keys[-1]] = _Custom(treedef, len(names), len(names) + len(inner))
        names += [".".join(keys + [_key(k) for k in sub]) for sub, _ in inner]
    index = {name: i for i, name in enumerate(names)}
    return _Spec(tuple(names), index, template, _plan(template))


def _plan(template: dict[str, Any]) -> Any:
    """For a template node: its key count and segments, each a run of leaf keys (read with
    one itemgetter) or a sub-node; None when a custom parameter makes it irregular."""
    segments: list[tuple[Any, Any]] = []
    for key, child in template.items():
        if type(child) is dict:
            sub = _plan(child)
            if sub is None:
                return None
            segments.append((key, sub))
        elif type(child) is int:
            if segments and type(segments[-1][0]) is list:
                segments[-1][0].append(key)
            else:
                segments.append(([key], None))
        else:
            return None
    runs = [
        (operator.itemgetter(*keys), len(keys) > 1) if type(keys) is list else (keys, sub)
        for keys, sub in segments
    ]
    return len(template), runs


def _gather(plan: Any, state: Any, out: list[Any]) -> None:
    """Appends a full nested state's values in leaf order; raises (LookupError, TypeError or
    AttributeError) when `state` isn't shaped exactly like the template."""
    size, runs = plan
    if len(state) != size:
        raise LookupError
    for first, second in runs:
        if type(second) is bool:  # a run of leaves
            if second:
                out.extend(first(state))
            else:
                out.append(first(state))
        else:
            _gather(second, state[first], out)


def _flatten(model: Any) -> tuple[list[Any], Any, _Spec]:
    leaves, treedef = jax.tree_util.tree_flatten(model)
    spec = _SPECS.get(treedef)
    if spec is None:
        if len(_SPECS) >= 4096:
            _SPECS.clear()
        spec = _SPECS[treedef] = _make_spec(model)
    return leaves, treedef, spec


def _build(template: dict[str, Any], leaves: list[Any]) -> dict[str, Any]:
    return {
        key: leaves[child]
        if type(child) is int
        else _build(child, leaves)
        if type(child) is dict
        else child.treedef.unflatten(leaves[child.start : child.stop])
        for key, child in template.items()
    }


def state_dict(model: Any) -> dict[str, Any]:
    leaves, _, spec = _flatten(model)
    return _build(spec.template, leaves)


def flat_state_dict(model: Any) -> dict[str, Any]:
    leaves, _, spec = _flatten(model)
    return dict(zip(spec.names, leaves))


# --- loading ---------------------------------------------------------------------------


def _collect(spec: _Spec, state: Mapping[Any, Any]) -> tuple[dict[int, Any], list[StateProblem]]:
    """Walks a nested state along the spec's template: leaf position -> value, and problems."""
    supplied: dict[int, Any] = {}
    problems: list[StateProblem] = []

    def name(path: tuple[Any, ...], key: Any) -> str:  # built only for problems
        parts = [key if isinstance(key, str) else repr(key)]
        while path:
            path, parent = path
            parts.append(parent)
        return ".".join(reversed(parts))

    def walk(template: dict[str, Any], state: Mapping[Any, Any], path: tuple[Any, ...]) -> None:
        for key, value in state.items():
            child = template.get(key)
            if type(child) is int:
                supplied[child] = value  # checked with the others
            elif type(child) is dict:
                if type(value) is dict or isinstance(value, Mapping):
                    walk(child, value, (path, key))
                else:
                    problems.append(err.group_expected(name(path, key), list(child), value))
            elif child is not None:  # a custom PyTree parameter, given whole
                inner, treedef = jax.tree_util.tree_flatten(value)
                if treedef == child.treedef:
                    supplied.update(zip(range(child.start, child.stop), inner))
                else:
                    problems.append(err.structure(name(path, key), child.treedef, treedef))
            elif isinstance(key, str) and "." in key:
                problems.append(err.dotted_key(name(path, key)))
            elif not isinstance(key, str):
                problems.append(err.non_string_key(name(path, key), key, str(key) in template))
            else:
                problems.append(err.unknown(name(path, key), spec.names, value, flat=False))

    walk(spec.template, state, ())
    return supplied, problems


_KINDS = (
    ("floating", jnp.floating),
    ("complex", jnp.complexfloating),
    ("signed integer", jnp.signedinteger),
    ("unsigned integer", jnp.unsignedinteger),
    ("bool", jnp.bool_),
)


def _kind(dtype: Any) -> str | None:
    """The kind a load may cast within, or None for a dtype that is not numeric or bool."""
    return next((name for name, kind in _KINDS if jnp.issubdtype(dtype, kind)), None)


def _convert(name: str, value: Any, old: Any, problems: list[StateProblem]) -> Any:
    """`value` checked against the leaf `old` it replaces and cast to its dtype; None (and a
    problem recorded) when it can't be."""
    if not isinstance(value, (jax.Array, np.ndarray)):
        if isinstance(value, Mapping):
            problems.append(err.array_expected(name, value, "this name is one array"))
            return None
        try:
            array = None if isinstance(value, jax.ShapeDtypeStruct) else np.asarray(value)
        except Exception:  # noqa: BLE001 - any failure means "not an array"
            array = None
        if array is None or _kind(array.dtype) is None:  # not numeric
            problems.append(err.not_an_array(name, value))
            return None
        value = array
    if not hasattr(old, "dtype"):  # a Python scalar forced to be a leaf
        old = jnp.asarray(old)
    if value.shape != old.shape:
        problems.append(err.shape(name, tuple(old.shape), tuple(value.shape)))
        return None
    if value.dtype == old.dtype:
        return value
    source = _kind(value.dtype) or str(value.dtype)
    target = _kind(old.dtype) or str(old.dtype)
    if source != target:
        problems.append(err.dtype_kind(name, old.dtype, value.dtype, target, source))
        return None
    if "integer" in target and jnp.iinfo(old.dtype).bits < jnp.iinfo(value.dtype).bits:
        info, traced = jnp.iinfo(old.dtype), isinstance(value, Tracer)
        if traced or (
            value.size and not info.min <= int(value.min()) <= int(value.max()) <= info.max
        ):
            problems.append(err.narrowing(name, old.dtype, value.dtype, traced))
            return None
    return value.astype(old.dtype)


def _shared(value: Any, given: Any, target: Any) -> bool:
    """Whether placing NumPy `value` on `target` (None: the default device) could leave the
    loaded leaf sharing memory with an array the caller still holds (`given` itself, or what
    it views, like a torch tensor's `.numpy()`). On CPU, jax.device_put shares aligned host
    buffers, even with may_alias=False, so a later write to the caller's array would
    silently change the loaded model."""
    if not isinstance(value, np.ndarray) or (value is not given and value.flags.owndata):
        return False
    devices = target.device_set if target is not None else jax.devices()[:1]
    return any(device.platform == "cpu" for device in devices)


def _full_state(state: Mapping[Any, Any], spec: _Spec, flat: bool) -> list[Any] | None:
    """The values of `state` in the model's leaf order when it names every leaf exactly as
    the model's own state does (a full load); None otherwise, or when unsure."""
    if flat:
        if len(state) == len(spec.names) and tuple(state) == spec.names:
            return list(state.values())
        return None
    if spec.plan is None or spec.plan[0] != len(state):
        return None
    values: list[Any] = []
    try:
        _gather(spec.plan, state, values)
    except (LookupError, TypeError, AttributeError):
        return None
    return values


def load(model: Any, state: Any, *, strict: bool, flat: bool) -> Any:
    method = "load_flat_state_dict" if flat else "load_state_dict"
    if not isinstance(state, Mapping):
        kind = type(state).__name__
        raise TypeError(f"{type(model).__name__}.{method}() expects a dict, got {kind}.")
    # A load allocates a few objects per leaf, all reachable: the cyclic collector has nothing
    # to find in them, but the allocations trigger collections that cost more than the load.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _load(model, state, strict, method)
    finally:
        if enabled:
            gc.enable()


def _load(model: Any, state: Mapping[Any, Any], strict: bool, method: str) -> Any:
    flat = method == "load_flat_state_dict"
    leaves, treedef, spec = _flatten(model)
    values = _full_state(state, spec, flat)  # every leaf, in leaf order: the fast path
    if not flat and values is None:
        supplied, problems = _collect(spec, state)
    else:
        supplied, problems = {}, []
    if flat and values is None:
        for name, value in state.items():
            i = spec.index.get(name)
            if i is None:
                problems.append(err.unknown(str(name), spec.names, value, flat=True))
            else:
                supplied[i] = value

    new = list(leaves)
    moves: list[tuple[int, Any, Any]] = []  # values to place like the leaf they replace
    array_type = _array_type()
    for i, value in enumerate(values) if values is not None else supplied.items():
        old = leaves[i]
        if type(value) is array_type and type(old) is array_type and value.aval == old.aval:
            have, want = value.sharding, old.sharding  # the common case: same shape and dtype
            if type(have) is _SINGLE and type(want) is _SINGLE:
                # every computed array carries its own single-device sharding: compare what
                # it places by, without the general (and, per leaf, costly) ==
                same = have._device is want._device and have._memory_kind == want._memory_kind
            else:
                same = have is want or have == want
            if same:
                new[i] = value
            else:
                moves.append((i, value, want))
            continue
        given, value = value, _convert(spec.names[i], value, old, problems)
        if value is None:
            continue
        target = getattr(old, "sharding", None)
        if isinstance(old, Tracer) or isinstance(value, Tracer):  # inside jit: jit places it
            new[i] = jnp.asarray(value)
        elif isinstance(value, jax.Array) and value.sharding == target:
            new[i] = value
        else:
            moves.append((i, value.copy() if _shared(value, given, target) else value, target))

    if values is None and len(supplied) < len(leaves):
        absent = [i for i in range(len(leaves)) if i not in supplied]
        if strict:
            problems += [err.missing(spec.names[i]) for i in absent]
        else:
            abstract = [i for i in absent if isinstance(leaves[i], jax.ShapeDtypeStruct)]
            problems += [err.abstract(spec.names[i]) for i in abstract]
    if problems:
        raise StateDictError(f"{type(model).__name__}.{method}()", problems)

    for placed in ([m for m in moves if m[2] is not None], [m for m in moves if m[2] is None]):
        if placed:  # one batched transfer; a None target means the default device
            targets = [t for _, _, t in placed] if placed[0][2] is not None else None
            # a zero-size value holds no data, so it is placed afresh: JAX 0.10's device_put of
            # a zero-size array onto a mesh of another device order makes misshapen shards
            sources = [np.zeros(v.shape, v.dtype) if v.size == 0 else v for _, v, _ in placed]
            arrays = jax.device_put(sources, targets)
            for (i, _, _), array in zip(placed, arrays):
                new[i] = array
    return treedef.unflatten(new)
