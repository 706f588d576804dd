"""taktiny.io.open_safetensors on bad input: every corrupt file, header and index is one
SafetensorsError that names the file and the tensor, raised before any data is read."""

import itertools
import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from taktiny.io import SafetensorsError, Tensor, open_safetensors, save_safetensors

TENSORS = {"a": np.arange(16, dtype=np.float32).reshape(4, 4), "b": np.arange(3, dtype=np.int64)}


def parts(path):
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write(path, header, data):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.safetensors"
    safetensors.numpy.save_file(TENSORS, str(path))
    return path


def test_a_good_file_reads_back_every_dtype(tmp_path):
    tensors = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "bf16": np.arange(4).astype(ml_dtypes.bfloat16),
        "f8": np.arange(4).astype(ml_dtypes.float8_e4m3fn),
        "u8": np.arange(5, dtype=np.uint8),
        "bool": np.array([True, False]),
        "scalar": np.array(2.5, np.float64),
        "empty": np.zeros((0, 3), np.float32),
    }
    save_safetensors(tmp_path / "all.safetensors", tensors)
    checkpoint = open_safetensors(tmp_path / "all.safetensors")
    assert set(checkpoint) == set(tensors)
    for name, expected in tensors.items():
        got = np.asarray(checkpoint[name])
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert got.tobytes() == expected.tobytes(), name
        assert got.size == 0 or got.ctypes.data % 64 == 0, name  # JAX adopts it uncopied


def test_blocks_read_only_their_bytes(good):
    tensor = open_safetensors(good)["a"]
    assert np.array_equal(tensor.read([slice(1, 3), slice(None)]), TENSORS["a"][1:3])
    assert np.array_equal(tensor.read([slice(None), slice(2, 4)]), TENSORS["a"][:, 2:])
    assert np.array_equal(tensor.read([slice(3, 4), slice(1, 2)]), TENSORS["a"][3:, 1:2])
    assert np.array_equal(tensor.read([slice(1, 3), slice(1, 3)]), TENSORS["a"][1:3, 1:3])
    cube = np.arange(60, dtype=np.int16).reshape(3, 4, 5)
    safetensors.numpy.save_file({"cube": cube}, str(good))
    tensor = open_safetensors(good)["cube"]
    block = (slice(1, 3), slice(0, 4), slice(2, 4))  # partial, whole, partial
    assert np.array_equal(tensor.read(block), cube[block])


def test_read_into_fills_the_start_of_a_buffer_it_views(tmp_path):
    cube = np.arange(60, dtype=np.int16).reshape(3, 4, 5)
    path = tmp_path / "cube.safetensors"
    save_safetensors(path, {"a": TENSORS["a"], "cube": cube})
    tensor = open_safetensors(path)["cube"]
    assert tensor.checksum is not None
    memory = bytearray(b"\xff" * (tensor.nbytes + 16))  # more than it needs
    got = tensor.read_into(memory)
    assert got.dtype == np.int16 and got.shape == (3, 4, 5)
    assert got.tobytes() == cube.tobytes()
    assert not got.flags.writeable
    assert np.shares_memory(got, np.frombuffer(memory, np.uint8))
    assert memory[tensor.nbytes :] == b"\xff" * 16  # only its bytes are written
    assert memory[: tensor.nbytes] == cube.tobytes()


def test_read_rows_gives_the_pieces_in_order_each_into_the_memory_asked(tmp_path):
    cube = np.arange(7 * 3 * 5, dtype=np.int16).reshape(7, 3, 5)
    path = tmp_path / "cube.safetensors"
    save_safetensors(path, {"cube": cube, "one": np.float32(2.5)})
    tensor = open_safetensors(path)["cube"]
    asked, buffers = [], [bytearray(96), bytearray(96)]

    def into(nbytes):
        asked.append(nbytes)
        return buffers[len(asked) % 2]

    pieces = [p.copy() for p in tensor.read_rows(3, into)]  # (each buffer read into again)
    assert asked == [90, 90, 30] and [p.shape for p in pieces] == [(3, 3, 5)] * 2 + [(1, 3, 5)]
    assert np.array_equal(np.concatenate(pieces), cube)
    (scalar,) = open_safetensors(path)["one"].read_rows(1, lambda n: bytearray(n))
    assert scalar.shape == () and scalar == np.float32(2.5)
    header, data = parts(path)
    raw = bytearray(path.read_bytes())
    raw[len(raw) - len(data) + header["cube"]["data_offsets"][1] - 10] ^= 1  # (its last row)
    path.write_bytes(bytes(raw))
    damaged = open_safetensors(path)["cube"]
    read = damaged.read_rows(3, lambda n: bytearray(n))
    assert [p.shape[0] for p in itertools.islice(read, 3)] == [3, 3, 1]  # every piece, then
    with pytest.raises(SafetensorsError, match="the bytes of 'cube' are damaged"):
        next(read)  # the check, before the iteration ends
    with pytest.raises(ValueError, match="at least one row at a time; got rows=0"):
        next(tensor.read_rows(0, lambda n: bytearray(n)))


def test_mapped_gives_a_local_files_own_pages_read_only(tmp_path, monkeypatch):
    import mmap
    import types

    import taktiny.io._storage as storage_module

    rng = np.random.default_rng(0)
    state = {f"t{i}": rng.standard_normal(1000 + 37 * i).astype(np.float32) for i in range(5)}
    state |= {"cube": np.arange(7 * 3 * 5, dtype=np.int16).reshape(7, 3, 5)}
    state |= {"none": np.zeros((0, 4), np.float32), "q": np.arange(-8, 8, dtype=ml_dtypes.int4)}
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    checkpoint = open_safetensors(path)
    for name, value in state.items():
        mapped = checkpoint[name].mapped()
        if name in ("none", "q"):  # (no bytes; stored packed two a byte)
            assert mapped is None
            continue
        assert mapped.dtype == value.dtype and not mapped.flags.writeable
        np.testing.assert_array_equal(mapped, value)  # (at offsets of every alignment)
    unmappable = types.SimpleNamespace(**{**vars(mmap), "mmap": _refused})
    monkeypatch.setattr(storage_module, "mmap", unmappable)
    assert open_safetensors(path)["cube"].mapped() is None  # (a file system that maps none)
    monkeypatch.undo()
    os.truncate(path, checkpoint["cube"].offset + 10)  # (cut after it was opened)
    with pytest.raises(
        SafetensorsError,
        match=rf"^{path}: the file ends inside the bytes of 'cube'; it was truncated after it "
        r"was opened\. Write it again\.$",
    ):
        checkpoint["cube"].mapped()


def test_a_file_is_mapped_once_for_the_tensors_in_a_window(tmp_path, monkeypatch):
    import mmap
    import types

    import taktiny.io._storage as storage_module

    unit = mmap.ALLOCATIONGRANULARITY
    state = {f"t{i}": np.full(unit // 4 + 3 * i, i, np.float32) for i in range(6)}
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    made = []

    class Counted(mmap.mmap):
        def __new__(cls, *args, **kwargs):
            made.append(kwargs.get("offset", 0))
            return super().__new__(cls, *args, **kwargs)

    counted = types.SimpleNamespace(**{**vars(mmap), "mmap": Counted})
    monkeypatch.setattr(storage_module, "mmap", counted)
    monkeypatch.setattr(storage_module, "MAP_WINDOW", 3 * unit)
    checkpoint = open_safetensors(path)
    views = {name: checkpoint[name].mapped() for name in state}  # (each kept: all live)
    for name, value in state.items():
        np.testing.assert_array_equal(views[name], value)
    # a window from the page of the first tensor it holds, 3 units long (at most to the
    # file's end); the next from the first tensor that ends past it (never split in two)
    expected, stop, size = [], 0, path.stat().st_size
    for name in state:
        start, end = checkpoint[name].offset, checkpoint[name].offset + checkpoint[name].nbytes
        if not expected or not (expected[-1] <= start and end <= stop):
            expected.append(start - start % unit)
            stop = min(max(end, expected[-1] + 3 * unit), size)
    assert made == expected and 1 < len(made) < len(state)
    views.clear()  # (no view lives: every window let go but the latest)
    checkpoint["t5"].mapped()
    assert len(made) == len(expected)  # the latest window, kept
    checkpoint["t0"].mapped()
    assert made[len(expected) :] == [expected[0]]  # mapped again


def _refused(*args, **kwargs):
    raise OSError(19, "No such device")  # (ENODEV)


def test_the_array_protocol_reads_in_the_dtype_asked(good):
    tensor = open_safetensors(good)["a"]
    for dtype in (np.int32, np.float16, np.float64):
        got = tensor.__array__(dtype)
        assert got.dtype == dtype and np.array_equal(got, TENSORS["a"].astype(dtype))
        assert np.asarray(tensor, dtype).dtype == dtype
    assert tensor.__array__().dtype == np.float32


def test_reads_take_one_contiguous_slice_per_axis(good):
    tensor = open_safetensors(good)["a"]
    with pytest.raises(
        ValueError,
        match=r"^Tensor\.read of 'a' \(shape \[4, 4\]\): reads take contiguous blocks, slices "
        r"with a step of 1, got slice\(None, None, 2\); read the block and slice the array it "
        r"returns \(array\[::2\]\)$",
    ):
        tensor.read([slice(None, None, 2), slice(None)])
    with pytest.raises(
        ValueError,
        match=r"^Tensor\.read of 'a' \(shape \[4, 4\]\): the index must be one slice per axis "
        r"\(2\), got \(slice\(0, 1, None\), slice\(0, 1, None\), slice\(0, 1, None\)\)$",
    ):
        tensor.read([slice(0, 1)] * 3)
    assert tensor.read([slice(3, 1), slice(None)]).shape == (0, 4)  # an empty block
    assert np.array_equal(tensor.read([slice(-2, None), slice(1, -1)]), TENSORS["a"][-2:, 1:-1])


def test_readahead_asks_for_the_bytes_ahead_of_the_reader_once_each(tmp_path, monkeypatch):
    import os

    from taktiny.loading._readers import Readahead

    path = tmp_path / "four.safetensors"
    arrays = {"x": np.ones(25, np.float32), "empty": np.zeros(0, np.float32),
              "y": np.ones(10, np.float32), "z": np.ones(25, np.float32)}  # fmt: skip
    save_safetensors(path, arrays)
    checkpoint = open_safetensors(path)
    tensors = [checkpoint[n] for n in arrays]  # the reader's order
    assert [t.nbytes for t in tensors] == [100, 0, 40, 100]
    x, _, y, z = (t.offset for t in tensors)
    asked = []

    def advise(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_WILLNEED
        asked.append((fd, offset, length))

    monkeypatch.setattr(os, "posix_fadvise", advise)
    with Readahead(tensors, window=150, chunk=64) as ahead:
        ahead.reached(0)  # 150 bytes ahead of x's start, in requests of 64 at most
        ahead.requests.join()  # (made by the read-ahead's own thread)
        assert [a[1:] for a in asked] == [(x, 64), (x + 64, 36), (y, 40), (z, 64)]
        ahead.reached(1)  # 150 bytes past x's end: z's last bytes
        ahead.requests.join()
        assert [a[1:] for a in asked[4:]] == [(z + 64, 36)]
        ahead.reached(2)
        ahead.reached(3)
        ahead.requests.join()
        assert len(asked) == 5  # each byte asked for once
        (fd,) = {a[0] for a in asked}  # the file opened once: as the checkpoint holds it
        assert os.path.samefile(f"/proc/self/fd/{fd}", path)
    assert os.path.samefile(f"/proc/self/fd/{fd}", path)  # the checkpoint's, still open
    asked.clear()
    with Readahead(tensors, window=64, chunk=64) as ahead:
        ahead.reached(3)  # a reader that overtook the requests: they start at its tensor
        ahead.reached(3)  # and go on from where they were
    assert [a[1:] for a in asked] == [(z, 64)]  # (every request claimed made on leaving)
    del checkpoint, tensors, ahead
    assert not os.path.exists(f"/proc/self/fd/{fd}")  # closed with the last of them
    asked.clear()
    made = [Tensor("z", (25,), np.float32, path, z), Tensor("y", (10,), np.float32, path, y)]
    with Readahead(made, window=150, chunk=64) as ahead:  # tensors made by hand, not opened
        ahead.reached(0)
        ahead.requests.join()
        assert [a[1:] for a in asked] == [(z, 64), (z + 64, 36), (y, 40)]
        (fd,) = {a[0] for a in asked}  # their file opened once, by the readahead
        assert os.path.samefile(f"/proc/self/fd/{fd}", path)
    assert not os.path.exists(f"/proc/self/fd/{fd}")  # and closed with it


def test_a_refused_read_ahead_request_ends_the_read_ahead_not_the_reads(tmp_path, monkeypatch):
    import os

    from taktiny.loading._readers import Readahead

    path = tmp_path / "two.safetensors"
    save_safetensors(path, {"x": np.ones(25, np.float32), "y": np.ones(10, np.float32)})
    checkpoint = open_safetensors(path)
    tensors = [checkpoint["x"], checkpoint["y"]]
    asked = []

    def refuse(fd, offset, length, advice):
        asked.append(offset)
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    with Readahead(tensors, window=64, chunk=64) as ahead:
        ahead.reached(0)  # x's first 64 bytes: refused
        ahead.requests.join()
        ahead.reached(1)  # x's last 36 and y's 40: never asked
    assert asked == [tensors[0].offset]
    assert np.array_equal(tensors[1].read(), np.ones(10, np.float32))


def test_a_truncated_file(good):
    raw = good.read_bytes()
    good.write_bytes(raw[:-10])
    with pytest.raises(
        SafetensorsError, match=r"good.safetensors: the bytes of 'a' run to 88, past"
    ):
        open_safetensors(good)
    good.write_bytes(raw[:5])
    with pytest.raises(SafetensorsError, match=r"good.safetensors: not a safetensors file"):
        open_safetensors(good)


def test_a_file_truncated_after_it_was_opened(good):
    checkpoint = open_safetensors(good)
    good.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(
        SafetensorsError, match=r"good.safetensors: the file ends inside the bytes of 'a'"
    ):
        np.asarray(checkpoint["a"])


def test_offsets_past_the_end_or_overlapping(good):
    header, data = parts(good)
    header["b"]["data_offsets"] = [64, 88]
    write(good, header, data)
    with pytest.raises(SafetensorsError, match=r"the bytes of '.' and '.' overlap"):
        open_safetensors(good)
    header["a"]["data_offsets"] = [16, 80]  # overlaps b's [0, 24) by 8 bytes only
    header["b"]["data_offsets"] = [0, 24]
    write(good, header, data)
    with pytest.raises(SafetensorsError, match=r"the bytes of 'b' and 'a' overlap"):
        open_safetensors(good)
    header["b"]["data_offsets"] = [88, 112]
    write(good, header, data)
    with pytest.raises(SafetensorsError, match=r"the bytes of 'b' run to 112, past the end"):
        open_safetensors(good)


def test_a_shape_that_disagrees_with_its_bytes(good):
    header, data = parts(good)
    header["a"]["shape"] = [4, 5]
    write(good, header, data)
    with pytest.raises(
        SafetensorsError, match=r"gives 'a' the shape \[4, 5\] of F32 \(80 bytes\) but 64"
    ):
        open_safetensors(good)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h: h["a"].update(dtype="F4"), r"'a' has the dtype 'F4', which Taktiny cannot read"),
        (lambda h: h["a"].update(shape=[4, -4]), r"the header entry of 'a' is"),
        (lambda h: h["a"].pop("data_offsets"), r"the header entry of 'a' is"),
    ],
)
def test_bad_header_entries(good, change, message):
    header, data = parts(good)
    change(header)
    write(good, header, data)
    with pytest.raises(SafetensorsError, match=message):
        open_safetensors(good)


def test_a_header_that_is_not_json_or_names_a_tensor_twice(good):
    _, data = parts(good)
    text = b'{"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [24, 88]}, "a": {}}'
    good.write_bytes(struct.pack("<Q", len(text)) + text + data)
    with pytest.raises(
        SafetensorsError, match=r"the header is not valid: the name 'a' appears twice"
    ):
        open_safetensors(good)
    good.write_bytes(struct.pack("<Q", 5) + b"{oops" + data)
    with pytest.raises(SafetensorsError, match=r"the header is not valid"):
        open_safetensors(good)


@pytest.fixture
def sharded(tmp_path):
    tensors = {f"t{i}": np.full((100,), i, np.float32) for i in range(4)}
    save_safetensors(tmp_path / "model.safetensors", tensors, max_shard_size=800)
    index = tmp_path / "model.safetensors.index.json"
    return index, json.loads(index.read_text())


def test_an_index_reads_its_shards(sharded):
    index, _ = sharded
    checkpoint = open_safetensors(index)
    assert list(checkpoint) == ["t0", "t1", "t2", "t3"]
    assert np.array_equal(np.asarray(checkpoint["t3"]), np.full((100,), 3, np.float32))


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ("../model-00001-of-00002.safetensors", r"the shard '\.\./model-00001.* is outside"),
        ("/etc/passwd", r"the shard '/etc/passwd' of 't0' is outside the index's folder"),
        ("gone.safetensors", r"the shard 'gone.safetensors' \(of 't0'\) is missing"),
        ("./model-00002-of-00002.safetensors", r"names one shard twice, as"),
    ],
)
def test_an_index_naming_bad_shards(sharded, shard, message):
    index, content = sharded
    content["weight_map"]["t0"] = shard
    index.write_text(json.dumps(content))
    with pytest.raises(SafetensorsError, match=message):
        open_safetensors(index)


def test_an_index_that_disagrees_with_its_shards(sharded):
    index, content = sharded
    assert content["weight_map"]["t0"] != content["weight_map"]["t2"]
    content["weight_map"]["t0"] = content["weight_map"]["t2"]
    index.write_text(json.dumps(content))
    with pytest.raises(SafetensorsError, match=r"holds 't0', but the index puts it in"):
        open_safetensors(index)
    del content["weight_map"]["t0"]
    index.write_text(json.dumps(content))
    with pytest.raises(SafetensorsError, match=r"holds 't0', but the index does not list it"):
        open_safetensors(index)
    content["weight_map"]["t9"] = content["weight_map"]["t1"]
    content["weight_map"]["t0"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(content))
    with pytest.raises(SafetensorsError, match=r"lists \['t9'\] in shards that do not hold them"):
        open_safetensors(index)
    content["weight_map"].update({f"t{i}": content["weight_map"]["t1"] for i in range(10, 15)})
    index.write_text(json.dumps(content))  # six names lacking: the first five are listed
    with pytest.raises(SafetensorsError, match=r": the index lists \['t9', 't10', 't11', 't12', "
                       r"'t13'\] in shards that do not hold them\.$"):  # fmt: skip
        open_safetensors(index)
    index.write_text('{"metadata": {}}')
    with pytest.raises(SafetensorsError, match=r"not a safetensors index"):
        open_safetensors(index)


def test_an_index_takes_its_shards_in_the_order_of_their_names(tmp_path):
    save = safetensors.numpy.save_file
    save({"t0": np.zeros(2, np.float32)}, str(tmp_path / "z.safetensors"), metadata={"n": "z"})
    save({"t1": np.ones(2, np.float32)}, str(tmp_path / "a.safetensors"), metadata={"n": "a"})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"t1": "a.safetensors", "t0": "./z.safetensors"}}))
    checkpoint = open_safetensors(index)  # './z.safetensors' sorts before 'a.safetensors'
    assert list(checkpoint) == ["t0", "t1"]
    assert checkpoint.metadata == {"n": "z"}  # the first shard's
    index.write_text(json.dumps({"weight_map": {}}))
    empty = open_safetensors(index)
    assert len(empty) == 0 and empty.metadata == {} and empty.quantized == {}


def test_an_index_of_up_to_a_headers_byte_limit_is_read(sharded, monkeypatch):
    from taktiny.io import _checkpoint

    index, _ = sharded
    size = index.stat().st_size
    monkeypatch.setattr(_checkpoint, "HEADER_LIMIT", size)
    assert len(open_safetensors(index)) == 4  # at the limit
    monkeypatch.setattr(_checkpoint, "HEADER_LIMIT", size - 1)
    with pytest.raises(SafetensorsError, match=rf": not a safetensors index \({size} bytes, more "
                       rf"than the {size - 1} a header may have\)"):  # fmt: skip
        open_safetensors(index)


def test_a_folder_must_hold_one_checkpoint(tmp_path):
    for name in ("a", "b"):
        safetensors.numpy.save_file(TENSORS, str(tmp_path / f"{name}.safetensors"))
    with pytest.raises(SafetensorsError, match=r"it holds 2: \['a.safetensors', 'b.safetensors'\]"):
        open_safetensors(tmp_path)
    for name in ("c", "d", "e", "f"):
        safetensors.numpy.save_file(TENSORS, str(tmp_path / f"{name}.safetensors"))
    with pytest.raises(
        SafetensorsError,
        match=r"it holds 6: \['a.safetensors', 'b.safetensors', 'c.safetensors', 'd.safetensors', "
        r"'e.safetensors'\]\. Name the file or index to read\.$",
    ):
        open_safetensors(tmp_path)  # the first five named
    with pytest.raises(SafetensorsError, match=r"missing.safetensors: no such file"):
        open_safetensors(tmp_path / "missing.safetensors")


def test_hidden_files_in_a_folder_are_not_its_checkpoint(tmp_path):
    """macOS leaves ``._name`` files (AppleDouble) beside the files it copies."""
    safetensors.numpy.save_file(TENSORS, str(tmp_path / "model.safetensors"))
    (tmp_path / "._model.safetensors").write_bytes(b"\0\5\26\7" + bytes(80))
    assert open_safetensors(tmp_path).path == tmp_path / "model.safetensors"


@pytest.mark.parametrize("length", [None, 200, 201, 400])
def test_a_path_that_cannot_be_opened_is_shown_whole_up_to_200_characters(
    tmp_path, monkeypatch, length
):
    """What a user without the right to list a folder gets (PermissionError): the path as
    given, or its first 100 characters and its length past 200; the error's own text cut
    at 200 characters."""
    from taktiny.io import _checkpoint

    path = str(tmp_path / "x")
    path, length = (path.ljust(length, "x"), length) if length else (path, len(path))
    assert len(path) == length

    def refused(path):
        raise PermissionError(13, "Permission denied", str(path) + "y" * 200)

    monkeypatch.setattr(_checkpoint, "_find", refused)
    shown = repr(path) if length <= 200 else repr(f"{path[:100]}...({length} characters)")
    error = str(PermissionError(13, "Permission denied", path + "y" * 200))[:200]
    with pytest.raises(SafetensorsError) as raised:
        open_safetensors(path)
    assert str(raised.value) == (
        f"{shown}: cannot be opened (PermissionError: {error}); name an existing .safetensors "
        f"file, index or folder."
    )


def test_a_tensor_described_by_hand_reads_in_a_numpy_dtype_given_by_name(tmp_path):
    from taktiny.io import Tensor

    path = tmp_path / "raw.bin"
    path.write_bytes(b"head" + np.arange(6, dtype=np.float32).tobytes())
    for dtype in ("float32", np.float32, np.dtype("float32"), "F32"):
        tensor = Tensor("w", (2, 3), dtype, path, 4)
        assert tensor.dtype == np.float32 and tensor.nbytes == 24, dtype
        assert np.array_equal(np.asarray(tensor), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_paths_that_cannot_name_a_file_are_refused_by_name(tmp_path):
    with pytest.raises(
        SafetensorsError,
        match=r"^'x{100}\.\.\.\(5000 characters\)': cannot be opened \(OSError: .*File name too long",
    ):
        open_safetensors("x" * 5000)
    with pytest.raises(SafetensorsError, match=r"^'a\\x00b': no such file\.$"):
        open_safetensors("a\0b")
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    with pytest.raises(
        SafetensorsError, match=r"loop\.safetensors.*(no such file|cannot be opened)"
    ):
        open_safetensors(loop)


def test_the_path_of_a_sharded_save_opens_its_index(tmp_path):
    from taktiny.io import save_safetensors

    save_safetensors(tmp_path / "model.safetensors", TENSORS, max_shard_size=8)
    assert not (tmp_path / "model.safetensors").exists()
    checkpoint = open_safetensors(tmp_path / "model.safetensors")
    assert checkpoint.path == tmp_path / "model.safetensors.index.json"
    assert sorted(checkpoint) == sorted(TENSORS)


def _oracle(text):
    """A header's names, dtypes, shapes, byte ranges and metadata, by a plain parse."""
    header = json.loads(text)
    metadata = header.pop("__metadata__", {})
    entries = list(header.values())
    return (list(header), [e["dtype"] for e in entries], [e["shape"] for e in entries],
            [e["data_offsets"] for e in entries], metadata)  # fmt: skip


@pytest.mark.parametrize(
    "tensors, metadata",
    [
        (TENSORS, None),  # safetensors' own header: no metadata
        ({"a": np.zeros(0, np.float32)}, {}),
        (
            {"x:y": np.ones((2, 1, 3), ml_dtypes.bfloat16), "b": np.ones(1, np.bool_)},
            {"key: with colons": "a value: with colons", "k": ""},
        ),
        ({f"layers.{i}.w": np.full((2, 2), i, np.int8) for i in range(12)}, {"step": "3"}),
    ],
)
def test_a_good_header_takes_the_fast_parse_and_reads_as_a_full_parse_reads_it(
    tmp_path, monkeypatch, tensors, metadata
):
    """Headers without a backslash are read by one `json.loads` without a hook (`_unhooked`,
    a fifth faster on large headers, bench/headers.py); the fields are those of a full
    parse. (Were the fast path to give up, the full parse would still be right, but slow.)"""
    from taktiny.io import _header

    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)
    length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    text = path.read_bytes()[8 : 8 + length]
    fields = _header._unhooked(text)
    assert fields is not None
    assert [list(f) if not isinstance(f, dict) else f for f in fields] == list(_oracle(text))

    def unused(text, what):
        raise AssertionError("a good header without a backslash took the full parse")

    monkeypatch.setattr(_header, "parse_json", unused)  # opening takes the fast parse
    assert sorted(open_safetensors(path)) == sorted(tensors)


def test_every_byte_is_read_through_the_storage_interface(tmp_path, monkeypatch):
    """Headers, indexes, tensors, blocks, tiles and the load's read-ahead reach a file only
    through its `Storage` (`read_into`, `advise`): a storage other than a local file needs
    nothing else. Every system call that reads or advises is logged with whether a
    Storage method made it."""
    import os
    import threading

    import jax

    from taktiny.io import _storage, load_safetensors

    path = tmp_path / "model.safetensors"
    values = {"w": np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)}
    values |= {f"b{i}": np.full(16, i, np.float32) for i in range(6)}
    save_safetensors(path, values, max_shard_size=64 * 1024)  # an index and its shards
    inside, calls = threading.local(), []

    def through(method):
        def call(self, *args):
            inside.n = getattr(inside, "n", 0) + 1
            try:
                return method(self, *args)
            finally:
                inside.n -= 1

        return call

    def logged(name):
        real = getattr(os, name)

        def call(fd, *args):
            if os.path.realpath(f"/proc/self/fd/{fd}").startswith(str(tmp_path.resolve())):
                calls.append((name, getattr(inside, "n", 0) > 0))
            return real(fd, *args)

        return call

    for method in ("read_into", "advise"):
        monkeypatch.setattr(_storage.OpenFile, method, through(getattr(_storage.OpenFile, method)))
    for name in ("read", "readv", "pread", "preadv", "posix_fadvise"):
        monkeypatch.setattr(os, name, logged(name))
    checkpoint = open_safetensors(path)
    assert np.array_equal(
        checkpoint["w"].read([slice(3, 9), slice(100, 200)]), values["w"][3:9, 100:200]
    )
    blocks = checkpoint["w"].read_blocks([[(0, 128), (0, 256)], [(128, 256), (0, 256)]])
    assert np.array_equal(np.concatenate(blocks), values["w"])
    target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in values.items()}
    loaded = load_safetensors(target, path)
    assert all(np.array_equal(loaded[n], v) for n, v in values.items())
    assert {name for name, _ in calls} >= {"preadv", "posix_fadvise"}
    assert [call for call in calls if not call[1]] == []


def test_small_tensors_read_together_one_read_for_each_run_of_neighbours(tmp_path, monkeypatch):
    """read_together: each tensor as its own read gives it, at a multiple of 64 bytes of
    one buffer, read-only; the tensors next to each other in a file read by one preadv,
    a gap or another file starting a new one; damaged bytes named as a read names them,
    and a file truncated since it was opened names the tensor it ends inside."""
    import os

    from taktiny.io._read import read_together

    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    values = {f"t{i}": np.arange(i * 7, i * 7 + 5 + i, dtype=np.float32) for i in range(5)}
    values["i"] = np.arange(6, dtype=np.int64).reshape(2, 3)
    save_safetensors(first, values)
    save_safetensors(second, {"u": np.ones((3, 3), np.float16)})
    checkpoint, other = open_safetensors(first), open_safetensors(second)
    order = sorted(checkpoint.values(), key=lambda t: t.offset)
    skipped = order[:2] + order[3:]  # a gap: the third tensor is left out
    tensors = [*skipped, other["u"]]
    calls = []
    real = os.preadv

    def logged(fd, buffers, offset, *flags):
        calls.append(offset)
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", logged)
    outs = read_together(tensors)
    assert len(calls) == 3  # the first two, the rest of the file, the other file
    monkeypatch.undo()
    for tensor, out in zip(tensors, outs, strict=True):
        assert out.dtype == tensor.dtype and not out.flags.writeable
        assert out.tobytes() == np.asarray(tensor.read()).tobytes()
        assert out.ctypes.data % 64 == 0
    assert [o.ctypes.data - outs[0].ctypes.data for o in outs[:2]] == [0, 64]
    # damaged bytes: the tensor, the file and both checksums, as a read names them
    name = order[3].name
    data = bytearray(first.read_bytes())
    data[order[3].offset + 1] ^= 4
    first.write_bytes(bytes(data))
    damaged = open_safetensors(first)
    with pytest.raises(SafetensorsError, match=rf"the bytes of '{name}' are damaged"):
        read_together([damaged[t.name] for t in order])
    assert len(read_together([damaged[t.name] for t in order], verify=False)) == len(order)
    # truncated after it was opened: the tensor the file now ends inside
    first.write_bytes(bytes(data[: order[-1].offset + 2]))
    with pytest.raises(
        SafetensorsError, match=rf"the file ends inside the bytes of '{order[-1].name}'"
    ):
        read_together([damaged[t.name] for t in order], verify=False)
