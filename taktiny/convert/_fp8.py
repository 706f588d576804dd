"""FP8 block-scaled weights, as Hugging Face checkpoints ship them: a ``float8_e4m3fn``
weight ``<module>.weight`` beside a float32 ``<module>.weight_scale_inv`` holding one
factor per block of ``block_size`` entries (128x128), the last blocks of each axis ragged
where the block does not divide it. The float weight is ``weight * scale_inv`` of its
block (the name says inverse: the factor multiplies). `dequantize_blocks` makes it; the
rules of a model gain it through :func:`taktiny.convert.quantized_rules`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..quant import QArray, quantize_array
from ._rules import Rule
from ._transforms import Transform, chain, element_layout, identity, permutation, transpose

SCALE_SUFFIX = "_scale_inv"  # the scale of "<module>.weight" is "<module>.weight_scale_inv"


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
    float32: the weights padded to whole blocks, each block times its scale by broadcasting,
    and cut back (one XLA loop; no array of repeated scales)."""
    grid = scale.shape
    padded = [(0, g * b - n) for g, b, n in zip(grid, blocks, value.shape, strict=True)]
    w = jnp.pad(value.astype(jnp.float32), padded)
    w = w.reshape([d for g, b in zip(grid, blocks, strict=True) for d in (g, b)])
    factor = scale.astype(jnp.float32).reshape([d for g in grid for d in (g, 1)])
    w = (w * factor).reshape([g * b for g, b in zip(grid, blocks, strict=True)])
    return w[tuple(slice(n) for n in value.shape)]


@partial(jax.jit, static_argnames=("blocks", "dtype", "perm"))
def _dequantized(
    value: Any, scale: Any, blocks: tuple[int, ...], dtype: Any, perm: Any
) -> jax.Array:
    """The block product in `dtype`, its axes permuted by `perm` (None: as they are; one
    XLA program, so the product is not held beside its transpose)."""
    product = _product(value, scale, blocks).astype(dtype)
    return product if perm is None else jnp.transpose(product, perm)


@partial(jax.jit, static_argnames=("blocks", "dtype", "bits", "axis", "group_size"))
def _placed(
    value: Any,
    scale: Any,
    blocks: tuple[int, ...],
    dtype: Any,
    bits: int | None,
    axis: int,
    group_size: int | None,
) -> Any:
    """The block product rounded once into `dtype`, then (with `bits`) quantized along
    `axis`, in one XLA program (which holds no float32 product for a float leaf)."""
    product = _product(value, scale, blocks).astype(dtype)
    if bits is None:
        return product
    return quantize_array(product, bits=bits, axis=axis, group_size=group_size, dtype=dtype)


class dequantize_blocks(Transform):
    """Makes one float array from two, block-scaled weights and their scales (sources
    ``["{m}.weight", "{m}.weight_scale_inv"]``, as FP8 checkpoints hold them): each entry
    times the scale of its block, ``block_size`` entries over the last axes, the last
    block of an axis holding what is left. Computed in float32, the product is exact for
    float8 weights and float32 scales; the result is in `dtype`, laid out by `layout` in
    the same XLA program (so a transposed product is not held beside the product).

    Args:
        block_size: the entries of a block along each of the last axes; ``(128, 128)``
            for the checkpoints Hugging Face ships.
        dtype: the dtype of the result; float32 by default (a load casts it to each
            leaf's dtype, rounding once).
        layout: ``identity()`` (the default) or a ``transpose`` of the result: a
            ``Linear``'s ``[out, in]`` weight into a kernel's ``[in, out]``.

    Raises:
        ValueError: `block_size` is not positive sizes, or `layout` neither a rename nor
            a transpose; called with other than two arrays, weights that are not float8,
            or scales whose shape is not one per block (a load names the tensors and the
            rule).
    """

    def __init__(
        self,
        block_size: Sequence[int] = (128, 128),
        *,
        dtype: Any = np.float32,
        layout: Transform | None = None,
    ):
        self.block_size = tuple(int(b) for b in block_size)
        if not self.block_size or min(self.block_size) < 1:
            raise ValueError(f"block_size must be positive sizes, got {block_size!r}.")
        self.dtype = np.dtype(dtype)
        self.layout = element_layout(layout, "; chain other transforms after this one.")

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        if len(arrays) != 2:
            raise ValueError(
                f"{self!r} takes two arrays, the weights and their scales, got {len(arrays)}"
            )
        value, scale = (a if isinstance(a, jax.Array | jax.ShapeDtypeStruct) else jnp.asarray(a)
                        for a in arrays)  # fmt: skip
        problem = scale_problem(value, scale, self.block_size)
        if problem:
            raise ValueError(problem)
        blocks = self.blocks(len(value.shape))
        return (_dequantized(value, scale, blocks, self.dtype, self.perm(len(value.shape))),)

    def blocks(self, ndim: int) -> tuple[int, ...]:
        """The block's size along every axis of a weight.

        Args:
            ndim: the weight's number of axes.

        Returns:
            `block_size` with a 1 for each leading axis.
        """
        return (1,) * (ndim - len(self.block_size)) + self.block_size

    def perm(self, ndim: int) -> tuple[int, ...] | None:
        """The permutation `layout` makes of a weight's axes.

        Args:
            ndim: the weight's number of axes.

        Returns:
            The new order of the axes, or None when `layout` is ``identity()``.
        """
        return permutation(self.layout, ndim)

    def placed(self, value: Any, scale: Any, dtype: Any, like: QArray | None = None) -> Any:
        """What a load places from weights already laid out (`value`: read permuted by
        :meth:`perm`, as the load reads them) and their scales as stored: the product
        rounded once into `dtype`; with `like`, quantized as it is (``(value, scale)``
        parts), in the same XLA program.

        Args:
            value: the float8 weights, permuted by :meth:`perm`.
            scale: the scales, as stored (one per block, unpermuted).
            dtype: the leaf's dtype (a quantized parameter's logical dtype).
            like: the quantized parameter the product fills; None for a float leaf.

        Returns:
            The array, or the ``(value, scale)`` parts of the QArray.
        """
        ndim, perm = len(scale.shape), self.perm(len(scale.shape))
        blocks = self.blocks(ndim)
        if perm is not None:
            scale, blocks = jnp.transpose(scale, perm), tuple(blocks[p] for p in perm)
        layout = (None, 0, None) if like is None else (like.bits, like.axis, like.group_size)
        return _placed(value, scale, blocks, jnp.dtype(dtype), *layout)

    def _args(self) -> str:
        dtype = "" if self.dtype == np.float32 else f", dtype={self.dtype.name!r}"
        layout = "" if isinstance(self.layout, identity) else f", layout={self.layout!r}"
        return f"block_size={self.block_size}{dtype}{layout}"


def fp8_rule(rule: Rule, block_size: tuple[int, ...]) -> Rule:
    """`rule` (one source template ``<module>.weight``) reading the weight with its block
    scales: ``[<module>.weight, <module>.weight_scale_inv]``, dequantized, then `rule`'s own
    transform."""
    source, then = rule.sources[0], rule.transform
    if isinstance(then, identity | transpose):  # (the presets' rules) in one XLA program
        transform: Transform = dequantize_blocks(block_size, layout=then)
    else:
        transform = chain(dequantize_blocks(block_size), then)
    return Rule([source, source + SCALE_SUFFIX], rule.targets, transform)
