"""`Conv`: channels-last convolutions in 1, 2 or 3 (or more) dimensions, and the argument
checks it shares with `ConvTranspose`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from .._module import Module
from .._rngs import Rngs
from .._sharding import Spec
from ._checks import check_features
from ._explicit import explicit_axes, follow, free, merged, typed_spec
from ._random import constant, lecun_normal

Padding = str | int | Sequence[int | tuple[int, int]]
_LETTERS = "ABDEFGHJKLMPQRSTUVWXYZ"  # spatial axis names for dimension numbers (no N, C, I, O)


def _spatial(layer: str, kernel_size: object) -> tuple[int, ...]:
    """`kernel_size` as a tuple; an int is refused (is 3 a 1D or a 2D window?)."""
    if not isinstance(kernel_size, Sequence) or not all(
        isinstance(k, int) and k >= 1 for k in kernel_size
    ):
        raise TypeError(
            f"{layer}'s kernel_size must be a tuple with one positive size per spatial axis, "
            f"which also sets the number of spatial axes: (3,) for 1D, (3, 3) for 2D, "
            f"(3, 3, 3) for 3D; got {kernel_size!r}."
        )
    if not 1 <= len(kernel_size) <= len(_LETTERS):
        raise ValueError(
            f"{layer}'s kernel_size must have 1 to {len(_LETTERS)} entries, got {kernel_size!r}."
        )
    return tuple(kernel_size)


def _per_axis(layer: str, name: str, value: int | Sequence[int], n: int) -> tuple[int, ...]:
    values = (value,) * n if isinstance(value, int) else tuple(value)
    if len(values) != n or not all(isinstance(v, int) and v >= 1 for v in values):
        raise ValueError(
            f"{layer}'s {name} must be a positive int or {n} positive ints (one per spatial "
            f"axis of its {n}D kernel_size), got {value!r}."
        )
    return values


def _padding(layer: str, padding: Padding, n: int) -> str | tuple[tuple[int, int], ...]:
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(
                f"{layer}'s padding must be 'SAME', 'VALID', an int, or one int or (low, high) "
                f"pair per spatial axis; got {padding!r}."
            )
        return padding.upper()
    pads = [padding] * n if isinstance(padding, int) else list(padding)
    pairs = [(p, p) if isinstance(p, int) else tuple(p) for p in pads]
    if len(pairs) != n or not all(
        len(p) == 2 and all(isinstance(v, int) for v in p) for p in pairs
    ):
        raise ValueError(
            f"{layer}'s padding must be 'SAME', 'VALID', an int, or {n} ints or (low, high) "
            f"pairs (one per spatial axis of its {n}D kernel_size); got {padding!r}."
        )
    return tuple((int(lo), int(hi)) for lo, hi in pairs)


def _dilated(sizes: Sequence[int], dilation: Sequence[int]) -> list[int]:
    """The extent of each axis of `sizes` with ``d - 1`` gaps between neighbours: a dilated
    kernel's window, or a dilated input."""
    return [(size - 1) * d + 1 for size, d in zip(sizes, dilation, strict=True)]


def _groups(layer: str, in_features: int, out_features: int, groups: int) -> None:
    if groups < 1 or in_features % groups or out_features % groups:
        raise ValueError(
            f"{layer}'s feature_group_count ({groups}) must divide both in_features "
            f"({in_features}) and out_features ({out_features})."
        )


def _parameters(
    layer: str, rngs: Rngs, window: tuple[int, ...], fan_in: int, out: int, use_bias: bool,
    dtype: DTypeLike, kernel_sharding: Spec | None, bias_sharding: Spec | None,
) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
    kernel = lecun_normal(rngs(), (*window, fan_in, out), dtype, kernel_sharding, f"{layer}.kernel")
    bias = constant(0, (out,), dtype, bias_sharding, f"{layer}.bias") if use_bias else None
    return kernel, bias


def _convolve(
    layer: str,
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    groups: int,
    pads_for: Callable[[tuple[int, ...]], Sequence[tuple[int, int]]],
    **conv: Any,
) -> jax.Array:
    """Checks `x` [*batch, *spatial, in], folds its batch axes into one, convolves, adds bias.
    `pads_for(spatial_shape)` gives the explicit padding for the input's spatial shape."""
    n = kernel.ndim - 2
    in_features = kernel.shape[-2] * groups
    why = f"its kernel is {tuple(kernel.shape)}" + (f" with {groups} groups" if groups > 1 else "")
    if x.ndim < n + 1:
        raise ValueError(
            f"{layer} has a {n}D kernel {tuple(kernel.shape)}, so it expects inputs "
            f"[*batch, {n} spatial axes, {in_features} features] (channels last), got an input "
            f"of shape {tuple(x.shape)}. Add the missing axes, e.g. x[..., None] for one channel."
        )
    check_features(layer, x, in_features, why=why, argument="in_features")
    batch, spatial = x.shape[: -n - 1], x.shape[-n - 1 : -1]
    letters = _LETTERS[:n]
    x = x.astype(kernel.dtype)
    # under Explicit axes the reshapes and the convolution are told their output's split:
    # the batch axes' split, none on the spatial axes, the kernel's on the output channels
    explicit = bool(explicit_axes())
    splits = typed_spec(x) if explicit else (None,) * x.ndim
    flat = merged(splits[: -n - 1])
    folded = P(flat, *splits[-n - 1 :]) if explicit else None
    out = P(flat, *(None,) * n, free(typed_spec(kernel)[-1], flat)) if explicit else None
    y = jax.lax.conv_general_dilated(
        jnp.reshape(x, (-1, *spatial, in_features), out_sharding=folded),
        kernel,
        padding=pads_for(spatial),
        dimension_numbers=(f"N{letters}C", f"{letters}IO", f"N{letters}C"),
        feature_group_count=groups,
        out_sharding=out,
        **conv,
    )
    unfolded = P(*splits[: -n - 1], *typed_spec(y)[1:]) if explicit else None
    y = y.reshape((*batch, *y.shape[1:]), out_sharding=unfolded)
    return y if bias is None else y + follow(bias, y)


class Conv(Module):
    """A convolution over the spatial axes of channels-last inputs ``[*batch, *spatial, in]``.

    The number of spatial axes is the length of ``kernel_size``: ``(5,)`` makes a 1D
    convolution over ``[batch, length, in]``, ``(3, 3)`` a 2D one over
    ``[batch, height, width, in]``, ``(3, 3, 3)`` a 3D one. Any number of leading batch
    axes (including none) is accepted.

    Parameters (state names):
        kernel: ``[*kernel_size, in_features // feature_group_count, out_features]``,
            LeCun-normal initialised (variance ``1 / fan_in``, where fan_in is
            ``prod(kernel_size) * in_features // feature_group_count``). PyTorch's
            ``nn.Conv{1,2,3}d.weight`` is ``[out, in // groups, *kernel_size]``: move its
            first two axes to the end (OIHW -> HWIO).
        bias: ``[out_features]``, zeros; ``None`` when ``use_bias=False``.

    Args:
        in_features: channels of the input (its last axis).
        out_features: channels of the output.
        kernel_size: the window, one size per spatial axis (a tuple, even in 1D).
        strides: the step between windows, an int or one per spatial axis.
        padding: ``"SAME"`` (output size ``ceil(size / stride)``, any odd padding at the
            end, as PyTorch's ``padding="same"``), ``"VALID"`` (no padding), an int (that
            many zeros on both sides of every spatial axis, as PyTorch's ``padding=p``), or
            one int or ``(low, high)`` pair per spatial axis.
        input_dilation: spacing between input elements (``d - 1`` zeros inserted
            between neighbours; a fractionally strided convolution). PyTorch has no
            equivalent argument.
        kernel_dilation: spacing between kernel taps (PyTorch's ``dilation``).
        feature_group_count: split input and output channels into this many groups
            convolved separately (PyTorch's ``groups``; ``in_features`` for depthwise).
        use_bias: whether to add a bias.
        dtype: the parameters' dtype, which is also the dtype the layer computes in.
        kernel_sharding: how ``kernel`` is split over the mesh of an enclosing
            ``jax.set_mesh``: a tuple of mesh axis names, one per axis (``(None, None,
            None, "model")`` splits a 2D kernel's output channels), or a
            ``PartitionSpec``. Ignored without a mesh.
        bias_sharding: the same for ``bias`` (``("model",)``).
        rngs: the key stream for the initialisation.
    """

    kernel: Float[Array, "*kernel_size in_per_group out_features"]
    bias: Float[Array, " out_features"] | None
    strides: tuple[int, ...]
    padding: str | tuple[tuple[int, int], ...]
    input_dilation: tuple[int, ...]
    kernel_dilation: tuple[int, ...]
    feature_group_count: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: Sequence[int],
        *,
        strides: int | Sequence[int] = 1,
        padding: Padding = "SAME",
        input_dilation: int | Sequence[int] = 1,
        kernel_dilation: int | Sequence[int] = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        dtype: DTypeLike = jnp.float32,
        kernel_sharding: Spec | None = None,
        bias_sharding: Spec | None = None,
        rngs: Rngs,
    ):
        window = _spatial("Conv", kernel_size)
        n = len(window)
        _groups("Conv", in_features, out_features, feature_group_count)
        fan_in = in_features // feature_group_count
        self.kernel, self.bias = _parameters(
            "Conv", rngs, window, fan_in, out_features, use_bias, dtype, kernel_sharding,
            bias_sharding,
        )  # fmt: skip
        self.strides = _per_axis("Conv", "strides", strides, n)
        self.padding = _padding("Conv", padding, n)
        self.input_dilation = _per_axis("Conv", "input_dilation", input_dilation, n)
        self.kernel_dilation = _per_axis("Conv", "kernel_dilation", kernel_dilation, n)
        self.feature_group_count = feature_group_count

    def _pads(self, spatial: tuple[int, ...]) -> Sequence[tuple[int, int]]:
        if not isinstance(self.padding, str):
            return self.padding
        dilated = _dilated(spatial, self.input_dilation)
        window = _dilated(self.kernel.shape[:-2], self.kernel_dilation)
        return jax.lax.padtype_to_pads(dilated, window, self.strides, self.padding)

    def __call__(
        self, x: Float[Array, "*batch_spatial in_features"]
    ) -> Float[Array, "*batch_spatial_out out_features"]:
        """Convolves ``x`` ``[*batch, *spatial, in_features]`` to
        ``[*batch, *out_spatial, out_features]``."""
        with jax.named_scope("Conv"):
            return _convolve(
                "Conv",
                x,
                self.kernel,
                self.bias,
                self.feature_group_count,
                self._pads,
                window_strides=self.strides,
                lhs_dilation=self.input_dilation,
                rhs_dilation=self.kernel_dilation,
            )
