"""What `Conv` and `ConvTranspose` share: their constructor arguments read and checked (the
window, an int ``kernel_size`` repeated over ``dims`` axes; per-axis strides and dilations;
padding in JAX's and PyTorch's forms; feature groups), and `_Convolution`, the base class
holding their configuration and the convolution itself."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from ..module import Module
from ._explicit import explicit_axes, follow, free, merged, typed_spec
from ._layer_checks import check_features
from ._precision import compute_dtype

Padding = str | int | Sequence[int | tuple[int, int]]
SPATIAL_LETTERS = (
    "ABDEFGHJKLMPQRSTUVWXYZ"  # spatial axis names for dimension numbers (no N, C, I, O)
)


def window_of(layer: str, kernel_size: object, dims: object, **per_axis: object) -> tuple[int, ...]:
    """`kernel_size` as one size per spatial axis. An int is repeated over `dims` axes, or
    over as many as a tuple among `per_axis` (strides, padding, dilations) has entries."""
    if dims is not None and (
        isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= len(SPATIAL_LETTERS)
    ):
        raise ValueError(
            f"{layer}'s dims is the number of spatial axes, an int from 1 to "
            f"{len(SPATIAL_LETTERS)}; got {dims!r}."
        )
    if isinstance(kernel_size, int) and not isinstance(kernel_size, bool):
        k = kernel_size
        tuples = [
            len(v) for v in per_axis.values() if isinstance(v, Sequence) and not isinstance(v, str)
        ]
        n = dims if dims is not None else tuples[0] if tuples else None
        if n is None:
            raise ValueError(
                f"{layer}'s kernel_size={k} does not say how many spatial axes the "
                f"convolution has: pass kernel_size=({k}, {k}) or dims=2 for a 2D one "
                f"(({k},) or dims=1 for 1D, ({k}, {k}, {k}) or dims=3 for 3D)."
            )
        kernel_size = (k,) * n
    if not isinstance(kernel_size, Sequence) or not all(
        isinstance(k, int) and not isinstance(k, bool) for k in kernel_size
    ):
        raise TypeError(
            f"{layer}'s kernel_size must be an int or a tuple of ints, one size per spatial "
            f"axis: (3,) for 1D, (3, 3) for 2D, (3, 3, 3) for 3D; got {kernel_size!r}."
        )
    if not 1 <= len(kernel_size) <= len(SPATIAL_LETTERS) or min(kernel_size) < 1:
        raise ValueError(
            f"{layer}'s kernel_size must have 1 to {len(SPATIAL_LETTERS)} entries, each at "
            f"least 1; got {kernel_size!r}."
        )
    if dims is not None and len(kernel_size) != dims:
        raise ValueError(
            f"{layer}'s kernel_size {tuple(kernel_size)} has {len(kernel_size)} spatial axes "
            f"but dims={dims}; make them agree (or leave dims out)."
        )
    return tuple(kernel_size)


def each_axis(layer: str, name: str, value: int | Sequence[int], n: int) -> tuple[int, ...]:
    values = (value,) * n if isinstance(value, int) else tuple(value)
    if len(values) != n or not all(isinstance(v, int) and v >= 1 for v in values):
        raise ValueError(
            f"{layer}'s {name} must be a positive int or {n} positive ints (one per spatial "
            f"axis of its {n}D kernel_size), got {value!r}."
        )
    return values


def padding_of(layer: str, padding: Padding, n: int) -> str | tuple[tuple[int, int], ...]:
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


def dilate(sizes: Sequence[int], dilation: Sequence[int]) -> list[int]:
    """The extent of each axis of `sizes` with ``d - 1`` gaps between neighbours: a dilated
    kernel's window, or a dilated input."""
    return [(size - 1) * d + 1 for size, d in zip(sizes, dilation, strict=True)]


def check_groups(layer: str, in_features: int, out_features: int, groups: int) -> None:
    if groups < 1 or in_features % groups or out_features % groups:
        raise ValueError(
            f"{layer}'s feature_group_count ({groups}) must divide both in_features "
            f"({in_features}) and out_features ({out_features})."
        )


class _Convolution(Module):
    """What `Conv` and `ConvTranspose` share: the parameters and configuration below and the
    convolution of channels-last inputs. Each documents these fields and declares the rest,
    ending with ``dtype`` and ``precision``, whose defaults must come last."""

    kernel: Float[Array, "*kernel_size in_per_group out_features"]
    bias: Float[Array, " out_features"] | None
    strides: tuple[int, ...]
    padding: str | tuple[tuple[int, int], ...]
    kernel_dilation: tuple[int, ...]
    feature_group_count: int

    def _pads(self, spatial: tuple[int, ...]) -> Sequence[tuple[int, int]]:
        """The explicit padding of the convolution for inputs of `spatial` shape."""
        raise NotImplementedError

    def _spans(self) -> list[int]:
        """The extent of the dilated kernel window on each spatial axis."""
        return dilate(self.kernel.shape[:-2], self.kernel_dilation)

    def _convolve(
        self, layer: str, x: jax.Array, strides: Sequence[int], input_dilation: Sequence[int]
    ) -> jax.Array:
        """Checks `x` ``[*batch, *spatial, in]``, folds its batch axes into one, convolves it
        with `strides` between windows and `input_dilation` between input elements, adds
        the bias, all in ``dtype`` (None: the kernel's); `layer` names the layer in errors.
        Returns ``[*batch, *out_spatial, out]``."""
        kernel, bias, groups = self.kernel, self.bias, self.feature_group_count
        n = kernel.ndim - 2
        in_features = kernel.shape[-2] * groups
        if x.ndim < n + 1:
            raise ValueError(
                f"{layer} has a {n}D kernel {tuple(kernel.shape)}, so it expects inputs "
                f"[*batch, {n} spatial axes, {in_features} features] (channels last), got an "
                f"input of shape {tuple(x.shape)}. Add the missing axes, e.g. x[..., None] for "
                f"one channel."
            )
        why = f"its kernel is {tuple(kernel.shape)}"
        why += f" with {groups} groups" if groups > 1 else ""
        check_features(layer, x, in_features, why=why, argument="in_features")
        batch, spatial = x.shape[: -n - 1], x.shape[-n - 1 : -1]
        letters = SPATIAL_LETTERS[:n]
        dtype = compute_dtype(self.dtype, kernel)
        x, kernel = x.astype(dtype), kernel.astype(dtype)
        bias = None if bias is None else bias.astype(dtype)
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
            window_strides=strides,
            padding=self._pads(spatial),
            lhs_dilation=input_dilation,
            rhs_dilation=self.kernel_dilation,
            dimension_numbers=(f"N{letters}C", f"{letters}IO", f"N{letters}C"),
            feature_group_count=groups,
            precision=self.precision,
            out_sharding=out,
        )
        unfolded = P(*splits[: -n - 1], *typed_spec(y)[1:]) if explicit else None
        y = y.reshape((*batch, *y.shape[1:]), out_sharding=unfolded)
        return y if bias is None else y + follow(bias, y)
