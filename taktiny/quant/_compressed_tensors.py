"""compressed-tensors' packed integers: int8 and int4 weights packed into int32 words as
its ``pack-quantized`` layout packs them, unpacked, and made a `QArray` with their scales.

A row of ``n`` integers of ``bits`` bits is offset by ``2**(bits - 1)`` (to 0..15 for 4
bits, 0..255 for 8) and packed densely, element ``i`` in bits ``i * bits`` onward of the
little-endian words: ``ceil(n * bits / 32)`` words, the last one padded. The checkpoints
that hold them, and the rules and transform that read them, are `taktiny.convert`'s
(``unpack_quantized``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._qarray import INT_DTYPES, QArray


def pack_int32(values: Any, bits: int) -> np.ndarray:
    """Integers ``[..., n]`` (int8 or int4, within the signed range of `bits`) packed as
    compressed-tensors packs them: int32 ``[..., ceil(n * bits / 32)]``."""
    per = 32 // bits
    v = (np.asarray(values).astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
    pad = -v.shape[-1] % per
    if pad:
        v = np.concatenate([v, np.zeros((*v.shape[:-1], pad), np.uint8)], axis=-1)
    if bits == 4:
        v = v[..., 0::2] | (v[..., 1::2] << 4)
    return np.ascontiguousarray(v).view("<i4")


@partial(jax.jit, static_argnames=("bits", "n"))
def unpack_int32(packed: Any, bits: int, n: int) -> jax.Array:
    """The integers `pack_int32` packed: `n` along the last axis, int8 (int4 for 4 bits)."""
    lead = packed.shape[:-1]
    data = jax.lax.bitcast_convert_type(packed, jnp.uint8).reshape(*lead, -1)
    if bits == 4:
        data = jnp.stack([data & 0x0F, data >> 4], axis=-1).reshape(*lead, -1)
    values = data[..., :n].astype(jnp.int16) - (1 << (bits - 1))
    return values.astype(INT_DTYPES[bits])


def packed_qarray(
    packed: Any, scale: Any, bits: int, n: int, group_size: int | None, perm: Any
) -> QArray:
    """The `QArray` of packed integers (`n` of `bits` bits along the last axis of int32
    `packed`) and their `scale` (one per row, or per `group_size` of them), quantized along
    that last axis: both permuted by `perm` (None: as they are), the axis with them."""
    values, scale = unpack_int32(jnp.asarray(packed), bits, n), jnp.asarray(scale)
    if perm is not None:
        values, scale = jnp.transpose(values, perm), jnp.transpose(scale, perm)
    last = len(packed.shape) - 1
    axis = last if perm is None else list(perm).index(last)
    return QArray(values, scale, bits=bits, axis=axis, group_size=group_size)
