"""The arguments every layer shares for dtypes and precision: parameters stored in one
dtype (``param_dtype``), computed in another (``dtype``), and matrix products at a chosen
``precision``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from ..module import field

# Declarations for a layer's class body: shown in its repr only when they are set.
DTYPE: Any = field(static=True, default=None)
PRECISION: Any = field(static=True, default=None)

# precision= values kept as they are given
_KEPT = (jax.lax.Precision, jax.lax.DotAlgorithm, jax.lax.DotAlgorithmPreset)


def static_dtype(dtype: DTypeLike | None) -> jnp.dtype | None:
    """A ``dtype=`` argument as the layer keeps it: a NumPy dtype, or None."""
    return None if dtype is None else jnp.dtype(dtype)


def static_precision(precision: jax.lax.PrecisionLike, layer: str | None = None) -> Any:
    """A ``precision=`` argument as the layer keeps it (a name such as ``"highest"``
    becomes a ``jax.lax.Precision``), so that a bad one fails when the layer is built;
    `layer` names the layer in the error."""
    if precision is None or isinstance(precision, _KEPT):
        return precision
    pair = isinstance(precision, tuple) and len(precision) == 2
    try:
        if isinstance(precision, str):
            return jax.lax.Precision(precision.lower())
        if pair:
            return tuple(_one(p) for p in precision)
    except (TypeError, ValueError):  # not a string, or not a precision's name
        pass
    who = f"{layer}'s precision" if layer else "precision"
    raise ValueError(
        f"{who} must be None, a jax.lax.Precision or one of the names 'default', 'high', "
        f"'highest' (or a pair of them, one per operand), or a jax.lax.DotAlgorithmPreset; "
        f"got {precision!r}. Use precision='highest' for full float32 products on GPUs "
        f"and TPUs."
    )


def _one(precision: object) -> jax.lax.Precision:
    """One operand's precision: a ``jax.lax.Precision`` or its name."""
    if isinstance(precision, jax.lax.Precision):
        return precision
    if isinstance(precision, str):
        return jax.lax.Precision(precision.lower())
    raise TypeError(precision)


def compute_dtype(dtype: jnp.dtype | None, parameter: Any) -> jnp.dtype:
    """The dtype a layer computes in: its ``dtype``, or its parameter's when that is None."""
    return jnp.dtype(parameter.dtype) if dtype is None else dtype
