"""Checksums of the tensors' bytes: written into each file's header metadata when Taktiny
saves, verified whenever a tensor is read.

The hash is XXH3 with 128 bits (the ``xxhash`` package, the reference implementation's
Python binding). It was chosen by measurement on the machine the benchmarks run on, over a
64 MiB buffer: XXH3-128 hashed 19-25 GB/s, faster than copying the same bytes (4.5 GB/s),
against 6-7 GB/s for BLAKE3, 2.3 GB/s for zlib's CRC-32, 1.4 GB/s for SHA-256 and 1.0 GB/s
for BLAKE2b; it releases the GIL, so a load's readers hash each piece as they read it
while the others read on. It detects damage, not tampering: it is not a cryptographic hash.

The header metadata entry ``"taktiny_checksums"`` is a JSON string:
``{"algorithm": "xxh3_128", "tensors": {name: 32 hex digits}}``, one digest for each tensor
of the file, over its bytes as stored (a packed 4-bit tensor's packed bytes).

A tensor of at least two tiles' bytes also has a digest per tile, so that a host reading
part of it (its own devices' blocks in a multi-process load) checks only the bytes it reads:
the entry ``"taktiny_tile_checksums"`` is ``{"algorithm": "xxh3_128", "tensors": {name:
{"grid": [parts per axis], "digests": "32 hex digits per tile"}}}``. The grid cuts each axis
into 1, 2, 4 or 8 equal parts (:func:`grid`), the first and last axes first, so that a split
of the tensor into 2, 4 or 8 parts along any of them falls on tile edges; each tile's digest
is over its bytes in row-major order, the tiles in row-major order of the grid.

The header checks itself: the entry ``"taktiny_header_checksums"`` is ``{"algorithm":
"xxh3_128", "header": 32 hex digits, "metadata": {key: 32 hex digits}, "metadata_digest":
32 hex digits}``. ``header`` is the digest of the file's first bytes, the 8-byte length
prefix and the header (its padding included), with the 32 digits of ``header`` itself read
as ``0`` (the entry is written with a placeholder, and :func:`sealed` writes the digest over
it once the file is written); ``metadata`` the digest of each other metadata entry's value,
and ``metadata_digest`` that of ``metadata`` (compact JSON), so that a damaged header names
the entry that changed. A bit flipped anywhere in such a header fails the open.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from .. import _lazy
from .._messages import short

if TYPE_CHECKING:
    import numpy as np
else:
    np = _lazy.module("numpy")  # (a header needs no NumPy: imported when a tensor is read)

KEY = "taktiny_checksums"
TILES_KEY = "taktiny_tile_checksums"
HEADER_KEY = "taktiny_header_checksums"
ALGORITHM = "xxh3_128"
_HEX = re.compile(r"[0-9a-f]{32}")
_TILE_BYTES = 64 << 10  # the smallest tile the writer makes
_MOST_TILES = 64  # the most tiles the writer makes of a tensor
_MOST_READ = 4096  # the most tiles a header may give a tensor (64 KiB of digests)


def digest(data: Any) -> str:
    """The checksum of `data`: bytes, a memoryview, or a C-contiguous NumPy array (of any
    dtype: its bytes)."""
    if not isinstance(data, bytes | memoryview) and isinstance(data, np.ndarray):
        data = data.reshape(-1).view(np.uint8)  # (bytes never import NumPy: a header's)
    return xxhash.xxh3_128_hexdigest(data)


def streaming() -> Any:
    """A hash object that takes the bytes in pieces (``update``), for ``hexdigest()``."""
    return xxhash.xxh3_128()


def grid(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """How many tiles each axis of a tensor of `shape` is cut into: the parts of each axis
    doubled in turn (the first axis, the last, then the others), up to 8, while they divide
    the axis, the tensor has at most 64 tiles and each holds at least 64 KiB. All ones:
    the tensor is one tile (no tile digests are written)."""
    parts = [1] * len(shape)
    order = dict.fromkeys([0, len(shape) - 1, *range(1, len(shape) - 1)]) if shape else {}
    nbytes, grown = math.prod(shape) * itemsize, True
    while grown:
        grown = False
        for axis in order:
            tiles = math.prod(parts) * 2
            if (
                parts[axis] < 8
                and shape[axis] % (parts[axis] * 2) == 0
                and tiles <= _MOST_TILES
                and nbytes // tiles >= _TILE_BYTES
            ):
                parts[axis] *= 2
                grown = True
    return tuple(parts)


def tiles(shape: Sequence[int], parts: Sequence[int]) -> list[list[tuple[int, int]]]:
    """The tiles of `parts` per axis over `shape`, in row-major order of the grid, each
    as (start, stop) per axis."""
    sizes = [n // p for n, p in zip(shape, parts, strict=True)]
    return [
        [(i * s, (i + 1) * s) for i, s in zip(index, sizes, strict=True)]
        for index in itertools.product(*map(range, parts))
    ]


def tile_digests(array: Any) -> tuple[tuple[int, ...], str] | None:
    """The grid of a C-contiguous NumPy `array` and its tiles' digests, concatenated; None
    for an array of one tile."""
    parts = grid(array.shape, array.dtype.itemsize)
    if math.prod(parts) == 1:
        return None
    digests = []
    for bounds in tiles(array.shape, parts):
        tile = np.ascontiguousarray(array[tuple(slice(*b) for b in bounds)])
        digests.append(digest(tile))
    return parts, "".join(digests)


def record(digests: Mapping[str, str]) -> str:
    """The header metadata value holding `digests` ({tensor name: checksum})."""
    return json.dumps({"algorithm": ALGORITHM, "tensors": dict(digests)}, separators=(",", ":"))


def parse(text: str, names: Any) -> dict[str, str]:
    """The digests a ``"taktiny_checksums"`` value holds, checked: a JSON object of the
    known algorithm, one 32-digit hex digest per tensor and only for `names` (the file's
    tensor names). Raises ValueError saying what is wrong."""
    tensors = _tensors(KEY, text, "digests")
    for name, hexdigest in tensors.items():
        if not isinstance(hexdigest, str) or not _HEX.fullmatch(hexdigest):
            raise ValueError(f"{KEY!r} gives {name!r} the digest {hexdigest!r}, not 32 hex digits")
        if name not in names:
            raise ValueError(f"{KEY!r} gives a digest for {name!r}, which the file does not hold")
    return tensors


def _tensors(key: str, text: str, what: str) -> dict[str, Any]:
    """The ``"tensors"`` object of the record `text` under metadata `key`, checked to be a
    JSON object of the known algorithm mapping names to `what`."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{key!r} is not valid JSON ({error})") from None
    if not isinstance(value, dict) or set(value) != {"algorithm", "tensors"}:
        raise ValueError(f"{key!r} must be a JSON object with 'algorithm' and 'tensors'")
    if value["algorithm"] != ALGORITHM:
        raise ValueError(
            f"{key!r} names the algorithm {value['algorithm']!r}; this Taktiny knows {ALGORITHM!r}"
        )
    tensors = value["tensors"]
    if not isinstance(tensors, dict):
        raise ValueError(f"{key!r}: 'tensors' must map tensor names to {what}")
    return tensors


def tiles_record(grids: Mapping[str, tuple[tuple[int, ...], str]]) -> str:
    """The header metadata value holding `grids` ({tensor name: (grid, the tiles' digests
    concatenated)}, as :func:`tile_digests` gives them)."""
    tensors = {n: {"grid": list(g), "digests": d} for n, (g, d) in grids.items()}
    return json.dumps({"algorithm": ALGORITHM, "tensors": tensors}, separators=(",", ":"))


def parse_tiles(text: str, tensors: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The grids and tile digests a ``"taktiny_tile_checksums"`` value holds, checked
    against `tensors` (the file's, by name, with their stored shapes): for each, one part
    count per axis that divides it, and 32 hex digits per tile. Raises ValueError saying
    what is wrong."""
    entries = _tensors(TILES_KEY, text, "their tiles")
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, entry in entries.items():
        if name not in tensors:
            raise ValueError(
                f"{TILES_KEY!r} gives tiles for {name!r}, which the file does not hold"
            )
        shape = tuple(getattr(tensors[name], "stored", tensors[name]).shape)
        parts = entry.get("grid") if isinstance(entry, dict) else None
        if (
            set(entry if isinstance(entry, dict) else ()) != {"grid", "digests"}
            or not isinstance(parts, list)
            or len(parts) != len(shape)
            or not all(
                type(p) is int and p >= 1 and n % p == 0 for p, n in zip(parts, shape, strict=True)
            )
            or not 1 < math.prod(parts) <= _MOST_READ
        ):
            raise ValueError(
                f"{TILES_KEY!r} gives {name!r} (stored shape {list(shape)}) the tiles "
                f"{short(entry)}: expected {{'grid': [parts per axis, each dividing the "
                f"axis, at most {_MOST_READ} tiles in all], 'digests': ...}}"
            )
        digests = entry["digests"]
        count = math.prod(parts)
        if (
            not isinstance(digests, str)
            or len(digests) != 32 * count
            or not all(_HEX.fullmatch(digests[k : k + 32]) for k in range(0, len(digests), 32))
        ):
            raise ValueError(
                f"{TILES_KEY!r} gives {name!r} the tile digests {short(digests)}: expected "
                f"{count} digests of 32 hex digits, one per tile of its grid {parts}"
            )
        found[name] = (tuple(parts), digests)
    return found


def attach(tensors: Mapping[str, Any], metadata: Mapping[str, str], bad: Any) -> None:
    """Gives each of a file's `tensors` (its :class:`~taktiny.io.Tensor` handles) the digest
    and the tile digests its header `metadata` records, if any; `bad(why)` makes the error
    for a malformed record."""
    text, tiled = metadata.get(KEY), metadata.get(TILES_KEY)
    try:
        digests = {} if text is None else parse(text, tensors)
        grids = {} if tiled is None else parse_tiles(tiled, tensors)
    except ValueError as error:
        raise bad(f"{error}; the header is corrupt.") from None
    for name, hexdigest in digests.items():
        tensor = tensors[name]
        tensor.checksum = hexdigest
        stored = getattr(tensor, "stored", None)  # a packed tensor's bytes
        if stored is not None:
            stored.checksum = hexdigest
    for name, tiles_of in grids.items():
        getattr(tensors[name], "stored", tensors[name]).tiles = tiles_of


def header_record(metadata: Mapping[str, str]) -> str:
    """The value of ``"taktiny_header_checksums"`` for a header whose other metadata is
    `metadata`: each entry's digest, the digest of those digests, and a placeholder for
    the header's own (32 hex digits unique to this save), which :func:`sealed` replaces
    once the file is written."""
    import uuid  # (only a save needs it)

    entries = {key: digest(value.encode()) for key, value in metadata.items()}
    value = {
        "algorithm": ALGORITHM,
        "header": uuid.uuid4().hex,
        "metadata": entries,
        "metadata_digest": _entries_digest(entries),
    }
    return json.dumps(value, separators=(",", ":"))


def _entries_digest(entries: Mapping[str, str]) -> str:
    return digest(json.dumps(entries, separators=(",", ":")).encode())


def sealed(head: bytes, metadata: Mapping[str, str]) -> bytes:
    """`head`, a file's first bytes (its length prefix and header, written with `metadata`,
    which holds a :func:`header_record`), with the header's digest written over the
    record's placeholder: the digest of those bytes with the 32 digits read as zeros."""
    placeholder = json.loads(metadata[HEADER_KEY])["header"].encode()
    at = head.find(placeholder)
    if at < 0 or head.count(placeholder) != 1:  # pragma: no cover - the writer's fault
        raise AssertionError("the header's placeholder digest is not found once")
    return head[:at] + _header_digest(head, at).encode() + head[at + 32 :]


def _header_digest(head: bytes, at: int) -> str:
    """The digest of `head` with the 32 bytes at `at` (where its digest is written) read as
    zeros."""
    stream = streaming()
    view = memoryview(head)
    stream.update(view[:at])
    stream.update(b"0" * 32)
    stream.update(view[at + 32 :])
    return stream.hexdigest()


def header_problem(
    prefix: bytes, text: bytes, metadata: Mapping[str, str], own: Sequence[str]
) -> str | None:
    """What is wrong with a header Taktiny wrote, or None: `prefix` and `text` are the
    file's first bytes (its length prefix, its header), `metadata` the header's, `own`
    Taktiny's metadata keys.

    A header Taktiny sealed (:func:`sealed`) must hash to the digest it records; when it does
    not, its metadata entries are checked against their digests, to name the one that
    changed. A header without a record (another program's, or an older Taktiny's) has
    nothing to hash against, but one of Taktiny's keys a bit away from its name (the
    record's own name damaged, say) is damage all the same."""
    stored = metadata.get(HEADER_KEY)
    if stored is None:
        return _renamed(metadata, own)
    try:
        record = json.loads(stored)
        recorded, entries = record["header"], record["metadata"]
        if (
            set(record) != {"algorithm", "header", "metadata", "metadata_digest"}
            or record["algorithm"] != ALGORITHM
            or not isinstance(recorded, str)
            or not _HEX.fullmatch(recorded)
            or not isinstance(entries, dict)
            or record["metadata_digest"] != _entries_digest(entries)
        ):
            raise ValueError
    except (ValueError, TypeError, KeyError, RecursionError):
        return (
            f"the header is damaged: its record {HEADER_KEY!r} (the digests of the header "
            f"and of its metadata) is not one Taktiny wrote. {_RESTORE}"
        )
    head = prefix + text
    at = head.find(recorded.encode())
    got = _header_digest(head, at) if at >= 0 and head.count(recorded.encode()) == 1 else None
    if got == recorded:
        return None
    hashed = f"hash to {got}" if got else "do not hold that digest once"
    return (
        f"the header is damaged: its bytes {hashed}, and it records {recorded} "
        f"({HEADER_KEY!r}, {ALGORITHM}); {_where(metadata, entries)}. {_RESTORE}"
    )


def _where(metadata: Mapping[str, str], entries: Mapping[str, str]) -> str:
    """Where a sealed header whose bytes do not hash to its digest changed, told by its
    metadata `entries` ({key: the digest of its value}, as written)."""
    others = {key: value for key, value in metadata.items() if key != HEADER_KEY}
    extra = [key for key in others if key not in entries]
    lacking = [key for key in entries if key not in others]
    found = []
    for key in extra:
        was = next((name for name in lacking if _one_bit(key, name)), None)
        if was is not None:
            found.append(f"its metadata entry {key!r} was written as {was!r}: its name is damaged")
            lacking.remove(was)
        else:
            found.append(f"its metadata entry {key!r} is not one Taktiny wrote")
    found += [f"it lacks the metadata entry {key!r} that Taktiny wrote" for key in lacking]
    found += [
        _changed(key)
        for key, value in others.items()
        if key in entries and digest(value.encode()) != entries[key]
    ]
    return "; ".join(found) or (
        "its metadata entries are as Taktiny wrote them, so the damage lies in a tensor's "
        "entry, in the JSON around the entries, or in the header's recorded digest"
    )


_RESTORE = (
    "The file changed after it was written (a bad disk, an interrupted copy), or another "
    "program rewrote its header; copy it again or write it again."
)


def _changed(key: str) -> str:
    """The damage to the metadata entry `key`, whose value does not hash to its digest."""
    if key == KEY:
        return (
            f"the checksums it records for its tensors ({KEY!r}) are not those Taktiny wrote: "
            f"that record is damaged, not (as far as the header tells) the tensors' bytes"
        )
    if key == TILES_KEY:
        return (
            f"the checksums it records for its tensors' tiles ({TILES_KEY!r}) are not those "
            f"Taktiny wrote: that record is damaged, not (as far as the header tells) the "
            f"tensors' bytes"
        )
    return f"its metadata entry {key!r} is not the one Taktiny wrote"


def _renamed(metadata: Mapping[str, str], own: Sequence[str]) -> str | None:
    """The damage in a header whose metadata holds a key one bit from one of Taktiny's
    `own` keys (which it lacks), when it also holds one of them; None otherwise."""
    if not any(key in metadata for key in own):
        return None  # another program's file
    for key in metadata:
        for name in own:
            if name not in metadata and _one_bit(key, name):
                return (
                    f"the header is damaged: its metadata holds {key!r}, one bit from "
                    f"Taktiny's {name!r}, which it lacks: that entry's name is damaged. "
                    f"{_RESTORE}"
                )
    return None


def _one_bit(a: str, b: str) -> bool:
    """Whether `a` and `b` differ in exactly one bit of their UTF-8 bytes."""
    x, y = a.encode(), b.encode()
    return len(x) == len(y) and sum((p ^ q).bit_count() for p, q in zip(x, y, strict=True)) == 1
