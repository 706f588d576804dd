"""Reading safetensors checkpoints: every header checked when the checkpoint is opened,
tensors read on demand into buffers Taktiny owns.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes. Opening reads the headers only.
Reads go into page-aligned anonymous memory (``mmap``), filled with ``os.preadv`` and made
read-only: JAX's CPU client adopts such a buffer without copying it (it copies any buffer
not 64-byte aligned, as NumPy's are), and no caller can write through it afterwards.
4-bit tensors that Taktiny stored packed two per byte are presented as what they are (see
`_quantized`): their 4-bit dtype and logical shape, unpacked as they are read.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from . import _quantized as qz

DTYPES: dict[str, Any] = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
    "F16": np.float16, "F32": np.float32, "F64": np.float64, "C64": np.complex64,
    "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}  # fmt: skip
_HEADER_LIMIT = 100 * 2**20  # the safetensors library's own limit on a header
MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
_CHUNK = 1 << 30  # bytes per preadv call (Linux moves at most ~2 GiB per call)


class SafetensorsError(ValueError):
    """A safetensors checkpoint that cannot be read as it claims: a truncated or corrupt
    file, a header whose byte ranges overlap or run past the file, an index naming a
    missing shard or one outside its folder. The message names the file and tensor."""


class Tensor:
    """One tensor of a checkpoint, not yet read: ``name``, ``shape``, ``dtype`` (NumPy),
    ``nbytes``, the ``file`` holding it and its byte ``offset`` there.

    ``np.asarray(tensor)`` reads it (a read-only array of ``shape``); :meth:`read` reads
    the whole tensor or one block of it. A 4-bit tensor that Taktiny stored packed two per
    byte (:func:`~taktiny.io.save_safetensors`) has ``packed`` set: its ``dtype`` and
    ``shape`` are the 4-bit ones, its ``nbytes`` the bytes stored, and reads unpack it.
    """

    __slots__ = ("dtype", "file", "name", "nbytes", "offset", "shape")

    def __init__(self, name: str, shape: tuple[int, ...], dtype: Any, file: Path, offset: int):
        self.name, self.shape, self.dtype = name, shape, np.dtype(dtype)
        self.file, self.offset = file, offset
        self.nbytes = math.prod(shape) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        """The number of axes."""
        return len(self.shape)

    @property
    def packed(self) -> bool:
        """Whether the file stores this 4-bit tensor packed two per byte (as uint8)."""
        return False

    def read(self, index: Sequence[slice] | None = None) -> np.ndarray:
        """The tensor, or the block ``index`` of it (one ``slice`` per axis, steps of 1),
        read from disk into a fresh read-only aligned buffer; only the block's bytes are
        read."""
        if index is None:
            index = [slice(None)] * self.ndim
        bounds = [s.indices(n)[:2] for s, n in zip(index, self.shape, strict=True)]
        shape = tuple(stop - start for start, stop in bounds)
        out, raw = _buffer(shape, self.dtype)
        return self._into(out, raw, bounds)

    def read_into(self, memory: Any) -> np.ndarray:
        """The whole tensor read into the start of `memory` (a writable buffer of at least
        ``nbytes``), as a read-only array viewing it. The caller owns `memory`, and must
        not reuse it while anything still uses the array (JAX on CPU may adopt it)."""
        out = np.frombuffer(memory, self.dtype, math.prod(self.shape)).reshape(self.shape)
        raw = memoryview(memory).cast("B")[: self.nbytes]
        return self._into(out, raw, [(0, n) for n in self.shape])

    def _into(self, out: np.ndarray, raw: Any, bounds: list[tuple[int, int]]) -> np.ndarray:
        if out.size:
            with open(self.file, "rb", buffering=0) as f:
                self._fill(f.fileno(), bounds, out.shape, raw)
        out.flags.writeable = False
        return out

    def _fill(
        self, fd: int, bounds: list[tuple[int, int]], shape: tuple[int, ...], to: Any
    ) -> None:
        # row-major: the axes after the last partial one are whole, so each run of the
        # block covers those axes and the partial one; runs repeat over the axes before it
        partial = max((i for i, (b, n) in enumerate(zip(bounds, self.shape, strict=True))
                       if b != (0, n)), default=0)  # fmt: skip
        item = self.dtype.itemsize
        strides = [math.prod(self.shape[i + 1 :]) * item for i in range(self.ndim)] or [item]
        run = math.prod(shape[partial:]) * item
        first = self.offset + sum(b[0] * s for b, s in zip(bounds, strides, strict=False))
        offsets = [first]
        if partial:
            steps = np.indices(shape[:partial], np.int64).reshape(partial, -1).T
            offsets = (first + steps @ np.array(strides[:partial], np.int64)).tolist()
        for k, at in enumerate(offsets):
            _pread(fd, to[k * run : (k + 1) * run], at, self)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self.read()
        return array if dtype is None else array.astype(dtype)

    def __repr__(self) -> str:
        packed = ", packed" if self.packed else ""
        return (
            f"Tensor({self.name!r}, {self.dtype.name}{list(self.shape)}{packed}, {self.file.name})"
        )


class _Packed(Tensor):
    """A 4-bit tensor stored packed two per byte along its last axis (see `_quantized`)."""

    __slots__ = ("stored",)

    def __init__(self, name: str, shape: tuple[int, ...], dtype: Any, file: Path, offset: int):
        super().__init__(name, shape, dtype, file, offset)
        self.stored = Tensor(name, qz.packed_shape(shape), np.uint8, file, offset)  # the bytes
        self.nbytes = self.stored.nbytes

    @property
    def packed(self) -> bool:
        return True

    def read(self, index: Sequence[slice] | None = None) -> np.ndarray:
        if index is None:
            index = [slice(None)] * self.ndim
        bounds = [s.indices(n)[:2] for s, n in zip(index, self.shape, strict=True)]
        if not bounds:  # 0-d: one byte
            return qz.unpack(self.stored.read(), self.dtype, 0, 1).reshape(())
        start, stop = bounds[-1]
        first = start - start % 2  # the bytes holding elements start to stop of each row
        rows = [slice(*b) for b in bounds[:-1]]
        raw = self.stored.read([*rows, slice(first // 2, (stop + 1) // 2)])
        return qz.unpack(raw, self.dtype, start - first, stop - first)

    def read_into(self, memory: Any) -> np.ndarray:
        raw = self.stored.read_into(memory)
        if not self.shape:
            return qz.unpack(raw, self.dtype, 0, 1).reshape(())
        return qz.unpack(raw, self.dtype, 0, self.shape[-1])


def _buffer(shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, memoryview]:
    """A zeroed array in fresh page-aligned anonymous memory, and its bytes. The pages are
    mapped up front (``MAP_POPULATE``: one call instead of a page fault per 4 KiB)."""
    size = math.prod(shape) * dtype.itemsize
    memory = mmap.mmap(-1, size, flags=MAP_FLAGS) if size else bytearray()
    return np.frombuffer(memory, dtype, math.prod(shape)).reshape(shape), memoryview(memory)


def _pread(fd: int, into: memoryview, offset: int, tensor: Tensor) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done : done + _CHUNK]], offset + done)
        if got == 0:
            raise SafetensorsError(
                f"{tensor.file}: the file ends inside the bytes of {tensor.name!r}; it was "
                f"truncated after it was opened. Write it again."
            )
        done += got


class Readahead:
    """Keeps the OS reading `window` bytes ahead of a reader that goes through `tensors` in
    this order, so the disk works while the reader copies and places: each call to
    :meth:`reached` (with the index of the tensor about to be read) asks for the bytes up
    to `window` past it with ``posix_fadvise(WILLNEED)``, in `chunk`-byte requests (Linux
    cuts each request to the disk's readahead size, a few MiB at most), never twice."""

    def __init__(self, tensors: Sequence[Tensor], window: int = 256 * 2**20, chunk: int = 2**20):
        self.tensors, self.window, self.chunk = tensors, window, chunk
        self.starts = list(itertools.accumulate((t.nbytes for t in tensors), initial=0))
        self.next, self.done = 0, 0  # the tensor being requested, and its bytes requested
        self.fds: dict[Path, int] = {}

    def reached(self, index: int) -> None:
        if self.next < index:  # the reader overtook the requests
            self.next, self.done = index, 0
        k = self.next
        while (
            k < len(self.tensors) and self.starts[k] + self.done - self.starts[index] < self.window
        ):
            tensor = self.tensors[k]
            step = min(self.chunk, tensor.nbytes - self.done)
            if step and hasattr(os, "posix_fadvise"):
                fd = self.fds.get(tensor.file)
                if fd is None:
                    fd = self.fds[tensor.file] = os.open(tensor.file, os.O_RDONLY)
                os.posix_fadvise(fd, tensor.offset + self.done, step, os.POSIX_FADV_WILLNEED)
            self.done += step
            if self.done >= tensor.nbytes:
                k, self.done = k + 1, 0
        self.next = k

    def __enter__(self) -> Readahead:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            os.close(fd)


class Checkpoint(Mapping[str, Tensor]):
    """A safetensors checkpoint, opened: a read-only mapping from tensor names to
    :class:`Tensor` handles, in the order of their bytes on disk (file by file). Made by
    :func:`open_safetensors`; ``metadata`` holds the header metadata of the first file
    (``{"format": "pt"}``, Taktiny's version, user metadata). ``quantized`` holds the
    layout of each quantized parameter saved from a :class:`~taktiny.QArray`, by name (its
    parts are the tensors ``<name>.value`` and ``<name>.scale``): ``{"bits": 4, "axis": 0,
    "group_size": 64, "shape": [512, 2048]}``, checked against those tensors."""

    def __init__(
        self,
        path: Path,
        tensors: dict[str, Tensor],
        metadata: dict[str, str],
        quantized: dict[str, dict[str, Any]] | None = None,
    ):
        self.path, self.metadata = path, metadata
        self.quantized = quantized or {}
        self._tensors = tensors

    def __getitem__(self, name: str) -> Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        """The bytes of all its tensors."""
        return sum(t.nbytes for t in self._tensors.values())

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self)} tensors, {self.nbytes:,} bytes)"


def open_safetensors(path: str | os.PathLike[str]) -> Checkpoint:
    """Opens a safetensors checkpoint, reading and checking its headers only.

    Args:
        path: a ``.safetensors`` file; a Hugging Face index (``*.safetensors.index.json``,
            whose ``weight_map`` names each tensor's shard); or a folder holding one index,
            or exactly one ``.safetensors`` file.

    Returns:
        A :class:`Checkpoint`: ``{name: Tensor}``, read tensor by tensor on demand.

    Raises:
        SafetensorsError: naming the file and tensor, for a truncated or corrupt file, a
            header whose shapes disagree with their bytes or whose ranges overlap or run
            past the file, a dtype safetensors does not define, an index naming a missing
            shard, the same shard twice or a shard outside its folder, or a tensor the
            index and its shard disagree on.
    """
    path = Path(path)
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        files = sorted(path.glob("*.safetensors"))
        if len(indexes) > 1 or (not indexes and len(files) != 1):
            raise SafetensorsError(
                f"{path}: a folder holding exactly one *.safetensors.index.json, or one "
                f"*.safetensors file and no index, was expected; it has {len(indexes)} "
                f"indexes and {len(files)} files. Name the file or index to read."
            )
        path = indexes[0] if indexes else files[0]
    if not path.is_file():
        raise SafetensorsError(f"{path}: no such file.")
    if path.name.endswith(".json"):
        return _open_index(path)
    tensors, metadata = _header(path)
    return Checkpoint(path, tensors, metadata, _layouts(path, [(path, metadata)], tensors))


def _layouts(
    where: Path, metadata: list[tuple[Path, dict[str, str]]], tensors: Mapping[str, Tensor]
) -> dict[str, dict[str, Any]]:
    """The quantized layouts the files record (every file records them all), each checked
    against its parts."""
    out: dict[str, dict[str, Any]] = {}
    for file, meta in metadata:
        if qz.QUANTIZED in meta:
            try:
                out.update(qz.quantized_record(qz.QUANTIZED, meta[qz.QUANTIZED]))
            except ValueError as error:
                raise SafetensorsError(f"{file}: {error}; the header is corrupt.") from None
    for name, record in out.items():
        problem = qz.check_quantized(name, record, tensors)
        if problem:
            raise SafetensorsError(
                f"{where}: the metadata {qz.QUANTIZED!r} records {name!r} as quantized "
                f"{qz.describe(record['bits'], record['axis'], record['group_size'])} of shape "
                f"{record['shape']}, but {problem}. The checkpoint is inconsistent; write it "
                f"again with taktiny.io.save_safetensors."
            )
    return out


def _open_index(index: Path) -> Checkpoint:
    try:
        weight_map = json.loads(index.read_bytes(), object_pairs_hook=_unique)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError) as error:
        raise SafetensorsError(
            f"{index}: not a safetensors index ({error or 'no weight_map'}); an index is JSON "
            f'with "weight_map": {{tensor name: shard file}}.'
        ) from None
    folder = index.parent.resolve()
    shards: dict[Path, str] = {}
    for name, shard in weight_map.items():
        file = (folder / str(shard)).resolve()
        if not isinstance(shard, str) or folder not in file.parents:
            raise SafetensorsError(
                f"{index}: the shard {shard!r} of {name!r} is outside the index's folder "
                f"{folder}; an index may name only files beside it."
            )
        if shards.setdefault(file, shard) != shard:
            raise SafetensorsError(
                f"{index}: names one shard twice, as {shards[file]!r} and {shard!r}; give "
                f"each shard one name."
            )
        if not file.is_file():
            raise SafetensorsError(f"{index}: the shard {shard!r} (of {name!r}) is missing.")
    tensors: dict[str, Tensor] = {}
    metas: list[tuple[Path, dict[str, str]]] = []
    for file, shard in sorted(shards.items(), key=lambda item: item[1]):
        found, meta = _header(file)
        metas.append((file, meta))
        for name, tensor in found.items():
            listed = weight_map.get(name)
            if listed is None or (folder / listed).resolve() != file:
                where = "does not list it" if listed is None else f"puts it in {listed!r}"
                raise SafetensorsError(
                    f"{index}: the shard {shard!r} holds {name!r}, but the index {where}; "
                    f"the index and its shards disagree. Write the checkpoint again."
                )
            tensors[name] = tensor
    lacking = [name for name in weight_map if name not in tensors]
    if lacking:
        raise SafetensorsError(
            f"{index}: the index lists {lacking[:5]} in shards that do not hold them."
        )
    metadata = metas[0][1] if metas else {}
    return Checkpoint(index, tensors, metadata, _layouts(index, metas, tensors))


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
