"""`Conv`: channels-last convolutions in 1, 2 or 3 (or more) dimensions."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from ..arrays import Spec
from ..module import Rngs
from ._convolution import (
    Padding,
    _Convolution,
    check_groups,
    dilate,
    each_axis,
    padding_of,
    window_of,
)
from ._precision import DTYPE, PRECISION, static_dtype, static_precision
from ._random import lecun_normal, zero_bias


class Conv(_Convolution):
    """A convolution over the spatial axes of channels-last inputs ``[*batch, *spatial, in]``.

    The number of spatial axes is the length of ``kernel_size``: ``(5,)`` makes a 1D
    convolution over ``[batch, length, in]``, ``(3, 3)`` a 2D one over
    ``[batch, height, width, in]``, ``(3, 3, 3)`` a 3D one. An int ``kernel_size`` is
    the same size on every axis, as in PyTorch; the number of axes then comes from
    ``dims`` (``Conv(3, 8, 3, dims=2)``) or from a tuple among ``strides``, ``padding``
    and the dilations. Any number of leading batch axes (including none) is accepted.

    Attributes:
        kernel: ``[*kernel_size, in_features // feature_group_count, out_features]``,
            LeCun-normal initialised (variance ``1 / fan_in``, where fan_in is
            ``prod(kernel_size) * in_features // feature_group_count``). PyTorch's
            ``nn.Conv{1,2,3}d.weight`` is ``[out, in // groups, *kernel_size]``: move its
            first two axes to the end (OIHW -> HWIO).
        bias: ``[out_features]``, zeros; ``None`` when ``use_bias=False``.

    Args:
        in_features: channels of the input (its last axis).
        out_features: channels of the output.
        kernel_size: the window: one size per spatial axis, or an int for the same
            size on every axis.
        dims: the number of spatial axes (1, 2, 3, ...), needed only when
            ``kernel_size`` is an int and no other argument is a tuple that fixes it
            (the same keyword as ``convert.conv(..., dims=)``).
        strides: the step between windows, an int or one per spatial axis.
        padding: ``"SAME"`` (the default; PyTorch's default is ``0``, which is
            ``"VALID"`` here) gives output size ``ceil(size / stride)``, with any odd
            padding at the end, as PyTorch's ``padding="same"``; ``"VALID"`` pads
            nothing; an int ``p`` pads ``p`` zeros on both sides of every spatial axis
            (PyTorch's ``padding=p``); or one int (both sides, as PyTorch's tuple) or
            ``(low, high)`` pair per spatial axis.
        input_dilation: spacing between input elements (``d - 1`` zeros inserted
            between neighbours; a fractionally strided convolution). PyTorch has no
            equivalent argument.
        kernel_dilation: spacing between kernel taps (PyTorch's ``dilation``), an int or
            one per spatial axis.
        feature_group_count: split input and output channels into this many groups
            convolved separately (PyTorch's ``groups``; ``in_features`` for depthwise).
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

    input_dilation: tuple[int, ...]
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
        input_dilation: int | Sequence[int] = 1,
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
        per_axis = {
            "strides": strides,
            "padding": padding,
            "input_dilation": input_dilation,
            "kernel_dilation": kernel_dilation,
        }
        window = window_of("Conv", kernel_size, dims, **per_axis)
        n = len(window)
        check_groups("Conv", in_features, out_features, feature_group_count)
        shape = (*window, in_features // feature_group_count, out_features)
        self.kernel = lecun_normal(rngs(), shape, param_dtype, kernel_sharding, "Conv.kernel")
        self.bias = zero_bias("Conv", out_features, use_bias, param_dtype, bias_sharding)
        self.strides = each_axis("Conv", "strides", strides, n)
        self.padding = padding_of("Conv", padding, n)
        self.input_dilation = each_axis("Conv", "input_dilation", input_dilation, n)
        self.kernel_dilation = each_axis("Conv", "kernel_dilation", kernel_dilation, n)
        self.feature_group_count = feature_group_count
        self.dtype = static_dtype(dtype)
        self.precision = static_precision(precision, "Conv")

    def _pads(self, spatial: tuple[int, ...]) -> Sequence[tuple[int, int]]:
        if not isinstance(self.padding, str):
            return self.padding
        dilated = dilate(spatial, self.input_dilation)
        return jax.lax.padtype_to_pads(dilated, self._spans(), self.strides, self.padding)

    def __call__(
        self, x: Float[Array, "*batch_spatial in_features"]
    ) -> Float[Array, "*batch_spatial_out out_features"]:
        """Convolves `x` over its spatial axes.

        Args:
            x: ``[*batch, *spatial, in_features]``, channels last, with as many spatial
                axes as the kernel has.

        Returns:
            ``[*batch, *out_spatial, out_features]``, in ``dtype``.

        Raises:
            ValueError: `x` has too few axes, or a last axis of another size than
                ``in_features``.
        """
        with jax.named_scope("Conv"):
            return self._convolve("Conv", x, self.strides, self.input_dilation)
