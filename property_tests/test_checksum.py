"""Checksums catch every damaged bit: whatever the tensors (dtypes including bfloat16, float8
and packed int4, 0-d and zero-size arrays) and however they are sharded into files, a bit
flipped anywhere in a file's data region is reported by ``load_safetensors`` (naming the
tensor whose bytes hold it) and by ``taktiny verify``'s check, and nothing else is."""

import json
import struct
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taktiny.io import SafetensorsError, load_safetensors, save_safetensors
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
