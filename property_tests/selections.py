"""Hypothesis strategies over states: partial selections, new values, bad values, renamings.

Each strategy takes a module's actual state (nested or flat) or one of its leaves and returns
what a load is given together with what the load must do with it: the names it supplies, the
array a value must load as, or the flat name and kind of the problem it must raise.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from .arrays import DTYPES, arrays, on_accelerator, place
from .checks import dtype_of, kind_of

# Where a value can come from: each form below is something `load_*` accepts for any leaf.
FORMS = ("jax, same placement", "jax, default device", "jax, another device", "numpy")
FORMS += ("numpy, wider dtype", "python list", "jax, wider dtype")
CAST = ("numpy, wider dtype", "python list", "jax, wider dtype")  # (forms a load casts back)
_WIDER = {"floating": np.float64, "signed": np.int64, "unsigned": np.uint64, "bool": np.bool_}
_WIDEST_JAX = {"floating": jnp.float32, "signed": jnp.int32, "unsigned": jnp.uint32}  # no x64
BAD_KINDS = ("shape", "dtype", "value", "structure")
RENAMINGS = ("typo", "suffix", "parent", "prefix", "index", "upper", "empty")


@st.composite
def flat_selections(draw: Any, flat: dict[str, Any]) -> list[str]:
    """Some names of a flat state, in its order: none, all, or a random subset."""
    mode = draw(st.sampled_from(("some", "all", "none")))
    if mode != "some":
        return list(flat) if mode == "all" else []
    keep = draw(st.lists(st.booleans(), min_size=len(flat), max_size=len(flat)))
    return [name for name, kept in zip(flat, keep, strict=True) if kept]


@st.composite
def nested_selections(draw: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Part of a nested state: each key kept whole, dropped, or (a group) selected from."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        choices = ("keep", "drop", "part") if isinstance(value, dict) else ("keep", "drop")
        choice = draw(st.sampled_from(choices))
        if choice == "keep":
            out[key] = value
        elif choice == "part":
            out[key] = draw(nested_selections(value))  # may be {}: it supplies nothing
    return out


@st.composite
def replacements(
    draw: Any, leaf: Any, devices: list[Any], forms: tuple[str, ...] = FORMS
) -> tuple[Any, np.ndarray]:
    """A new value for `leaf` in one of `forms`, and the array it must load as (same values,
    the leaf's dtype). Values start in the leaf's dtype, so every widening is exact."""
    dtype, shape = dtype_of(leaf), np.shape(leaf)
    if not isinstance(leaf, jax.Array):  # a Python scalar has no placement to keep
        forms = tuple(form for form in forms if form != "jax, same placement")
    if math.prod(shape) == 0:  # [] has no dtype (NumPy makes it float64) nor a shape like (0, 2)
        forms = tuple(form for form in forms if form != "python list")
    form = draw(st.sampled_from(forms))
    # subnormals and NaN payloads where the value is not cast on its way (a cast makes a
    # signalling NaN quiet) and the devices keep them (a TPU's programs do not)
    odd_bits = form not in CAST and not on_accelerator(devices)
    host = draw(arrays(None, shape=shape, dtype=dtype, odd_bits=odd_bits))
    if form == "jax, same placement":
        value = place(host, leaf.sharding if leaf.committed else None, devices[0])
    elif form == "jax, default device":
        value = jnp.asarray(host)
    elif form == "jax, another device":
        value = jax.device_put(host, draw(st.sampled_from(devices)))
    elif form == "numpy":
        value = host
    elif form == "numpy, wider dtype":
        value = host.astype(_WIDER[kind_of(dtype)])
    elif form == "python list":
        value = host.tolist()
    else:  # the widest dtype JAX has without x64
        value = jnp.asarray(host.astype(_WIDEST_JAX.get(kind_of(dtype), dtype)))
    return value, host


@st.composite
def bad_values(draw: Any, leaf: Any, traced: bool = False) -> tuple[Any, str]:
    """A value `leaf` cannot take, and the kind of problem it must raise (`BAD_KINDS`). With
    `traced`, one that can be passed to ``jax.jit`` (arrays; no 64-bit ints, which jit would
    quietly narrow)."""
    dtype, shape = dtype_of(leaf), tuple(np.shape(leaf))
    kind = draw(st.sampled_from([k for k in BAD_KINDS if not (traced and k == "value")]))
    if kind == "shape":
        shapes = [(*shape, 2)]
        shapes += [shape[1:], (*shape[:-1], shape[-1] + 1)] if shape else []
        return np.zeros(draw(st.sampled_from(shapes)), dtype), kind
    if kind == "dtype":
        if kind_of(dtype) in _WIDER and kind_of(dtype) != "floating" and np.prod(shape) > 0:
            if not traced and draw(st.booleans()) and dtype != jnp.bool_:  # narrowing
                out_of_range = 2**40 if np.dtype(dtype).itemsize == 4 else 1000
                wider = _WIDER[kind_of(dtype)]  # (JAX has no 64-bit ints without x64)
                return np.full(shape, out_of_range, wider), kind
        value = draw(st.sampled_from([d for d in DTYPES if kind_of(d) != kind_of(dtype)]))
        value = np.zeros(shape, value)
        return (jnp.asarray(value) if draw(st.booleans()) else value), kind
    if kind == "value":
        values = ("oops", None, object(), ["a", "b"], jax.ShapeDtypeStruct(shape, dtype))
        return draw(st.sampled_from(values)), kind
    return {"value": np.zeros(shape, dtype)}, kind  # a dict where an array belongs


def _renamed(draw: Any, base: str, how: str) -> str:
    if how == "typo":
        i = draw(st.integers(0, max(len(base) - 1, 0)))
        return base[:i] + draw(st.sampled_from(("x", "_", "", "0"))) + base[i + 1 :]
    if how == "suffix":
        return base + ".value"
    if how == "parent":
        return base.rsplit(".", 1)[0] if "." in base else base + "s"
    if how == "prefix":
        return "model." + base
    if how == "index":
        parts = base.split(".")
        digits = [i for i, part in enumerate(parts) if part.isdigit()]
        parts[digits[0] if digits else -1] = "99"
        return ".".join(parts)
    return base.upper() if how == "upper" else ""


@st.composite
def flat_renamings(draw: Any, names: list[str]) -> str:
    """A flat name the module does not have, made from one it has."""
    base = draw(st.sampled_from(names)) if names else "kernel"
    new = _renamed(draw, base, draw(st.sampled_from(RENAMINGS)))
    while new in names:
        new += "_"
    return new


def flat_problem_kind(name: str, names: list[str]) -> str:
    """The kind of problem an unknown flat `name` raises: "structure" when it names a group of
    parameters or something inside one array, "unknown" otherwise."""
    inside = any(n.startswith(name + ".") for n in names)
    return "structure" if inside or any(name.startswith(n + ".") for n in names) else "unknown"


@st.composite
def nested_renamings(draw: Any, state: dict[str, Any], known: dict[str, Any]) -> dict[str, Any]:
    """`state` (part of the nested state `known`) with a key at some depth renamed, or copied
    to a new key beside it, to a key `known` has not got there (below the top level, possibly
    an int)."""
    how = draw(st.sampled_from((*RENAMINGS, "dotted", "int")))
    paths = _groups(state, known)
    if how == "int":  # not at the top level: beartype checks its annotation (str keys) in tests
        paths = [p for p in paths if p] or [[]]
        numbered = [p for p in paths if any(_numeric(k) for k in _at(state, p))]
        paths = numbered or paths
        how = "int" if paths[0] else "typo"
    path = draw(st.sampled_from(paths))
    node, known_node = _at(state, path), _at(known, path)
    keys = list(node)
    if how == "int":
        keys = [k for k in keys if _numeric(k)] or keys
    old = draw(st.sampled_from(keys)) if keys else None
    if how == "int":
        new: Any = int(old) if _numeric(old) else 0
    else:
        base = old if isinstance(old, str) and old else "w"
        new = base + ".sub" if how == "dotted" else _renamed(draw, base, how)
        while new in node or new in known_node:
            new += "_"
    value = node[old] if node else np.zeros(1, np.float32)
    keep = old is not None and draw(st.booleans())  # copied beside the old key, or renamed
    renamed = {(new if k == old and not keep else k): v for k, v in node.items()}
    renamed[new] = value
    for depth in reversed(range(len(path))):  # copy the dicts along the path, values kept
        parent = _at(state, path[:depth])
        renamed = {k: (renamed if k == path[depth] else v) for k, v in parent.items()}
    return renamed


def walk_nested(
    state: dict[str, Any], names: list[str], prefix: str = ""
) -> tuple[list[str], list[tuple[str, str]]]:
    """An oracle for nested loads, from the rules of the design: the names of the leaves a
    nested `state` supplies to a module whose flat names are `names`, and the (flat name,
    kind) of each key it has not got ("key" for a key that is not a string or has a ".", else
    "unknown"), in the order a walk of `state` meets them. Values are assumed to be arrays at leaves, dicts at groups."""
    supplied: list[str] = []
    problems: list[tuple[str, str]] = []
    for key, value in state.items():
        name = f"{prefix}{key}" if isinstance(key, str) else f"{prefix}{key!r}"
        if isinstance(key, str) and "." in key:
            problems.append((name, "key"))
        elif not isinstance(key, str):
            problems.append((name, "key"))
        elif not any(n == name or n.startswith(name + ".") for n in names):
            problems.append((name, "unknown"))
        elif isinstance(value, dict):
            inner, inner_problems = walk_nested(value, names, name + ".")
            supplied += inner
            problems += inner_problems
        else:
            supplied.append(name)
    return supplied, problems


def _groups(state: dict[str, Any], known: dict[str, Any], path: tuple = ()) -> list[list[str]]:
    """The paths of `state`'s dicts (itself included) that `known` has too, non-empty."""
    paths = [list(path)]
    for key, value in state.items():
        if isinstance(value, dict) and value and isinstance(known.get(key), dict):
            paths += _groups(value, known[key], (*path, key))
    return paths


def _numeric(key: Any) -> bool:
    return isinstance(key, str) and key.isdigit()


def _at(state: dict[str, Any], path: list[str]) -> dict[str, Any]:
    for key in path:
        state = state[key]
    return state
