"""One safetensors file's header, read and checked: an 8-byte little-endian header length,
a JSON header naming each tensor's dtype, shape and byte range, then the bytes. Every entry
is checked against the file's size and the others' ranges, and the tensors the metadata
lists as packed 4-bit tensors are presented as such."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from . import _quantized as qz
from ._read import SafetensorsError, Tensor, _Packed

DTYPES: dict[str, Any] = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
    "F16": np.float16, "F32": np.float32, "F64": np.float64, "C64": np.complex64,
    "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}  # fmt: skip
_HEADER_LIMIT = 100 * 2**20  # the safetensors library's own limit on a header


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the name {key!r} appears twice")
        out[key] = value
    return out


def _header(file: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors a safetensors file's header describes, in the order of their bytes,
    and its metadata; every entry checked against the file's size."""
    size = file.stat().st_size

    def bad(why: str) -> SafetensorsError:
        return SafetensorsError(f"{file}: {why}")

    with open(file, "rb", buffering=0) as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < length <= min(size - 8, _HEADER_LIMIT):
            raise bad(
                f"not a safetensors file: its first 8 bytes give a header of {length} bytes, "
                f"and the file has {size}. It is truncated or of another format."
            )
        try:
            header = json.loads(f.read(length), object_pairs_hook=_unique)
            if not isinstance(header, dict):
                raise TypeError("it is not a JSON object")
        except (ValueError, TypeError) as error:
            raise bad(f"the header is not valid: {error}. The file is corrupt.") from None
    metadata = header.pop("__metadata__", None) or {}
    data, start = size - 8 - length, 8 + length
    tensors: list[tuple[int, int, Tensor]] = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(shape)
            if not all(type(n) is int and n >= 0 for n in (*shape, begin, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise bad(
                f"the header entry of {name!r} is {entry!r}; an entry holds a dtype, a shape of "
                f"non-negative ints and data_offsets [begin, end]."
            ) from None
        if dtype not in DTYPES:
            raise bad(
                f"{name!r} has the dtype {dtype!r}, which Taktiny cannot read; it reads "
                f"{sorted(DTYPES)}."
            )
        tensor = Tensor(name, shape, DTYPES[dtype], file, start + begin)
        if end - begin != tensor.nbytes:
            raise bad(
                f"the header gives {name!r} the shape {list(shape)} of {dtype} "
                f"({tensor.nbytes} bytes) but {end - begin} bytes [{begin}, {end}); the "
                f"header disagrees with its bytes."
            )
        if end > data:
            raise bad(
                f"the bytes of {name!r} run to {end}, past the end of the data ({data} "
                f"bytes): the file is truncated."
            )
        tensors.append((begin, end, tensor))
    tensors.sort(key=lambda t: (t[0], t[1]))
    for (_, end, a), (begin, _, b) in itertools.pairwise(tensors):
        if begin < end:
            raise bad(f"the bytes of {a.name!r} and {b.name!r} overlap; the file is corrupt.")
    metadata = {str(k): str(v) for k, v in metadata.items()}
    found = {t.name: t for _, _, t in tensors}
    return _unpacked(found, metadata.get(qz.PACKED), bad), metadata


def _unpacked(tensors: dict[str, Tensor], packed: str | None, bad: Any) -> dict[str, Tensor]:
    """`tensors` with those the metadata lists as packed 4-bit tensors presented as such."""
    if packed is None:
        return tensors
    try:
        records = qz.packed_record(qz.PACKED, packed)
    except ValueError as error:
        raise bad(f"{error}; the header is corrupt.") from None
    for name, (dtype, shape) in records.items():
        stored = tensors.get(name)
        want = qz.packed_shape(shape)
        if stored is None:
            raise bad(
                f"the metadata {qz.PACKED!r} lists {name!r} as a packed {dtype.name}{list(shape)}, "
                f"but the file holds no tensor of that name; the header is inconsistent."
            )
        if stored.dtype != np.uint8 or stored.shape != want:
            raise bad(
                f"the metadata {qz.PACKED!r} lists {name!r} as {dtype.name}{list(shape)} packed "
                f"two per byte, which is stored as uint8{list(want)}, but the file holds "
                f"{stored.dtype.name}{list(stored.shape)}; the header is inconsistent."
            )
        tensors[name] = _Packed(name, shape, dtype, stored.file, stored.offset)
    return tensors
