"""Assertions the properties share: leaves compared bit for bit with dtypes and shardings.

A leaf is usually a JAX array; a Python scalar forced into the data (``field(static=False)``)
is compared as the array JAX makes of it (its canonical dtype), which is what a load returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def dtype_of(x: Any) -> np.dtype:
    """The dtype of an array, or the canonical dtype JAX gives a Python scalar."""
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.dtype(jnp.result_type(x))


def kind_of(dtype: Any) -> str:
    """ "floating", "signed", "unsigned" or "bool": the kinds a load never converts between."""
    if jnp.issubdtype(dtype, jnp.floating):
        return "floating"
    if jnp.issubdtype(dtype, jnp.integer):
        return "signed" if jnp.issubdtype(dtype, jnp.signedinteger) else "unsigned"
    return "bool"


def host(x: Any) -> np.ndarray:
    """`x` as a NumPy array of its (canonical) dtype. A zero-size array holds no values, and is
    not read back: in JAX 0.10, computing on a zero-size sharded array (``x * 2``, a gradient)
    can make shards of the wrong shape, which ``np.asarray`` then rejects."""
    if np.size(x) == 0:
        return np.zeros(np.shape(x), dtype_of(x))
    return np.asarray(x, dtype=dtype_of(x))


def same_bits(a: Any, b: Any) -> bool:
    """Whether `a` and `b` have the same dtype, shape and bytes."""
    x, y = host(a), host(b)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def same_values(a: Any, b: Any) -> bool:
    """Whether `a` and `b` have the same dtype, shape and values (NaNs equal, -0.0 not 0.0):
    what survives a cast through another dtype of the same kind."""
    x, y = host(a), host(b)
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if kind_of(x.dtype) != "floating":
        return bool(np.array_equal(x, y))
    x, y = x.astype(np.float32), y.astype(np.float32)
    return bool(
        np.array_equal(x, y, equal_nan=True) and np.array_equal(np.signbit(x), np.signbit(y))
    )


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """The leaves of `tree` with their key paths, in flatten order."""
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def assert_same_leaf(got: Any, want: Any, where: str, *, sharding: bool = True) -> None:
    """`got` has `want`'s dtype, shape and bytes and, where `want` is a JAX array, its sharding."""
    assert same_bits(got, want), f"{where}: {host(got)!r} is not bitwise {host(want)!r}"
    if sharding and isinstance(want, jax.Array):
        assert isinstance(got, jax.Array), f"{where}: {type(got).__name__} is not a jax.Array"
        assert got.sharding == want.sharding, f"{where}: {got.sharding} != {want.sharding}"


def assert_same_model(got: Any, want: Any, *, sharding: bool = True) -> None:
    """`got` equals `want` leaf for leaf: tree structure, dtypes, bits and shardings."""
    assert type(got) is type(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (where, x), (_, y) in zip(named_leaves(got), named_leaves(want), strict=True):
        assert_same_leaf(x, y, where, sharding=sharding)


def flatten_by_path(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested state flattened by path, keys joined with ".", in the dicts' own order; a
    custom PyTree parameter kept whole in it is flattened by its own key paths."""
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update(flatten_by_path(value, f"{prefix}{key}."))
        elif dataclasses.is_dataclass(value):  # a custom parameter (strategies.Scaled)
            for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
                inner = jax.tree_util.keystr(path, simple=True, separator=".")
                flat[f"{prefix}{key}.{inner}"] = leaf
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def identities(tree: Any) -> list[tuple[str, Any]]:
    """What a call must leave as it was: for a state, the path and ``id`` of every dict and
    value in it; for a module, its tree structure and the ``id`` of every leaf."""
    if not isinstance(tree, dict):
        return [("structure", jax.tree.structure(tree))] + [
            (where, id(x)) for where, x in named_leaves(tree)
        ]
    out: list[tuple[str, Any]] = []

    def visit(node: Any, path: str) -> None:
        out.append((path, id(node)))
        if isinstance(node, dict):
            for key, value in node.items():
                visit(value, f"{path}[{key!r}]")

    visit(tree, "")
    return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """The nested state with the leaves of a flat one (names split at "."; dict keys never
    contain one, so the split is unambiguous)."""
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        *groups, last = name.split(".")
        node = nested
        for group in groups:
            node = node.setdefault(group, {})
        node[last] = value
    return nested
