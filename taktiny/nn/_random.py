"""Random draws for initialisers and dropout, made as one flat vector and reshaped.

The values are those of ``jax.nn.initializers`` and ``jax.random`` on the full shape
(JAX numbers random elements by their flat position; the LeCun scale may differ in the
last bit, as it is computed in Python), but a one-axis draw
compiles several times faster on CPU than a multi-axis one (about 0.3-0.5 s against
2-4 s per new shape with JAX 0.10's partitionable threefry), which otherwise dominates
building small models and compiling dropout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.typing import DTypeLike

# The standard deviation of a standard normal truncated to [-2, 2]; dividing by it
# keeps the requested variance, as jax.nn.initializers.variance_scaling does.
_TRUNCATED_STDDEV = 0.87962566103423978


def lecun_normal(key: jax.Array, shape: Sequence[int], dtype: DTypeLike) -> jax.Array:
    """``jax.nn.initializers.lecun_normal()(key, shape, dtype)`` for a kernel whose last
    axis is the output: a normal truncated to two standard deviations, with variance
    ``1 / fan_in``, where ``fan_in`` is the product of every other axis (input features
    times the window)."""
    stddev = math.sqrt(1.0 / math.prod(shape[:-1])) / _TRUNCATED_STDDEV
    init = jax.nn.initializers.truncated_normal(stddev, lower=-2.0, upper=2.0)
    return init(key, (math.prod(shape),), dtype).reshape(shape)


def normal(key: jax.Array, shape: Sequence[int], dtype: DTypeLike, stddev: float) -> jax.Array:
    """``jax.nn.initializers.normal(stddev)(key, shape, dtype)``."""
    return jax.nn.initializers.normal(stddev)(key, (math.prod(shape),), dtype).reshape(shape)


def keep_mask(key: jax.Array, rate: float, shape: Sequence[int]) -> jax.Array:
    """``jax.random.bernoulli(key, 1 - rate, shape)``: True for the elements dropout keeps."""
    return jax.random.bernoulli(key, 1.0 - rate, (math.prod(shape),)).reshape(shape)
