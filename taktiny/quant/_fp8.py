"""FP8 block-scaled weights decoded: their scales checked, their products with the scales
of their blocks, and those products requantized into a `QArray`'s parts.

The weights are ``float8_e4m3fn`` (or another float8), one float32 scale per block of
``blocks`` entries along every axis, the last blocks of each axis ragged where the block
does not divide it; the float weight is ``weight * scale`` of its block. Hugging Face's
checkpoints of them, and the rules and transform that read them, are `taktiny.convert`'s
(``dequantize_blocks``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..arrays import as_bits, from_bits
from ._qarray import quantize_array, rounded_values, stored_scale


def blocks_of(shape: Sequence[int], block_size: Sequence[int]) -> tuple[int, ...]:
    """The scale's shape for weights of `shape` in blocks of `block_size` (over its last
    axes): the leading axes as they are, each blocked axis the number of blocks, a ragged
    last block included."""
    lead = len(shape) - len(block_size)
    return (*shape[:lead], *(-(-n // b) for n, b in zip(shape[lead:], block_size, strict=True)))


def scale_problem(value: Any, scale: Any, block_size: tuple[int, ...]) -> str | None:
    """What is wrong with `value` and `scale` as block-scaled weights (None: nothing)."""
    shape, dtype = tuple(value.shape), np.dtype(value.dtype)
    if len(shape) < len(block_size):
        return (
            f"weights in blocks of {_blocks(block_size)} have {len(block_size)} axes at least, "
            f"got shape {list(shape)}"
        )
    if dtype.itemsize != 1 or not jnp.issubdtype(dtype, jnp.floating):
        return f"block-scaled weights are float8, got {dtype.name}"
    want = blocks_of(shape, block_size)
    if tuple(scale.shape) != want or not jnp.issubdtype(scale.dtype, jnp.floating):
        return (
            f"weights of shape {list(shape)} in blocks of {_blocks(block_size)} take one float "
            f"scale per block, a scale of shape {list(want)}; got "
            f"{np.dtype(scale.dtype).name}{list(scale.shape)}. The checkpoint's block size is "
            f"its config.json's quantization_config.weight_block_size"
        )
    return None


def _blocks(block_size: Sequence[int]) -> str:
    return "x".join(map(str, block_size))


def _product(value: Any, scale: Any, blocks: tuple[int, ...]) -> jax.Array:
    """``value * scale`` of each entry's block (`blocks`: its size along every axis), in
    float32 (one XLA loop; no array of repeated scales)."""
    return value.astype(jnp.float32) * _factors(scale, blocks, value.shape)


@partial(jax.jit, static_argnames=("blocks", "dtype", "perm"))
def dequantized_blocks(
    value: Any, scale: Any, blocks: tuple[int, ...], dtype: Any, perm: Any
) -> jax.Array:
    """The block product in `dtype`, its axes permuted by `perm` (None: as they are; one
    XLA program, so the product is not held beside its transpose)."""
    product = _product(value, scale, blocks).astype(dtype)
    return product if perm is None else jnp.transpose(product, perm)


@partial(jax.jit, static_argnames=("blocks", "dtype", "bits", "axis", "group_size", "perm", "turn"))
def placed_blocks(
    value: Any,
    scale: Any,
    blocks: tuple[int, ...],
    dtype: Any,
    bits: int | None,
    axis: int,
    group_size: int | None,
    perm: tuple[int, ...] | None = None,
    turn: bool = False,
) -> Any:
    """The block product (rounded to float32) rounded into `dtype`, then (with `bits`)
    quantized along `axis`, in one XLA program, which holds no float32 product for a
    float leaf, nor for a quantized one of a `_ROUNDED` dtype from `_ORDERED` weights
    (`_requantized`). With `perm`, the scales (and `blocks`, both as stored) are permuted
    by it in the program, as are the weights with `turn` (else they come laid out; with
    `turn`, `_requantized`'s first pass reads them as stored); one program for a step,
    so no dispatch of its own for a transpose."""
    if perm is not None and not turn:  # (the weights laid out already: the scales too)
        _, scale, blocks = _laid_out(None, scale, blocks, perm)
        perm = None
    if bits is not None and _unheld(value.dtype, dtype):
        return _requantized(value, scale, blocks, dtype, bits, axis, group_size, perm)
    if perm is not None:
        value, scale, blocks = _laid_out(value, scale, blocks, perm)
    product = _product(value, scale, blocks).astype(dtype)
    if bits is None:
        return product
    return quantize_array(product, bits=bits, axis=axis, group_size=group_size, dtype=dtype)


def _laid_out(
    value: Any, scale: Any, blocks: tuple[int, ...], perm: tuple[int, ...]
) -> tuple[Any, jax.Array, tuple[int, ...]]:
    """Float8 weights `value` (moved as their bytes; None: none), their `scale` and
    `blocks`, as stored, with their axes permuted by `perm`."""
    if value is not None:
        value = from_bits(jnp.transpose(as_bits(value), perm), value.dtype)
    return value, jnp.transpose(scale, perm), tuple(blocks[p] for p in perm)


def blocks_held_bytes(weights: Any, dtype: Any, quantized: bool) -> int:
    """The bytes `placed_blocks` holds besides its arguments and its result, for float8
    `weights` (anything with their ``shape`` and ``dtype``) placed into a leaf of `dtype`,
    `quantized` or not: the float32 product, or none where it is not held."""
    if not quantized or _unheld(weights.dtype, dtype):
        return 0
    return math.prod(weights.shape) * 4


# the leaf dtypes whose rounding `jax.lax.reduce_precision` makes exactly as a cast does
# (float16's smallest subnormals it flushes: those leaves take the unfused path)
_ROUNDED = {jnp.dtype(jnp.float32): None, jnp.dtype(jnp.bfloat16): (8, 7)}
# the float8 dtypes whose bytes, sign bit cleared, order as their magnitudes with NaN above
# every number (the "fnuz" ones keep their NaN in the sign bit: they take the unfused path)
_ORDERED = {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)}


def _unheld(weights: Any, dtype: Any) -> bool:
    """Whether float8 weights of dtype `weights` requantize into a leaf of `dtype` without
    holding their product (`_requantized`)."""
    return jnp.dtype(dtype) in _ROUNDED and jnp.dtype(weights) in _ORDERED


def _requantized(
    value: Any,
    scale: Any,
    blocks: tuple[int, ...],
    dtype: Any,
    bits: int,
    axis: int,
    group_size: int | None,
    perm: tuple[int, ...] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`quantize_array` of the block product rounded into `dtype`, bit for bit, without
    holding the product (XLA:CPU materializes it, four bytes a weight, for a reduction
    and a division that both read it): the scales from the largest magnitudes of the
    float8 bytes themselves, then the values in one elementwise pass over the bytes.
    With `perm`, `value`, `scale` and `blocks` are as stored and the results' axes are
    theirs permuted by it (`axis` one of the results'): the first pass reads the stored
    bytes along the axis `perm` takes to `axis`, and only the second reads them
    permuted. Permuted bytes read by both passes, XLA permutes twice or writes them out
    whole first (XLA:CPU permuted twice, 2.5x the time of one pass's;
    bench/FINDINGS.md section 14).

    The largest ``|w * block scale|`` of a slice is the largest over its blocks of the
    block's ``|scale|`` times its largest ``|w|``, and the largest ``|w|`` of `_ORDERED`
    float8 weights is the largest of their bytes with the sign bit cleared; rounding into
    `dtype` keeps the order, so the maximum of the rounded products is the rounded
    maximum. A slice (a channel, or a group along `axis`) is cut into segments
    that lie within one block and one group each. Ragged edge blocks need no padding:
    the scales are broadcast over whole blocks and cut to the weights."""
    along = axis if perm is None else perm[axis]  # (the quantized axis, as stored)
    group = value.shape[along] if group_size is None else group_size
    top = _largest(value, scale, blocks, dtype, along, group)
    if perm is not None:  # (each group's largest, found as stored, laid out as the values)
        top = jnp.transpose(top, perm)
        value, scale, blocks = _laid_out(value, scale, blocks, perm)
    shape = value.shape
    scales = stored_scale(top, bits, dtype)  # one per group: scale_shape's
    # pass 2: the product rounded into dtype, in units of its group's stored scale
    product = _rounded(_product(value, scale, blocks), dtype)
    product = product.reshape(*shape[:axis], shape[axis] // group, group, *shape[axis + 1 :])
    values = rounded_values(product, jnp.expand_dims(scales, axis + 1), bits).reshape(shape)
    return values, scales


def _largest(
    value: Any, scale: Any, blocks: Sequence[int], dtype: Any, axis: int, group: int
) -> jax.Array:
    """Pass 1 of `_requantized`: each group's largest ``|w * block scale|`` along `axis`
    (groups of `group` entries), rounded into `dtype`, still float32: from each segment's
    largest byte, a float, times its block's scale."""
    shape = value.shape
    segment = math.gcd(group, blocks[axis])
    magnitude = jax.lax.bitcast_convert_type(value, jnp.uint8) & jnp.uint8(0x7F)
    split = (*shape[:axis], shape[axis] // segment, segment, *shape[axis + 1 :])
    tops = jax.lax.bitcast_convert_type(
        jnp.max(magnitude.reshape(split), axis=axis + 1), value.dtype
    )
    per_segment = [b // segment if k == axis else b for k, b in enumerate(blocks)]
    tops = tops.astype(jnp.float32) * _factors(jnp.abs(scale), per_segment, tops.shape)
    grouped = (*shape[:axis], shape[axis] // group, group // segment, *shape[axis + 1 :])
    return _rounded(jnp.max(tops.reshape(grouped), axis=axis + 1), dtype)


def _factors(scale: Any, blocks: Sequence[int], shape: Sequence[int]) -> jax.Array:
    """Each entry's block scale, for an array of `shape` in blocks of `blocks` entries
    along each axis (the last ones ragged): the scales broadcast over whole blocks and
    cut, which XLA computes inside the product that uses them (no array of them)."""
    grid = scale.shape
    whole = [d for g, b in zip(grid, blocks, strict=True) for d in (g, b)]
    factors = jnp.broadcast_to(
        scale.astype(jnp.float32).reshape([d for g in grid for d in (g, 1)]), whole
    )
    factors = factors.reshape([g * b for g, b in zip(grid, blocks, strict=True)])
    return factors[tuple(slice(n) for n in shape)]


def _rounded(array: Any, dtype: Any) -> jax.Array:
    """`array` (float32) rounded to `dtype`'s precision, still float32: an operation XLA
    keeps (a cast there and back it may skip inside a fusion)."""
    bits = _ROUNDED[jnp.dtype(dtype)]
    return array if bits is None else jax.lax.reduce_precision(array, *bits)
