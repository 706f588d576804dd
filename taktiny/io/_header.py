"""One safetensors file's header, read and checked: an 8-byte little-endian header length,
a JSON header naming each tensor's dtype, shape and byte range, then the bytes. Every entry
is checked against the file's size and the others' ranges, and the tensors the metadata
lists as packed 4-bit tensors are presented as such.

Whatever the bytes, the result is a checked header or one `SafetensorsError`: the header
must be UTF-8 JSON (no deeper than Python's JSON parser goes, no name twice), each entry an
object of a known dtype, a shape of at most 64 ints below 2**63 whose bytes are fewer than
2**63 (a zero axis counted as one: NumPy makes no array, empty or not, whose other axes'
bytes overflow), and data_offsets of two ints; the metadata maps strings to strings; and the
tensors' byte ranges cover the data exactly, as the safetensors library requires (no
overlaps, no gaps, nothing after the last). A header of 100,000 tensors is checked in a
few passes of C-level work (bulk type and range checks over all entries at once); only a
header that fails them is walked entry by entry, to name the first bad entry.
"""

from __future__ import annotations

import itertools
import json
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._messages import short
from ..quant import PACKED, QUANTIZED, packed_record, packed_shape
from . import _checksum
from ._dtypes import CODES
from ._errors import SafetensorsError
from ._read import Packed, Tensor
from ._storage import open_storage, read_range

if TYPE_CHECKING:
    from ._object_store import Url

_KNOWN = frozenset(CODES)  # the dtype codes a header may give (see _dtypes)
_DTYPE, _SHAPE = operator.itemgetter("dtype"), operator.itemgetter("shape")
_OFFSETS = operator.itemgetter("data_offsets")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_NBYTES = operator.attrgetter("nbytes")
SCHEMA_KEY = "taktiny_schema"  # state._schema.KEY (whose module imports JAX)
# Taktiny's own metadata keys
_OWN = (
    *(_checksum.KEY, _checksum.TILES_KEY, _checksum.HEADER_KEY, PACKED, QUANTIZED),
    *(SCHEMA_KEY, "taktiny_version"),
)
# The safetensors library's own limit on a header: MAX_HEADER_SIZE in its Rust crate
# (huggingface/safetensors, safetensors/src/tensor.rs), which refuses a longer one before
# reading it.
HEADER_LIMIT = 100_000_000
MAX_RANK = 64  # NumPy's most axes
_CONTAINERS_PER_ENTRY, _SPARE_CONTAINERS = 8, 1_000_000  # JSON lists and objects a header may hold
LIMIT = 2**63  # dims, element counts and byte offsets stay below it (int64, as NumPy)
_ENTRY = (
    'an entry is {"dtype": a safetensors dtype, "shape": a list of at most 64 ints from 0 '
    'to 2**63 - 1, "data_offsets": [begin, end], two such ints}'
)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a name given twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the name {key!r} appears twice")
            seen.add(key)
    return out


def parse_json(text: bytes, what: str) -> Any:
    """`text` parsed as UTF-8 JSON with every object's names unique; raises ValueError
    saying what is wrong with it (`what` names it: "the header")."""
    try:
        return json.loads(text.decode("utf-8"), object_pairs_hook=_unique)
    except RecursionError:
        raise ValueError(
            f"{what} is not valid: it nests lists or objects deeper than Python's JSON parser goes"
        ) from None
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError among them
        raise ValueError(f"{what} is not valid: {error}") from None


def unpaired_surrogate(strings: list[str]) -> str | None:
    """The first of `strings` that is no Unicode text (JSON's ``\\ud800`` escapes give
    Python strings holding half a surrogate pair, which nothing can encode), or None."""
    try:
        "".join(strings).encode("utf-8")
    except UnicodeEncodeError:
        return next(s for s in strings if not s.isascii() and not _encodes(s))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def count(shape: Any, itemsize: int = 1) -> int:
    """The element count of a checked `shape`: the product of its axes, each below 2**63.
    Raises OverflowError when the bytes of `itemsize`-byte items reach 2**63 with every
    zero axis counted as one: NumPy refuses a shape whose other axes' product times the
    item size overflows its 64-bit size, even when a zero axis makes the array empty."""
    n = itemsize
    for d in shape:
        n *= d or 1
        if n >= LIMIT:
            raise OverflowError
    return 0 if 0 in shape else n // itemsize


def _problem(name: str, entry: Any) -> str | None:
    """What is wrong with one header entry on its own, or None."""
    if type(entry) is not dict:
        return f"the header entry of {name!r} is {short(entry)}, not an object; {_ENTRY}."
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if type(dtype) is not str or type(shape) is not list or type(offsets) is not list:
        return f"the header entry of {name!r} is {short(entry)}; {_ENTRY}."
    if len(shape) > MAX_RANK:
        return (
            f"{name!r} has {len(shape)} axes, more than the {MAX_RANK} NumPy allows; the header "
            f"is corrupt."
        )
    if len(offsets) != 2 or not all(type(n) is int and 0 <= n < LIMIT for n in (*shape, *offsets)):
        return f"the header entry of {name!r} is {short(entry)}; {_ENTRY}."
    if dtype not in CODES:
        return (
            f"{name!r} has the dtype {short(dtype)}, which Taktiny cannot read; it reads "
            f"{sorted(CODES)}."
        )
    overflow = _overflow(name, shape, dtype)
    if overflow:
        return overflow
    begin, end = offsets
    if begin > end:
        return f"{name!r} has data_offsets [{begin}, {end}], which end before they begin."
    return None


def _overflow(name: str, shape: Any, dtype: str) -> str | None:
    """Why the checked `shape` of `dtype` (a code) is no array's, or None: its element
    count, or its size in bytes, reaches 2**63 (each with zero axes counted as one)."""
    try:
        count(shape, CODES[dtype][1])
    except OverflowError:
        try:
            count(shape)
        except OverflowError:
            return (
                f"{name!r} has the shape {short(shape)}, whose element count reaches 2**63; "
                f"the header is corrupt."
            )
        return (
            f"{name!r} has the shape {short(shape)} of {dtype} ({CODES[dtype][1]} bytes an "
            f"element), whose size reaches 2**63 bytes with its zero axes counted as one: "
            f"NumPy makes no array of that shape, not even an empty one; the header is corrupt."
        )
    return None


def _disagrees(tensor: Tensor, dtype: str, begin: int, end: int) -> str:
    if begin > end:
        return f"{tensor.name!r} has data_offsets [{begin}, {end}], which end before they begin."
    return (
        f"the header gives {tensor.name!r} the shape {list(tensor.shape)} of {dtype} "
        f"({tensor.nbytes} bytes) but {end - begin} bytes [{begin}, {end}); the header "
        f"disagrees with its bytes."
    )


def _torch_kind(prefix: bytes) -> str:
    """What a file whose first bytes are `prefix` is, when they are those of a PyTorch
    checkpoint: a zip archive (what ``torch.save`` writes) or a pickle (its legacy
    format); "" for any other file."""
    if prefix[:4] == b"PK\x03\x04":
        return "a zip archive, as torch.save writes"
    if prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a pickle, torch.save's legacy format"
    return ""


def read_header(file: Path | Url) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors a safetensors file's header describes, in the order of their bytes,
    and its metadata; every entry checked against the file's size. The file (or object)
    is opened once, and its tensors read through that storage (`open_storage`). Raises
    FileNotFoundError when it is gone."""
    held = open_storage(file)  # (the tensors read through it: the file as it is now)
    size = held.size

    def bad(why: str) -> SafetensorsError:
        return SafetensorsError(f"{file}: {why}")

    prefix = read_range(held, 0, 8)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 < length <= min(size - 8, HEADER_LIMIT):
        kind = _torch_kind(prefix)
        if kind:
            raise bad(
                f"not a safetensors file but, by its first bytes, a PyTorch file ({kind}): "
                f"read it with taktiny.io.read_torch(path), which loads its tensors "
                f"without running code, and load the result with load_state_dict or "
                f"taktiny.convert."
            )
        raise bad(
            f"not a safetensors file: its first 8 bytes give a header of {length} bytes, "
            f"and the file has {size}"
            + (
                f"; a header may have at most {HEADER_LIMIT} bytes (the safetensors "
                f"library's limit). The file is corrupt."
                if length > HEADER_LIMIT
                else ". It is truncated or of another format."
            )
        )
    text = read_range(held, 8, length)
    data, start = size - 8 - length, 8 + length
    names, dtypes, shapes, ranges, metadata = _fields(text, bad)
    begins, ends = list(map(_FIRST, ranges)), list(map(_SECOND, ranges))
    tensors = list(
        map(
            Tensor,
            names,
            map(tuple, shapes),
            dtypes,  # codes: each NumPy dtype is made when the tensor is first asked for it
            itertools.repeat(file),
            map(start.__add__, begins),
        )
    )
    sizes = list(map(_NBYTES, tensors))
    if sizes != list(map(operator.sub, ends, begins)):
        for tensor, dtype, begin, end in zip(tensors, dtypes, begins, ends, strict=True):
            if end - begin != tensor.nbytes:
                raise bad(
                    _overflow(tensor.name, list(tensor.shape), dtype)
                    or _disagrees(tensor, dtype, begin, end)
                )
    if 0 in sizes:  # a tensor of no bytes may still claim axes whose product overflows
        for tensor, dtype, n in zip(tensors, dtypes, sizes, strict=True):
            if not n and (problem := _overflow(tensor.name, list(tensor.shape), dtype)):
                raise bad(problem)
    if _covers(begins, ends, data):  # in the header's order, as writers write it
        found = dict(zip(names, tensors, strict=True))
    else:
        order = sorted(zip(begins, ends, range(len(tensors)), strict=True))
        if not _covers([b for b, _, _ in order], [e for _, e, _ in order], data):
            _uncovered(order, tensors, ends, data, bad)
        found = {tensors[k].name: tensors[k] for _, _, k in order}
    for tensor in tensors:
        tensor._held = held
    if problem := _checksum.header_problem(prefix, text, metadata, _OWN):
        raise bad(problem)  # (before its records are read: it names the damaged one)
    found = _unpacked(found, metadata.get(PACKED), bad)
    _checksum.attach(found, metadata, bad)  # (the lead's: keep it)
    return found, metadata


_Fields = tuple[list[str], Sequence[str], Sequence[list[int]], Sequence[list[int]], dict[str, str]]


def _fields(text: bytes, bad: Any) -> _Fields:
    """The header's names, dtypes, shapes, byte ranges and metadata, each entry checked on
    its own; raises for the first that is wrong, in the header's order."""
    # Before parsing: a header's lists and objects are its entries' (three each) and a few
    # in metadata strings (Taktiny's own: two per tensor at most). One made of little else
    # (``[[],[],...]``: 100 MB of it parses into 2.5 GB of Python lists) is refused at once.
    # (Counted only where the bytes per entry are many more than an entry takes, ~100.)
    entries = text.count(b'"data_offsets"')
    if len(text) < _SPARE_CONTAINERS or len(text) < 400 * entries:
        containers = 0
    else:
        containers = text.count(b"[") + text.count(b"{")
    if containers > _CONTAINERS_PER_ENTRY * entries + _SPARE_CONTAINERS:
        raise bad(
            f"the header holds {containers:,} JSON lists and objects for {entries:,} tensor "
            f"entries; a safetensors header holds a few per entry. The file is corrupt, or "
            f"not a checkpoint."
        )
    if b"\\" not in text and (fields := _unhooked(text)) is not None:
        return fields
    try:
        header = parse_json(text, "the header")
        if type(header) is not dict:
            raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    except ValueError as error:
        raise bad(f"{error}. The file is corrupt.") from None
    metadata = _metadata(header.pop("__metadata__", None), bad)
    names, entries = list(header), list(header.values())
    if (unpaired := unpaired_surrogate([*names, *metadata, *metadata.values()])) is not None:
        raise bad(
            f"the header holds the string {unpaired!r}, which has a lone surrogate (a \\u "
            f"escape of half a UTF-16 pair): it is no Unicode text. The file is corrupt."
        )
    checked = _bulk(entries)
    if checked is not None:
        return (names, *checked, metadata)
    for name, entry in zip(names, entries, strict=True):
        problem = _problem(name, entry)
        if problem is not None:
            raise bad(problem)
    raise AssertionError("a header failed its bulk checks, but no entry is wrong")


def _bulk(entries: list[Any]) -> tuple[Sequence[str], Sequence[Any], Sequence[Any]] | None:
    """The entries' dtypes, shapes and byte ranges when every entry passes `_problem`'s
    checks, made in bulk (C-level passes over all entries at once); None otherwise."""
    try:
        dtypes, shapes = list(map(_DTYPE, entries)), list(map(_SHAPE, entries))
        ranges = list(map(_OFFSETS, entries))
        numbers = [*itertools.chain.from_iterable(shapes), *itertools.chain.from_iterable(ranges)]
        if (
            set(map(type, entries)) <= {dict}
            and set(map(type, dtypes)) <= {str}
            and set(dtypes) <= _KNOWN
            and set(map(type, shapes)) <= {list}
            and set(map(type, ranges)) <= {list}
            and max(map(len, shapes), default=0) <= MAX_RANK
            and set(map(len, ranges)) <= {2}
            and set(map(type, numbers)) <= {int}
            and min(numbers, default=0) >= 0
            and max(numbers, default=0) < LIMIT
        ):
            return dtypes, shapes, ranges
    except (KeyError, TypeError, ValueError):
        pass
    return None


def _unhooked(text: bytes) -> _Fields | None:
    """The fields of a good header without a backslash, parsed without an
    ``object_pairs_hook`` (which costs a fifth of a large header's time); None for any
    other header, which `_fields` parses again with the hook, for its checks and messages.

    The hook refuses a name given twice, which the plain parser lets pass (the last value
    winning), so this proves that no pair was lost. Without a backslash no string has an
    escape, so the text holds one colon per pair of every object, plus those inside its
    strings. It counts the pairs and strings it kept: the header's names, the metadata's
    pairs, and each entry's three (entries of exactly three, whose values are a known
    dtype and lists of ints: no colon, no object). A pair given twice is a colon that no
    dict kept, so the counts differ."""
    try:
        header = json.loads(text.decode("utf-8"))
        had = "__metadata__" in header
        metadata = header.pop("__metadata__", {})
        names, entries = list(header), list(header.values())
        checked = _bulk(entries)
        if (
            checked is None
            or type(metadata) is not dict
            or not set(map(type, metadata.values())) <= {str}
            or not set(map(len, entries)) <= {3}
        ):
            return None
        strings = "".join([*names, *metadata, *metadata.values()])
        if text.count(b":") != 4 * len(names) + had + len(metadata) + strings.count(":"):
            return None
    except (RecursionError, ValueError, TypeError, AttributeError):
        return None
    return (names, *checked, metadata)


def _covers(begins: list[int], ends: list[int], data: int) -> bool:
    """Whether byte ranges, in this order, cover the data exactly, one after the other."""
    return begins[:1] in ([], [0]) and begins[1:] == ends[:-1] and (ends[-1:] or [0]) == [data]


def _uncovered(
    order: list[tuple[int, int, int]], tensors: list[Tensor], ends: list[int], data: int, bad: Any
) -> None:
    """Raises for the byte ranges `order` ((begin, end, index), sorted), which do not cover
    the data exactly: a range past its end, overlaps, gaps, bytes after the last."""
    for tensor, end in zip(tensors, ends, strict=True):
        if end > data:
            raise bad(
                f"the bytes of {tensor.name!r} run to {end}, past the end of the data ({data} "
                f"bytes): the file is truncated."
            )
    for (_, end, i), (begin, _, j) in itertools.pairwise(order):
        if begin < end:
            a, b = tensors[i].name, tensors[j].name
            raise bad(f"the bytes of {a!r} and {b!r} overlap; the file is corrupt.")
    if not order:
        raise bad(
            f"the header lists no tensors, but the data holds {data} bytes; the tensors' "
            f"ranges must cover the data exactly. The file is corrupt."
        )
    at, last = 0, None
    for begin, end, k in order:
        if begin > at:
            after = f"after {tensors[last].name!r}" if last is not None else "at its start"
            raise bad(
                f"the data holds {begin - at} bytes [{at}, {begin}) {after} that no tensor's "
                f"data_offsets cover; the tensors' ranges must cover the data exactly. The "
                f"file is corrupt."
            )
        at, last = end, k
    raise bad(
        f"the data holds {data - at} bytes [{at}, {data}) after the last tensor that no "
        f"tensor's data_offsets cover; the tensors' ranges must cover the data exactly. The "
        f"file is corrupt or was appended to."
    )


def _metadata(metadata: Any, bad: Any) -> dict[str, str]:
    """The header's ``__metadata__``: absent or null, or an object of strings to strings."""
    if metadata is None:
        return {}
    if type(metadata) is not dict:
        raise bad(
            f"the header's __metadata__ is {short(metadata)}, not an object; the metadata "
            f"maps strings to strings. The file is corrupt."
        )
    if not set(map(type, metadata.values())) <= {str}:
        key, value = next((k, v) for k, v in metadata.items() if type(v) is not str)
        raise bad(
            f"the header's __metadata__ gives {key!r} the value {short(value)}, which is no "
            f"string; the metadata maps strings to strings. The file is corrupt."
        )
    return metadata


def _unpacked(tensors: dict[str, Tensor], packed: str | None, bad: Any) -> dict[str, Tensor]:
    """`tensors` with those the metadata lists as packed 4-bit tensors presented as such."""
    if packed is None:
        return tensors
    try:
        records = packed_record(PACKED, packed)
    except ValueError as error:
        raise bad(f"{error}; the header is corrupt.") from None
    for name, (dtype, shape) in records.items():
        stored = tensors.get(name)
        want = packed_shape(shape)
        if stored is None:
            raise bad(
                f"the metadata {PACKED!r} lists {name!r} as a packed {dtype.name}{list(shape)}, "
                f"but the file holds no tensor of that name; the header is inconsistent."
            )
        if stored.dtype_name != "uint8" or stored.shape != want:
            raise bad(
                f"the metadata {PACKED!r} lists {name!r} as {dtype.name}{list(shape)} packed "
                f"two per byte, which is stored as uint8{list(want)}, but the file holds "
                f"{stored.dtype_name}{list(stored.shape)}; the header is inconsistent."
            )
        try:  # unpacked through a buffer of two bytes for each byte stored
            count(want, 2)
        except OverflowError:
            raise bad(
                f"the metadata {PACKED!r} lists {name!r} as {dtype.name}{short(list(shape))}, "
                f"which is unpacked through two bytes for each byte stored: 2**63 bytes or more "
                f"with its zero axes counted as one. NumPy makes no array of that shape, not "
                f"even an empty one; the header is corrupt."
            ) from None
        unpacked = Packed(name, shape, dtype, stored.file, stored.offset)
        unpacked._held = unpacked.stored._held = stored._held  # (read through its file)
        tensors[name] = unpacked
    return tensors
