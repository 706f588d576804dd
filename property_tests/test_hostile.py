"""Invariant 11: whatever the bytes of a safetensors file or index, opening it either gives
a checkpoint whose tensors read back as the safetensors library reads the same bytes, or
raises one SafetensorsError naming the file; and nothing outside the index's folder is
opened.

The files are valid ones (tensors of several dtypes, zero-size and 0-d ones, odd names,
metadata, the header in any order, written with or without JSON's escapes) with one change:
any JSON value anywhere in the header (an entry, its dtype, shape, offsets or one of their
elements, the metadata, Taktiny's packed and quantized metadata, its tile checksums), hostile shapes (more than
64 axes, a zero axis beside axes whose product overflows), a name given twice, a nesting
bomb, byte ranges moved, header bytes flipped, inserted or cut, data added or cut, a wrong
length prefix. The indexes name their shards with hostile names (NUL bytes, empty, parent
folders, absolute paths, overlong names, symlinks out of the folder and in loops) or hold
any JSON value in place of their parts.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors
from hypothesis import given, settings
from hypothesis import strategies as st

from taktiny.io import SafetensorsError, _checksum, load_safetensors, open_safetensors
from taktiny.io import _checkpoint as checkpoint_module
from taktiny.quant import _format as qz

from .budget import examples

ITEMSIZE = {"F32": 4, "I32": 4, "U8": 1, "BF16": 2, "F16": 2, "I64": 8, "BOOL": 1, "F8_E4M3": 1}
NUMPY = {"F32": np.float32, "I32": np.int32, "U8": np.uint8, "BF16": ml_dtypes.bfloat16,
         "F16": np.float16, "I64": np.int64, "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn}  # fmt: skip
NAMES = ("a", "b", "w.kernel", "0", "", "é", "a:b", 'q"x', "\\", "\0")
PLAIN = ("a", "b", "w.kernel", "0", "", "é", "a:b", "::")  # no escape in UTF-8 JSON
LOADABLE = {"F32", "I32", "U8", "BF16", "F16"}  # dtypes a JAX leaf holds without x64
BIG = (-1, 0, 1, 2**31, 2**62, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -(2**63))
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.sampled_from(BIG),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.sampled_from(("F32", "U8", "int4", "pt", "\ud800")),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


DEEP = "\x01deep\x01"  # where a nesting bomb goes (JSON escapes it: \u0001deep\u0001)
CHANGES = ("none", "value", "value", "drop", "offsets", "taktiny", "taktiny", "bytes", "deep",
           "data", "prefix", "twice", "twice", "shape", "shape", "metadata")  # fmt: skip
HIDING = ([0, 2**62, 2**62], [0, 2**63 - 1, 2**63 - 1], [2**40, 0, 2**40])  # fmt: skip
SHAPES = ([0, 2**62, 2**62], [0, 2**64], [2**63], [2**32, 2**32], [1] * 65, [0] * 100,
          [True, 2], [2.0], [-1], [], [0], [1, 0, 3])  # fmt: skip


def framed(text: bytes, data: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if length is None else length) + text + data


@st.composite
def valid(draw: Any, plain: bool = False) -> tuple[dict[str, Any], bytes]:
    """A valid header (as a dict, in any order of entries) and its data; `plain`: no
    string that JSON escapes."""
    names = draw(st.lists(st.sampled_from(PLAIN if plain else NAMES), unique=True, max_size=4), label="names")  # fmt: skip
    entries, data = [], b""
    for name in names:
        dtype = draw(st.sampled_from(("U8", *sorted(ITEMSIZE))))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        entries.append((name, {"dtype": dtype, "shape": shape,
                               "data_offsets": [len(data), len(data) + nbytes]}))  # fmt: skip
        data += draw(st.binary(min_size=nbytes, max_size=nbytes))
    entries = draw(st.permutations(entries))
    header: dict[str, Any] = dict(entries)
    text = st.text("abc:é", max_size=3) if plain else st.text(max_size=3)
    metadata = draw(st.none() | st.dictionaries(st.sampled_from(("format", "x")), text, max_size=2))  # fmt: skip
    if metadata is not None:
        header["__metadata__"] = metadata
    return header, data


def _packed(draw: Any, header: dict[str, Any]) -> Any:
    """Taktiny's packed metadata: for a U8 tensor, mostly a record that fits it."""
    names = [n for n, e in header.items() if n != "__metadata__" and e["dtype"] == "U8"]
    if not names or draw(st.integers(0, 3)) == 0:
        return draw(JSON)
    name = draw(st.sampled_from(names))
    stored = header[name]["shape"]
    shape = [] if stored == [1] and draw(st.booleans()) else list(stored)
    if shape:
        shape[-1] = max(0, 2 * shape[-1] - draw(st.integers(0, 1)))
    dtype = draw(st.sampled_from(("int4", "uint4", "float4_e2m1fn", "int4", "int8", ["int4"], {"int4": 4})))  # fmt: skip
    return {name: {"dtype": dtype, "shape": shape if draw(st.integers(0, 4)) else draw(JSON)}}


def _tiles(draw: Any, header: dict[str, Any]) -> Any:
    """Taktiny's tile checksums: any JSON, or a record for one of the tensors whose grid is
    any JSON or any list of ints, and whose digests never fit it (one hex digit too many),
    so that the file is refused when it is opened."""
    names = [n for n in header if n != "__metadata__"]
    if not names or draw(st.integers(0, 3)) == 0:
        return draw(JSON)
    name = draw(st.sampled_from(names))
    grid = draw(st.lists(st.integers(-1, 9), max_size=4) | JSON)
    count = math.prod(grid) if isinstance(grid, list) and all(type(g) is int for g in grid) else 1
    digests = "0" * (32 * max(0, min(count, 100)) + 1)
    return {"algorithm": "xxh3_128", "tensors": {name: {"grid": grid, "digests": digests}}}


@st.composite
def hostile_files(draw: Any) -> tuple[bytes, str]:
    """The bytes of a valid file with one change, and what the change was."""
    change = draw(st.sampled_from(CHANGES), label="change")
    header, data = draw(valid(plain=change == "twice"), label="valid")
    names = [n for n in header if n != "__metadata__"]
    length = None
    if change == "value" and names:  # any JSON value at any place of an entry
        name = draw(st.sampled_from(names))
        entry = header[name]
        where = draw(st.sampled_from(("entry", "dtype", "shape", "data_offsets", "shape[i]", "offsets[i]", "metadata", "metadata[k]")))  # fmt: skip
        value = draw(st.sampled_from(SHAPES) if where == "shape" else JSON)
        if where == "entry":
            header[name] = value
        elif where in ("dtype", "shape", "data_offsets"):
            entry[where] = value
        elif where == "shape[i]" and entry["shape"]:
            entry["shape"][draw(st.integers(0, len(entry["shape"]) - 1))] = value
        elif where == "offsets[i]":
            entry["data_offsets"][draw(st.integers(0, 1))] = value
        elif where == "metadata":
            header["__metadata__"] = value
        else:
            header.setdefault("__metadata__", {})
            if isinstance(header["__metadata__"], dict):
                header["__metadata__"][draw(st.sampled_from(("format", "k")))] = value
    elif change == "shape" and (not names or draw(st.booleans())):  # a zero-size tensor
        end = len(data)  # of axes whose product overflows, or another hostile shape
        shapes = [*HIDING, [0, 2**64], [2**63, 0], [0] * 65, [0, 3], [0, 2**62], [0, 2**61 - 1]]
        shape = draw(st.sampled_from(shapes))  # (the last two: 2**64 and 2**63 - 4 bytes)
        header["z"] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end]}
    elif change == "shape":  # hostile shapes of the same element count
        entry = header[draw(st.sampled_from(names))]
        shape = entry["shape"]
        options = [[1] * 65 + shape, [1] * (64 - len(shape)) + shape, [math.prod(shape)]]
        if not math.prod(shape):
            options += HIDING
        entry["shape"] = draw(st.sampled_from(options))
    elif change == "metadata":  # any JSON value for a metadata value
        metadata = header.setdefault("__metadata__", {})
        metadata[draw(st.sampled_from(("format", "x", "k")))] = draw(JSON)
    elif change == "deep":  # a nesting bomb in place of a value
        key = draw(st.sampled_from([*names, "__metadata__"]))
        if key in header and draw(st.booleans()):
            header[key][draw(st.sampled_from(("dtype", "shape", "data_offsets")))] = DEEP
        else:
            header[key] = DEEP
    elif change == "drop" and names:
        name = draw(st.sampled_from(names))
        del header[name][draw(st.sampled_from(("dtype", "shape", "data_offsets")))]
    elif change == "offsets" and names:  # byte ranges moved: gaps, overlaps, past the end
        entry = header[draw(st.sampled_from(names))]
        for i in (0, 1):
            entry["data_offsets"][i] = max(0, entry["data_offsets"][i] + draw(st.integers(-4, 4)))
    elif change == "taktiny":
        key = draw(st.sampled_from((qz.PACKED, qz.PACKED, qz.QUANTIZED, _checksum.TILES_KEY)))
        record = (
            _packed(draw, header)
            if key == qz.PACKED
            else _tiles(draw, header)
            if key == _checksum.TILES_KEY
            else draw(JSON)
        )
        text = json.dumps(record) if draw(st.integers(0, 5)) else draw(st.text(max_size=6))
        header.setdefault("__metadata__", {})[key] = text
    ascii_ = draw(st.booleans())  # escapes for all but ASCII, or UTF-8 as Rust writes it
    text = json.dumps(header, ensure_ascii=ascii_).encode("utf-8", "surrogatepass")
    bomb = draw(st.sampled_from((b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"0" + b"}" * 50_000)))  # fmt: skip
    text = text.replace(json.dumps(DEEP).encode(), bomb)
    if change == "twice" and not names:
        change = "none"
    if change == "twice":  # a name given twice: the same entry, or another value
        name = draw(st.sampled_from(names))
        again = header[name] if draw(st.booleans()) else draw(JSON)
        pair = json.dumps({name: again}, ensure_ascii=ascii_).encode("utf-8", "surrogatepass")[1:-1]
        try:
            pair.decode("utf-8")
        except UnicodeDecodeError:  # a lone surrogate in the value: escaped, so that the
            pair = json.dumps({name: again}).encode()[1:-1]  # name twice is the only change
        at = draw(st.sampled_from(("first", "last")))
        text = b"{" + pair + b", " + text[1:] if at == "first" else text[:-1] + b", " + pair + b"}"
    elif change == "bytes":  # the header's bytes flipped, inserted, cut, or a nesting bomb
        how = draw(st.sampled_from(("flip", "insert", "cut", "bomb")))
        colons = [i + 1 for i, c in enumerate(text) if c == ord(":")]
        if how == "bomb" and colons and draw(st.booleans()):  # in place of a value
            at = draw(st.sampled_from(colons))
        else:
            at = draw(st.integers(0, len(text)))
        if how == "flip" and at < len(text):
            text = text[:at] + bytes([draw(st.integers(0, 255))]) + text[at + 1 :]
        elif how == "insert":
            text = text[:at] + draw(st.binary(min_size=1, max_size=3)) + text[at:]
        elif how == "cut":
            text = text[:at] + text[at + draw(st.integers(1, 4)) :]
        else:
            text = text[:at] + b"[" * 5000 + text[at:]
        if draw(st.booleans()):  # the prefix left as it was
            length = len(json.dumps(header, ensure_ascii=ascii_).encode("utf-8", "surrogatepass"))
    elif change == "data":
        cut = draw(st.integers(-4, 4))
        data = data[:cut] if cut < 0 else data + bytes(cut)
    elif change == "prefix":
        length = min(2**64 - 1, max(0, len(text) + draw(st.integers(-3, 3) | st.sampled_from((2**63, 2**64)))))  # fmt: skip
    return framed(text, data, length), change


def same_as_the_library(checkpoint: Any, raw: bytes) -> None:
    """Every tensor of an opened checkpoint is what the safetensors library reads from the
    same bytes (its stored bytes, dtype and shape; a packed tensor's stored uint8 bytes),
    read whole and by a block."""
    library = dict(safetensors.deserialize(raw))
    assert sorted(checkpoint) == sorted(library)
    for name, tensor in checkpoint.items():
        theirs = library[name]
        stored = tensor.stored if tensor.packed else tensor
        # NumPy's bounds, zero axes or not: 64 axes, and fewer than 2**63 bytes with every
        # zero axis counted as one (a packed tensor unpacks through two bytes a byte stored)
        unpacked = (stored.shape, 2) if tensor.packed else (tensor.shape, tensor.dtype.itemsize)
        for shape, itemsize in ((stored.shape, stored.dtype.itemsize), unpacked):
            assert len(shape) <= 64 and math.prod(d or 1 for d in shape) * itemsize < 2**63, shape
        assert stored.dtype == np.dtype(NUMPY.get(theirs["dtype"], np.uint8)), name
        assert list(stored.shape) == theirs["shape"], name
        expected = np.frombuffer(bytes(theirs["data"]), stored.dtype).reshape(stored.shape)
        assert np.asarray(stored).tobytes() == expected.tobytes(), name
        if tensor.packed:
            last = tensor.shape[-1] if tensor.shape else 1
            unpacked = qz.unpack(expected.reshape(stored.shape), tensor.dtype, 0, last)
            assert np.asarray(tensor).tobytes() == unpacked.tobytes(), name
        elif expected.ndim and expected.size:
            block = (slice(expected.shape[0] - 1, None), *[slice(None)] * (expected.ndim - 1))
            assert tensor.read(block).tobytes() == expected[block].tobytes(), name


def _loads(checkpoint: Any, path: Path) -> None:
    """A checkpoint of plain names and JAX dtypes loads into a concrete and an abstract
    target, bit for bit."""
    tensors = {n: np.asarray(t) for n, t in checkpoint.items()}
    if not all(n.isidentifier() and t.dtype.name in ("float32", "int32", "uint8", "bfloat16", "float16") for n, t in tensors.items()):  # fmt: skip
        return
    target = {n: jax.numpy.zeros(t.shape, t.dtype) for n, t in tensors.items()}
    for model in (target, jax.eval_shape(lambda: target)):
        loaded = load_safetensors(model, path, progress=False)
        assert {n: np.asarray(v).tobytes() for n, v in loaded.items()} == {
            n: t.tobytes() for n, t in tensors.items()
        }


@settings(max_examples=examples(200))
@given(case=hostile_files())
def test_any_header_opens_as_the_library_reads_it_or_is_refused_by_name(case, tmp_path_factory):
    """A file with any one change to a valid header or its bytes either opens, holding what
    ``safetensors.deserialize`` reads from the same bytes (read whole and by a block, a
    packed tensor unpacked from its bytes; a file of plain names loads bit for bit into a
    concrete and an abstract target), or raises a SafetensorsError (opening and loading
    alike) whose one line starts with the file's name. A valid file always opens.

    Seen to catch (each by hand, in the ``ci`` profile): a header check dropped (the
    ranges' cover, the rank bound, the element-count bound, the metadata's string values),
    the proof that no name was given twice dropped from the parse without a hook, and the
    recursion limit not caught (a RecursionError)."""
    raw, change = case
    path = tmp_path_factory.mktemp("hostile") / "model.safetensors"
    path.write_bytes(raw)
    try:
        checkpoint = open_safetensors(path)
    except SafetensorsError as error:
        assert change != "none", error
        message = str(error)
        assert message.startswith(f"{path}: ") and "\n" not in message, message
        if change == "twice":
            assert "appears twice" in message, message
        with pytest.raises(SafetensorsError, match="^" + re.escape(message) + "$"):
            load_safetensors({}, path, progress=False)
        return
    assert change != "twice", "a name given twice was let through"
    same_as_the_library(checkpoint, raw)
    _loads(checkpoint, path)


SHARD_NAMES = ("", "\0", "a\0b.safetensors", ".", "..", "../outside.safetensors", "/etc/passwd",
               "x" * 300, "sub/../s0.safetensors", "./s0.safetensors", "loop.safetensors",
               "out.safetensors", "in.safetensors", "missing.safetensors", "s1.safetensors",
               "s0.safetensors", "\ud800.safetensors", "folder")  # fmt: skip


def _shard(names: list[str]) -> bytes:
    header = {n: {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]}
              for i, n in enumerate(names)}  # fmt: skip
    values = np.arange(2 * len(names), dtype=np.float32) + 10 * len(names)
    return framed(json.dumps(header).encode(), values.tobytes())


@st.composite
def hostile_indexes(draw: Any) -> tuple[dict[str, list[str]], bytes, str]:
    """Shards {file: its tensor names} and the bytes of their index with one change."""
    count = draw(st.integers(1, 3))
    tensors = [f"t{i}" for i in range(draw(st.integers(count, 5)))]
    shards: dict[str, list[str]] = {f"s{k}.safetensors": [] for k in range(count)}
    for i, name in enumerate(tensors):
        shards[f"s{i % count}.safetensors" if i < count else draw(st.sampled_from(sorted(shards)))].append(name)  # fmt: skip
    content: Any = {"metadata": {"total_size": 8 * len(tensors)},
                    "weight_map": {n: s for s, ns in shards.items() for n in ns}}  # fmt: skip
    change = draw(st.sampled_from(("none", "shard", "shard", "shard", "json shard", "value", "bytes")))  # fmt: skip
    if change in ("shard", "json shard"):  # a hostile shard name, or any JSON value for it
        name = draw(st.sampled_from(tensors))
        content["weight_map"][name] = draw(st.sampled_from(SHARD_NAMES) if change == "shard" else JSON)  # fmt: skip
    elif change == "value":
        where = draw(st.sampled_from(("index", "weight_map", "metadata", "extra name")))
        value = draw(JSON)
        if where == "index":
            content = value
        elif where == "extra name":
            content["weight_map"][draw(st.text(max_size=3))] = value
        else:
            content[where] = value
    text = json.dumps(content).encode()
    if change == "bytes":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from((b"\\", b"[" * 5000, b"\xff", b",", b'"'))) + text[at:]  # fmt: skip
    return shards, text, change


@settings(max_examples=examples(150))
@given(case=hostile_indexes())
def test_any_index_opens_its_own_shards_or_is_refused_by_name(case, tmp_path_factory):
    """An index with any hostile shard name or JSON value either opens, every tensor it lists
    read from a shard inside its folder as the safetensors library reads that shard, or
    raises a SafetensorsError starting with the name of the index or of one of its shards;
    no file outside the folder is opened either way (a valid file sits beside the folder,
    and symlinks point at it), and an unchanged index always opens.

    Seen to catch: the folder check dropped (``../outside.safetensors`` and the symlink out
    are opened); resolving without catching (a symlink loop is a RuntimeError, a NUL byte a
    ValueError, an overlong name an OSError)."""
    shards, text, change = case
    root = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
    try:
        folder = root / "checkpoint"
        folder.mkdir()
        (root / "outside.safetensors").write_bytes(_shard(["t0", "t1", "t2", "t3", "t4"]))
        for file, names in shards.items():
            (folder / file).write_bytes(_shard(names))
        (folder / "folder").mkdir()
        os.symlink("loop.safetensors", folder / "loop.safetensors")
        os.symlink("../outside.safetensors", folder / "out.safetensors")
        os.symlink("s0.safetensors", folder / "in.safetensors")
        index = folder / "model.safetensors.index.json"
        index.write_bytes(text)
        opened: list[Path] = []
        header = checkpoint_module.read_header

        def recorded(file: Path) -> Any:
            opened.append(file)
            return header(file)

        inside = folder.resolve()
        with mock.patch.object(checkpoint_module, "read_header", recorded):
            try:
                checkpoint = open_safetensors(index)
            except SafetensorsError as error:
                assert change != "none", error
                message = str(error)
                named = [index, *(folder / f for f in shards)]
                assert any(message.startswith(f"{f}: ") for f in named), message
                assert "\n" not in message, message
                checkpoint = None
        assert all(inside in Path(f).resolve().parents for f in opened), opened
        if checkpoint is None:
            return
        assert set(checkpoint) == set(json.loads(text)["weight_map"])
        for name, tensor in checkpoint.items():
            assert inside in tensor.file.resolve().parents, tensor.file
            theirs = dict(safetensors.deserialize(tensor.file.read_bytes()))[name]
            assert np.asarray(tensor).tobytes() == bytes(theirs["data"]), name
    finally:
        shutil.rmtree(root)
