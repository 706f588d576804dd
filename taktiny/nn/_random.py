"""Random draws for initialisers and dropout, made as one flat vector and reshaped.

The values are those of ``jax.nn.initializers`` and ``jax.random`` on the full shape
(JAX numbers random elements by their flat position; the LeCun scale may differ in the
last bit, as it is computed in Python), but a one-axis draw
compiles several times faster on CPU than a multi-axis one (about 0.3-0.5 s against
2-4 s per new shape with JAX 0.10's partitionable threefry), which otherwise dominates
building small models and compiling dropout.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh
from jax.typing import DTypeLike

from ..arrays import Spec, part, placement

# The standard deviation of a standard normal truncated to [-2, 2]; dividing by it
# keeps the requested variance, as jax.nn.initializers.variance_scaling does.
_TRUNCATED_STDDEV = 0.87962566103423978


@partial(jax.jit, static_argnames=("kind", "shape", "dtype", "stddev", "explicit", "auto"))
def _sharded(
    key: Any,
    *,
    kind: str,
    shape: tuple[int, ...],
    dtype: Any,
    stddev: float,
    explicit: Any,
    auto: Any,
) -> jax.Array:
    """A parameter created directly with its sharding: every device computes its own shard
    (JAX's threefry is partitionable), so no device ever holds the whole parameter. The
    values are those of the unsharded draw."""
    if kind == "lecun_normal":
        init = jax.nn.initializers.truncated_normal(stddev, lower=-2.0, upper=2.0)
        x = init(key, shape, dtype, out_sharding=explicit)
    elif kind == "normal":
        x = jax.nn.initializers.normal(stddev)(key, shape, dtype, out_sharding=explicit)
    else:
        x = jnp.full(shape, kind == "ones", dtype, out_sharding=explicit)
    # the draw is placed on the Explicit axes; the Auto ones (and those of `with mesh:`) by
    # a constraint, which the compiler propagates back into the draw
    return x if auto is None else jax.lax.with_sharding_constraint(x, auto)


def _create(
    kind: str,
    key: Any,
    shape: Sequence[int],
    dtype: DTypeLike,
    stddev: float,
    sharding: Spec | None,
    where: str,
) -> jax.Array | None:
    """The parameter created on the ambient mesh by `sharding`; None when it is to be
    created as without a mesh."""
    placed = placement(sharding, tuple(shape), where)
    if placed is None:
        return None
    spec, mesh = placed
    # the mesh of `with mesh:` (a concrete Mesh) is made ambient as jax.set_mesh would;
    # inside a trace (where JAX refuses set_mesh) the deprecated context places by itself
    concrete = isinstance(mesh, Mesh) and not isinstance(jnp.zeros((), np.int8), Tracer)
    with jax.set_mesh(mesh) if concrete else contextlib.nullcontext():
        return _sharded(
            key,
            kind=kind,
            shape=tuple(shape),
            dtype=np.dtype(dtype),
            stddev=stddev,
            explicit=part(spec, mesh, explicit=True),
            auto=part(spec, mesh, explicit=False),
        )


def lecun_normal(
    key: jax.Array,
    shape: Sequence[int],
    dtype: DTypeLike,
    sharding: Spec | None = None,
    where: str = "",
) -> jax.Array:
    """``jax.nn.initializers.lecun_normal()(key, shape, dtype)`` for a kernel whose last
    axis is the output: a normal truncated to two standard deviations, with variance
    ``1 / fan_in``, where ``fan_in`` is the product of every other axis (input features
    times the window). Under a mesh, `sharding` (named `where` in errors) places it."""
    stddev = math.sqrt(1.0 / math.prod(shape[:-1])) / _TRUNCATED_STDDEV
    placed = _create("lecun_normal", key, shape, dtype, stddev, sharding, where)
    if placed is not None:
        return placed
    init = jax.nn.initializers.truncated_normal(stddev, lower=-2.0, upper=2.0)
    return init(key, (math.prod(shape),), dtype).reshape(shape)


def normal(
    key: jax.Array,
    shape: Sequence[int],
    dtype: DTypeLike,
    stddev: float,
    sharding: Spec | None = None,
    where: str = "",
) -> jax.Array:
    """``jax.nn.initializers.normal(stddev)(key, shape, dtype)``; see :func:`lecun_normal`
    for `sharding`."""
    placed = _create("normal", key, shape, dtype, stddev, sharding, where)
    if placed is not None:
        return placed
    return jax.nn.initializers.normal(stddev)(key, (math.prod(shape),), dtype).reshape(shape)


def constant(
    value: int,
    shape: Sequence[int],
    dtype: DTypeLike,
    sharding: Spec | None = None,
    where: str = "",
) -> jax.Array:
    """``jnp.zeros`` (`value` 0) or ``jnp.ones`` (1); see :func:`lecun_normal` for
    `sharding`."""
    kind = "ones" if value else "zeros"
    placed = _create(kind, None, shape, dtype, 0.0, sharding, where)
    if placed is not None:
        return placed
    return jnp.ones(shape, dtype) if value else jnp.zeros(shape, dtype)


def zero_bias(
    layer: str, size: int, use_bias: bool, dtype: DTypeLike, sharding: Spec | None = None
) -> jax.Array | None:
    """A layer's bias: zeros ``[size]`` (named ``<layer>.bias`` in errors), or None when
    `use_bias` is False; see :func:`lecun_normal` for `sharding`."""
    return constant(0, (size,), dtype, sharding, f"{layer}.bias") if use_bias else None


def unit_scale(
    layer: str, size: int, use_scale: bool, dtype: DTypeLike, sharding: Spec | None = None
) -> jax.Array | None:
    """A norm's scale: ones ``[size]`` (named ``<layer>.scale`` in errors), or None when
    `use_scale` is False; see :func:`lecun_normal` for `sharding`."""
    return constant(1, (size,), dtype, sharding, f"{layer}.scale") if use_scale else None


def keep_mask(key: jax.Array, rate: float, shape: Sequence[int]) -> jax.Array:
    """``jax.random.bernoulli(key, 1 - rate, shape)``: True for the elements dropout keeps."""
    return jax.random.bernoulli(key, 1.0 - rate, (math.prod(shape),)).reshape(shape)
