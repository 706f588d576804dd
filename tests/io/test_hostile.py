"""Hostile files: whatever the bytes, opening, loading and reading a safetensors checkpoint,
`read_torch` and the `taktiny` command either work or refuse with one error that names the
file and says what is wrong; the command prints that one line and exits with 1.

Each case of the tables is a crafted file (or folder); its message is pinned. The files a
valid header may hold however odd (no tensors, zero-size tensors, names of any text) are
the last table, read back byte for byte.
"""

import json
import os
import re
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _child import cpu_environment

from taktiny import _cli
from taktiny.io import (
    SafetensorsError,
    load_safetensors,
    open_safetensors,
    plan_load,
    read_torch,
)
from taktiny.io import _checkpoint as checkpoint_module

LIMIT = 100_000_000  # the most bytes a header may have (safetensors' MAX_HEADER_SIZE)
A = {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}
B = {"dtype": "I32", "shape": [3], "data_offsets": [64, 76]}
VALUES = {"a": np.arange(16, dtype=np.float32).reshape(4, 4), "b": np.arange(3, dtype=np.int32)}
DATA = VALUES["a"].tobytes() + VALUES["b"].tobytes()


def js(value):
    return json.dumps(value).encode()


def framed(text, data=DATA):
    """A safetensors file: the header's length, the header, the data."""
    return struct.pack("<Q", len(text)) + text + data


def header(a=A, b=B, **more):
    """The good header of VALUES, with `a`, `b` or more entries changed."""
    return framed(js({"a": a, "b": b, **more}))


def meta(metadata, **entries):
    return framed(js({"__metadata__": metadata, "a": A, "b": B, **entries}))


def entry(**changes):
    return {**A, **changes}


def zero_size(shape, dtype="F32", b=B, **more):
    """A file whose 'a' is a zero-size tensor of `shape` and whose 'b' covers the data,
    with no gap: nothing wrong but the shape."""
    a = {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}
    return framed(js({**more, "a": a, "b": dict(b, data_offsets=[0, 12])}), VALUES["b"].tobytes())


def deep(n=100_000):
    return b"[" * n + b"]" * n


def packed(record):
    """A file whose 'taktiny_packed' metadata gives 'a' the JSON `record`."""
    return meta({"taktiny_packed": json.dumps({"a": record})})


def quantized(**record):
    layout = {"bits": 8, "axis": 0, "group_size": None, "shape": [4, 4], **record}
    return meta({"taktiny_quantized": json.dumps({"q": layout})})


def parts(value=None, scale=None):
    """A file of the int8 parts of 'q' ([4, 4], one scale per channel along axis 0), its
    layout recorded, with the entry of its value or scale changed."""
    value = {"dtype": "I8", "shape": [4, 4], "data_offsets": [0, 16], **(value or {})}
    scale = {"dtype": "F32", "shape": [1, 4], "data_offsets": [16, 32], **(scale or {})}
    layout = {"bits": 8, "axis": 0, "group_size": None, "shape": [4, 4]}
    metadata = {"taktiny_quantized": json.dumps({"q": layout})}
    return framed(js({"__metadata__": metadata, "q.value": value, "q.scale": scale}), bytes(32))


def sparse(length, size):
    """A file of `size` bytes (a hole: nothing written) whose first 8 give `length`."""

    def make(path):
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", length))
            f.truncate(size)

    return make


ENTRY = r"the header entry of 'a' is .*; an entry is \{\"dtype\""
COVER = r"that no tensor's data_offsets cover; the tensors' ranges must cover the data exactly"

# (id, the file's bytes (or a function making it), what the error says after the file's name)
FILES = [
    # the frame and the JSON
    ("empty file", b"", r"not a safetensors file: its first 8 bytes give a header of -1 bytes, and the file has 0\. It is truncated or of another format\.$"),
    ("zero length", framed(b""), r"not a safetensors file: its first 8 bytes give a header of 0 bytes, and the file has 84\. It is truncated or of another format\.$"),
    ("length past the end", struct.pack("<Q", 2**64 - 1) + b"{}", r"not a safetensors file: its first 8 bytes give a header of 18446744073709551615 bytes, and the file has 10"),
    ("length over the limit", sparse(LIMIT + 1, LIMIT + 16), rf"not a safetensors file: .* bytes, and the file has {LIMIT + 16}; a header may have at most {LIMIT} bytes \(the safetensors library's limit\)\. The file is corrupt\.$"),
    ("length of 100 MiB", sparse(100 * 2**20, 100 * 2**20 + 16), rf"not a safetensors file: its first 8 bytes give a header of {100 * 2**20} bytes, and the file has {100 * 2**20 + 16}; a header may have at most {LIMIT} bytes \(the safetensors library's limit\)\. The file is corrupt\.$"),
    ("length at the limit, past the end", sparse(LIMIT, LIMIT), rf"not a safetensors file: its first 8 bytes give a header of {LIMIT} bytes, and the file has {LIMIT}\. It is truncated or of another format\.$"),
    ("not JSON", framed(b"{oops"), r"the header is not valid: Expecting property name"),
    *[(f"a pickle of protocol {p}", b"\x80" + bytes([p]) + bytes(20), r"not a safetensors file but, by its first bytes, a PyTorch file \(a pickle, torch\.save's legacy format\): read it with taktiny\.io\.read_torch") for p in (2, 3, 4, 5)],
    ("a pickle's first byte, no protocol after it", b"\x80\x01" + bytes(20), r"not a safetensors file: its first 8 bytes give a header of 384 bytes, and the file has 22\. It is truncated or of another format\.$"),
    ("a protocol byte after another first byte", b"\x81\x02" + bytes(20), r"not a safetensors file: its first 8 bytes give a header of 641 bytes, and the file has 22\. It is truncated"),
    ("not UTF-8", framed(b'{"\xff": 1}'), r"the header is not valid: 'utf-8' codec can't decode"),
    ("UTF-16", framed('{"a": 1}'.encode("utf-16")), r"the header is not valid: 'utf-8' codec"),
    ("deep lists", framed(deep()), r"the header is not valid: it nests lists or objects deeper"),
    ("deep objects", framed(b'{"a":' * 50_000 + b"1" + b"}" * 50_000), r"nests lists or objects deeper"),
    ("deep in an entry", framed(b'{"a": {"dtype": ' + deep() + b"}}"), r"nests lists or objects deeper"),
    ("a list", framed(b"[]"), r"the header is a JSON list, not an object\. The file is corrupt\."),
    ("a number", framed(b"7"), r"the header is a JSON int, not an object"),
    ("a name twice", framed(b'{"a": {}, "a": ' + js(A) + b', "b": ' + js(B) + b"}"), r"the header is not valid: the name 'a' appears twice"),
    ("a name twice, not the first", framed(b'{"a": ' + js(A) + b', "b": {}, "b": ' + js(B) + b"}"), r"the header is not valid: the name 'b' appears twice"),
    ("a name twice, escaped", framed(b'{"a": ' + js(A) + b', "\\u0061": ' + js(A) + b', "b": ' + js(B) + b"}"), r"the name 'a' appears twice"),
    ("a field twice", framed(b'{"a": {"dtype": "I8", ' + js(A)[1:] + b', "b": ' + js(B) + b"}"), r"the name 'dtype' appears twice"),
    ("two fields twice, one pair per name", framed(b'{"a": {"dtype": "I8", "shape": [1], ' + js(A)[1:] + b', "b": ' + js(B) + b"}"), r"the name 'dtype' appears twice"),
    ("lone surrogate", framed(b'{"\\ud800": ' + js(A) + b', "b": ' + js(B) + b"}"), r"the string '\\ud800', which has a lone surrogate"),
    ("lone surrogate after other text", framed(b'{"\\u00e9": ' + js(A) + b', "\\ud800": ' + js(B) + b"}"), r"the string '\\ud800', which has a lone surrogate"),
    # entries of the wrong JSON types
    ("entry a list", header(a=[A]), r"the header entry of 'a' is \[\{.*\}\], not an object"),
    ("entry a string", header(a="F32"), r"the header entry of 'a' is 'F32', not an object"),
    ("entry null", header(a=None), r"the header entry of 'a' is None, not an object"),
    ("entry without dtype", header(a={"shape": [4, 4], "data_offsets": [0, 64]}), r"the header entry of 'a' is \{'data_offsets': \[0, 64\], 'shape': \[4, 4\]\}; an entry is \{\"dtype\""),
    ("dtype a list", header(a=entry(dtype=["F32"])), ENTRY),
    ("dtype null", header(a=entry(dtype=None)), ENTRY),
    ("dtype unknown", header(a=entry(dtype="f32")), r"'a' has the dtype 'f32', which Taktiny cannot read; it reads \['BF16'"),
    ("shape a number", header(a=entry(shape=16)), ENTRY),
    ("shape an object", header(a=entry(shape={"0": 4})), ENTRY),
    ("shape of bools", header(a=entry(shape=[True, 16])), ENTRY),
    ("shape of floats", header(a=entry(shape=[4.0, 4])), ENTRY),
    ("shape of strings", header(a=entry(shape=["4", "4"])), ENTRY),
    ("shape negative", header(a=entry(shape=[-4, -4])), ENTRY),
    ("offsets a number", header(a=entry(data_offsets=64)), ENTRY),
    ("offsets of one", header(a=entry(data_offsets=[64])), r"the header entry of 'a' is \{'data_offsets': \[64\], 'dtype': 'F32', 'shape': \[4, 4\]\}; an entry is \{\"dtype\""),
    ("offsets of three", header(a=entry(data_offsets=[0, 64, 64])), ENTRY),
    ("offsets of bools", header(b=dict(B, dtype="U8", shape=[1], data_offsets=[False, True])), r"the header entry of 'b' is"),
    ("offsets of strings", header(a=entry(data_offsets=["0", "64"])), ENTRY),
    ("offsets of floats", header(a=entry(data_offsets=[0.0, 64.0])), ENTRY),
    ("offsets backwards", header(a=entry(data_offsets=[64, 0])), r"'a' has data_offsets \[64, 0\], which end before they begin"),
    ("64 axes and no bytes, before a bad entry", header(a=entry(shape=[1] * 64, data_offsets=[64, 64]), b=dict(B, dtype="f32")), r"'b' has the dtype 'f32', which Taktiny cannot read"),
    ("offsets past 2**63", header(a=entry(data_offsets=[2**63, 2**63 + 64])), ENTRY),
    # counts and ranks
    ("a dim of 2**63", header(a=entry(shape=[2**63])), ENTRY),
    ("a zero and 2**64", header(a=entry(shape=[0, 2**64], data_offsets=[0, 0]), b=dict(B, data_offsets=[0, 12])), ENTRY),
    ("a count of 2**64", header(a=entry(shape=[2**32, 2**32])), r"'a' has the shape \[4294967296, 4294967296\], whose element count reaches 2\*\*63"),
    ("a count of 2**64, before a bad entry", header(a=entry(shape=[2**32, 2**32]), b=dict(B, dtype="f32")), r"'a' has the shape \[4294967296, 4294967296\], whose element count reaches 2\*\*63; the header is corrupt\.$"),
    ("a count of 2**63", header(a=entry(shape=[2**62, 2])), r"'a' has the shape \[4611686018427387904, 2\], whose element count reaches 2\*\*63; the header is corrupt\.$"),
    ("a count of 2**63 - 1", header(a=entry(dtype="U8", shape=[2**63 - 1])), r"the header gives 'a' the shape \[9223372036854775807\] of U8 \(9223372036854775807 bytes\) but 64 bytes \[0, 64\); the header disagrees with its bytes\.$"),
    ("a zero hiding 2**124", header(a=entry(shape=[0, 2**62, 2**62], data_offsets=[0, 0]), b=dict(B, data_offsets=[0, 12])), r"'a' has the shape \[0, 4611686018427387904, 4611686018427387904\], whose element count"),
    ("a zero and 2**62 of F32, no gap", zero_size([0, 2**62]), r"'a' has the shape \[0, 4611686018427387904\] of F32 \(4 bytes an element\), whose size reaches 2\*\*63 bytes with its zero axes counted as one: NumPy makes no array of that shape, not even an empty one; the header is corrupt\.$"),
    ("a zero and 2**61 of F32, no gap", zero_size([0, 2**61]), r"'a' has the shape \[0, 2305843009213693952\] of F32 \(4 bytes an element\), whose size reaches 2\*\*63 bytes"),
    ("a zero and 2**31 twice of F32", zero_size([2**31, 0, 2**31]), r"'a' has the shape \[2147483648, 0, 2147483648\] of F32 \(4 bytes an element\), whose size reaches 2\*\*63 bytes"),
    ("a zero and 61 twos of F64", zero_size([0] + [2] * 61, "F64"), r"'a' has the shape \[0, 2, 2, 2, 2, 2, 2, 2, \.\.\.\] of F64 \(8 bytes an element\), whose size reaches 2\*\*63 bytes"),
    ("a zero and 63 twos", zero_size([0] + [2] * 63, "U8"), r"'a' has the shape \[0, 2, 2, 2, 2, 2, 2, 2, \.\.\.\], whose element count reaches 2\*\*63; the header is corrupt\.$"),
    ("a zero and 2**62 of F32, entry by entry", zero_size([0, 2**62], b=dict(B, dtype="f32")), r"'a' has the shape \[0, 4611686018427387904\] of F32 \(4 bytes an element\), whose size reaches 2\*\*63 bytes"),
    ("65 axes", header(a=entry(shape=[1] * 65)), r"'a' has 65 axes, more than the 64 NumPy allows"),
    ("10,000 axes", header(a=entry(shape=[1] * 10_000)), r"'a' has 10000 axes, more than the 64"),
    ("10,000 axes and a zero", header(a=entry(shape=[0] * 10_000, data_offsets=[0, 0])), r"'a' has 10000 axes"),
    ("wrong byte count", header(a=entry(shape=[4, 5])), r"gives 'a' the shape \[4, 5\] of F32 \(80 bytes\) but 64 bytes \[0, 64\)"),
    ("no bytes for a shape", header(a=entry(data_offsets=[64, 64])), r"the header gives 'a' the shape \[4, 4\] of F32 \(64 bytes\) but 0 bytes \[64, 64\); the header disagrees with its bytes\.$"),
    # byte ranges that do not cover the data exactly
    ("a gap between", framed(js({"a": A, "b": dict(B, data_offsets=[72, 84])}), DATA + bytes(8)), rf"the data holds 8 bytes \[64, 72\) after 'a' {COVER}"),
    ("a gap at the start", framed(js({"a": entry(data_offsets=[8, 72]), "b": dict(B, data_offsets=[72, 84])}), bytes(8) + DATA), rf"the data holds 8 bytes \[0, 8\) at its start {COVER}"),
    ("bytes after the last", framed(js({"a": A, "b": B}), DATA + b"extra"), r"the data holds 5 bytes \[76, 81\) after the last tensor that no tensor's"),
    ("no tensors, some data", framed(b"{}", b"\0" * 8), r"the header lists no tensors, but the data holds 8 bytes"),
    ("overlapping", header(b=dict(B, data_offsets=[60, 72])), r"the bytes of 'a' and 'b' overlap"),
    # ... overlapping where the sizes still sum to the data, the first range starts at 0 and the
    # last ends at the data's end: only ranges that follow one another catch these
    ("an overlap and a gap", framed(js({"a": A, "b": dict(B, data_offsets=[60, 72]), "c": {"dtype": "U8", "shape": [4], "data_offsets": [76, 80]}}), bytes(80)), r"the bytes of 'a' and 'b' overlap; the file is corrupt\.$"),
    ("an overlap and a gap, listed backwards", framed(js({"c": {"dtype": "U8", "shape": [4], "data_offsets": [76, 80]}, "b": dict(B, data_offsets=[60, 72]), "a": A}), bytes(80)), r"the bytes of 'a' and 'b' overlap; the file is corrupt\.$"),
    ("two tensors in one range", framed(js({"b": dict(B, data_offsets=[0, 12]), "b2": dict(B, data_offsets=[0, 12]), "a": entry(data_offsets=[24, 88])}), bytes(88)), r"the bytes of 'b' and 'b2' overlap; the file is corrupt\.$"),
    ("a range inside another", framed(js({"a": A, "b": dict(B, data_offsets=[16, 28]), "c": dict(B, data_offsets=[76, 88])}), bytes(88)), r"the bytes of 'a' and 'b' overlap; the file is corrupt\.$"),
    ("past the end", header(b=dict(B, data_offsets=[76, 88])), r"the bytes of 'b' run to 88, past the end of the data \(76 bytes\)"),
    ("truncated", header()[:-4], r"the bytes of 'b' run to 76, past the end of the data \(72 bytes\)"),
    # __metadata__
    ("metadata a list", meta(["pt"]), r"the header's __metadata__ is \['pt'\], not an object; the metadata maps strings to strings"),
    ("metadata a string", meta("pt"), r"the header's __metadata__ is 'pt', not an object"),
    ("metadata a number", meta(1), r"the header's __metadata__ is 1, not an object"),
    ("metadata value a number", meta({"format": 1}), r"__metadata__ gives 'format' the value 1, which is no string"),
    ("metadata value null", meta({"format": None}), r"__metadata__ gives 'format' the value None, which is no string"),
    ("metadata value a number after a string", meta({"format": "pt", "step": 1}), r"__metadata__ gives 'step' the value 1, which is no string"),
    ("metadata value a bool", meta({"format": True}), r"gives 'format' the value True, which is no string"),
    ("metadata value an object", meta({"format": {"pt": "1"}}), r"gives 'format' the value \{'pt': '1'\}, which is no string"),
    ("metadata deep", framed(b'{"__metadata__": ' + deep() + b"}"), r"nests lists or objects deeper"),
    ("metadata key twice", framed(b'{"__metadata__": {"k": "1", "k": "2"}}'), r"the name 'k' appears twice"),
    # Taktiny's packed 4-bit tensors
    ("packed not JSON", meta({"taktiny_packed": "{"}), r"the metadata 'taktiny_packed' is not valid JSON"),
    ("packed deep", meta({"taktiny_packed": deep().decode()}), r"the metadata 'taktiny_packed' nests deeper than the JSON parser goes"),
    ("packed a list", meta({"taktiny_packed": "[]"}), r"the metadata 'taktiny_packed' is not a JSON object of records: '\[\]'"),
    ("packed a long list", meta({"taktiny_packed": json.dumps(list(range(40)))}), r"the metadata 'taktiny_packed' is not a JSON object of records: '\[0, 1, 2, .*, 20, 21, 2'; the header"),
    ("packed record a number", packed(4), r"'taktiny_packed' is not a JSON object of records"),
    ("packed dtype a list", packed({"dtype": ["int4"], "shape": [4, 8]}), r"the metadata 'taktiny_packed' gives 'a' the record \{'dtype': \['int4'\], 'shape': \[4, 8\]\}; a packed tensor's record is \{'dtype': one of \['float4_e2m1fn', 'int4', 'uint4'\], 'shape': its logical shape\}; the header is corrupt\.$"),
    ("packed dtype unknown", packed({"dtype": "int3", "shape": [4, 8]}), r"gives 'a' the record .*; a packed tensor's record is"),
    ("packed shape of bools", packed({"dtype": "int4", "shape": [True, 8]}), r"gives 'a' the record .*; a packed tensor's record is"),
    ("packed shape a string", packed({"dtype": "int4", "shape": "4, 8"}), r"gives 'a' the record .*; a packed tensor's record is"),
    ("packed shape of 65 axes", packed({"dtype": "int4", "shape": [1] * 65}), r"gives 'a' the record .*; a packed tensor's record is"),
    ("packed shape of 2**64", packed({"dtype": "int4", "shape": [2**64]}), r"gives 'a' the record .*; a packed tensor's record is"),
    ("packed shape of 2**63", packed({"dtype": "int4", "shape": [4, 2**63]}), r"the metadata 'taktiny_packed' gives 'a' the record \{'dtype': 'int4', 'shape': \[4, 9223372036854775808\]\}; a packed tensor's record is"),
    ("packed extra field", packed({"dtype": "int4", "shape": [4, 8], "axis": 0}), r"a packed tensor's record is"),
    ("packed, a zero and 2**63 - 1", zero_size([0, 2**62], "U8", __metadata__={"taktiny_packed": json.dumps({"a": {"dtype": "int4", "shape": [0, 2**63 - 1]}})}), r"the metadata 'taktiny_packed' lists 'a' as int4\[0, 9223372036854775807\], which is unpacked through two bytes for each byte stored: 2\*\*63 bytes or more with its zero axes counted as one\. NumPy makes no array of that shape, not even an empty one; the header is corrupt\.$"),
    ("packed, stored otherwise", packed({"dtype": "int4", "shape": [4, 8]}), r"lists 'a' as int4\[4, 8\] packed two per byte, which is stored as uint8\[4, 4\], but the file holds float32\[4, 4\]"),
    # Taktiny's quantized layouts
    ("quantized not JSON", meta({"taktiny_quantized": "nope"}), r"the metadata 'taktiny_quantized' is not valid JSON"),
    ("quantized a list", meta({"taktiny_quantized": "[1]"}), r"'taktiny_quantized' is not a JSON object of records"),
    ("bits a list", quantized(bits=[8]), r"the metadata 'taktiny_quantized' gives 'q' the record \{'axis': 0, 'bits': \[8\], 'group_size': None, 'shape': \[4, 4\]\}; a quantized parameter's record is \{'bits': int, 'axis': int, 'group_size': int or null, 'shape': a list of ints\}; the header is corrupt\.$"),
    ("bits a bool", quantized(bits=True), r"gives 'q' the record .*; a quantized parameter's record is"),
    ("bits a float", quantized(bits=8.0), r"gives 'q' the record .*; a quantized parameter's record is"),
    ("bits 3", quantized(bits=3), r"gives 'q' an impossible layout: bits must be 8 or 4, got 3"),
    ("axis a string", quantized(axis="0"), r"gives 'q' the record .*; a quantized parameter's record is"),
    ("axis a bool", quantized(axis=False), r"gives 'q' the record .*; a quantized parameter's record is"),
    ("axis out of range", quantized(axis=5), r"gives 'q' an impossible layout: axis must be an axis of the array, 0 to 1, got 5"),
    ("group_size a bool", quantized(group_size=True), r"gives 'q' the record .*; a quantized parameter's record is"),
    ("group_size a string", quantized(group_size="2"), r"a quantized parameter's record is"),
    ("shape an object", quantized(shape={"a": 1}), r"a quantized parameter's record is"),
    ("8-bit values of floats", framed(js({"__metadata__": {"taktiny_quantized": json.dumps({"q": {"bits": 8, "axis": 0, "group_size": None, "shape": [4, 4]}})}, "q.value": A, "q.scale": B})), r"records 'q' as quantized int8 \(one scale per channel along axis 0\) of shape \[4, 4\], but its 8-bit values q\.value must be int8, and the checkpoint holds float32\[4, 4\]\. The checkpoint is inconsistent"),
    ("values of another shape", parts(value={"shape": [2, 8]}), r"records 'q' as quantized int8 \(one scale per channel along axis 0\) of shape \[4, 4\], but its values q\.value have the shape \[2, 8\], not \[4, 4\]\. The checkpoint is inconsistent"),
    ("scales of ints", parts(scale={"dtype": "I32"}), r"but its scales q\.scale must be floats of shape \[1, 4\], and the checkpoint holds int32\[1, 4\]\. The checkpoint is inconsistent; write it again with taktiny\.io\.save_safetensors\.$"),
    ("quantized, no parts", quantized(), r"records 'q' as quantized int8 \(one scale per channel along axis 0\) of shape \[4, 4\], but its parts must be tensors, and the checkpoint has no q\.value or q\.scale\. The checkpoint is inconsistent"),
]  # fmt: skip


def shards(tmp_path):
    """A folder with two good shards, and the index of them."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "one.safetensors").write_bytes(framed(js({"a": A}), DATA[:64]))
    (folder / "two.safetensors").write_bytes(
        framed(js({"b": dict(B, data_offsets=[0, 12])}), DATA[64:])
    )
    return folder  # fmt: skip


def index(weight_map=None, **content):
    """An index of the two shards of `shards`, with its weight_map or content changed."""
    if weight_map is None:
        weight_map = {"a": "one.safetensors", "b": "two.safetensors"}
    return js({"metadata": {"total_size": 76}, "weight_map": weight_map, **content})


def weight_map(b):
    return index({"a": "one.safetensors", "b": b})


def linked(target, shard="link.safetensors"):
    """An index whose shard of 'b' is a symlink to `target` (relative to the folder)."""

    def link(folder):
        os.symlink(target, folder / shard)
        return weight_map(shard)

    return link


def loop(folder):
    os.symlink("loop2.safetensors", folder / "loop1.safetensors")
    os.symlink("loop1.safetensors", folder / "loop2.safetensors")
    return weight_map("loop1.safetensors")


def outside(folder):
    (folder.parent / "outside.safetensors").write_bytes(
        framed(js({"b": dict(B, data_offsets=[0, 12])}), DATA[64:])
    )
    return weight_map("../outside.safetensors")  # fmt: skip


NO_NAME = r"the weight_map gives 'b' the shard .*, which is no file name"
NOT_INDEX = r"not a safetensors index \("

# (id, the index's bytes, or a function of the folder making them; the error after its name)
INDEXES = [
    ("index not JSON", b"{", NOT_INDEX + r"its JSON is not valid: Expecting property name"),
    ("index not UTF-8", b'{"\xfe": 1}', NOT_INDEX + r"its JSON is not valid: 'utf-8' codec"),
    ("index deep", deep(), NOT_INDEX + r"its JSON is not valid: it nests lists or objects deeper"),
    ("index a list", b"[]", NOT_INDEX + r"a JSON list, not an object\)"),
    ("index without weight_map", b'{"metadata": {}}', NOT_INDEX + r"no weight_map\)"),
    ("weight_map a list", index(["one.safetensors"]), NOT_INDEX + r"the weight_map is \['one.safetensors'\], not an object"),
    ("weight_map null", js({"weight_map": None}), NOT_INDEX + r"the weight_map is None, not an object"),
    ("metadata a list", index(metadata=[76]), NOT_INDEX + r"the metadata is \[76\], not an object"),
    ("metadata a string", index(metadata="76"), NOT_INDEX + r"the metadata is '76', not an object"),
    ("a name twice", b'{"weight_map": {"a": "one.safetensors", "a": "two.safetensors"}}', NOT_INDEX + r"its JSON is not valid: the name 'a' appears twice"),
    ("shard a number", weight_map(2), r"the weight_map gives 'b' the shard 2, which is no file name"),
    ("shard a list", weight_map(["two.safetensors"]), r"the weight_map gives 'b' the shard \['two.safetensors'\], which is no file name"),
    ("shard null", weight_map(None), r"the weight_map gives 'b' the shard None, which is no file name"),
    ("shard a bool", weight_map(True), r"the weight_map gives 'b' the shard True, which is no file name"),
    ("shard empty", weight_map(""), r"the weight_map gives 'b' the shard '', which is no file name"),
    ("shard with NUL", weight_map("two\0.safetensors"), r"the weight_map gives 'b' the shard 'two\\x00.safetensors', which is no file name"),
    ("shard name too long", weight_map("x" * 300 + ".safetensors"), r"the shard 'xxxx.*' of 'b' cannot be opened \(\[Errno 36\] File name too long"),
    ("shard lone surrogate", b'{"weight_map": {"a": "one.safetensors", "b": "\\udc00.safetensors"}}', r"the weight_map holds the string '\\udc00.safetensors', which has a lone surrogate"),
    ("shard a symlink loop", loop, r"the shard 'loop1.safetensors' of 'b' cannot be resolved \(Symlink loop from"),
    ("shard outside", outside, r"the shard '\.\./outside\.safetensors' of 'b' is outside the index's folder"),
    ("shard absolute", weight_map("/etc/passwd"), r"the shard '/etc/passwd' of 'b' is outside the index's folder"),
    ("shard links outside", linked("../outside.safetensors"), r"the shard 'link.safetensors' of 'b' is outside the index's folder"),
    ("shard links to /dev/zero", linked("/dev/zero"), r"the shard 'link.safetensors' of 'b' is outside the index's folder"),
    ("shard a folder", weight_map("."), r"the shard '\.' of 'b' is outside the index's folder"),
    ("shard missing", weight_map("three.safetensors"), r"the shard 'three.safetensors' \(of 'b'\) is missing"),
    ("index too large", sparse(0, LIMIT + 1), NOT_INDEX + rf"{LIMIT + 1} bytes, more than the {LIMIT} a header may have"),
]  # fmt: skip


def make_file(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    if callable(content):
        content(path)
    else:
        path.write_bytes(content)
    return path


def make_index(tmp_path, content):
    folder = shards(tmp_path)
    path = folder / "model.safetensors.index.json"
    if callable(content) and content.__name__ == "make":  # a sparse file
        content(path)
    else:
        path.write_bytes(content(folder) if callable(content) else content)
    return path


CASES = [pytest.param(make_file, content, message, id=name) for name, content, message in FILES]
CASES += [pytest.param(make_index, c, m, id=f"index: {n}") for n, c, m in INDEXES]


@pytest.fixture
def opened(monkeypatch):
    """The files `read_header` opens, each checked to be inside the folder of the index."""
    seen = []
    header = checkpoint_module.read_header

    def recorded(file):
        seen.append(file)
        return header(file)

    monkeypatch.setattr(checkpoint_module, "read_header", recorded)
    return seen


@pytest.mark.parametrize(("make", "content", "message"), CASES)
def test_open_refuses_naming_the_file(tmp_path, make, content, message, opened):
    path = make(tmp_path, content)
    with pytest.raises(SafetensorsError, match=f"^{re.escape(str(path))}: .*{message}"):
        open_safetensors(path)
    folder = path.parent.resolve()
    assert all(folder in Path(file).resolve().parents for file in opened), opened


def model():
    return {"a": jnp.zeros((4, 4), jnp.float32), "b": jnp.zeros(3, jnp.int32)}


@pytest.mark.parametrize("abstract", [False, True], ids=["concrete", "abstract"])
@pytest.mark.parametrize(("make", "content", "message"), CASES)
def test_load_refuses_naming_the_file(tmp_path, make, content, message, abstract):
    path = make(tmp_path, content)
    target = jax.eval_shape(model) if abstract else model()
    with pytest.raises(SafetensorsError, match=f"^{re.escape(str(path))}: .*{message}"):
        load_safetensors(target, path, progress=False)
    with pytest.raises(SafetensorsError, match=f"^{re.escape(str(path))}: .*{message}"):
        plan_load(target, path)  # (a plan opens the headers as the load does)


def refused(capsys, argv, message):
    """`taktiny *argv` exits with 2 after one line on stderr matching `message`."""
    assert _cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.fullmatch(message, err.rstrip("\n")), err


@pytest.mark.parametrize(("make", "content", "message"), CASES)
def test_the_command_prints_one_line_and_exits_with_2(tmp_path, capsys, make, content, message):
    path = make(tmp_path, content)
    good = tmp_path / "good.safetensors"
    good.write_bytes(header())
    line = f"taktiny: {re.escape(str(path))}: .*{message}.*"
    refused(capsys, ["inspect", str(path)], line)
    refused(capsys, ["inspect", str(path), "--json"], line)
    refused(capsys, ["diff", str(good), str(path)], line)
    refused(capsys, ["diff", str(path), str(good)], line)
    refused(capsys, ["verify", str(path)], line)


def test_the_command_runs_as_a_program_without_a_traceback(tmp_path):
    import subprocess
    import sys

    path = make_file(tmp_path, header(a=entry(shape=[0, 2**64], data_offsets=[0, 0])))
    run = subprocess.run([sys.executable, "-m", "taktiny", "inspect", str(path)],
                         capture_output=True, text=True, timeout=120,
                         env=cpu_environment())  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        f"taktiny: {path}: the header entry of 'a' is {{'data_offsets': [0, 0], 'dtype': 'F32', "
        f"'shape': [0, 18446744073709551616]}}; an entry is {{\"dtype\": a safetensors dtype, "
        f'"shape": a list of at most 64 ints from 0 to 2**63 - 1, "data_offsets": [begin, end], '
        f"two such ints}}."
    ]


def test_a_damaged_orbax_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    import orbax.checkpoint as ocp

    path = (tmp_path / "orbax").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, {"w": np.ones((2, 3), np.float32)})
    good = tmp_path / "good.safetensors"
    good.write_bytes(framed(js({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}),
                            np.ones(6, np.float32).tobytes()))  # fmt: skip

    def fail(*args, **kwargs):
        raise OSError("the array's chunk is gone\nand a second line")

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", fail)  # its data damaged
    refused(capsys, ["diff", str(path), str(good)], rf"taktiny: {re.escape(str(path))}: the "
            r"array 'w' cannot be restored \(OSError: the array's chunk is gone\)\.")  # fmt: skip
    monkeypatch.undo()
    (path / "_METADATA").write_bytes(b"{not json")  # its tree of arrays damaged
    message = rf"taktiny: {re.escape(str(path))}: an Orbax checkpoint without a readable tree"
    refused(capsys, ["inspect", str(path)], message + ".*")
    refused(capsys, ["diff", str(good), str(path)], message + ".*")


def odd(tmp_path, tensors, order=None, pad=b""):
    """A valid file holding `tensors` ({name: array}), in the header's `order` of names."""
    entries, data = {}, b""
    for name, array in tensors.items():
        dtype = {"float32": "F32", "int32": "I32", "uint8": "U8"}[array.dtype.name]
        entries[name] = {"dtype": dtype, "shape": list(array.shape),
                         "data_offsets": [len(data), len(data) + array.nbytes]}  # fmt: skip
        data += array.tobytes()
    names = order or list(entries)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(framed(js({n: entries[n] for n in names}) + pad, data))
    return path


ZEROS = {"z0": np.zeros((0,), np.float32), "z1": np.zeros((3, 0, 2), np.int32)}
# (id, its tensors, the header's order of them or None, bytes after the JSON)
WORKING = [
    ("no tensors", {}, None, b""),
    ("no tensors, padded", {}, None, b" " * 7),
    ("zero-size tensors only", ZEROS, None, b""),
    ("zero-size between", {"a": VALUES["a"], **ZEROS, "b": VALUES["b"]}, None, b""),
    ("zero-size first and last", {**ZEROS, **VALUES, "z2": np.zeros((0, 2**40), np.uint8)}, None, b""),
    ("zero-size, bytes just below 2**63 for the zero", {"f": np.zeros((0, 2**61 - 1), np.float32), "u": np.zeros((2**63 - 1, 0), np.uint8)}, None, b""),
    ("listed out of order", VALUES, ["b", "a"], b""),
    ("64 axes", {"a": np.zeros((1,) * 64, np.float32)}, None, b""),
    ("names of any text", {"": VALUES["b"], "\0": VALUES["a"], "é.日本": VALUES["b"], 'a"b\\': VALUES["b"]}, None, b""),
    ("names holding colons", {"a:b": VALUES["a"], "::": VALUES["b"]}, None, b""),
]  # fmt: skip


@pytest.mark.parametrize(("tensors", "order", "pad"), [w[1:] for w in WORKING],
                         ids=[w[0] for w in WORKING])  # fmt: skip
def test_odd_but_valid_files_read_back(tmp_path, capsys, tensors, order, pad):
    path = odd(tmp_path, tensors, order, pad)
    checkpoint = open_safetensors(path)
    assert sorted(checkpoint) == sorted(tensors)
    for name, array in tensors.items():
        got = np.asarray(checkpoint[name])
        assert got.dtype == array.dtype and got.shape == array.shape, name
        assert got.tobytes() == array.tobytes(), name
    assert _cli.main(["inspect", str(path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["tensors"]
    assert sorted(t["name"] for t in listed) == sorted(tensors)
    assert _cli.main(["diff", str(path), str(path)]) == 0
    capsys.readouterr()


def test_count_is_the_element_count_of_a_shape_below_2_63():
    from taktiny.io._header import count

    assert count([]) == 1 and count([3, 4]) == 12 and count([1, 3]) == 3
    assert count([0]) == 0 and count([3, 0, 2**61]) == 0 and count([1, 2**63 - 1]) == 2**63 - 1
    for shape in ([2**62, 2], [0, 2**62, 2], [2**32, 2**32]):  # a zero axis counts as one
        with pytest.raises(OverflowError):
            count(shape)
    # with an item size, the bytes stay below 2**63 (NumPy's bound, empty arrays included)
    assert count([3, 4], 8) == 12 and count([0, 2**61 - 1], 4) == 0 and count([2**60], 4) == 2**60
    for shape, itemsize in (([0, 2**61], 4), ([2**62, 0], 2), ([0] + [2] * 61, 8)):
        with pytest.raises(OverflowError):
            count(shape, itemsize)


def test_an_empty_header_loads_into_an_empty_model(tmp_path):
    path = odd(tmp_path, {})
    assert load_safetensors({}, path, progress=False) == {}
    assert load_safetensors(jax.eval_shape(dict), path, progress=False) == {}


def test_a_header_at_the_limit_opens(tmp_path):
    text = b'{"__metadata__": {"x": "' + b"a" * (LIMIT - 30) + b'"}}'
    path = tmp_path / "large.safetensors"
    path.write_bytes(framed(text + b" " * (LIMIT - len(text)), b""))
    checkpoint = open_safetensors(path)
    assert len(checkpoint) == 0 and len(checkpoint.metadata["x"]) == LIMIT - 30


# read_torch: PyTorch files whose zip, members or pickled tensor records are wrong


def pickled(offset=0, size=(2, 3), stride=(3, 1), repeat=0):
    """The data.pkl of a zip-format torch file holding {'w': a float32 tensor on the
    storage '0' of 6 elements}, with the tensor's offset, size and stride as given, or
    with 'w' a pair of pairs of ... of it, `repeat` deep."""

    def int_(n):
        return torch.serialization.pickle.dumps(n, protocol=2)[2:-1]

    def tuple_(ns):
        return b"(" + b"".join(map(int_, ns)) + b"t"

    return (b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00"
            b"storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpu" + int_(6)
            + b"tQ" + int_(offset) + tuple_(size) + tuple_(stride)
            + b"\x89ccollections\nOrderedDict\n)RtRq\x00" + b"h\x00\x86q\x00" * repeat
            + b"s.")  # fmt: skip


def torch_file(tmp_path, pkl=None, drop=None, cut=None):
    """A torch.save zip of {'w': [2, 3] float32}, its data.pkl replaced by `pkl`, its
    member ending in `drop` left out, or its bytes cut to `cut`."""
    import zipfile

    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, good)
    path = tmp_path / "bad.pt"
    if cut is not None:
        path.write_bytes(good.read_bytes()[:cut])
        return path
    with zipfile.ZipFile(good) as source, zipfile.ZipFile(path, "w") as out:
        for info in source.infolist():
            if drop is not None and info.filename.endswith(drop):
                continue
            replace = pkl is not None and info.filename.endswith("data.pkl")
            out.writestr(info.filename, pkl if replace else source.read(info.filename))
    return path


NOT_TORCH = r"is not a readable PyTorch file \(RuntimeError: "
TORCH = [
    ("as written", {}, None),
    ("truncated to 10 bytes", {"cut": 10}, NOT_TORCH + r"PytorchStreamReader failed reading zip archive"),
    ("truncated to half", {"cut": 700}, NOT_TORCH + r"PytorchStreamReader failed reading zip archive"),
    ("no data.pkl", {"drop": "data.pkl"}, NOT_TORCH + r"PytorchStreamReader failed locating file data.pkl"),
    ("no storage", {"drop": "data/0"}, NOT_TORCH + r"PytorchStreamReader failed locating file data/0"),
    ("no version", {"drop": "/version"}, NOT_TORCH + r"Expected hasRecord\(\"version\"\)"),
    ("shape of 2**80 elements", {"pkl": pickled(size=(2**40, 2**40))}, NOT_TORCH + r"numel: integer multiplication overflow"),
    ("negative shape", {"pkl": pickled(size=(-1, 3))}, NOT_TORCH + r"numel: integer multiplication overflow"),
    ("stride past the storage", {"pkl": pickled(stride=(2**62, 1))}, NOT_TORCH + r"Storage size calculation overflowed"),
    ("offset past the storage", {"pkl": pickled(offset=2**60)}, NOT_TORCH + r"Trying to resize storage that is not resizable"),
    ("offset a little past", {"pkl": pickled(offset=4)}, NOT_TORCH + r"Trying to resize storage that is not resizable"),
    ("100 axes", {"pkl": pickled(size=(1,) * 100, stride=(1,) * 100)}, r"has the shape \[1, 1, .*, which NumPy cannot hold \(number of dimensions must be within \[0, 64\]\)"),
    ("a zero and 2**62", {"pkl": pickled(size=(0, 2**62), stride=(1, 1))}, r"has the shape \[0, 4611686018427387904\], which NumPy cannot hold \(array is too big"),
    ("a list inside itself", {"pkl": b"\x80\x02}X\x01\x00\x00\x00a]q\x00h\x00as."}, r" holds a container inside itself \(at 0, 2 deep\); it is no checkpoint"),
    ("a dict inside itself", {"pkl": b"\x80\x02}q\x00X\x01\x00\x00\x00ah\x00s."}, r" holds a container inside itself \(at 'a', 1 deep\); it is no checkpoint$"),
    ("lists 100,000 deep", {"pkl": b"\x80\x02}X\x01\x00\x00\x00a" + b"]" * 100_000 + b"a" * 99_999 + b"s."}, None),
    ("a list repeated 2**30 times", {"pkl": b"\x80\x02}X\x01\x00\x00\x00a]q\x00" + b"h\x00\x86q\x00" * 30 + b"s."}, None),
    ("a tensor repeated 2**30 times", {"pkl": pickled(repeat=30)}, r" names more than 1,048,576 tensors \(it repeats containers inside each other\)"),
    # torch's reason is quoted whole up to its own advice (". Please use ..."), which is left out
    ("a global of a blocked module", {"pkl": b"\x80\x02cos\nsystem\n)R."}, r" \(Trying to load unsupported GLOBAL os\.system whose module os is blocked\.\): it holds objects other than tensors"),
    ("an INST opcode", {"pkl": b"\x80\x02}X\x01\x00\x00\x00ai__builtin__\nobject\ns."}, r" \(Unsupported operand 105\): it holds objects other than tensors"),
    ("a global named like torch's reason", {"pkl": b"\x80\x02cx WeightsUnpickler error: y. Please z\nThing\n)R."}, r" \(Unsupported global: GLOBAL x WeightsUnpickler error: y\): it holds objects other than tensors"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "message"), [t[1:] for t in TORCH], ids=[t[0] for t in TORCH])
def test_read_torch_refuses_a_damaged_file_by_name(tmp_path, change, message):
    path = torch_file(tmp_path, **change)
    if message is None:  # it reads, or holds no tensor
        expected = {} if "pkl" in change else {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
        got = read_torch(path)
        assert list(got) == list(expected)
        assert all(np.array_equal(got[k], v) for k, v in expected.items())
        return
    with pytest.raises(ValueError, match=f"^read_torch: .*{re.escape(path.name)}.*{message}"):
        read_torch(path)


def torch_index(tmp_path, shard):
    folder = tmp_path / "torch"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "one.bin")
    path = folder / "pytorch_model.bin.index.json"
    if callable(shard):
        shard = shard(folder)
    path.write_bytes(shard if isinstance(shard, bytes) else js({"weight_map": {"w": shard}}))
    return path


def torch_loop(folder):
    os.symlink("loop2.bin", folder / "loop1.bin")
    os.symlink("loop1.bin", folder / "loop2.bin")
    return "loop1.bin"


UNNAMED = r"names shards that are no file names or cannot be resolved: "
TORCH_INDEXES = [
    ("NUL", "one\0.bin", UNNAMED + r"'one\\x00.bin' \(no file name\)"),
    ("empty", "", UNNAMED + r"'' \(no file name\)"),
    ("too long", "x" * 300 + ".bin", UNNAMED + r"'xxxx.*\.\.\. \(\[Errno 36\] File name too long"),
    ("a symlink loop", torch_loop, UNNAMED + r"'loop1.bin' \(Symlink loop from"),
    ("outside", "../one.bin", r"names shards outside its folder"),
    ("a number", 3, r"has no 'weight_map' of tensor names to shard files"),
    ("deep", deep(), r"is not a JSON object: its JSON is not valid: it nests lists or objects deeper"),
    ("a list", b"[]", r"is not a JSON object: 'list' object has no attribute 'get'"),
]  # fmt: skip


@pytest.mark.parametrize(("shard", "message"), [t[1:] for t in TORCH_INDEXES],
                         ids=[t[0] for t in TORCH_INDEXES])  # fmt: skip
def test_read_torch_refuses_a_bad_index_by_name(tmp_path, shard, message):
    path = torch_index(tmp_path, shard)
    with pytest.raises(ValueError, match=f"^read_torch: {re.escape(str(path))} {message}"):
        read_torch(path)


def test_a_header_made_of_little_but_lists_is_refused_before_it_is_parsed(tmp_path):
    bomb = tmp_path / "bomb.safetensors"
    bomb.write_bytes(framed(b'{"__metadata__": [' + b"[]," * 1_000_000 + b"[]]}", b""))
    with pytest.raises(
        SafetensorsError,
        match=r"bomb\.safetensors: the header holds 1,000,003 JSON lists and objects for 0 tensor entries; a safetensors header holds a few per entry",
    ):
        open_safetensors(bomb)
    # brackets in metadata strings, up to the spare allowance, are fine
    fine = tmp_path / "fine.safetensors"
    fine.write_bytes(header(__metadata__={"config": "[" * 900_000}))
    assert sorted(open_safetensors(fine)) == ["a", "b"]


def crowded(tmp_path, entries, brackets, size=0, spare=0):
    """A file of `entries` zero-size tensors, each named by `brackets` '[' and its number,
    `spare` more '[' in a metadata string, its header padded with spaces to `size` bytes:
    a header of many JSON lists and objects (a '[' in a string counts as one)."""
    header = {f"{'[' * brackets}{i:05}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
              for i in range(entries)}  # fmt: skip
    text = js({"__metadata__": {"m": "[" * spare}, **header} if spare else header)
    path = tmp_path / "crowded.safetensors"
    path.write_bytes(framed(text.ljust(size), b""))
    return path, max(size, len(text)), text.count(b"[") + text.count(b"{")


def test_the_guard_against_headers_of_lists_counts_only_where_entries_are_sparse(tmp_path):
    """Lists and objects are counted only in a header of 1,000,000 bytes or more with at
    least 400 bytes per entry; a dense header (here of names full of '[') opens however
    many it holds."""
    path, length, containers = crowded(tmp_path, 3100, 330)
    assert 10**6 <= length < 400 * 3100 and containers > 8 * 3100 + 10**6
    assert len(open_safetensors(path)) == 3100


@pytest.mark.parametrize(
    ("entries", "brackets", "size", "spare", "refused"),
    [
        (3100, 330, 400 * 3100 - 1, 0, False),  # a byte short of 400 per entry: not counted
        (3100, 330, 400 * 3100, 0, True),  # 400 per entry: counted, and too many
        (0, 0, 0, 10**6 - 2, False),  # no entries: 1,000,000 allowed ({, { and the '['s)
        (0, 0, 0, 10**6 - 1, True),
    ],
    ids=["dense", "400 bytes per entry", "at the allowance", "one over"],
)
def test_the_guard_against_headers_of_lists_at_its_bounds(
    tmp_path, entries, brackets, size, spare, refused
):
    path, length, containers = crowded(tmp_path, entries, brackets, size, spare)
    assert length == (size or length) and length >= 10**6
    if not refused:
        assert len(open_safetensors(path)) == entries
        return
    with pytest.raises(
        SafetensorsError,
        match=rf"crowded\.safetensors: the header holds {containers:,} JSON lists and objects "
        rf"for {entries:,} tensor entries; a safetensors header holds a few per entry",
    ):
        open_safetensors(path)


def test_a_header_naming_every_dtype_opens(tmp_path):
    from taktiny.arrays import numpy_dtype
    from taktiny.io._dtypes import CODES

    entries, at = {}, 0
    for code, (_, itemsize) in sorted(CODES.items()):
        entries[code] = {"dtype": code, "shape": [2], "data_offsets": [at, at + 2 * itemsize]}
        at += 2 * itemsize
    path = tmp_path / "all.safetensors"
    path.write_bytes(framed(js(entries), bytes(at)))
    checkpoint = open_safetensors(path)
    assert {name: checkpoint[name].dtype for name in checkpoint} == {
        code: numpy_dtype(name) for code, (name, _) in CODES.items()
    }
