"""Checksums catch every damaged bit: whatever the tensors (dtypes including bfloat16, float8
and packed int4, 0-d and zero-size arrays) and however they are sharded into files, a bit
flipped anywhere in a file's data region is reported by ``load_safetensors`` (naming the
tensor whose bytes hold it) and by ``taktiny verify``'s check, and nothing else is; and a
bit flipped anywhere in a file, its header included, is reported by ``taktiny verify``."""

import contextlib
import io
import json
import math
import struct
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taktiny._cli import main
from taktiny.io import SafetensorsError, load_safetensors, open_safetensors, save_safetensors
from taktiny.io._verify import verify

from .budget import examples

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.int8, jnp.int4, jnp.uint32, jnp.bool_]  # fmt: skip


@st.composite
def checkpoints(draw):
    """Tensors (at least one byte of data among them) and a shard limit."""
    count = draw(st.integers(1, 6))
    tensors = {}
    for i in range(count):
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        rng = np.random.default_rng(draw(st.integers(0, 2**16)))
        bits = rng.integers(0, 2, shape) if dtype == jnp.bool_ else rng.integers(-8, 8, shape)
        tensors[f"t{i}"] = jnp.asarray(bits).astype(dtype)
    if not any(np.asarray(t).size for t in tensors.values()):
        tensors["last"] = jnp.arange(3, dtype=jnp.int8)
    return tensors, draw(st.sampled_from([None, 8, 40]))


def data_regions(files):
    """(file, first data byte, end, {tensor: (begin, end)}) of each shard."""
    out = []
    for file in files:
        data = file.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        header.pop("__metadata__")
        ranges = {n: tuple(e["data_offsets"]) for n, e in header.items()}
        out.append((file, 8 + length, len(data), ranges))
    return [r for r in out if r[2] > r[1]]


@settings(max_examples=examples(40))
@given(case=checkpoints(), where=st.data())
def test_a_bit_flipped_anywhere_in_the_data_is_always_reported(case, where):
    """Seen to catch: a loader that checks only what it hashes in the reader thread (the
    check dropped from `_load`), a block read that skips the whole-tensor check, a packed
    tensor checked after unpacking."""
    tensors, limit = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        files = [
            f for f in save_safetensors(path, tensors, max_shard_size=limit) if f.suffix != ".json"
        ]
        file, start, end, ranges = where.draw(st.sampled_from(data_regions(files)), label="file")
        at = where.draw(st.integers(start, end - 1), label="byte")
        bit = where.draw(st.integers(0, 7), label="bit")
        raw = bytearray(file.read_bytes())
        raw[at] ^= 1 << bit
        file.write_bytes(bytes(raw))
        (hit,) = [n for n, (b, e) in ranges.items() if b <= at - start < e]
        target = {n: jax.ShapeDtypeStruct(t.shape, t.dtype) for n, t in tensors.items()}
        with pytest.raises(SafetensorsError, match=rf"the bytes of '{hit}' are damaged"):
            load_safetensors(target, path)
        report = verify(path)
        assert [line.split("'")[1] for line in report.damaged] == [hit]
        assert report.checked == len(tensors) - 1 and report.unchecked == 0


@settings(max_examples=examples(30))
@given(case=checkpoints(), where=st.data())
def test_a_bit_flipped_anywhere_in_a_file_is_reported_by_taktiny_verify(case, where):
    """Every byte of every file is a candidate: the 8-byte length prefix, the header's JSON
    (names, shapes, byte ranges, the metadata records: the schema, the checksums, the
    header's own digest), the spaces that pad it, and the data. A bit flipped in the data
    is a damaged tensor (exit 1, the tensor named); anywhere before it, a damaged header
    (exit 2, one line on stderr), even where the header stays valid JSON that means the
    same (a zero-size tensor's other axis, a version string). Seen to catch: an open that
    does not check the header's digest (a flipped schema then passed verify, and a flipped
    recorded checksum was reported as damaged bytes)."""
    tensors, limit = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        files = [
            f for f in save_safetensors(path, tensors, max_shard_size=limit) if f.suffix != ".json"
        ]
        file = where.draw(st.sampled_from(files), label="file")
        raw = bytearray(file.read_bytes())
        (length,) = struct.unpack("<Q", raw[:8])
        json_end = 8 + len(raw[8 : 8 + length].rstrip(b" "))
        regions = {
            "length prefix": (0, 8),
            "header": (8, json_end),
            "padding": (json_end, 8 + length),
            "data": (8 + length, len(raw)),
        }
        region = where.draw(
            st.sampled_from([r for r, (b, e) in regions.items() if e > b]), label="region"
        )
        begin, end = regions[region]
        at = where.draw(st.integers(begin, end - 1), label="byte")
        bit = where.draw(st.integers(0, 7), label="bit")
        raw[at] ^= 1 << bit
        file.write_bytes(bytes(raw))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["verify", str(path)])
        if region == "data":
            assert code == 1 and err.getvalue() == "", (out.getvalue(), err.getvalue())
            assert "are damaged" in out.getvalue()
        else:
            assert code == 2 and out.getvalue() == "", (out.getvalue(), err.getvalue())
            assert err.getvalue().startswith(f"taktiny: {file}: ")
            assert "the bytes of" not in err.getvalue()


@st.composite
def tiled(draw):
    """A tensor of at least two tiles (128 KiB to 2 MiB, axes of many factors of two), a
    block of it, and a byte of its data to damage."""
    dtype = draw(st.sampled_from([np.float32, np.int8, ml_dtypes.bfloat16]))
    ndim = draw(st.integers(1, 3))
    item = np.dtype(dtype).itemsize
    shape = [draw(st.sampled_from([8, 16, 24, 64])) for _ in range(ndim - 1)]
    least = draw(st.sampled_from([1 << 17, 1 << 19, 1 << 20]))  # grids of one axis or more
    last = -(-least // (math.prod(shape) * item))
    shape.append(-(-last // 8) * 8 * draw(st.integers(1, 2)))
    block = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        block.append((lo, draw(st.integers(lo + 1, n))))
    at = draw(st.integers(0, math.prod(shape) * item - 1))
    return np.dtype(dtype), tuple(shape), block, at


@settings(max_examples=examples(40))
@given(case=tiled(), bit=st.integers(0, 7))
def test_a_damaged_tile_fails_exactly_the_partial_reads_that_touch_it(case, bit):
    """A read of any block of a tiled tensor with one damaged bit raises, naming the tile,
    exactly when the block touches the tile holding the bit; otherwise it returns the
    block's values. Seen to catch: tiles hashed out of row-major order, a block cut from
    the wrong rows of a piece, a digest looked up by the wrong tile index."""
    dtype, shape, block, at = case
    value = np.random.default_rng(at).integers(-100, 100, shape).astype(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        save_safetensors(path, {"t": value})
        tensor = open_safetensors(path)["t"]
        assert tensor.tiles is not None
        parts = tensor.tiles[0]
        raw = bytearray(path.read_bytes())
        raw[tensor.offset + at] ^= 1 << bit
        path.write_bytes(bytes(raw))
        element = np.unravel_index(at // dtype.itemsize, shape)
        tile = [int(i) // (n // p) for i, n, p in zip(element, shape, parts, strict=True)]
        touched = all(
            lo // (n // p) <= t <= (hi - 1) // (n // p)
            for (lo, hi), n, p, t in zip(block, shape, parts, tile, strict=True)
        )
        index = [slice(*b) for b in block]
        if touched:
            with pytest.raises(
                SafetensorsError, match=r"'t' are damaged: the checksum of its tile"
            ):
                tensor.read(index)
        else:
            assert tensor.read(index).tobytes() == value[tuple(index)].tobytes()
