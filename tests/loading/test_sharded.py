"""Sharded loads with taktiny.io.load_safetensors: the devices of one process read the blocks
they hold together, each byte they need once and no byte outside them, whatever the plan
(outer or inner axis split, replicated, 2-D meshes, mixed); each block is bitwise the
file's."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _reads import log_preads
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from taktiny.io import Tensor, load_safetensors, open_safetensors, save_safetensors

MiB = 2**20
SHAPES = {  # name -> (shape, dtype): each plan below splits them along some axis
    "wide": ((64, 2048), np.float32),  # an inner split: 8 runs of 1 KiB per row
    "tall": ((512, 256), np.float32),  # an outer split: one run per block
    "long": ((2, 2**19), np.float32),  # split on its last axis: runs of >= 1 MiB
    "cube": ((8, 16, 64), ml_dtypes.bfloat16),  # three axes: split on the middle and last
    "bias": ((64,), np.float32),
}
ONE, TWO = ((8,), ("x",)), ((2, 4), ("a", "b"))  # meshes made in the tests, not at import


def mesh_of(shape_and_axes):
    return jax.make_mesh(*shape_and_axes)


PLANS = {  # plan -> (mesh, spec per tensor): every tensor not named is replicated
    "one device": (None, {}),
    "outer": (ONE, {"wide": P("x"), "tall": P("x"), "bias": P("x"), "cube": P("x")}),
    "inner": (ONE, {"wide": P(None, "x"), "tall": P(None, "x"), "long": P(None, "x")}),
    "replicated": (ONE, {}),
    "2-D": (TWO, {"wide": P("a", "b"), "tall": P("b", "a"), "cube": P(None, "a", "b")}),
    "2-D inner": (TWO, {"wide": P(None, "b"), "tall": P(None, ("a", "b")), "long": P("a", "b")}),
    "mixed": (
        TWO,
        {"wide": P(None, "a"), "tall": P("b"), "cube": P("a", None, "b"), "long": P(None, "a")},
    ),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    rng = np.random.default_rng(0)
    values = {
        name: rng.standard_normal(shape, np.float32).astype(dtype)
        for name, (shape, dtype) in SHAPES.items()
    }
    path = tmp_path_factory.mktemp("sharded") / "tensors.safetensors"
    save_safetensors(path, values)
    return values, path


@pytest.fixture
def preads(monkeypatch):
    """Every read of a file's bytes: (path, offset, bytes read)."""
    return log_preads(monkeypatch)


def target(plan):
    mesh, specs = PLANS[plan]
    return {
        name: jax.ShapeDtypeStruct(
            shape,
            jnp.dtype(dtype),
            sharding=SingleDeviceSharding(jax.devices()[0])
            if mesh is None
            else NamedSharding(mesh_of(mesh), specs.get(name, P())),
        )
        for name, (shape, dtype) in SHAPES.items()
    }


def read_of(log, path, tensor):
    """The reads that fall in `tensor`'s bytes, as (start, stop) in the file."""
    end = tensor.offset + tensor.nbytes
    return [(at, at + n) for file, at, n in log if file == str(path) and tensor.offset <= at < end]


def merged(ranges):
    out = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_every_plan_loads_bitwise_reading_each_byte_once(saved, preads, plan, verify):
    values, path = saved
    want = target(plan)
    loaded = load_safetensors(want, path, verify=verify)
    checkpoint = open_safetensors(path)
    for name, value in values.items():
        array = loaded[name]
        assert array.sharding == want[name].sharding, name
        assert np.asarray(array).tobytes() == value.tobytes(), name
        for shard in array.addressable_shards:
            assert np.asarray(shard.data).tobytes() == value[shard.index].tobytes(), name
        tensor = checkpoint[name]
        ranges = read_of(preads, path, tensor)
        # nothing outside the tensor's bytes, all of them read (every device here is this
        # process's), and each once: a checksum is computed from the bytes as they are read;
        # blocks of long runs read straight into their buffers out of the file's order
        # ("long" in "mixed") are checked against the digests of its tiles as they are read
        assert all(stop <= tensor.offset + tensor.nbytes for _, stop in ranges), name
        assert merged(ranges) == [(tensor.offset, tensor.offset + tensor.nbytes)], name
        assert sum(stop - start for start, stop in ranges) == tensor.nbytes, name
    assert checkpoint["long"].tiles is not None


def test_blocks_read_together_are_cut_from_rows_read_a_few_mib_at_a_time(saved, preads):
    """An inner split reads its rows sequentially in pieces of at most a few MiB (not one
    read per row and device), and the blocks are what NumPy's slices of the tensor are."""
    values, path = saved
    tensor = open_safetensors(path)["wide"]
    blocks = [((0, 64), (k * 256, (k + 1) * 256)) for k in range(8)]
    out = tensor.read_blocks(blocks)  # and verified: hashed as the rows are read
    for block, array in zip(blocks, out, strict=True):
        assert np.array_equal(array, values["wide"][tuple(slice(*b) for b in block)])
        assert not array.flags.writeable
        assert array.ctypes.data % 4096 == 0  # its own page-aligned buffer (JAX adopts it)
    ranges = read_of(preads, path, tensor)
    assert merged(ranges) == [(tensor.offset, tensor.offset + tensor.nbytes)]
    assert len(ranges) == 1  # 512 KiB: one piece
    big = np.arange(512 * 4096, dtype=np.float32).reshape(512, 4096)  # 8 MiB: pieces
    save_safetensors(path.with_name("big.safetensors"), {"big": big})
    tensor = open_safetensors(path.with_name("big.safetensors"))["big"]
    preads.clear()
    blocks = [((0, 512), (k * 512, (k + 1) * 512)) for k in range(8)]
    for block, array in zip(blocks, tensor.read_blocks(blocks), strict=True):
        assert np.array_equal(array, big[tuple(slice(*b) for b in block)])
    ranges = read_of(preads, path.with_name("big.safetensors"), tensor)
    assert merged(ranges) == [(tensor.offset, tensor.offset + tensor.nbytes)]
    assert max(stop - start for start, stop in ranges) <= 4 * MiB < tensor.nbytes


def test_blocks_of_one_process_read_only_their_own_bytes(saved, preads):
    """Another process's blocks are not read: four of eight column blocks (one process of
    two, on an inner split) read half the tensor, row by row, and nothing else; blocks
    that do not tile a box are each read alone."""
    values, path = saved
    tensor = open_safetensors(path)["tall"]
    mine = [((0, 512), (k * 32, (k + 1) * 32)) for k in range(4)]  # columns 0 to 128
    for block, array in zip(mine, tensor.read_blocks(mine, verify=False), strict=True):
        assert np.array_equal(array, values["tall"][tuple(slice(*b) for b in block)])
    ranges = read_of(preads, path, tensor)
    assert sum(stop - start for start, stop in ranges) == tensor.nbytes // 2
    assert all((start - tensor.offset) % 1024 < 512 for start, _ in ranges)  # left halves
    preads.clear()
    apart = [((0, 512), (0, 32)), ((0, 512), (128, 160))]  # a gap between: read one by one
    for block, array in zip(apart, tensor.read_blocks(apart, verify=False), strict=True):
        assert np.array_equal(array, values["tall"][tuple(slice(*b) for b in block)])
    assert sum(stop - start for start, stop in read_of(preads, path, tensor)) == 2 * 512 * 32 * 4
    preads.clear()  # verified: through the digests of its tiles, (4, 2): the left ones
    assert tensor.tiles is not None and tensor.tiles[0] == (4, 2)
    tensor.read_blocks(mine)
    assert sum(stop - start for start, stop in read_of(preads, path, tensor)) == tensor.nbytes // 2
    preads.clear()  # without tiles (as an older Taktiny wrote it), the whole streamed first
    tensor.tiles = None
    tensor.read_blocks(mine)
    assert sum(stop - start for start, stop in read_of(preads, path, tensor)) == 1.5 * tensor.nbytes


def plans_of(shape):
    for plan in ("one device", "outer", "inner", "2-D", "2-D inner", "mixed"):
        mesh, specs = PLANS[plan]
        sharding = (
            SingleDeviceSharding(jax.devices()[0])
            if mesh is None
            else NamedSharding(mesh_of(mesh), specs.get("wide", P()))
        )
        yield {"wide": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)}


def test_a_damaged_tensor_is_refused_on_every_plan(tmp_path):
    """The bytes streamed through the hash as the blocks are read are the bytes checked,
    piece by piece as the rows are read (8 MiB here: two pieces): a sound file loads, and
    one flipped byte in a tensor split any way is found."""
    values = {"wide": np.arange(512 * 4096, dtype=np.float32).reshape(512, 4096)}
    path = tmp_path / "t.safetensors"
    save_safetensors(path, values)
    tensor = open_safetensors(path)["wide"]
    for want in plans_of((512, 4096)):
        assert np.array_equal(load_safetensors(want, path)["wide"], values["wide"])
    with open(path, "r+b") as f:
        f.seek(tensor.offset + tensor.nbytes - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 1]))
    for want in plans_of((512, 4096)):
        with pytest.raises(ValueError, match="the bytes of 'wide' are damaged"):
            load_safetensors(want, path)


def test_a_4_bit_tensor_split_on_any_axis_is_unpacked_block_by_block(tmp_path):
    values = {"q": np.arange(16 * 64).reshape(16, 64).astype(ml_dtypes.int4)}
    path = tmp_path / "q.safetensors"
    save_safetensors(path, values)
    for spec in (P("x"), P(None, "x"), P(None, ("a", "b"))):
        mesh = mesh_of(ONE if "x" in spec else TWO)
        want = {"q": jax.ShapeDtypeStruct((16, 64), jnp.int4, sharding=NamedSharding(mesh, spec))}
        loaded = load_safetensors(want, path)
        assert np.asarray(loaded["q"]).tobytes() == values["q"].tobytes()


def test_read_blocks_of_tensors_not_read_together(saved, preads):
    """Blocks with no short runs (outer splits, one-axis tensors) are read straight into
    their own buffers, in the file's order and hashed as they are read when they are each
    one run; blocks of long runs out of order are checked against the digests of the tiles
    they touch as they are read, or, for a tensor without tiles, verified first."""
    values, path = saved
    checkpoint = open_safetensors(path)
    for name, blocks, tiles in [
        ("tall", [((k * 64, (k + 1) * 64), (0, 256)) for k in range(8)], True),
        ("bias", [((0, 32),), ((32, 64),)], True),
        ("long", [((0, 2), (0, 2**18)), ((0, 2), (2**18, 2**19))], True),
        ("long", [((0, 2), (0, 2**18)), ((0, 2), (2**18, 2**19))], False),
        ("cube", [((0, 8), (0, 16), (0, 64))], True),
    ]:
        tensor: Tensor = checkpoint[name]
        if not tiles:  # as in a file an older Taktiny wrote
            tensor.tiles = None
        preads.clear()
        for block, array in zip(blocks, tensor.read_blocks(blocks), strict=True):
            assert array.tobytes() == values[name][tuple(slice(*b) for b in block)].tobytes()
        read = sum(stop - start for start, stop in read_of(preads, path, tensor))
        assert read == tensor.nbytes * (1 if tiles else 2), name


@pytest.mark.parametrize(
    ("shape", "dtype", "perm"),
    [
        ((512, 4096), np.float32, None),  # 8 MiB: two pieces, the rows of each moved in runs
        ((6, 10, 12), ml_dtypes.bfloat16, (1, 2, 0)),
        ((6, 10, 12), np.int8, (-1, 0, 1)),
        ((5,), np.float32, None),
        ((), np.float64, None),
    ],
)
def test_read_transposed_is_numpy_s_transpose_read_once(tmp_path, preads, shape, dtype, perm):
    rng = np.random.default_rng(1)
    value = (rng.standard_normal(shape) * 50).astype(dtype)
    path = tmp_path / "t.safetensors"
    save_safetensors(path, {"t": value})
    tensor = open_safetensors(path)["t"]
    preads.clear()
    got = tensor.read_transposed(perm)  # verified: hashed as it is read
    want = np.transpose(value, perm)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()
    assert not got.flags.writeable and got.flags.c_contiguous
    ranges = read_of(preads, path, tensor)
    assert sum(stop - start for start, stop in ranges) == tensor.nbytes  # each byte once
    assert all(stop - start <= 4 * MiB for start, stop in ranges)  # a piece at a time


def test_read_transposed_of_a_damaged_or_packed_tensor(tmp_path):
    value = np.arange(512 * 4096, dtype=np.float32).reshape(512, 4096)
    packed = np.arange(8 * 6).reshape(8, 6).astype(ml_dtypes.int4)
    path = tmp_path / "t.safetensors"
    save_safetensors(path, {"t": value, "q": packed})
    checkpoint = open_safetensors(path)
    assert np.array_equal(checkpoint["q"].read_transposed(), packed.T)
    with open(path, "r+b") as f:
        f.seek(checkpoint["t"].offset + 5 * MiB)  # in the second piece
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ValueError, match="the bytes of 't' are damaged"):
        checkpoint["t"].read_transposed()
    flipped = checkpoint["t"].read_transposed(verify=False)
    assert np.sum(flipped != value.T) == 1


def test_a_transposing_rule_reads_into_the_leaves_not_a_scratch_buffer(
    tmp_path, preads, monkeypatch
):
    """A rule that only transposes reads each tensor once, piece by piece into the leaf's
    own buffer (its peak memory is the model and one piece): no read buffer holds a whole
    tensor, on one device or sharded."""
    from taktiny import convert as cv
    from taktiny.loading import _place

    rng = np.random.default_rng(2)
    values = {"w": rng.standard_normal((64, 128), np.float32), "b": np.ones(64, np.float32)}
    path = tmp_path / "t.safetensors"
    save_safetensors(path, {"w": values["w"].T.copy(), "b": values["b"]})
    monkeypatch.setattr(_place.Scratch, "read", None)  # fails if a step reads into it
    rule = [cv.Rule("{p}", "{p}", cv.transpose())]
    for sharding in (
        SingleDeviceSharding(jax.devices()[1]),
        NamedSharding(mesh_of(ONE), P(None, "x")),
    ):
        want = {
            n: jax.ShapeDtypeStruct(
                v.shape,
                jnp.float32,
                sharding=sharding if v.ndim == 2 else SingleDeviceSharding(jax.devices()[1]),
            )
            for n, v in values.items()
        }
        preads.clear()
        loaded = load_safetensors(want, path, rules=rule)
        for name, value in values.items():
            assert np.asarray(loaded[name]).tobytes() == value.tobytes()
            assert loaded[name].sharding == want[name].sharding
        assert sum(n for _, _, n in preads) >= values["w"].nbytes + values["b"].nbytes
        tensor = open_safetensors(path)["w"]
        assert sum(stop - start for start, stop in read_of(preads, path, tensor)) == tensor.nbytes
