"""taktiny.io.save_safetensors: files read back bitwise, shards and their index, header
metadata, and failed saves that leave nothing behind."""

import json
import os
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import xxhash
from _models import MLP
from jax.sharding import NamedSharding, PartitionSpec

import taktiny as tt
from taktiny import nn
from taktiny.io import _write, save_safetensors

# safetensors' dtype names; its numpy loader knows no bfloat16 or float8, so the tests parse
# the files themselves (an 8-byte header length, a JSON header, then the tensor bytes)
DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "U16": np.uint16,
    "I32": np.int32,
    "U32": np.uint32,
    "I64": np.int64,
    "U64": np.uint64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


def read(path):
    """The header metadata and the tensors of a safetensors file."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    body = data[8 + length :]
    metadata = header.pop("__metadata__", None)
    tensors = {}
    for name, entry in header.items():
        start, stop = entry["data_offsets"]
        flat = np.frombuffer(body[start:stop], dtype=DTYPES[entry["dtype"]])
        tensors[name] = flat.reshape(entry["shape"])
    return metadata, tensors


def assert_bitwise(got, expected):
    expected = np.asarray(expected)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.tobytes() == np.ascontiguousarray(expected).tobytes()


def random_array(dtype, shape, seed=0):
    """Random bits of `dtype` (NaN payloads and all), as a JAX array."""
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return jnp.asarray(rng.integers(0, 2, shape).astype(np.bool_))
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return jnp.asarray(np.frombuffer(rng.bytes(size), dtype=dtype).reshape(shape))


def test_a_failure_after_the_commit_is_a_warning_and_the_checkpoint_stays(tmp_path, monkeypatch):
    import inspect
    import warnings

    from taktiny.io import _save

    sync = _save._Commit._sync

    def failing(folder):  # the folder's own flushes fail, after the commit
        if folder == tmp_path:
            raise OSError("the disk is gone")
        sync(folder)

    monkeypatch.setattr(_save._Commit, "_sync", staticmethod(failing))
    path = tmp_path / "w.safetensors"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # (unwrapped: the test-time type checks wrap it in frames of their own)
        inspect.unwrap(save_safetensors)(path, {"w": np.ones(2, np.float32)})
    assert [w.filename for w in caught] == [__file__, __file__]  # the caller's line
    assert [str(w.message) for w in caught] == [
        f"save_safetensors: {path} is saved, but flushing its directory to disk failed (the "
        f"disk is gone): it may not survive a power loss.",
        f"save_safetensors: {path} is saved, but removing the previous checkpoint's files "
        f"failed (the disk is gone); the next save to it removes them.",
    ]
    assert safetensors.numpy.load_file(str(path))["w"].tolist() == [1.0, 1.0]


def test_without_the_safetensors_package_saving_says_to_install_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)  # the import fails
    with pytest.raises(
        ImportError,
        match=r"^taktiny\.io\.save_safetensors needs the safetensors package: pip install "
        r"'taktiny\[safetensors\]'\.$",
    ):
        save_safetensors(tmp_path / "w.safetensors", {"w": np.ones(2, np.float32)})
    assert not list(tmp_path.iterdir())


def test_a_model_round_trips_bitwise_with_metadata_in_the_header(tmp_path):
    model = MLP(rngs=nn.Rngs(0))
    path = tmp_path / "model.safetensors"
    written = save_safetensors(path, model, metadata={"step": "12"})
    assert written == [path]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    metadata, tensors = read(path)
    sealed = json.loads(metadata.pop("taktiny_header_checksums"))
    # the digest of each other metadata entry, and of the header's bytes (the length prefix,
    # the JSON and its padding) with the 32 digits of that digest read as zeros
    assert sealed["metadata"] == {
        k: xxhash.xxh3_128_hexdigest(v.encode()) for k, v in metadata.items()
    }
    assert sealed["metadata_digest"] == xxhash.xxh3_128_hexdigest(
        json.dumps(sealed["metadata"], separators=(",", ":")).encode()
    )
    data = path.read_bytes()
    head = data[: 8 + struct.unpack("<Q", data[:8])[0]]
    assert head.count(sealed["header"].encode()) == 1
    zeroed = head.replace(sealed["header"].encode(), b"0" * 32)
    assert sealed["header"] == xxhash.xxh3_128_hexdigest(zeroed)
    assert sealed["algorithm"] == "xxh3_128" and len(sealed) == 4
    checksums = json.loads(metadata.pop("taktiny_checksums"))
    assert tt.Schema.from_json(metadata.pop("taktiny_schema")) == tt.schema(model)
    assert metadata == {"format": "taktiny", "taktiny_version": tt.__version__, "step": "12"}
    expected = model.flat_state_dict()
    # every tensor's XXH3-128 digest, computed here from the bytes the file holds
    assert checksums == {
        "algorithm": "xxh3_128",
        "tensors": {n: xxhash.xxh3_128_hexdigest(t.tobytes()) for n, t in tensors.items()},
    }
    assert list(tensors) == sorted(expected)  # safetensors orders its header by name
    for name, value in expected.items():
        assert_bitwise(tensors[name], value)
    # and the safetensors library reads it too
    loaded = safetensors.numpy.load_file(path)
    np.testing.assert_array_equal(loaded["input.kernel"], np.asarray(model.input.kernel))


@pytest.mark.parametrize(
    "dtype",
    [
        jnp.float32,
        jnp.float16,
        jnp.bfloat16,
        jnp.float8_e4m3fn,
        jnp.float8_e5m2,
        jnp.int8,
        jnp.uint8,
        jnp.int16,
        jnp.uint16,
        jnp.int32,
        jnp.uint32,
        jnp.bool_,
    ],
    ids=lambda d: np.dtype(d).name,
)
def test_every_dtype_round_trips_bitwise(tmp_path, dtype, platform):
    value = random_array(dtype, (3, 5))
    path = tmp_path / "flat.safetensors"
    save_safetensors(path, {"layer.weight": value, "empty": jnp.zeros((0, 4), dtype)})
    _, tensors = read(path)
    assert_bitwise(tensors["layer.weight"], value)
    assert_bitwise(tensors["empty"], np.zeros((0, 4), dtype))


def test_host_arrays_64_bit_non_contiguous_and_sharded_arrays_are_saved(tmp_path):
    strided = np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2]
    assert not strided.flags.c_contiguous
    mesh = jax.make_mesh((8,), ("x",))
    spread = jax.device_put(
        random_array(jnp.float32, (8, 3)), NamedSharding(mesh, PartitionSpec("x"))
    )
    path = tmp_path / "flat.safetensors"
    scalar = jnp.float32(2.5)  # a 0-d array stays 0-d (a step count, a temperature)
    flat = {"strided": strided, "f64": np.linspace(0, 1, 5), "spread": spread, "scalar": scalar}
    save_safetensors(path, flat)
    _, tensors = read(path)
    assert tensors["scalar"].shape == () and tensors["scalar"] == 2.5
    assert_bitwise(tensors["strided"], strided)
    assert_bitwise(tensors["f64"], np.linspace(0, 1, 5))
    assert_bitwise(tensors["spread"], spread)


def test_any_pytree_is_saved_under_its_flat_state_dict_names(tmp_path):
    tree = {"model": nn.Linear(2, 3, rngs=nn.Rngs(1)), "step": [jnp.arange(3)]}
    save_safetensors(tmp_path / "t.safetensors", tree)
    _, tensors = read(tmp_path / "t.safetensors")
    expected = tt.flat_state_dict(tree)
    assert sorted(tensors) == sorted(expected) == ["model.bias", "model.kernel", "step.0"]
    for name, value in expected.items():
        assert_bitwise(tensors[name], value)


@pytest.mark.parametrize("limit", [1200, "1.2KB"])
def test_shards_and_an_index_hold_every_tensor_once(tmp_path, limit):
    model = MLP(rngs=nn.Rngs(0))  # kernels of 8192 and 1024 bytes, biases of 256 and 16
    path = tmp_path / "model.safetensors"
    written = save_safetensors(path, model, max_shard_size=limit)
    index_path = tmp_path / "model.safetensors.index.json"
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert written == [tmp_path / s for s in shards] + [index_path]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*shards, index_path.name])
    index = json.loads(index_path.read_text())
    expected = model.flat_state_dict()
    assert index["metadata"] == {"total_size": sum(v.nbytes for v in expected.values())}
    assert index["metadata"]["total_size"] == 8192 + 256 + 1024 + 16
    assert sorted(index["weight_map"]) == sorted(expected)
    assert index["weight_map"] == {
        "input.kernel": shards[0],
        "input.bias": shards[1],
        "output.kernel": shards[2],
        "output.bias": shards[2],
    }
    seen = {}
    for shard in shards:
        metadata, tensors = read(tmp_path / shard)
        assert metadata["format"] == "taktiny"
        for name, value in tensors.items():
            assert name not in seen and index["weight_map"][name] == shard
            seen[name] = value
        # the big kernel has a shard of its own; the others stay within the limit
        assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 1200
    assert sorted(seen) == sorted(expected)
    for name, value in expected.items():
        assert_bitwise(seen[name], value)


def test_a_limit_everything_fits_in_writes_one_file_and_no_index(tmp_path):
    path = tmp_path / "model.safetensors"
    assert save_safetensors(path, MLP(rngs=nn.Rngs(0)), max_shard_size="1GiB") == [path]
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_a_failed_sharded_save_leaves_no_file_and_no_temporary(tmp_path, monkeypatch):
    real = _write.write_file
    calls = []

    def fail_on_the_second_shard(tensors, filename, metadata):
        calls.append(filename)
        real(tensors, filename, metadata)  # the bytes are on disk, then it fails
        if len(calls) == 2:
            raise RuntimeError("disk full")

    monkeypatch.setattr(_write, "write_file", fail_on_the_second_shard)
    with pytest.raises(OSError, match=r"writing .*model-00002-of-00003\.safetensors: disk full"):
        save_safetensors(tmp_path / "model.safetensors", MLP(rngs=nn.Rngs(0)), max_shard_size=1200)
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []


def test_a_failed_rename_removes_the_shards_already_in_place(tmp_path, monkeypatch):
    real = os.replace

    def fail_on_the_index(src, dst):
        if str(dst).endswith(".index.json"):
            raise OSError("rename refused")
        real(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_the_index)
    with pytest.raises(OSError, match="rename refused"):
        save_safetensors(tmp_path / "model.safetensors", MLP(rngs=nn.Rngs(0)), max_shard_size=1200)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_save_whose_cleanup_fails_too_raises_its_own_error(tmp_path, monkeypatch):
    real_replace, real_unlink = os.replace, os.unlink
    refused = OSError("rename refused")

    def fail_on_the_index(src, dst):
        if str(dst).endswith(".index.json"):
            raise refused
        real_replace(src, dst)

    def read_only(path, *args, **kwargs):  # the folder went read-only: nothing is removed
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "replace", fail_on_the_index)
    monkeypatch.setattr(os, "unlink", read_only)
    with pytest.raises(OSError, match=r"^rename refused$") as info:
        save_safetensors(tmp_path / "model.safetensors", MLP(rngs=nn.Rngs(0)), max_shard_size=1200)
    assert info.value is refused  # not the cleanup's error
    left = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in left if not n.startswith(".")] == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ] and len(left) == 4  # the shards and the staging folder, which it could not remove
    monkeypatch.setattr(os, "replace", real_replace)
    monkeypatch.setattr(os, "unlink", real_unlink)
    written = save_safetensors(tmp_path / "model.safetensors", MLP(rngs=nn.Rngs(1)))
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in written]


def test_a_failed_save_over_an_earlier_one_leaves_it_as_it_was(tmp_path, monkeypatch):
    # (tests/io/test_crash.py fails and kills every step of every kind of save)
    path, index = tmp_path / "model.safetensors", tmp_path / "model.safetensors.index.json"
    save_safetensors(path, MLP(rngs=nn.Rngs(0)), max_shard_size=1200)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real, renamed = os.replace, []

    def fail_on_the_second_shard(src, dst):
        renamed.append(dst)
        if len(renamed) == 2:
            raise OSError("rename refused")
        real(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_the_second_shard)
    with pytest.raises(OSError, match="rename refused"):
        save_safetensors(path, MLP(rngs=nn.Rngs(1)), max_shard_size=1200)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.setattr(os, "replace", real)
    # the earlier shards keep their names: the new ones take a suffix of their own
    written = save_safetensors(path, MLP(rngs=nn.Rngs(0)), max_shard_size=1200)
    assert [p.name for p in written[:1]] != ["model-00001-of-00003.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)
    save_safetensors(path, MLP(rngs=nn.Rngs(2)))  # one file, and the index goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert not index.exists()


def test_none_in_a_mapping_is_an_empty_subtree_as_in_flat_state_dict(tmp_path):
    save_safetensors(tmp_path / "n.safetensors", {"w": jnp.ones(2), "cache": None})
    assert list(read(tmp_path / "n.safetensors")[1]) == ["w"]


def test_int4_is_packed_two_per_byte_and_listed_in_the_header(tmp_path):
    # (tests/io/test_quantized_files.py tests the packing and quantized models in full)
    tensors = {"ok": jnp.ones(4), "packed.weight": jnp.array([-8, 7, -1], jnp.int4)}
    path = tmp_path / "q.safetensors"
    save_safetensors(path, tensors)
    metadata, stored = read(path)
    assert stored["packed.weight"].dtype == np.uint8
    assert stored["packed.weight"].tolist() == [0x78, 0x0F]  # low nibble first, zero-padded
    assert json.loads(metadata["taktiny_packed"]) == {
        "packed.weight": {"dtype": "int4", "shape": [3]}
    }


def test_the_quantization_metadata_keys_are_taktinys_own(tmp_path):
    for key in ("taktiny_packed", "taktiny_quantized", "taktiny_header_checksums"):
        with pytest.raises(ValueError, match=f"metadata key '{key}' is Taktiny's own"):
            save_safetensors(tmp_path / "m.safetensors", {"w": jnp.ones(2)}, metadata={key: "{}"})
    assert list(tmp_path.iterdir()) == []


def test_an_array_other_processes_hold_parts_of_is_refused_by_name(tmp_path, monkeypatch):
    # one process cannot make such an array: this one says it is one
    spread = jnp.ones(8)
    monkeypatch.setattr(type(spread), "is_fully_addressable", property(lambda self: False))
    with pytest.raises(ValueError, match=r"'w' is spread over several processes.*gather it"):
        save_safetensors(tmp_path / "p.safetensors", {"w": spread})
    assert list(tmp_path.iterdir()) == []


def test_prng_keys_are_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match=r"'seed' is an array of PRNG keys.*key_data"):
        save_safetensors(tmp_path / "k.safetensors", {"seed": jax.random.key(0)})


@pytest.mark.parametrize("wait", [True, False], ids=["waits", "background"])
def test_a_deleted_array_is_refused_by_name_before_anything_is_written(tmp_path, wait):
    step = jax.jit(lambda w: w + 1, donate_argnums=0)
    weights = jnp.ones(8)
    step(weights)  # (donated: deleted)
    with pytest.raises(RuntimeError, match=r"'w' is an array that has been deleted \(donated"):
        save_safetensors(tmp_path / "d.safetensors", {"w": weights, "b": jnp.ones(2)}, wait=wait)
    assert list(tmp_path.iterdir()) == []


def test_tensors_are_laid_out_as_the_safetensors_library_lays_them_out(tmp_path):
    # by dtype, largest item size first, each at a multiple of its item size, then by name
    state = {
        "z": np.arange(3, dtype=np.int8),
        "b": np.arange(5, dtype=np.float16),
        "y": np.arange(3, dtype=np.float64),
        "a": jnp.arange(7, dtype=jnp.int16),
        "c": np.arange(2, dtype=np.uint8),
    }
    path = tmp_path / "l.safetensors"
    save_safetensors(path, state)
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0 and data[8 + length - 1 : 8 + length] in (b"}", b" ")
    header = json.loads(data[8 : 8 + length])
    ranges = {n: e["data_offsets"] for n, e in header.items() if n != "__metadata__"}
    assert sorted(ranges, key=lambda n: ranges[n][0]) == ["y", "b", "a", "z", "c"]
    for name, (start, stop) in ranges.items():
        assert start % np.asarray(state[name]).itemsize == 0
        assert data[8 + length + start : 8 + length + stop] == np.asarray(state[name]).tobytes()
    loaded = safetensors.numpy.load_file(path)  # (the library's own reader takes it)
    assert all(np.array_equal(loaded[n], np.asarray(a)) for n, a in state.items())
    header["__metadata__"] = {"format": "taktiny"}  # (the library writes the same layout)
    safetensors.numpy.save_file({n: np.asarray(a) for n, a in state.items()}, tmp_path / "s")
    theirs = (tmp_path / "s").read_bytes()
    (n,) = struct.unpack("<Q", theirs[:8])
    assert {k: v for k, v in json.loads(theirs[8 : 8 + n]).items() if k != "__metadata__"} == {
        k: v for k, v in header.items() if k != "__metadata__"
    }


@pytest.mark.usefixtures("without_type_checks")
def test_metadata_must_be_strings_and_leave_the_format_keys_alone(tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(TypeError, match=r"metadata must map strings to strings.*'step': 12"):
        save_safetensors(path, {"w": jnp.ones(2)}, metadata={"step": 12})
    with pytest.raises(ValueError, match=r"metadata key 'format' is Taktiny's own"):
        save_safetensors(path, {"w": jnp.ones(2)}, metadata={"format": "pt"})
    assert list(tmp_path.iterdir()) == []


def test_bad_paths_names_and_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"must name a '\*\.safetensors' file: .*model\.bin"):
        save_safetensors(tmp_path / "model.bin", {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"tensor names must be strings, got 3"):
        save_safetensors(tmp_path / "m.safetensors", {3: jnp.ones(2)})
    with pytest.raises(ValueError, match=r"max_shard_size '5 parsecs' is not a size"):
        save_safetensors(tmp_path / "m.safetensors", {"w": jnp.ones(2)}, max_shard_size="5 parsecs")
    with pytest.raises(ValueError, match=r"max_shard_size must be positive, got 0"):
        save_safetensors(tmp_path / "m.safetensors", {"w": jnp.ones(2)}, max_shard_size=0)
    assert list(tmp_path.iterdir()) == []


def test_a_dtype_safetensors_cannot_store_is_refused_with_the_list_of_those_it_can(tmp_path):
    message = (
        "save_safetensors: 'w' has dtype complex128, which safetensors cannot store; it stores "
        "bfloat16, bool, complex64, float16, float32, float64, float8_e4m3fn, float8_e5m2, "
        "int16, int32, int64, int8, uint16, uint32, uint64, uint8, and int4, uint4, "
        "float4_e2m1fn packed two per byte"
    )
    with pytest.raises(TypeError) as error:
        save_safetensors(tmp_path / "c.safetensors", {"w": np.ones(2, np.complex128)})
    assert str(error.value) == message
    assert list(tmp_path.iterdir()) == []


def test_python_numbers_are_saved_as_numpy_reads_them(tmp_path):
    path = tmp_path / "v.safetensors"
    save_safetensors(path, {"w": 2.5, "n": 3})  # leaves without a dtype
    _, tensors = read(path)
    assert_bitwise(tensors["w"], np.array(2.5))
    assert_bitwise(tensors["n"], np.array(3))


def test_a_limit_of_one_byte_gives_each_tensor_a_shard_of_its_own(tmp_path):
    written = save_safetensors(
        tmp_path / "m.safetensors",
        {"a": np.ones(2, np.float32), "b": np.zeros(3)},
        max_shard_size=1,
    )
    assert [p.name for p in written] == [
        "m-00001-of-00002.safetensors",
        "m-00002-of-00002.safetensors",
        "m.safetensors.index.json",
    ]


def test_files_are_written_as_transformers_writes_them(tmp_path):
    # the index indented by 2 with a final newline, the files readable by all (0o644 less the
    # umask), the checksums' record compact (it is repeated in each shard's header)
    path = tmp_path / "m.safetensors"
    state = {"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)}
    written = save_safetensors(path, state, max_shard_size=1)
    index = {
        "metadata": {"total_size": 20},
        "weight_map": {"a": written[0].name, "b": written[1].name},
    }
    assert written[2].read_text() == json.dumps(index, indent=2) + "\n"
    os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT, 0o644))  # (the umask's)
    for file in written:
        assert os.stat(file).st_mode & 0o777 == os.stat(tmp_path / "probe").st_mode & 0o777, file
    metadata, _ = read(written[0])
    digest = xxhash.xxh3_128_hexdigest(np.ones(2, np.float32).tobytes())
    compact = '{"algorithm":"xxh3_128","tensors":{"a":"' + digest + '"}}'
    assert metadata["taktiny_checksums"] == compact


def test_a_save_over_a_one_file_checkpoint_removes_what_killed_saves_left(tmp_path):
    path = tmp_path / "m.safetensors"
    save_safetensors(path, {"a": np.ones(2, np.float32)})
    left = tmp_path / ".m.safetensors.0123456789ab.tmp"  # a killed save's temporary file
    left.write_bytes(b"partial")
    save_safetensors(path, {"a": np.zeros(2, np.float32)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


@pytest.mark.parametrize("kind", ["plain", "quantized", "stacked"])
def test_a_save_flattens_the_tree_once(tmp_path, flattens, kind):
    """The names, the quantized parameters' layouts and the schema (its stacks, its state
    versions) all come from one flatten of the tree, its description cached by structure."""
    model = MLP(rngs=nn.Rngs(0))
    if kind == "quantized":
        model = tt.quantize(model, bits=4, group_size=16)
    elif kind == "stacked":
        model = nn.Stack(lambda rngs: MLP(rngs=rngs), 2, rngs=nn.Rngs(0))
    path = tmp_path / "model.safetensors"
    save_safetensors(path, model)  # (the structure's description made, and cached)
    calls = flattens(model)
    save_safetensors(path, model)
    assert calls == ["tree_flatten"]
    metadata, _ = read(path)
    assert tt.Schema.from_json(metadata["taktiny_schema"]) == tt.schema(model)
    assert ("taktiny_quantized" in metadata) == (kind == "quantized")
