"""FP8 block-scaled weights, as Hugging Face checkpoints ship them: a ``float8_e4m3fn``
weight ``<module>.weight`` beside a float32 ``<module>.weight_scale_inv`` holding one
factor per block of ``block_size`` entries (128x128), the last blocks of each axis ragged
where the block does not divide it. The float weight is ``weight * scale_inv`` of its
block (the name says inverse: the factor multiplies). `dequantize_blocks` makes it; the
rules of a model gain it through :func:`taktiny.convert.quantized_rules`. The arithmetic
(the products, their rounding, requantizing them) is `taktiny.quant`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..quant import Parameter, blocks_held_bytes, dequantized_blocks, placed_blocks, scale_problem
from ._rules import Rule
from ._transforms import Transform, chain, element_layout, identity, permutation, transpose

SCALE_SUFFIX = "_scale_inv"  # the scale of "<module>.weight" is "<module>.weight_scale_inv"


class dequantize_blocks(Transform):
    """Makes one float array from two, block-scaled weights and their scales (sources
    ``["{m}.weight", "{m}.weight_scale_inv"]``, as FP8 checkpoints hold them): each entry
    times the scale of its block, ``block_size`` entries over the last axes, the last
    block of an axis holding what is left. Computed in float32 and rounded to it (a
    float8 value times a float32 scale can need 28 significant bits), the product is
    then cast to `dtype`, rounded again where that is narrower: PyTorch's
    ``(w.float() * scale).to(dtype)``, bit for bit. It is laid out by `layout` in the
    same XLA program (so a transposed product is not held beside the product).

    Args:
        block_size: the entries of a block along each of the last axes; ``(128, 128)``
            for the checkpoints Hugging Face ships.
        dtype: the dtype of the result; float32 by default (a load casts that to each
            leaf's dtype).
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
        perm = self.perm(len(value.shape))
        return (dequantized_blocks(value, scale, blocks, self.dtype, perm),)

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

    def placed(
        self,
        value: Any,
        scale: Any,
        dtype: Any,
        like: Parameter | None = None,
        laid_out: bool = True,
    ) -> Any:
        """What a load places from weights and their scales as stored: the float32 product
        cast to `dtype`; with `like`, quantized as it is (``(value, scale)`` parts); the
        weights (unless already `laid_out`: read permuted by :meth:`perm`, as a load into
        host memory reads them) and the scales permuted in the same XLA program.

        Args:
            value: the float8 weights, permuted by :meth:`perm` when `laid_out`, else as
                stored.
            scale: the scales, as stored (one per block, unpermuted).
            dtype: the leaf's dtype (a quantized parameter's logical dtype).
            like: the quantized parameter the product fills; None for a float leaf.
            laid_out: whether `value` was read permuted already.

        Returns:
            The array, or the parts of the quantized parameter (a QArray's value and
            scale).
        """
        ndim = len(scale.shape)
        layout = {"bits": None, "axis": 0, "group_size": None} if like is None else like.layout()
        blocks, perm = self.blocks(ndim), self.perm(ndim)
        dtype = jnp.dtype(dtype)
        return placed_blocks(value, scale, blocks, dtype, **layout, perm=perm, turn=not laid_out)

    def held_bytes(self, weights: Any, dtype: Any, like: Parameter | None = None) -> int:
        """The bytes :meth:`placed` holds while it runs, besides its arguments and its
        result: none into a float leaf, nor into a quantized one of a float32 or bfloat16
        logical dtype from ``float8_e4m3fn`` or ``float8_e5m2`` weights (the product is
        computed twice, never held); into other quantized leaves, the float32 product.

        Args:
            weights: the float8 weights, or anything with their ``shape`` and ``dtype``
                (a ``jax.ShapeDtypeStruct``, a checkpoint's tensor).
            dtype: the leaf's dtype (a quantized parameter's logical dtype).
            like: the quantized parameter the product fills; None for a float leaf.

        Returns:
            A number of bytes.
        """
        return blocks_held_bytes(weights, dtype, like is not None)

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
