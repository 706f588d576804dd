"""The problems a load finds from the checkpoint's headers, before any data is read: a
quantized parameter's float array or parts that do not fit it, a float leaf whose
checkpoint holds quantized parts, a packed tensor its file does not list, leaves not
loaded that must be."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .._messages import layout_text
from .._problems import StateProblem
from ..io import Checkpoint, SafetensorsError, Tensor
from ..quant import FOUR_BIT, PACKED, QArray, packed_shape
from ..state import kind
from ..state import problems as err


def unquantizable(name: str, tensor: Tensor, like: QArray) -> StateProblem | None:
    """What stops a float tensor from being quantized into the QArray `like` (None: nothing)."""
    layout = layout_text(like.bits, like.axis, like.group_size)
    if kind(tensor.dtype) != "floating":
        return stored_not_float(name, layout, tensor.dtype, tuple(tensor.shape))
    if tuple(tensor.shape) != like.shape:
        return stored_shape(name, layout, like.shape, tuple(tensor.shape))
    return None


def other_representation(name: str, like: QArray, checkpoint: Checkpoint) -> StateProblem | None:
    """A problem when the checkpoint's parts of `name` are quantized otherwise than `like`
    (by its recorded layout, or else by its values' dtype)."""
    want = (like.bits, like.axis, like.group_size)
    record = checkpoint.quantized.get(name)
    value = checkpoint.get(f"{name}.value")
    if record is not None:
        have: tuple[Any, ...] = _meta(record)
        if have == want:
            return None
        got = layout_text(*have)
    elif value is None or value.dtype in (np.dtype(like.value.dtype), np.uint8):
        return None  # (uint8: a 4-bit array packed, unless its packing is unlisted: checked)
    else:
        bits = {"int8": 8, "int4": 4}.get(value.dtype.name)
        have, got = (bits, *want[1:]), f"{value.dtype.name} values"
    return stored_quantized_otherwise(name, layout_text(*want), want, got, have)


def other_layout(name: str, like: QArray, got: Any, sources: Sequence[str]) -> StateProblem | None:
    """A problem when a transform makes, from `sources`, a QArray `got` quantized otherwise
    than `like` (None: the same layout, or no QArray)."""
    if not isinstance(got, QArray):
        return None
    want, have = (like.bits, like.axis, like.group_size), (got.bits, got.axis, got.group_size)
    if want == have:
        return None
    text = f"{layout_text(*have)} ({', '.join(sources)})"
    return stored_quantized_otherwise(name, layout_text(*want), want, text, have)


def quantized_into_float(
    checkpoint: Checkpoint, leaves: Mapping[str, Any], unknown: list[str]
) -> dict[str, StateProblem]:
    """A problem for each float leaf whose checkpoint holds quantized parts instead."""
    out: dict[str, StateProblem] = {}
    for name in unknown:
        base, _, part = name.rpartition(".")
        if part not in ("value", "scale") or base not in leaves or base in out:
            continue
        record = checkpoint.quantized.get(base)
        if record is None and not {f"{base}.value", f"{base}.scale"} <= set(checkpoint):
            continue
        shape, dtype = spec_of(leaves[base])
        layout = None if record is None else (_meta(record), layout_text(*_meta(record)))
        out[base] = stored_quantized(base, dtype, shape, layout)
    return out


def _meta(record: Mapping[str, Any]) -> tuple[int, int, int | None]:
    return record["bits"], record["axis"], record["group_size"]


def check_packed_listed(tensor: Tensor, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Raises when a uint8 tensor stands where the model holds a 4-bit array of which it
    could be the packed bytes, but its file does not list it as packed."""
    if dtype.name in FOUR_BIT and tensor.dtype == np.uint8 and not tensor.packed:
        if tuple(tensor.shape) == packed_shape(shape):
            raise SafetensorsError(
                f"{tensor.file}: {tensor.name!r} is stored as uint8{list(tensor.shape)}, where "
                f"the model holds {dtype.name}{list(shape)}: 4-bit tensors are stored packed "
                f"two per byte, but the header metadata {PACKED!r}, which lists each packed "
                f"tensor with its dtype and shape, does not list it, so it cannot be unpacked. "
                f"Write the checkpoint with taktiny.io.save_safetensors, which records it."
            )


def absent_leaves(leaves: Mapping[str, Any], loaded: set[str], strict: bool) -> list[StateProblem]:
    """The leaves not loaded that must be: all of them under strict=True, and those of an
    abstract model (they have no value to keep); checked before anything is read."""
    absent = [(n, isinstance(leaves[n], jax.ShapeDtypeStruct)) for n in leaves if n not in loaded]
    if strict:
        return [err.missing(name, abstract) for name, abstract in absent]
    return [err.abstract(name) for name, abstract in absent if abstract]


def spec_of(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    dtype = getattr(leaf, "dtype", None)
    return tuple(np.shape(leaf)), np.dtype(dtype) if dtype is not None else np.result_type(leaf)


# The builders of the problems these checks find. A layout is (bits, axis, group_size);
# its text is how taktiny.io describes it ("int8 per channel").


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
