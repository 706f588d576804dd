"""`ConvTranspose`: the channels-last transpose of a strided convolution."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from ..arrays import Spec
from ..module import Rngs
from ._convolution import Padding, _Convolution, check_groups, each_axis, padding_of, window_of
from ._precision import DTYPE, PRECISION, static_dtype, static_precision
from ._random import lecun_normal, zero_bias


class ConvTranspose(_Convolution):
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
        kernel_size: the window, as for :class:`Conv`.
        dims: the number of spatial axes, as for :class:`Conv` (the same keyword as
            ``convert.conv_transpose(..., dims=)``).
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
        kernel_dilation: spacing between kernel taps, as for :class:`Conv`.
        feature_group_count: channel groups (PyTorch's ``groups``).
        use_bias: whether to add a bias.
        dtype: the dtype the layer computes in and returns, as for :class:`Conv`.
        param_dtype: the dtype the parameters are created and stored in.
        precision: the precision of the convolution, as for :class:`Conv`.
        kernel_sharding: how ``kernel`` is split over the mesh, as for :class:`Conv`.
        bias_sharding: the same for ``bias``.
        rngs: the key stream for the initialisation.

    Raises:
        ValueError: as for :class:`Conv`: the number of spatial axes cannot be told, or a
            size or the groups do not fit.
        TypeError: `kernel_size` is neither an int nor a tuple of ints.
    """

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
        per_axis = {"strides": strides, "padding": padding, "kernel_dilation": kernel_dilation}
        window = window_of("ConvTranspose", kernel_size, dims, **per_axis)
        n = len(window)
        check_groups("ConvTranspose", in_features, out_features, feature_group_count)
        shape = (*window, in_features // feature_group_count, out_features)
        where = "ConvTranspose.kernel"
        self.kernel = lecun_normal(rngs(), shape, param_dtype, kernel_sharding, where)
        self.bias = zero_bias("ConvTranspose", out_features, use_bias, param_dtype, bias_sharding)
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
        spans = self._spans()
        excess = [span - s for span, s in zip(spans, self.strides, strict=True)]  # full - size * s
        return [(e - e // 2, e // 2) for e in excess]

    def _pads(self, spatial: tuple[int, ...]) -> Sequence[tuple[int, int]]:
        spans = self._spans()
        crops = self._crops()
        return [(span - 1 - lo, span - 1 - hi) for span, (lo, hi) in zip(spans, crops, strict=True)]

    def __call__(
        self, x: Float[Array, "*batch_spatial in_features"]
    ) -> Float[Array, "*batch_spatial_out out_features"]:
        """Upsamples `x` over its spatial axes.

        Args:
            x: ``[*batch, *spatial, in_features]``, as for :class:`Conv`.

        Returns:
            ``[*batch, *out_spatial, out_features]``, in ``dtype``: on each spatial axis the
            full output, ``(size - 1) * stride + dilation * (k - 1) + 1``, less the crops.

        Raises:
            ValueError: `x` has too few axes or a last axis of another size than
                ``in_features``, or the padding crops the whole output.
        """
        with jax.named_scope("ConvTranspose"):
            spans = self._spans()
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
            return self._convolve("ConvTranspose", x, (1,) * len(spans), self.strides)
