"""`QArray`: a quantized array (integer values, float scales) that is one parameter.

Symmetric max-abs quantization along one axis, per channel or per group: ``scale = max|w| /
qmax`` (127 for 8 bits, 7 for 4) in the scale's dtype, ``value = clip(round(w * (1 /
scale)))`` with the scale as stored. Loaders that fill `QArray` leaves tensor by tensor use
`quantize_like` and `dequantize_array`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import wadler_lindig as wl
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import taktiny.quant._problems as err

from .._problems import StateProblem
from ..arrays import ARRAY_TYPES, CACHE_BOUND, eval_shape, mesh_text
from ._parameter import Parameter

INT_DTYPES = {8: jnp.dtype(jnp.int8), 4: jnp.dtype(jnp.int4)}
_QMAX = {8: 127, 4: 7}
PARTS = ("value", "scale")  # a QArray's children, as state names name them
_STATIC = {"static": True}


def scale_shape(shape: tuple[int, ...], axis: int, group_size: int | None) -> tuple[int, ...]:
    """The scale's shape: `shape` with `axis` reduced to 1, or to its number of groups."""
    groups = 1 if group_size is None else shape[axis] // group_size
    return (*shape[:axis], groups, *shape[axis + 1 :])


def check_layout(shape: tuple[int, ...], bits: Any, axis: Any, group_size: Any) -> str | None:
    """What is wrong with quantizing an array of `shape` this way (None: nothing)."""
    if bits not in _QMAX:
        return f"bits must be 8 or 4, got {bits!r}"
    if not isinstance(axis, int) or not 0 <= axis < len(shape):
        return f"axis must be an axis of the array, 0 to {len(shape) - 1}, got {axis!r}"
    if group_size is not None and (
        not isinstance(group_size, int) or group_size < 1 or shape[axis] % group_size
    ):
        return (
            f"group_size must divide axis {axis} (size {shape[axis]}) into whole groups, got "
            f"{group_size!r}; pick a divisor of {shape[axis]}, or None for one scale per channel"
        )
    return None


def _split(array: Any, name: str, axis: int, group_size: int | None) -> Any:
    """The (mesh, spec) that `array` is split by (a concrete array's NamedSharding, a traced
    one's type on Explicit axes; None: unknown), checked: no group may straddle devices."""
    if isinstance(array, Tracer):
        typed = jax.typeof(array).sharding
        if typed.mesh.empty or AxisType.Explicit not in typed.mesh.axis_types:
            return None
        mesh, spec = typed.mesh, typed.spec
    elif isinstance(getattr(array, "sharding", None), NamedSharding):
        mesh, spec = array.sharding.mesh, array.sharding.spec
    else:
        return None
    entry = (*spec, *(None,) * array.ndim)[axis]
    parts = math.prod(mesh.shape[n] for n in (entry if isinstance(entry, tuple) else (entry,)) if n)
    groups = 0 if group_size is None else array.shape[axis] // group_size
    if groups % parts:
        raise ValueError(
            f"{name} of shape {tuple(array.shape)} is split {parts} ways along axis {axis} "
            f"({spec} on the mesh {mesh_text(mesh)}), which does not divide its {groups} groups "
            f"of {group_size}: a group would straddle two devices. Use a group size that "
            f"gives a multiple of {parts} groups, or do not split axis {axis}."
        )
    return mesh, spec


@partial(jax.jit, static_argnames=("bits", "axis", "group_size", "dtype"))
def _quantize(array: Any, *, bits: int, axis: int, group_size: int | None, dtype: Any) -> Any:
    shape = array.shape
    w = array.astype(jnp.float32)
    if group_size is not None:
        w = w.reshape(*shape[:axis], shape[axis] // group_size, group_size, *shape[axis + 1 :])
    reduced = axis if group_size is None else axis + 1
    scale = stored_scale(jnp.max(jnp.abs(w), axis=reduced, keepdims=True), bits, dtype)
    value = rounded_values(w, scale, bits).reshape(shape)
    return value, scale if group_size is None else scale.squeeze(reduced)


def stored_scale(top: Any, bits: int, dtype: Any) -> jax.Array:
    """The scale of slices whose largest magnitude is `top` (float32, any shape):
    ``top / qmax`` in `dtype`, 1 for an all-zero slice."""
    scale = (top / _QMAX[bits]).astype(dtype)
    return jnp.where(scale == 0, jnp.ones_like(scale), scale)


def rounded_values(w: Any, scale: Any, bits: int) -> jax.Array:
    """`w` (float32) in units of `scale` (its stored dtype, broadcast against `w`): ``w``
    times the float32 reciprocal of the scale as stored, rounded to nearest even and
    clipped to ``[-qmax, qmax]``, in the integer dtype of `bits`. The barrier keeps XLA
    from computing with the scale before its rounding into its dtype (a bfloat16 scale
    is coarser than ``max|w| / qmax``), and the reciprocal is written out, so that every
    backend rounds the same product."""
    qmax = _QMAX[bits]
    inverse = 1 / jax.lax.optimization_barrier(scale).astype(jnp.float32)
    return jnp.clip(jnp.round(w * inverse), -qmax, qmax).astype(INT_DTYPES[bits])


def quantize_array(
    array: Any,
    *,
    bits: int = 8,
    axis: int = 0,
    group_size: int | None = None,
    dtype: Any = None,
    name: str = "the array",
) -> tuple[jax.Array, jax.Array]:
    """`array` (float, any shape) quantized along `axis`: ``(value, scale)``, `value` of
    `array`'s shape in int8 (int4 for 4 bits), `scale` of :func:`scale_shape` in `dtype`
    (by default `array`'s). A split array gives a value split alike and a scale split
    alike but never along `axis`. `name` names the array in errors."""
    array = array if isinstance(array, jax.Array) else jnp.asarray(array)
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise TypeError(f"cannot quantize {name}: expected a float array, got {array.dtype}.")
    problem = check_layout(tuple(array.shape), bits, axis, group_size)
    if problem:
        raise ValueError(f"cannot quantize {name} of shape {tuple(array.shape)}: {problem}.")
    placed = _split(array, name, axis, group_size)
    dtype = jnp.dtype(array.dtype if dtype is None else dtype)
    value, scale = _quantize(array, bits=bits, axis=axis, group_size=group_size, dtype=dtype)
    if placed is None:
        return value, scale
    mesh, spec = placed
    entries = [*spec, *(None,) * array.ndim][: array.ndim]
    scale_at = NamedSharding(mesh, PartitionSpec(*entries[:axis], None, *entries[axis + 1 :]))
    if isinstance(array, Tracer):  # Explicit axes: the type holds the split
        return value, jax.sharding.reshard(scale, scale_at)
    value, scale = jax.device_put([value, scale], [NamedSharding(mesh, spec), scale_at])
    return value, scale


def quantized(
    array: Any,
    *,
    bits: int,
    axis: int,
    group_size: int | None,
    dtype: Any = None,
    name: str = "the array",
) -> QArray:
    """:func:`quantize_array` as a `QArray`; an abstract `array` gives an abstract one."""
    meta = {"bits": bits, "axis": axis, "group_size": group_size}
    quantize = partial(quantize_array, **meta, dtype=dtype, name=name)
    if isinstance(array, jax.ShapeDtypeStruct):
        return QArray(*eval_shape(quantize, array), **meta)
    return QArray(*quantize(array), **meta)


def quantize_like(array: Any, like: QArray, name: str = "the array") -> QArray:
    """`array` (float, `like`'s shape) quantized as `like` is: its bits, axis, group size
    and scale dtype; for a stack's QArray (:func:`layer_axes`), each layer as it is. For
    loaders that fill a `QArray` leaf from a float tensor."""
    if tuple(array.shape) != like.shape:
        raise ValueError(f"cannot quantize {name} like {like!r}: its shape is {array.shape}.")
    quantize = partial(
        quantized,
        bits=like.bits,
        axis=like.axis,
        group_size=like.group_size,
        dtype=like.dtype,
        name=name,
    )
    for _ in range(layer_axes(like)):  # (a stack's layers, each quantized as one)
        quantize = jax.vmap(quantize)
    return quantize(array)


@partial(jax.jit, static_argnames=("axis", "group_size", "dtype"))
def dequantize_array(
    value: Any, scale: Any, *, axis: int, group_size: int | None, dtype: Any
) -> jax.Array:
    """``value * scale`` in `dtype`, a float array of `value`'s shape: each scale applied
    to its channel, or to its group along `axis`."""
    v, s = value.astype(dtype), scale.astype(dtype)
    if group_size is None:
        return v * s
    shape = value.shape
    grouped = (*shape[:axis], shape[axis] // group_size, group_size, *shape[axis + 1 :])
    return (v.reshape(grouped) * jnp.expand_dims(s, axis + 1)).reshape(shape)


def parts_layout(value: Any, scale: Any) -> tuple[int, int, int | None] | str:
    """The ``(bits, axis, group_size)`` of a `QArray` made of these parts, read from the
    value's dtype and the two shapes (the scale is the value's shape with at most one axis
    reduced: to 1, or to a number of groups that divides it); or what is wrong with them.
    For parts that come without their layout (a ``{"value", "scale"}`` dict)."""
    shape, reduced = tuple(value.shape), tuple(scale.shape)
    bits = next((b for b, dtype in INT_DTYPES.items() if jnp.dtype(value.dtype) == dtype), None)
    if bits is None:
        return f"the value must be int8 or int4, got {jnp.dtype(value.dtype).name}"
    if not shape or len(reduced) != len(shape):
        return (
            f"the scale must have as many axes as the value (at least one), got a value of "
            f"shape {shape} and a scale of shape {reduced}"
        )
    differ = [i for i, (n, k) in enumerate(zip(shape, reduced, strict=True)) if n != k]
    if not differ:  # one scale per entry: any axis reads them alike
        return bits, 0, None if shape[0] == 1 else 1
    axis = differ[0]
    n, k = shape[axis], reduced[axis]
    if len(differ) > 1 or k == 0 or n % k:
        return (
            f"a scale of shape {reduced} does not fit a value of shape {shape}: it must be the "
            f"value's shape with one axis reduced to 1 (one scale per channel) or to a number "
            f"of groups that divides it"
        )
    return bits, axis, None if k == 1 else n // k


_CHECKED: set[tuple[Any, ...]] = set()  # layouts found consistent (every load rebuilds QArrays)


def _stacked_axes(q: QArray, shape: tuple[int, ...]) -> int:
    """How many leading axes `q`'s parts share as the layers of a stack (``nn.Stack``
    holds a QArray per layer as one QArray with a leading layer axis, its `axis` counted
    within a layer, a layer's weight of two axes at least: a kernel, an embedding): 0 for
    a QArray of one layer, or where no leading axes fit."""
    scale = tuple(q.scale.shape)
    for k in range(1, len(shape) - 1):  # (a layer's quantized weight has two axes at least)
        if len(scale) != len(shape) or scale[:k] != shape[:k] or q.axis >= len(shape) - k:
            continue
        if check_layout(shape[k:], q.bits, q.axis, q.group_size):
            continue
        if scale[k:] == scale_shape(shape[k:], q.axis, q.group_size):
            return k
    return 0


def layer_axes(q: QArray) -> int:
    """How many leading axes of `q`'s parts are the layers of a stack (``nn.Stack`` holds
    a QArray per layer as one QArray, its parts with the leading layer axes and its
    `axis` counted within a layer): 0 for the QArray of one layer, or one whose parts are
    not arrays."""
    if not (hasattr(q.value, "shape") and hasattr(q.scale, "shape")):
        return 0
    return _stacked_axes(q, tuple(q.value.shape))


def _problem(q: QArray) -> str | None:
    """What is inconsistent in `q`, whose parts are arrays (None: nothing)."""
    shape = tuple(q.value.shape)
    stacked = _stacked_axes(q, shape)
    if stacked:  # the parts of a stack's layers, with a leading layer axis: each checked
        shape = shape[stacked:]
    problem = check_layout(shape, q.bits, q.axis, q.group_size)
    if problem:
        return f"{problem} (value of shape {shape})"
    numeric = lambda dtype: jnp.issubdtype(dtype, jnp.number)  # not float0 (int gradients)
    want, got = INT_DTYPES[q.bits], jnp.dtype(q.value.dtype)
    if numeric(got) and got != want:
        return (
            f"a {q.bits}-bit QArray holds {want.name} values, got {got.name}; quantize float "
            f"weights with QArray.quantize(w, bits={q.bits}, ...)"
        )
    if numeric(q.scale.dtype) and not jnp.issubdtype(q.scale.dtype, jnp.floating):
        return f"scale must be a float array, got {jnp.dtype(q.scale.dtype).name}"
    expected = scale_shape(shape, q.axis, q.group_size)
    if tuple(q.scale.shape)[stacked:] != expected:
        per = "one per channel" if q.group_size is None else f"one per group of {q.group_size}"
        return (
            f"scale has shape {tuple(q.scale.shape)}, expected {expected} for a value of shape "
            f"{shape} quantized along axis {q.axis} ({per})"
        )
    return None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class QArray(Parameter):
    """A quantized array, ``value * scale``: one parameter of a model.

    Its parts are its PyTree children, named ``value`` and ``scale`` in the flat state
    (``"dense.kernel.value"``); `bits`, `axis` and `group_size` are static (part of the tree
    structure). It reads like the float array it stands for (`shape`, `dtype`, `ndim`,
    `size`); :meth:`dequantize` gives that array. Built directly, its parts are checked
    against each other (a ``ValueError`` otherwise); :meth:`quantize` makes one.

    Attributes:
        value: the integers, of the full logical shape: ``int8``, or ``jnp.int4`` (4 bits).
        scale: float, `value`'s dims with `axis` reduced to 1 (one scale per channel:
            ``[1, out]`` for an ``[in, out]`` kernel along its input axis 0) or to
            ``shape[axis] // group_size`` (one per group of `group_size` along it).
        bits: 8 or 4.
        axis: the quantized axis, along which the scales are taken (a contraction axis).
        group_size: entries per scale along `axis`; None for one scale per channel.
    """

    parts: ClassVar[tuple[str, ...]] = PARTS

    value: Any
    scale: Any
    bits: int = dataclasses.field(kw_only=True, metadata=_STATIC)
    axis: int = dataclasses.field(kw_only=True, metadata=_STATIC)
    group_size: int | None = dataclasses.field(default=None, kw_only=True, metadata=_STATIC)

    def __post_init__(self) -> None:
        # only parts that are arrays are checked: a tree map may give other leaves (None,
        # masks, shardings); a layout once found consistent is not checked again
        value, scale = self.value, self.scale
        if not (isinstance(value, ARRAY_TYPES) and isinstance(scale, ARRAY_TYPES)):
            return
        key = (
            value.shape,
            value.dtype,
            scale.shape,
            scale.dtype,
            self.bits,
            self.axis,
            self.group_size,
        )
        if key not in _CHECKED:
            problem = _problem(self)
            if problem:
                raise ValueError(f"QArray: {problem}.")
            if len(_CHECKED) >= CACHE_BOUND:
                _CHECKED.clear()
            _CHECKED.add(key)

    @classmethod
    def quantize(
        cls, array: Any, *, bits: int = 8, axis: int = 0, group_size: int | None = None
    ) -> QArray:
        """`array` quantized along `axis` by symmetric max-abs rounding:
        ``scale = max|w| / qmax`` per channel or per group of `group_size` (qmax 127 for
        8 bits, 7 for 4) in the scale's dtype, ``value = clip(round(w * (1 / scale)))``
        with the scale as stored.

        Args:
            array: a float array of any shape, or a ``jax.ShapeDtypeStruct``.
            bits: 8 (``int8`` values) or 4 (``jnp.int4``).
            axis: the axis the scales are taken along (a contraction axis: 0 for an
                ``[in, out]`` kernel).
            group_size: entries per scale along `axis`, which it must divide; None for
                one scale per channel.

        Returns:
            A QArray of `array`'s shape; its scale has `array`'s dtype, and a sharded
            `array` gives parts sharded like it.

        Raises:
            TypeError: `array` is not a float array.
            ValueError: `bits` is not 8 or 4, `axis` is not an axis of `array`,
                `group_size` does not divide ``shape[axis]``, or a group would straddle
                two devices of a sharded `array`.
        """
        return quantized(array, bits=bits, axis=axis, group_size=group_size)

    def dequantize(self, dtype: Any = None) -> jax.Array | jax.ShapeDtypeStruct:
        """The float array ``value * scale``.

        Args:
            dtype: the dtype of the result; None for the scale's (the QArray's `dtype`).

        Returns:
            An array of shape `shape`; a ``jax.ShapeDtypeStruct`` when the QArray is
            abstract.
        """
        fn = partial(
            dequantize_array,
            axis=layer_axes(self) + self.axis,
            group_size=self.group_size,
            dtype=jnp.dtype(self.scale.dtype if dtype is None else dtype),
        )
        if isinstance(self.value, jax.ShapeDtypeStruct):
            return eval_shape(fn, self.value, self.scale)
        return fn(self.value, self.scale)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: the value's."""
        return tuple(self.value.shape)

    @property
    def dtype(self) -> Any:
        """The logical (float) dtype: the scale's, which :meth:`dequantize` gives."""
        return self.scale.dtype

    @property
    def ndim(self) -> int:
        """The number of axes."""
        return len(self.value.shape)

    @property
    def size(self) -> int:
        """The number of entries."""
        return math.prod(self.value.shape)

    @property
    def nbytes(self) -> int:
        """The bytes stored: the values (half a byte each for 4 bits) and the scales."""
        scales = math.prod(self.scale.shape) * jnp.dtype(self.scale.dtype).itemsize
        return (self.size * self.bits + 7) // 8 + scales

    def __repr__(self) -> str:
        short = lambda x: (  # i8[512,2048], as modules show arrays; other leaves as they are
            eqx.tree_pformat(jax.ShapeDtypeStruct(x.shape, x.dtype), struct_as_array=True)
            if hasattr(x, "shape") and hasattr(x, "dtype")
            else repr(x)
        )
        group = "" if self.group_size is None else f", group_size={self.group_size}"
        k = layer_axes(self)  # a stack's layers: shown apart, the shapes and axis a layer's
        if k:
            layer = lambda x: jax.ShapeDtypeStruct(x.shape[k:], x.dtype)
            count = "x".join(map(str, self.value.shape[:k]))
            value, scale = short(layer(self.value)), short(layer(self.scale))
            return f"QArray({count} layers of {value}, scale={scale}, axis={self.axis}{group})"
        return f"QArray({short(self.value)}, scale={short(self.scale)}, axis={self.axis}{group})"

    def __pdoc__(self, **kwargs: Any) -> wl.AbstractDoc:
        return wl.TextDoc(repr(self))

    # --- As a `Parameter`: what the state walk, saving and the loaders ask of it -------

    def from_float(self, array: Any, name: str = "the array") -> QArray:
        return quantize_like(array, self, name)

    def to_float(self, dtype: Any = None) -> Any:
        return self.dequantize(dtype)

    @classmethod
    def from_parts(cls, parts: Mapping[str, Any]) -> QArray | str:
        missing = [part for part in PARTS if part not in parts]
        if missing:
            return f"both the value and the scale are needed, got no {' or '.join(missing)}"
        value, scale = parts["value"], parts["scale"]
        if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in (value, scale)):
            return "the value and the scale must be arrays"
        layout = parts_layout(value, scale)
        if isinstance(layout, str):
            return layout
        bits, axis, group_size = layout
        try:
            return cls(value, scale, bits=bits, axis=axis, group_size=group_size)
        except ValueError as error:
            return str(error).removeprefix("QArray: ").rstrip(".")

    def layout(self) -> dict[str, Any]:
        return {"bits": self.bits, "axis": self.axis, "group_size": self.group_size}

    def made_by(self) -> str:
        group = "" if self.group_size is None else f", group_size={self.group_size}"
        return f"tt.quantize(model, bits={self.bits}{group})"

    def stored_problem(
        self, name: str, stored: Mapping[str, Any], record: Mapping[str, Any] | None
    ) -> StateProblem | None:
        return err.stored_problem(self, name, stored, record)

    def made_problem(self, name: str, made: Any, sources: Sequence[str]) -> StateProblem | None:
        if not isinstance(made, QArray):
            return None
        return err.made_problem(self, name, made, sources)

    def part_problem(self, problem: StateProblem, name: str) -> StateProblem:
        return err.quantized_problem(problem, name, self)


def part_names(name: str) -> tuple[str, ...]:
    """The flat names of the stored parts of a quantized parameter named `name`, in
    flatten order (the first split as the whole is), for code that has its name only."""
    return QArray.part_names(name)


def from_parts(parts: Mapping[str, Any]) -> QArray | str:
    """The quantized parameter a dict of its stored parts makes (``{"value": ...,
    "scale": ...}``, as a checkpoint restored without a target gives them); or why none."""
    return QArray.from_parts(parts)
