"""Quantized parameters in safetensors files: 4-bit tensors packed two per byte, and the
layout of each `QArray` recorded in the header.

Safetensors has no 4-bit dtype. A 4-bit tensor (``int4``, ``uint4``, ``float4_e2m1fn``) of
logical shape ``[..., n]`` is stored as ``U8`` of shape ``[..., ceil(n / 2)]``: along the
last axis, element ``2i`` sits in the low nibble of byte ``i`` and element ``2i + 1`` in
its high nibble (the order of XLA's own int4 packing); an odd ``n`` leaves the last byte's
high nibble zero, and a 0-d tensor takes one byte. Each file's header metadata lists the
packed tensors it holds, as JSON::

    "taktiny_packed": {"dense.kernel.value": {"dtype": "int4", "shape": [512, 2048]}}

Every file of a checkpoint also records the layout of each quantized parameter, whose parts
are the tensors ``<name>.value`` and ``<name>.scale``::

    "taktiny_quantized": {"dense.kernel": {"bits": 4, "axis": 0, "group_size": 64,
                                           "shape": [512, 2048]}}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

from .. import _lazy
from .._messages import short
from ..arrays import numpy_dtype

if TYPE_CHECKING:
    import numpy as np
else:
    np = _lazy.module("numpy")  # (a header needs no NumPy: imported when a tensor is read)

# (JAX and the quantized arrays are imported where a load needs them: opening a file, and
# listing it with `taktiny inspect`, imports neither)
PACKED = "taktiny_packed"  # the header metadata keys
QUANTIZED = "taktiny_quantized"
FOUR_BIT = ("int4", "uint4", "float4_e2m1fn")  # NumPy's names (ml_dtypes' dtypes)


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored (uint8) shape of a 4-bit tensor of logical `shape`."""
    return (*shape[:-1], (shape[-1] + 1) // 2) if shape else (1,)


def pack(array: np.ndarray) -> np.ndarray:
    """A 4-bit `array` packed two per byte along its last axis (low nibble first)."""
    nibbles = np.ascontiguousarray(array).reshape(array.shape or (1,)).view(np.uint8) & 0x0F
    if nibbles.shape[-1] % 2:
        pad = np.zeros((*nibbles.shape[:-1], 1), np.uint8)
        nibbles = np.concatenate([nibbles, pad], axis=-1)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack(raw: np.ndarray, dtype: np.dtype, start: int, stop: int) -> np.ndarray:
    """Elements `start` to `stop` along the last axis of the 4-bit tensor whose packed
    bytes are `raw` ([..., m] uint8), as a read-only array of `dtype`."""
    out = np.empty((*raw.shape, 2), np.uint8)
    np.bitwise_and(raw, 0x0F, out=out[..., 0])
    np.right_shift(raw, 4, out=out[..., 1])
    out = out.reshape(*raw.shape[:-1], 2 * raw.shape[-1])
    if (start, stop) != (0, out.shape[-1]):
        out = np.ascontiguousarray(out[..., start:stop])
    out = out.view(dtype)
    out.flags.writeable = False
    return out


def packed_record(key: str, text: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The `PACKED` metadata of one file, checked: {name: (dtype, logical shape)}. Raises
    ValueError with what is wrong (the caller adds the file)."""
    records = _records(key, text)
    out = {}
    for name, record in records.items():
        dtype, shape = record.get("dtype"), record.get("shape")
        if (
            not isinstance(dtype, str)
            or dtype not in FOUR_BIT
            or not _shape(shape)
            or set(record) != {"dtype", "shape"}
        ):
            raise ValueError(
                f"the metadata {key!r} gives {name!r} the record {short(record)}; a packed "
                f"tensor's record is {{'dtype': one of {sorted(FOUR_BIT)}, 'shape': its logical "
                f"shape}}"
            )
        out[name] = (numpy_dtype(dtype), tuple(shape))
    return out


def quantized_record(key: str, text: str) -> dict[str, dict[str, Any]]:
    """The `QUANTIZED` metadata of one file, checked for form: {name: layout}."""
    records = _records(key, text)
    for name, record in records.items():
        shape, group = record.get("shape"), record.get("group_size")
        ints = all(type(record.get(k)) is int for k in ("bits", "axis"))
        if (
            set(record) != {"bits", "axis", "group_size", "shape"}
            or not _shape(shape)
            or not ints
            or (group is not None and type(group) is not int)
        ):
            raise ValueError(
                f"the metadata {key!r} gives {name!r} the record {short(record)}; a quantized "
                f"parameter's record is {{'bits': int, 'axis': int, 'group_size': int or null, "
                f"'shape': a list of ints}}"
            )
        from ._qarray import check_layout  # (imports JAX: see the top)

        problem = check_layout(tuple(shape), record["bits"], record["axis"], record["group_size"])
        if problem:
            raise ValueError(f"the metadata {key!r} gives {name!r} an impossible layout: {problem}")
    return records


def _records(key: str, text: str) -> dict[str, dict[str, Any]]:
    try:
        records = json.loads(text)
    except RecursionError:
        raise ValueError(f"the metadata {key!r} nests deeper than the JSON parser goes") from None
    except ValueError as error:
        raise ValueError(f"the metadata {key!r} is not valid JSON ({error})") from None
    if not isinstance(records, dict) or not all(isinstance(r, dict) for r in records.values()):
        raise ValueError(f"the metadata {key!r} is not a JSON object of records: {text[:80]!r}")
    return records


def _shape(shape: Any) -> TypeGuard[list[int]]:
    """A shape as a header may hold one: at most 64 axes (NumPy's most), each an int from 0
    to 2**63 - 1 (bools, JSON's true and false, are not ints here)."""
    return (
        type(shape) is list
        and len(shape) <= 64
        and all(type(n) is int and 0 <= n < 2**63 for n in shape)
    )


def check_quantized(name: str, record: Mapping[str, Any], tensors: Mapping[str, Any]) -> str | None:
    """What is wrong with the parts of the quantized parameter `name` that `record`
    describes, among `tensors` (name -> Tensor); None: nothing."""
    bits, axis, group, shape = (record[k] for k in ("bits", "axis", "group_size", "shape"))
    value, scale = tensors.get(f"{name}.value"), tensors.get(f"{name}.scale")
    lacking = [f"{name}.{p}" for p, t in (("value", value), ("scale", scale)) if t is None]
    if lacking:
        return f"its parts must be tensors, and the checkpoint has no {' or '.join(lacking)}"
    assert value is not None and scale is not None
    import jax.numpy as jnp  # (see the top)

    from ._qarray import INT_DTYPES, scale_shape

    want = INT_DTYPES[bits]
    if value.dtype != want:
        how = (
            " (stored packed two per byte, listed in the file's 'taktiny_packed')"
            if bits == 4
            else ""
        )
        return (
            f"its {bits}-bit values {name}.value must be {want.name}{how}, and the checkpoint "
            f"holds {value.dtype.name}{list(value.shape)}"
        )
    if tuple(value.shape) != tuple(shape):
        return f"its values {name}.value have the shape {list(value.shape)}, not {shape}"
    expected = scale_shape(tuple(shape), axis, group)
    if tuple(scale.shape) != expected or not jnp.issubdtype(scale.dtype, jnp.floating):
        return (
            f"its scales {name}.scale must be floats of shape {list(expected)}, and the "
            f"checkpoint holds {scale.dtype.name}{list(scale.shape)}"
        )
    return None
