"""`ConvTranspose`: the channels-last transpose of a strided convolution."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from ..module._module import Module
from ..module._rngs import Rngs
from ..sharding._specs import Spec
from ._conv import _convolve
from ._conv_args import (
    Padding,
    check_groups,
    dilate,
    each_axis,
    make_parameters,
    padding_of,
    window_of,
)
from ._precision import DTYPE, PRECISION, static_dtype, static_precision


class ConvTranspose(Module):
    """The transpose of a strided convolution (a learned upsampling), channels last.

    As in PyTorch, ``strides`` spreads the input out and each input element adds a
    weighted copy of the kernel window to the output; the full output of a spatial axis
    of size ``L`` has ``(L - 1) * stride + dilation * (k - 1) + 1`` elements, and
    ``padding`` says how much of it to crop. Computed as a convolution of the
    stride-dilated input with ``kernel``, so ``kernel`` is stored in that convolution's
    orientation.

    Attributes:
        kernel: ``[*kernel_size, in_features // feature_group_count, out_features]``,
            LeCun-normal initialised (fan_in ``prod(kernel_size) * in_features //
            feature_group_count``). PyTorch's ``nn.ConvTranspose{1,2,3}d.weight`` is
            ``[in, out // groups, *kernel_size]`` and applied mirrored: reshape it to
            ``[groups, in // groups, out // groups, *kernel_size]``, move the window axes
            first, merge the group axis into the output axis and flip the window axes.
        bias: ``[out_features]``, zeros; ``None`` when ``use_bias=False``.

    Args:
        in_features: channels of the input (its last axis).
        out_features: channels of the output.
        kernel_size: the window: one size per spatial axis, or an int for the same
            size on every axis.
        dims: the number of spatial axes (1, 2, 3, ...), needed only when
            ``kernel_size`` is an int and no other argument is a tuple that fixes it
            (the same keyword as ``convert.conv_transpose(..., dims=)``).
        strides: the upsampling factor, an int or one per spatial axis.
        padding: how much of the full output to crop: ``"SAME"`` (the default;
            PyTorch's default is ``0``, which is ``"VALID"`` here) gives output size
            ``size * stride``, cropping as evenly as possible with any odd element
            cropped at the start, as PyTorch's ``padding=p, output_padding=op`` do when
            they give that size; ``"VALID"`` crops nothing; an int ``p`` crops ``p``
            from both ends (PyTorch's ``padding=p``); or one int (both ends, as
            PyTorch's tuple) or ``(low, high)`` pair per spatial axis (PyTorch's
            ``padding=p, output_padding=op`` is ``(p, p - op)``; a negative value pads
            instead).
        kernel_dilation: spacing between kernel taps (PyTorch's ``dilation``), an int or
            one per spatial axis.
        feature_group_count: channel groups (PyTorch's ``groups``).
        use_bias: whether to add a bias.
        dtype: the dtype the layer computes in and returns (inputs and parameters are
            cast to it); None (the default) computes in the parameters' dtype.
        param_dtype: the dtype the parameters are created and stored in.
        precision: the precision of the convolution (``jax.lax.Precision`` or its name,
            ``"highest"`` for full float32 on GPUs and TPUs); None uses JAX's default,
            which is TF32 for float32 on recent NVIDIA GPUs.
        kernel_sharding: how ``kernel`` is split over the mesh of an enclosing
            ``jax.set_mesh``: a tuple of mesh axis names, one per axis (``(None, None,
            None, "model")`` splits a 2D kernel's output channels), or a
            ``PartitionSpec``. Ignored without a mesh.
        bias_sharding: the same for ``bias`` (``("model",)``).
        rngs: the key stream for the initialisation.

    Raises:
        ValueError: the number of spatial axes cannot be told, or the arguments disagree
            on it; a size is out of range; or `feature_group_count` does not divide
            `in_features` and `out_features`.
        TypeError: `kernel_size` is neither an int nor a tuple of ints.
    """

    kernel: Float[Array, "*kernel_size in_per_group out_features"]
    bias: Float[Array, " out_features"] | None
    strides: tuple[int, ...]
    padding: str | tuple[tuple[int, int], ...]
    kernel_dilation: tuple[int, ...]
    feature_group_count: int
    dtype: jnp.dtype | None = DTYPE
    precision: jax.lax.PrecisionLike = PRECISION

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | Sequence[int],
        *,
        dims: int | None = None,
        strides: int | Sequence[int] = 1,
        padding: Padding = "SAME",
        kernel_dilation: int | Sequence[int] = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        kernel_sharding: Spec | None = None,
        bias_sharding: Spec | None = None,
        rngs: Rngs,
    ):
        window = window_of("ConvTranspose", kernel_size, dims, strides=strides, padding=padding,
                         kernel_dilation=kernel_dilation)  # fmt: skip
        n = len(window)
        check_groups("ConvTranspose", in_features, out_features, feature_group_count)
        fan_in = in_features // feature_group_count
        self.kernel, self.bias = make_parameters(
            "ConvTranspose", rngs, window, fan_in, out_features, use_bias, param_dtype,
            kernel_sharding, bias_sharding,
        )  # fmt: skip
        self.strides = each_axis("ConvTranspose", "strides", strides, n)
        self.padding = padding_of("ConvTranspose", padding, n)
        self.kernel_dilation = each_axis("ConvTranspose", "kernel_dilation", kernel_dilation, n)
        self.feature_group_count = feature_group_count
        self.dtype = static_dtype(dtype)
        self.precision = static_precision(precision, "ConvTranspose")

    def _crops(self) -> Sequence[tuple[int, int]]:
        if not isinstance(self.padding, str):
            return self.padding
        if self.padding == "VALID":
            return [(0, 0)] * len(self.strides)
        spans = dilate(self.kernel.shape[:-2], self.kernel_dilation)
        excess = [span - s for span, s in zip(spans, self.strides, strict=True)]  # full - size * s
        return [(e - e // 2, e // 2) for e in excess]

    def _pads(self, spatial: tuple[int, ...]) -> Sequence[tuple[int, int]]:
        spans = dilate(self.kernel.shape[:-2], self.kernel_dilation)
        crops = self._crops()
        return [(span - 1 - lo, span - 1 - hi) for span, (lo, hi) in zip(spans, crops, strict=True)]

    def __call__(
        self, x: Float[Array, "*batch_spatial in_features"]
    ) -> Float[Array, "*batch_spatial_out out_features"]:
        """Upsamples `x` over its spatial axes.

        Args:
            x: ``[*batch, *spatial, in_features]``, channels last, with as many spatial
                axes as the kernel has.

        Returns:
            ``[*batch, *out_spatial, out_features]``, in ``dtype``.

        Raises:
            ValueError: `x` has too few axes or a last axis of another size than
                ``in_features``, or the padding crops the whole output.
        """
        with jax.named_scope("ConvTranspose"):
            spans = dilate(self.kernel.shape[:-2], self.kernel_dilation)
            if x.ndim > len(spans):
                spatial = x.shape[-len(spans) - 1 : -1]
                full = [
                    (s - 1) * st + span
                    for s, st, span in zip(spatial, self.strides, spans, strict=True)
                ]
                sizes = [f - lo - hi for f, (lo, hi) in zip(full, self._crops(), strict=True)]
                if min(sizes) < 1:
                    raise ValueError(
                        f"ConvTranspose's padding {self.padding} crops more than the full "
                        f"output {tuple(full)} of an input of shape {tuple(x.shape)} holds "
                        f"(it would leave {tuple(sizes)}); use less padding or a larger input."
                    )
            return _convolve(
                "ConvTranspose",
                x,
                self.kernel,
                self.bias,
                self.feature_group_count,
                self._pads,
                self.dtype,
                window_strides=(1,) * len(self.strides),
                lhs_dilation=self.strides,
                rhs_dilation=self.kernel_dilation,
                precision=self.precision,
            )
