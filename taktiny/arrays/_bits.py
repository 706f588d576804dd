"""Floats moved as the integers of their bits, by programs that only move values (a
transpose, a join, slices written into place), so that every bit arrives: XLA's CPU
backend joins bfloat16 and writes its slices through float32, which makes a NaN's payload
canonical, while integers move as they are.

A TPU is the exception this does not mend: its programs for large arrays flush bfloat16
subnormals to zero and make bfloat16, float16 and float8 NaNs canonical as they read
them, a bitcast from integers included (float32 keeps its bits). There only
``jax.device_put`` of host memory is sure to keep such values, and programs move floats
as they are (`bits_kept`): a load that transposes or joins pieces on the chip holds them
as the chip does (bench/FINDINGS.md section 14, docs/safetensors.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer


def bits_kept(sharding: Any) -> bool:
    """Whether programs on `sharding`'s devices keep every bit of the floats they move as
    integers: all but a TPU's, where programs moving floats as they are then save the
    bitcasts (they would not keep those bits either way)."""
    return all(device.platform != "tpu" for device in sharding.device_set)


def as_bits(array: jax.Array) -> jax.Array:
    """A float `array`'s bits, as unsigned integers of its width (inside a program); any
    other array as it is."""
    if not jnp.issubdtype(array.dtype, jnp.floating):
        return array
    return jax.lax.bitcast_convert_type(array, jnp.dtype(f"uint{8 * array.dtype.itemsize}"))


def from_bits(array: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`array` (made by :func:`as_bits` from arrays of `dtype`) as `dtype` again."""
    return array if array.dtype == dtype else jax.lax.bitcast_convert_type(array, dtype)


def moved(move: Callable[..., jax.Array], *arrays: Any) -> jax.Array:
    """``move(*arrays)``, for a `move` that only moves values (a concatenation, a stack: a
    linear map), run on the arrays' bits when they are floats of one dtype and none lies
    on a TPU (`bits_kept`). Its derivatives are `move`'s own: a bitcast has none, so a
    gradient through the bits alone would be zero."""
    dtype = arrays[0].dtype
    if not jnp.issubdtype(dtype, jnp.floating) or any(a.dtype != dtype for a in arrays):
        return move(*arrays)
    placed = [a.sharding for a in arrays if isinstance(a, jax.Array) and not isinstance(a, Tracer)]
    if not all(bits_kept(sharding) for sharding in placed):
        return move(*arrays)

    @jax.custom_jvp
    def run(*values: Any) -> jax.Array:
        return from_bits(move(*(as_bits(v) for v in values)), dtype)

    @run.defjvp
    def _(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[jax.Array, jax.Array]:
        return run(*primals), move(*tangents)

    return run(*arrays)
