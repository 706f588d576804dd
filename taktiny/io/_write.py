"""Writing one safetensors file as its tensors reach host memory: the header first, sized
for the checksums it will hold, then each tensor's bytes in turn (hashed, on a thread of
the writer's own, while they are written), and last the header again, with those
checksums and its own digest.

A tensor may still be on its way off a device when the file is begun (a JAX array whose
copy to host memory `_save._start_copies` started): the writer waits for it when its turn
comes, while the later ones go on arriving, so the copies off the devices overlap the
writes instead of all coming first. The header can be written before the checksums are
known because every digest is 32 hex digits: the header with zeros in their place has the
length of the final one, which is written over it.

The format: an 8-byte little-endian header length, the JSON header (each tensor's dtype
code, shape and byte range, and ``"__metadata__"``), padded with spaces to a multiple of 8
bytes, then the tensors' bytes, laid out as the safetensors library lays them out (by
dtype, largest item size first, so that every tensor starts at a multiple of its item
size, then by name: `layout`, the order in which a save that waits starts the copies off
the devices).
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from . import _checksum
from ._dtypes import CODES
from ._object_store import Url

_CODE = {name: code for code, (name, _) in CODES.items()}  # NumPy's dtype name -> its code
_ZERO = "0" * 32  # a digest's place, before it is known
# the order of the dtypes in a file the safetensors library writes (its dtype enumeration,
# largest last, taken backwards: every tensor starts at a multiple of its item size)
_RANK = {
    code: i
    for i, code in enumerate(
        "U64 I64 F64 C64 F32 U32 I32 BF16 F16 U16 I16 F8_E4M3 F8_E5M2 I8 U8 BOOL".split()
    )
}


def write_sealed(
    file: Path,
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str],
    final: Path | Url | None = None,
) -> None:
    """Writes `tensors` to `file` as a sealed safetensors file (`write_file`). A failure is
    an OSError naming the file's `final` name (`write_error`).

    Args:
        file: the file to write (created, or truncated).
        tensors: {name: a C-contiguous host array, or a JAX array whose bytes are read
            when its turn comes}, of dtypes safetensors stores.
        metadata: the header's metadata, without the checksums (the writer adds them).
        final: the name the file will have once committed, for messages (None: `file`).

    Raises:
        OSError: the write failed: its errno, when it had one, and the file's name.
    """
    try:
        write_file(tensors, file, metadata)
    except Exception as error:
        raise write_error(error, final or file) from error


def write_file(tensors: Mapping[str, Any], file: Path, metadata: Mapping[str, str]) -> None:
    """Writes `tensors` ({name: host or JAX array}) to `file` as a safetensors file whose
    header holds `metadata` and, computed from the bytes while they are written, each
    tensor's checksum, its tiles' checksums (`_checksum.tile_digests`) and the header's own
    digest (`_checksum.sealed`)."""
    order = layout(tensors)
    ranges: dict[str, tuple[int, int]] = {}
    end = 0
    for name in order:
        ranges[name] = (end, end + tensors[name].nbytes)
        end += tensors[name].nbytes
    grids = {n: _checksum.grid(t.shape, t.dtype.itemsize) for n, t in tensors.items()}
    # (the tensors with tiles: those `_checksum.tile_digests` gives digests for)
    tiled = {n: (g, _ZERO * math.prod(g)) for n, g in grids.items() if math.prod(g) > 1}
    head = _head(tensors, ranges, _sealable(metadata, dict.fromkeys(tensors, _ZERO), tiled))
    hasher = _Hasher()
    try:
        with open(file, "wb", buffering=0) as f:
            _write_all(f, memoryview(head))
            for name in order:
                host = np.asarray(tensors[name], order="C")  # (a JAX array's: waits for it)
                hasher.put(name, host)
                _write_all(f, host.reshape(-1).view(np.uint8).data)
                del host
            hashed = hasher.result()
            digests = {n: hashed[n][0] for n in tensors}
            tiled |= {n: t for n in tensors if (t := hashed[n][1]) is not None}
            own = _sealable(metadata, digests, tiled)
            final = _head(tensors, ranges, own)
            if len(final) != len(head):  # pragma: no cover - the writer's fault
                raise AssertionError(f"{file}: the header's length changed with its digests")
            f.seek(0)
            _write_all(f, memoryview(_checksum.sealed(final, own)))
    finally:
        hasher.stop()


class _Hasher:
    """Hashes host arrays on a thread of its own, while the writer writes them: each
    array's checksum, and its grid and tiles' checksums (xxhash and the tiles' copies
    release the GIL). A plain thread, not an executor's: a background save may still be
    writing when the interpreter exits, and executors take no work once it has begun to."""

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue[tuple[str, np.ndarray] | None] = queue.SimpleQueue()
        self._done: dict[str, tuple[str, tuple[tuple[int, ...], str] | None]] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="taktiny hash", daemon=True)
        self._thread.start()

    def put(self, name: str, host: np.ndarray) -> None:
        """Hashes `host` (a C-contiguous array) as `name`, after those put before."""
        self._todo.put((name, host))

    def result(self) -> dict[str, tuple[str, tuple[tuple[int, ...], str] | None]]:
        """Waits for every array put; {name: (checksum, (grid, tiles' checksums) or None)}."""
        self._todo.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._done

    def stop(self) -> None:
        """Ends the thread, leaving what is not hashed yet (after a failure)."""
        self._stopped = True
        self._todo.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            if self._stopped or self._error is not None:
                continue
            name, host = item
            try:
                digest = _checksum.digest(host.reshape(-1).view(np.uint8))
                self._done[name] = digest, _checksum.tile_digests(host)
            except BaseException as error:  # noqa: BLE001 - raised by result()
                self._error = error


def layout(tensors: Mapping[str, Any]) -> list[str]:
    """The names of `tensors` in the order their bytes lie in the file, the safetensors
    library's: by dtype in `_RANK`'s order (largest item size first), then by name."""
    return sorted(tensors, key=lambda n: (_RANK[_CODE[np.dtype(tensors[n].dtype).name]], n))


def _sealable(
    metadata: Mapping[str, str],
    digests: Mapping[str, str],
    tiled: Mapping[str, tuple[tuple[int, ...], str]],
) -> dict[str, str]:
    """`metadata` with the checksums' entries: the tensors' digests, their tiles', and the
    header's record (last: it covers the others), whose own digest `_checksum.sealed`
    writes."""
    own = dict(metadata)
    own[_checksum.KEY] = _checksum.record(digests)
    if tiled:
        own[_checksum.TILES_KEY] = _checksum.tiles_record(tiled)
    own[_checksum.HEADER_KEY] = _checksum.header_record(own)
    return own


def _head(
    tensors: Mapping[str, Any], ranges: Mapping[str, tuple[int, int]], metadata: Mapping[str, str]
) -> bytes:
    """The file's first bytes: the header's length, then the header, padded with spaces."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    for name, (start, stop) in ranges.items():
        array = tensors[name]
        code = _CODE[np.dtype(array.dtype).name]
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [start, stop]}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_all(f: Any, data: memoryview) -> None:
    """Writes all of `data` (a write may take only part of it)."""
    while data:
        data = data[f.write(data) :]


def write_error(error: Exception, file: Path | Url) -> OSError:
    """The error for a new file of the checkpoint that could not be written: an OSError
    with the errno of the OS's error that stopped it and the file's final name; for an
    error without an errno, its message."""
    code = error.errno if isinstance(error, OSError) else None
    if code is None:
        return OSError(f"save_safetensors: writing {file}: {error}")
    return OSError(
        code,
        f"save_safetensors: {os.strerror(code)} (the previous checkpoint is left as it was), "
        f"writing",
        str(file),
    )
