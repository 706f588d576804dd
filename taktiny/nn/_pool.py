"""`MaxPool`, `AvgPool` and `GlobalAvgPool`: pooling over the spatial axes of channels-last
inputs, with PyTorch's arguments and results."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from ..module import Module
from ._explicit import explicit_axes, typed_spec
from ._norm import statistics_dtype

Size = int | Sequence[int]


def _sizes(
    layer: str, kernel_size: Size, strides: Size | None, padding: Size, dims: int | None
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The window, strides and padding, one entry per spatial axis: their number is `dims`
    or the length of any of them given as a tuple, which must all agree."""
    given = {"kernel_size": kernel_size, "strides": strides, "padding": padding}
    lengths = {name: len(v) for name, v in given.items() if isinstance(v, Sequence)}
    if dims is not None:
        if not isinstance(dims, int) or dims < 1:
            raise ValueError(f"{layer}'s dims is the number of spatial axes, got {dims!r}.")
        lengths = {"dims": dims, **lengths}
    if not lengths:
        raise ValueError(
            f"{layer} cannot tell the number of spatial axes from kernel_size={kernel_size!r}: "
            f"pass a tuple, one size per spatial axis ((2, 2) for 2D), or dims= (dims=2)."
        )
    if empty := [name for name, n in lengths.items() if n == 0]:
        raise ValueError(f"{layer}'s {empty[0]} is empty; give one entry per spatial axis.")
    n = next(iter(lengths.values()))
    if any(v != n for v in lengths.values()):
        shown = ", ".join(f"{name}={given.get(name, dims)!r}" for name in lengths)
        raise ValueError(
            f"{layer}'s arguments disagree on the number of spatial axes ({shown}); give "
            f"each tuple one entry per spatial axis, and dims that number."
        )

    def per_axis(name: str, value: Size, least: int) -> tuple[int, ...]:
        values = (value,) * n if isinstance(value, int) else tuple(value)
        if not all(isinstance(v, int) and v >= least for v in values):
            kind = "positive" if least else "non-negative"
            raise ValueError(
                f"{layer}'s {name} must be a {kind} int or {n} {kind} ints (one per spatial "
                f"axis), got {value!r}."
            )
        return values

    window = per_axis("kernel_size", kernel_size, 1)
    steps = window if strides is None else per_axis("strides", strides, 1)
    pads = per_axis("padding", padding, 0)
    if any(2 * p > k for p, k in zip(pads, window, strict=True)):
        most = tuple(k // 2 for k in window)
        raise ValueError(
            f"{layer}'s padding {pads} must be at most half of kernel_size {window} on every "
            f"axis (as PyTorch requires), or a window could hold padding only; pass "
            f"padding={most if n > 1 else most[0]} or less, or a larger kernel_size."
        )
    return window, steps, pads


class _Pool(Module):
    """What `MaxPool` and `AvgPool` share: the window's configuration, the input checks and
    the output sizes of PyTorch's formula."""

    kernel_size: tuple[int, ...]
    strides: tuple[int, ...]
    padding: tuple[int, ...]
    ceil_mode: bool

    def _geometry(self, layer: str, x: jax.Array) -> list[tuple[int, int, int]]:
        """(input size, output size, extra padding at the end) per spatial axis of `x`,
        checked; the extra padding holds the windows that ``ceil_mode`` adds."""
        n = len(self.kernel_size)
        if x.ndim < n + 1:
            raise ValueError(
                f"{layer} has a {n}D window {self.kernel_size}, so it expects inputs "
                f"[*batch, {n} spatial axes, features] (channels last), got an input of shape "
                f"{tuple(x.shape)}. Add the missing axes, e.g. x[..., None] for one feature."
            )
        geometry = []
        spatial = x.shape[-n - 1 : -1]
        for size, k, s, p in zip(
            spatial, self.kernel_size, self.strides, self.padding, strict=True
        ):
            span = size + 2 * p - k
            out = (-(-span // s) if self.ceil_mode else span // s) + 1
            if self.ceil_mode and (out - 1) * s >= size + p:
                out -= 1  # a last window that would start in the end padding is dropped
            if out < 1:
                padded = tuple(d + 2 * q for d, q in zip(spatial, self.padding, strict=True))
                raise ValueError(
                    f"{layer}'s window {self.kernel_size} is larger than its padded input "
                    f"{padded} (the input's spatial axes {tuple(spatial)} with padding "
                    f"{self.padding} on both sides). Pass a larger input, a smaller "
                    f"kernel_size or more padding."
                )
            geometry.append((size, out, (out - 1) * s + k - size - 2 * p))
        return geometry

    def _reduce(self, x: jax.Array, init: np.ndarray, op: Callable, extras: Sequence[int]):
        """`op` over each window of `x`'s spatial axes, which are padded with `init`: by
        `self.padding` on both sides and `extras` more at the end. Under Explicit mesh axes
        the spatial axes are gathered first (as `Conv` does): windows cross their splits."""
        n = len(self.kernel_size)
        batch = x.ndim - n - 1
        if explicit_axes():  # split as the batch and the features, not the spatial axes
            spec = typed_spec(x)
            if any(spec[batch:-1]):
                x = jax.sharding.reshard(x, P(*spec[:batch], *(None,) * n, spec[-1]))
        pads = [(p, p + e) for p, e in zip(self.padding, extras, strict=True)]
        window, steps = (1,) * batch + self.kernel_size + (1,), (1,) * batch + self.strides + (1,)
        return jax.lax.reduce_window(x, init, op, window, steps, [(0, 0)] * batch + pads + [(0, 0)])


class MaxPool(_Pool):
    """The largest value in each window of the spatial axes, per feature, as PyTorch's
    ``nn.MaxPool1d``, ``nn.MaxPool2d`` and ``nn.MaxPool3d`` (without ``dilation``).

    Inputs are channels-last, ``[*batch, *spatial, features]``, with as many spatial axes
    as the window has sizes; any number of leading batch axes (including none). The output
    ``[*batch, *out_spatial, features]`` has ``out = floor((size + 2 * padding -
    kernel_size) / strides) + 1`` on each spatial axis (``ceil`` with ``ceil_mode``).

    No parameters (an empty state); computes in the input's dtype.

    Args:
        kernel_size: the window, an int or one size per spatial axis.
        strides: the step between windows, an int or one per spatial axis; None (the
            default) steps by the window, as PyTorch's ``stride=None``.
        padding: ``-inf`` added on both sides of each spatial axis, an int or one per
            axis; at most half the window (as PyTorch requires).
        ceil_mode: round the output size up, as PyTorch's ``ceil_mode``: a last, partial
            window is kept when it starts inside the input or its start padding.
        dims: the number of spatial axes, needed when ``kernel_size``, ``strides`` and
            ``padding`` are all ints (``MaxPool(2, dims=2)`` is ``MaxPool((2, 2))``).

    Raises:
        ValueError: the number of spatial axes cannot be told, or the arguments disagree
            on it; a size is not a positive int (padding: non-negative); or the padding
            is more than half the window.
    """

    def __init__(
        self,
        kernel_size: Size,
        strides: Size | None = None,
        padding: Size = 0,
        *,
        ceil_mode: bool = False,
        dims: int | None = None,
    ):
        window, steps, pads = _sizes("MaxPool", kernel_size, strides, padding, dims)
        self.kernel_size, self.strides, self.padding = window, steps, pads
        self.ceil_mode = bool(ceil_mode)

    def __call__(
        self, x: Float[Array, "*batch_spatial features"]
    ) -> Float[Array, "*batch_out_spatial features"]:
        """The largest value of each window of the spatial axes of `x`.

        Args:
            x: ``[*batch, *spatial, features]``, channels last, with as many spatial axes
                as the window has.

        Returns:
            ``[*batch, *out_spatial, features]``, in `x`'s dtype.

        Raises:
            ValueError: `x` has too few axes, or the window is larger than its padded
                spatial axes.
        """
        with jax.named_scope("MaxPool"):
            extras = [extra for _, _, extra in self._geometry("MaxPool", x)]
            # a NumPy constant, not a traced one, so that JAX sees the max with its identity
            # (which it knows how to differentiate)
            floating = jnp.issubdtype(x.dtype, jnp.floating)
            lowest = np.array(-np.inf if floating else jnp.iinfo(x.dtype).min, x.dtype)
            return self._reduce(x, lowest, jax.lax.max, extras)


class AvgPool(_Pool):
    """The mean of each window of the spatial axes, per feature, as PyTorch's
    ``nn.AvgPool1d``, ``nn.AvgPool2d`` and ``nn.AvgPool3d`` (without ``divisor_override``).

    Shapes are those of :class:`MaxPool`. Padding adds zeros; ``count_include_pad`` says
    whether they count in a window's divisor (the windows ``ceil_mode`` adds past the
    padding count only what they cover, as in PyTorch).

    No parameters (an empty state). The output has the input's dtype; the sums are taken
    in at least float32, so that bfloat16 windows lose nothing to rounding.

    Args:
        kernel_size: the window, an int or one size per spatial axis.
        strides: the step between windows, an int or one per spatial axis; None (the
            default) steps by the window.
        padding: zeros added on both sides of each spatial axis, an int or one per axis;
            at most half the window.
        count_include_pad: divide by the whole window, padding included (True, PyTorch's
            default), or only by the input elements it covers (False).
        ceil_mode: round the output size up, as :class:`MaxPool`'s.
        dims: the number of spatial axes, needed when ``kernel_size``, ``strides`` and
            ``padding`` are all ints.

    Raises:
        ValueError: as for :class:`MaxPool`: the spatial axes cannot be told, or a size or
            the padding does not fit.
    """

    count_include_pad: bool

    def __init__(
        self,
        kernel_size: Size,
        strides: Size | None = None,
        padding: Size = 0,
        *,
        count_include_pad: bool = True,
        ceil_mode: bool = False,
        dims: int | None = None,
    ):
        window, steps, pads = _sizes("AvgPool", kernel_size, strides, padding, dims)
        self.kernel_size, self.strides, self.padding = window, steps, pads
        self.ceil_mode = bool(ceil_mode)
        self.count_include_pad = bool(count_include_pad)

    def __call__(
        self, x: Float[Array, "*batch_spatial features"]
    ) -> Float[Array, "*batch_out_spatial features"]:
        """Averages each window of the spatial axes of `x`.

        Args:
            x: ``[*batch, *spatial, features]``, as for :class:`MaxPool`.

        Returns:
            ``[*batch, *out_spatial, features]``, in `x`'s dtype (the sums are taken in at
            least float32).

        Raises:
            ValueError: as for :class:`MaxPool`: `x` does not fit the window.
        """
        with jax.named_scope("AvgPool"):
            geometry = self._geometry("AvgPool", x)
            dtype = statistics_dtype(x.dtype)
            zero = np.zeros((), dtype)
            sums = self._reduce(x.astype(dtype), zero, jax.lax.add, [e for *_, e in geometry])
            # the divisor of each window: per axis, the elements it covers of the input (and
            # of the padding with count_include_pad); a product over the axes, known statically
            counts = np.ones((), np.float64)
            for (size, out, _), k, s, p in zip(
                geometry, self.kernel_size, self.strides, self.padding, strict=True
            ):
                lo, hi = (-p, size + p) if self.count_include_pad else (0, size)
                starts = np.arange(out) * s - p
                covered = np.minimum(starts + k, hi) - np.maximum(starts, lo)
                counts = np.multiply.outer(counts, covered)
            counts = jnp.asarray(counts[..., None], dtype)
            return (sums / counts).astype(x.dtype)


class GlobalAvgPool(Module):
    """The mean over every spatial axis, per example and feature: ``[batch, *spatial,
    features]`` to ``[batch, features]``, as PyTorch's ``nn.AdaptiveAvgPool2d(1)`` (or
    ``x.mean((2, 3))``) followed by a flatten. The first axis is the batch, the last the
    features, and every axis between them is spatial.

    No parameters (an empty state). The output has the input's dtype; the mean is taken
    in at least float32.

    Args:
        keepdims: keep the spatial axes with size 1 (``[batch, 1, ..., 1, features]``).
    """

    keepdims: bool

    def __init__(self, keepdims: bool = False):
        self.keepdims = bool(keepdims)

    def __call__(self, x: Float[Array, "batch *spatial features"]) -> Float[Array, "batch ..."]:
        """Averages `x` over its spatial axes.

        Args:
            x: ``[batch, *spatial, features]``, with at least one spatial axis.

        Returns:
            ``[batch, features]``; ``[batch, 1, ..., 1, features]`` with ``keepdims``. In
            `x`'s dtype.

        Raises:
            ValueError: `x` has fewer than three axes.
        """
        with jax.named_scope("GlobalAvgPool"):
            if x.ndim < 3:
                raise ValueError(
                    f"GlobalAvgPool expects inputs [batch, *spatial, features] with at least "
                    f"one spatial axis, got an input of shape {tuple(x.shape)}. Add a spatial "
                    f"axis (x[:, None]) or leave the pooling out."
                )
            axes = tuple(range(1, x.ndim - 1))
            mean = jnp.mean(x, axis=axes, dtype=statistics_dtype(x.dtype), keepdims=self.keepdims)
            return mean.astype(x.dtype)
