"""Floats moved as the integers of their bits, by programs that only move values (a
transpose, a join, slices written into place), so that every bit arrives: XLA's CPU
backend joins bfloat16 and writes its slices through float32, which makes a NaN's payload
canonical, while integers move as they are.

Arrays moved between devices by ``jax.device_put`` go the same way (`put`): a reshard from
one mesh to another runs a program, and on the CPU it makes a bfloat16 NaN's payload
canonical.

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
from jax.sharding import NamedSharding


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


def put(values: list[Any], shardings: list[Any]) -> list[Any]:
    """``jax.device_put(values, shardings)``, one batched transfer, with every bit kept:
    a float JAX array narrower than 32 bits that goes from one mesh to another sharding
    of a mesh (a reshard, which runs a program: on the CPU it makes a bfloat16 NaN's
    payload canonical) moves as its bits, unless a TPU is at either end (`bits_kept`).
    Host arrays, arrays on one device and arrays that stay where they are move as they
    are (a copy, which keeps every bit).

    Args:
        values: arrays (JAX or NumPy) or Python numbers.
        shardings: where each goes, one per value.

    Returns:
        The placed arrays, in order.
    """
    turned = [_resharded(v, s) for v, s in zip(values, shardings, strict=True)]
    if not any(turned):
        return jax.device_put(values, shardings)  # pyright: ignore[reportUnknownMemberType]  (JAX leaves its parameters unannotated)
    sources = []
    for value, turn in zip(values, turned, strict=True):
        if turn:  # (each bitcast under its own mesh: an ambient one would refuse it)
            with jax.set_mesh(value.sharding.mesh):
                value = as_bits(value)
        sources.append(value)
    placed = jax.device_put(sources, shardings)  # pyright: ignore[reportUnknownMemberType]  (as above)
    out = []
    for array, value, sharding, turn in zip(placed, values, shardings, turned, strict=True):
        if turn:
            with jax.set_mesh(sharding.mesh):  # (then spelled as asked for: no transfer)
                array = jax.device_put(from_bits(array, value.dtype), sharding)  # pyright: ignore[reportUnknownMemberType]  (as above)
        out.append(array)
    return out


def _resharded(value: Any, sharding: Any) -> bool:
    """Whether `value` is a float JAX array narrower than 32 bits on a mesh that a program
    would move onto `sharding`, of a mesh too (another layout or other devices), neither
    of them a TPU's."""
    if not isinstance(sharding, NamedSharding) or not isinstance(value, jax.Array):
        return False
    dtype = value.dtype  # (first the cheap refusals: a load of many leaves asks for each)
    if dtype.itemsize >= 4 or isinstance(value, Tracer) or not jnp.issubdtype(dtype, jnp.floating):
        return False
    have = value.sharding
    if have is sharding or not isinstance(have, NamedSharding):
        return False
    if not (bits_kept(have) and bits_kept(sharding)):
        return False
    return not have.is_equivalent_to(sharding, value.ndim)
