"""Transforms: what a conversion rule does to the arrays it reads.

A transform maps a tuple of arrays to a tuple of arrays (``count`` is how many the rule
wants out, so a ``split`` can infer its parts). Element-wise ones (``transpose``,
``reshape``, ``cast``) act on every array; ``split``/``unstack`` make several from one,
``concatenate``/``stack`` one from several, ``quantize`` a value and its scales from a
float array and ``dequantize`` the reverse. ``inverse`` is the transform that undoes it,
or None; it is what runs on export. Arrays may be NumPy or JAX: each is transformed with
its own library (``quantize`` and ``dequantize`` always give JAX arrays). They are classes
used as functions, like ``tt.by_name``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..arrays import moved
from ..quant import dequantize_array, quantize_array


def _xp(array: Any) -> Any:
    return jnp if isinstance(array, jax.Array) else np


def _joined(join: str, arrays: tuple[Any, ...], axis: int) -> Any:
    """``concatenate`` or ``stack`` (`join`) of `arrays`; JAX arrays joined as the integers of
    their bits (XLA's CPU backend joins bfloat16 through float32, which makes a NaN's
    payload canonical: taktiny.arrays.moved)."""
    if _xp(arrays[0]) is np:
        return getattr(np, join)(arrays, axis=axis)
    return moved(lambda *values: getattr(jnp, join)(values, axis=axis), *arrays)


class Transform:
    """The base of every transform: ``transform(arrays, count) -> arrays``."""

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        """Transforms the arrays a rule read (NumPy or JAX, each with its own library).

        Args:
            arrays: the arrays of the rule's sources, in order.
            count: how many arrays the rule wants out (its targets), which a `split`
                without sizes divides into; None when not known.

        Returns:
            The arrays for the rule's targets, in order.

        Raises:
            ValueError: the transform takes another number of arrays than it was given,
                or cannot tell how many to make.
        """
        raise NotImplementedError

    @property
    def inverse(self) -> Transform | None:
        """The transform that undoes this one (export runs it), or None."""
        return None

    def _args(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._args()})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and repr(other) == repr(self)

    def __hash__(self) -> int:
        return hash(repr(self))


class _EachArray(Transform):
    def one(self, array: Any) -> Any:
        """Transforms one array (the call does each array it is given).

        Args:
            array: a NumPy or JAX array.

        Returns:
            The transformed array, of the same library.
        """
        raise NotImplementedError

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        return tuple(self.one(a) for a in arrays)


class identity(_EachArray):
    """Keeps the arrays as they are: the rule only renames."""

    def one(self, array: Any) -> Any:
        return array

    @property
    def inverse(self) -> Transform:
        return self


class transpose(_EachArray):
    """Permutes the axes of each array; its inverse permutes them back.

    Args:
        perm: the new order of the axes, as ``numpy.transpose`` takes it; None (the
            default) reverses them all, a matrix's ``.T``.
    """

    def __init__(self, perm: Sequence[int] | None = None):
        self.perm = None if perm is None else tuple(int(p) for p in perm)

    def one(self, array: Any) -> Any:
        return _xp(array).transpose(array, self.perm)

    @property
    def inverse(self) -> Transform:
        return self if self.perm is None else transpose(np.argsort(self.perm).tolist())

    def _args(self) -> str:
        return "" if self.perm is None else repr(self.perm)


def element_layout(layout: Transform | None, why: str) -> Transform:
    """`layout` (None: ``identity()``), checked to lay an array out element by element: a
    rename or a transpose, as the transforms that lay out what they make take it. Raises
    ValueError otherwise, `why` ending the message."""
    layout = identity() if layout is None else layout
    if not isinstance(layout, identity | transpose):
        raise ValueError(f"layout is identity() or a transpose, got {layout!r}{why}")
    return layout


def permutation(layout: Transform, ndim: int) -> tuple[int, ...] | None:
    """The order of `ndim` axes that an `element_layout` gives; None for ``identity()``."""
    if not isinstance(layout, transpose):
        return None
    return layout.perm or tuple(range(ndim - 1, -1, -1))


class reshape(_EachArray):
    """Reshapes each array to ``shape``.

    Args:
        shape: the new shape (``-1`` allowed, for one axis).
        source_shape: the shape the inverse reshapes back to (``-1`` allowed); None (the
            default) leaves the transform without an inverse.
    """

    def __init__(self, shape: Sequence[int], *, source_shape: Sequence[int] | None = None):
        self.shape = tuple(int(s) for s in shape)
        self.source_shape = None if source_shape is None else tuple(int(s) for s in source_shape)

    def one(self, array: Any) -> Any:
        return _xp(array).reshape(array, self.shape)

    @property
    def inverse(self) -> Transform | None:
        if self.source_shape is None:
            return None
        return reshape(self.source_shape, source_shape=self.shape)

    def _args(self) -> str:
        back = "" if self.source_shape is None else f", source_shape={self.source_shape}"
        return f"{self.shape}{back}"


class cast(_EachArray):
    """Casts each array to ``dtype``.

    Args:
        dtype: the new dtype.
        source_dtype: the dtype the inverse casts back to; None (the default) leaves the
            transform without an inverse.
    """

    def __init__(self, dtype: Any, *, source_dtype: Any = None):
        self.dtype = np.dtype(dtype)
        self.source_dtype = None if source_dtype is None else np.dtype(source_dtype)

    def one(self, array: Any) -> Any:
        return array.astype(self.dtype)

    @property
    def inverse(self) -> Transform | None:
        if self.source_dtype is None:
            return None
        return cast(self.source_dtype, source_dtype=self.dtype)

    def _args(self) -> str:
        back = "" if self.source_dtype is None else f", source_dtype={self.source_dtype.name!r}"
        return f"{self.dtype.name!r}{back}"


def _single(transform: Transform, arrays: tuple[Any, ...]) -> Any:
    if len(arrays) != 1:
        raise ValueError(f"{transform!r} takes one array, got {len(arrays)}")
    return arrays[0]


class flip(_EachArray):
    """Reverses the order of the elements along each of ``axes`` (a transposed
    convolution's window); its own inverse.

    Args:
        axes: the axes to reverse.
    """

    def __init__(self, axes: Sequence[int]):
        self.axes = tuple(int(a) for a in axes)

    def one(self, array: Any) -> Any:
        return _xp(array).flip(array, axis=self.axes)

    @property
    def inverse(self) -> Transform:
        return self

    def _args(self) -> str:
        return repr(self.axes)


class split(Transform):
    """Splits one array into several along ``axis``: a fused qkv into query, key and
    value. Its inverse is :class:`concatenate`.

    Args:
        axis: the axis to split.
        sizes: the size of each part along `axis`; None (the default) makes as many
            equal parts as the rule has targets.
    """

    def __init__(self, axis: int = 0, sizes: Sequence[int] | None = None):
        self.axis = int(axis)
        self.sizes = None if sizes is None else tuple(int(s) for s in sizes)

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        array = _single(self, arrays)
        if self.sizes is not None:
            sections: Any = np.cumsum(self.sizes)[:-1].tolist()
        elif count is None:
            raise ValueError(f"{self!r} needs its sizes here: the number of parts is not known")
        else:
            sections = count
        return tuple(_xp(array).split(array, sections, axis=self.axis))

    @property
    def inverse(self) -> Transform:
        return concatenate(self.axis, self.sizes)

    def _args(self) -> str:
        return f"axis={self.axis}" + ("" if self.sizes is None else f", sizes={self.sizes}")


class concatenate(Transform):
    """Joins several arrays along ``axis``. Its inverse is :class:`split`.

    Args:
        axis: the axis to join along.
        sizes: the parts the inverse splits into; None (the default) makes as many
            equal parts as the rule has sources.
    """

    def __init__(self, axis: int = 0, sizes: Sequence[int] | None = None):
        self.axis = int(axis)
        self.sizes = None if sizes is None else tuple(int(s) for s in sizes)

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        return (_joined("concatenate", arrays, self.axis),)

    @property
    def inverse(self) -> Transform:
        return split(self.axis, self.sizes)

    def _args(self) -> str:
        return f"axis={self.axis}" + ("" if self.sizes is None else f", sizes={self.sizes}")


class stack(Transform):
    """Stacks several arrays along a new ``axis`` (per-layer tensors into one). Its
    inverse is :class:`unstack`.

    Args:
        axis: the position of the new axis.
    """

    def __init__(self, axis: int = 0):
        self.axis = int(axis)

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        return (_joined("stack", arrays, self.axis),)

    @property
    def inverse(self) -> Transform:
        return unstack(self.axis)

    def _args(self) -> str:
        return f"axis={self.axis}"


class unstack(Transform):
    """Cuts one array along ``axis`` into the arrays it stacks. Its inverse is
    :class:`stack`.

    Args:
        axis: the axis to cut along; it is removed.
    """

    def __init__(self, axis: int = 0):
        self.axis = int(axis)

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        array = _xp(arrays[0]).moveaxis(_single(self, arrays), self.axis, 0)
        return tuple(array[i] for i in range(array.shape[0]))

    @property
    def inverse(self) -> Transform:
        return stack(self.axis)

    def _args(self) -> str:
        return f"axis={self.axis}"


class chain(Transform):
    """Runs transforms one after the other: ``chain(split(0), transpose())``. Its inverse
    runs their inverses in reverse order (None when one of them has none).

    Args:
        *transforms: the transforms, in the order they run.
    """

    def __init__(self, *transforms: Transform):
        self.transforms = transforms

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        for transform in self.transforms:
            arrays = transform(arrays, count)
        return arrays

    @property
    def inverse(self) -> Transform | None:
        inverses = [t.inverse for t in reversed(self.transforms)]
        if any(t is None for t in inverses):
            return None
        return chain(*[t for t in inverses if t is not None])

    def _args(self) -> str:
        return ", ".join(map(repr, self.transforms))


class quantize(Transform):
    """Quantizes one float array into two, its integer values and its float scales, as
    :meth:`taktiny.QArray.quantize` does (symmetric max-abs rounding along ``axis``, one
    scale per channel or per ``group_size`` entries): a rule's targets are a quantized
    parameter's parts, ``["{l}.kernel.value", "{l}.kernel.scale"]``. The scales are in
    ``dtype`` (by default the array's). Its inverse is :class:`dequantize`.

    (A load into a quantized model needs no such rule: a float array made for a
    :class:`~taktiny.QArray`'s own name is quantized as that QArray is.)

    Args:
        bits: 8 (int8 values) or 4 (``jnp.int4``).
        axis: the axis the scales are taken along.
        group_size: entries per scale along `axis`; None for one scale per channel.
        dtype: the dtype of the scales; None (the default) is the array's.
    """

    def __init__(
        self, bits: int = 8, axis: int = 0, group_size: int | None = None, *, dtype: Any = None
    ):
        self.bits, self.axis, self.group_size = int(bits), int(axis), group_size
        self.dtype = None if dtype is None else np.dtype(dtype)

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        value, scale = quantize_array(
            _single(self, arrays),
            bits=self.bits,
            axis=self.axis,
            group_size=self.group_size,
            dtype=self.dtype,
        )
        return value, scale

    @property
    def inverse(self) -> Transform:
        return dequantize(self.axis, self.group_size, bits=self.bits)

    def _args(self) -> str:
        group = "" if self.group_size is None else f", group_size={self.group_size}"
        dtype = "" if self.dtype is None else f", dtype={self.dtype.name!r}"
        return f"bits={self.bits}, axis={self.axis}{group}{dtype}"


class dequantize(Transform):
    """Makes one float array from two, a quantized parameter's values and scales (sources
    ``["{l}.kernel.value", "{l}.kernel.scale"]``): ``value * scale``, each scale applied to
    its channel (or to its group of ``group_size`` entries) along ``axis``, in ``dtype`` (by
    default the scales'). Invertible (into :class:`quantize`) when ``bits`` is given.

    Args:
        axis: the axis the scales were taken along.
        group_size: entries per scale along `axis`; None for one scale per channel.
        bits: the bits of the values (8 or 4), which the inverse quantizes to; None (the
            default) leaves the transform without an inverse.
        dtype: the dtype of the result; None (the default) is the scales'.
    """

    def __init__(
        self,
        axis: int = 0,
        group_size: int | None = None,
        *,
        bits: int | None = None,
        dtype: Any = None,
    ):
        self.axis, self.group_size, self.bits = int(axis), group_size, bits
        self.dtype = None if dtype is None else np.dtype(dtype)

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        if len(arrays) != 2:
            raise ValueError(
                f"{self!r} takes two arrays, the values and the scales, got {len(arrays)}"
            )
        value, scale = (jnp.asarray(a) for a in arrays)
        dtype = jnp.dtype(scale.dtype if self.dtype is None else self.dtype)
        array = dequantize_array(
            value, scale, axis=self.axis, group_size=self.group_size, dtype=dtype
        )
        return (array,)

    @property
    def inverse(self) -> Transform | None:
        if self.bits is None:
            return None
        return quantize(self.bits, self.axis, self.group_size)

    def _args(self) -> str:
        group = "" if self.group_size is None else f", group_size={self.group_size}"
        bits = "" if self.bits is None else f", bits={self.bits}"
        dtype = "" if self.dtype is None else f", dtype={self.dtype.name!r}"
        return f"axis={self.axis}{group}{bits}{dtype}"
