"""The problems of loading a `QArray` from a file or a state: a float array that does
not fit it, parts stored in another layout, a part of the wrong dtype or shape, and parts
stored where the model holds a float array. Each is built by the check that finds it
(`QArray`'s `Parameter` methods, `stored_problem` below); a layout is (bits, axis,
group_size), told as ``int8 (one scale per channel along axis 0)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

from .._messages import layout_text
from .._problems import StateProblem

if TYPE_CHECKING:
    from ._qarray import QArray

_MATCH = "match_quantization=True"  # the load option that converts representations


def stored_problem(
    q: QArray, name: str, stored: Mapping[str, Any], record: Mapping[str, Any] | None
) -> StateProblem | None:
    """What stops what a file stores for `name` (by flat name: the float array, or the
    parts; each with a shape and a dtype) from loading into `q` (None: nothing)."""
    parts = [p for p in q.part_names(name) if p in stored]
    tensor = stored.get(name)
    if tensor is not None and parts:
        return stored_both(name, parts)
    if tensor is not None:
        return _float_problem(q, name, tuple(tensor.shape), np.dtype(tensor.dtype))
    return _layout_problem(q, name, record, stored.get(f"{name}.value"))


def _float_problem(
    q: QArray, name: str, shape: tuple[int, ...], dtype: np.dtype
) -> StateProblem | None:
    """What stops a stored float array of `shape` and `dtype` from being quantized into `q`."""
    layout = layout_text(q.bits, q.axis, q.group_size)
    if not jnp.issubdtype(dtype, jnp.floating):
        return stored_not_float(name, layout, dtype, shape)
    if shape != q.shape:
        return stored_shape(name, layout, q.shape, shape)
    return None


def _layout_problem(
    q: QArray, name: str, record: Mapping[str, Any] | None, value: Any
) -> StateProblem | None:
    """A problem when stored parts are quantized otherwise than `q` (by their recorded
    layout, or else by the dtype of their `value`, None when not stored)."""
    want = (q.bits, q.axis, q.group_size)
    value = None if value is None else np.dtype(value.dtype)
    if record is not None:
        have: tuple[Any, ...] = _meta(record)
        if have == want:
            return None
        got = layout_text(*have)
    elif value is None or value in (np.dtype(q.value.dtype), np.uint8):
        return None  # (uint8: a 4-bit array packed, unless its packing is unlisted: checked)
    else:
        bits = {"int8": 8, "int4": 4}.get(value.name)
        have, got = (bits, *want[1:]), f"{value.name} values"
    return stored_quantized_otherwise(name, layout_text(*want), want, got, have)


def made_problem(q: QArray, name: str, made: Any, sources: Any) -> StateProblem | None:
    """A problem when a conversion makes, from `sources`, a parameter `made` quantized
    otherwise than `q` (None: the same layout, or no QArray)."""
    want = (q.bits, q.axis, q.group_size)
    have = (made.bits, made.axis, made.group_size)
    if want == have:
        return None
    text = f"{layout_text(*have)} ({', '.join(sources)})"
    return stored_quantized_otherwise(name, layout_text(*want), want, text, have)


def stored_for_float(
    name: str, names: Any, records: Mapping[str, Any], shape: tuple[int, ...], dtype: Any
) -> StateProblem | None:
    """A problem when a file stores, among `names`, the quantized parts of `name` (or
    records its layout in `records`) where the model holds a float array of `shape` and
    `dtype`; None when it does not."""
    record = records.get(name)
    if record is None and not all(f"{name}.{part}" in names for part in ("value", "scale")):
        return None
    layout = None if record is None else (_meta(record), layout_text(*_meta(record)))
    return stored_quantized(name, np.dtype(dtype), shape, layout)


def _meta(record: Mapping[str, Any]) -> tuple[int, int, int | None]:
    return record["bits"], record["axis"], record["group_size"]


# The builders of the problems these checks find.


def stored_both(name: str, parts: list[str]) -> StateProblem:
    """A checkpoint holding a quantized parameter both as a float array and as parts."""
    return StateProblem(
        "structure",
        name,
        "a float array or its quantized parts",
        "both",
        f"the checkpoint holds both the float array {name!r} and the quantized parts "
        f"{parts} of this quantized parameter; keep one of them.",
    )


def stored_not_float(
    name: str, layout: str, dtype: np.dtype, shape: tuple[int, ...]
) -> StateProblem:
    """A tensor that is no float array where the model quantizes one as `layout`."""
    have = f"{dtype.name}{list(shape)}"
    hint = (
        f"the model quantizes {name!r} as {layout}, and the checkpoint holds {have} under its "
        f"name, which is not a float array to quantize. Give the float array, or the quantized "
        f"parts {name}.value and {name}.scale."
    )
    return StateProblem("dtype", name, "a float array", dtype.name, hint)


def stored_shape(
    name: str, layout: str, expected: tuple[int, ...], got: tuple[int, ...]
) -> StateProblem:
    """A float tensor of another shape than the one the model quantizes as `layout`."""
    hint = (
        f"shape mismatch: the model quantizes {name!r} ({layout}) from a float array of shape "
        f"{expected}, got {got}."
    )
    return StateProblem("shape", name, expected, got, hint)


def stored_quantized_otherwise(
    name: str, layout: str, want: tuple[Any, ...], got: str, have: tuple[Any, ...]
) -> StateProblem:
    """Quantized parts stored in another layout (`have`, told as `got`; bits None when
    unknown) than the model's (`want`, told as `layout`)."""
    group = "" if have[2] is None else f", group_size={have[2]}"
    fix = (
        f"Quantize the model as the checkpoint was (tt.quantize(float_model, bits={have[0]}"
        f"{group})), or load a float checkpoint, which is quantized on load."
        if have[0]
        else "Load a float checkpoint, which is quantized on load."
    )
    hint = f"the model quantizes {name!r} as {layout}, the checkpoint holds it as {got}. {fix}"
    return StateProblem("dtype" if have[0] != want[0] else "shape", name, layout, got, hint)


def stored_quantized(
    name: str, dtype: np.dtype, shape: tuple[int, ...], layout: tuple[tuple[Any, ...], str] | None
) -> StateProblem:
    """Quantized parts stored where the model holds a float array; `layout` is the parts'
    recorded layout and its text (None: not recorded)."""
    bits = group = ""
    stored, axis = "", "..."
    if layout is None:
        bits = "bits=..."
    else:
        (b, axis, size), text = layout
        bits, stored = f"bits={b}", f" as {text}"
        group = "" if size is None else f", group_size={size}"
    float_array = f"a float array {dtype.name}{list(shape)}"
    hint = (
        f"the checkpoint holds it quantized{stored}, as {name}.value and {name}.scale; the "
        f"model holds {float_array}. Load it into the quantized model, tt.quantize(model, "
        f"{bits}{group}) (then tt.dequantize it for floats), or pass rules that dequantize: "
        f"convert.Rule(['{name}.value', '{name}.scale'], '{name}', "
        f"convert.dequantize(axis={axis}{group}))."
    )
    return StateProblem("structure", name, float_array, "quantized parts", hint)


def quantized_problem(problem: StateProblem, param: str, q: QArray) -> StateProblem:
    """`problem`, about a part of the QArray `q` at `param`, told as a problem with `q`."""
    part = problem.name[len(param) + 1 :]
    how = (
        f"A checkpoint quantized another way loads whole, as tt.QArray(value, scale, bits=..., "
        f"axis=..., group_size=...), with {_MATCH}, which re-quantizes it as the model's is; "
        f"or quantize the float model as the checkpoint is."
    )
    got = _dtype(problem.got) if problem.kind == "dtype" and part == "value" else None
    if got is not None and jnp.issubdtype(got, jnp.integer):
        hint = (
            f"the value of {param!r}, {q!r}, holds {problem.expected} ({_a(q.bits)}-bit "
            f"quantization); got {got.name}, the integers of another one "
            f"({jnp.iinfo(got).bits}-bit), which a cast would not re-scale. {how}"
        )
    elif got is not None and jnp.issubdtype(got, jnp.floating):
        hint = (
            f"the value of {param!r}, {q!r}, holds {problem.expected} ({_a(q.bits)}-bit "
            f"quantization); got {got.name}, a float array where the quantized integers "
            f"belong. Give the float weight itself at {param!r}, with {_MATCH}, to quantize it "
            f"on load as the model's is."
        )
    elif problem.kind == "shape" and part == "scale":
        per = "one per channel" if q.group_size is None else f"one per group of {q.group_size}"
        hint = (
            f"the scale of {param!r}, {q!r}, has shape {problem.expected} ({per} along axis "
            f"{q.axis}), got {problem.got}: the scales of another layout. {how}"
        )
    else:
        hint = f"{problem.hint} (It is the {part} of {param!r}, {q!r}.)"
    return dataclasses.replace(problem, hint=hint)


def _a(bits: int) -> str:
    return f"an {bits}" if bits == 8 else f"a {bits}"


def _dtype(name: Any) -> Any:
    """The dtype of a name a problem holds (``"int4"`` too); None for another value."""
    try:
        return jnp.dtype(name)
    except TypeError:
        return None
