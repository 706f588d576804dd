"""Tile checksums: save_safetensors writes, besides each tensor's digest, the digests of
its tiles (tensors of 128 KiB or more), so that a read of part of a tensor (a host's
blocks in a multi-process load) checks only the tiles it touches and reads only their
bytes. A damaged tile fails a read that touches it, naming the tile; a read that does not
touch it succeeds. A malformed record is refused when the file is opened. The
two-process byte counts are in tests/loading/test_multiprocess.py."""

import json
import re
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import xxhash

from taktiny.io import SafetensorsError, open_safetensors, save_safetensors
from taktiny.io._checksum import grid


def header_of(path):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), 8 + length


def tiles_of(path):
    header, _ = header_of(path)
    return json.loads(header["__metadata__"]["taktiny_tile_checksums"])


@pytest.mark.parametrize(
    ("shape", "itemsize", "expected"),
    [
        ((4096, 4096), 4, (8, 8)),  # 64 tiles of 1 MiB
        ((512, 512), 4, (4, 4)),  # 16 tiles of 64 KiB: the smallest tile
        ((512, 64), 4, (2, 1)),  # 128 KiB: two tiles, on the first axis
        ((64, 2048), 4, (4, 2)),
        ((1, 256, 512), 2, (1, 2, 2)),  # the first axis cannot be cut: last, then middle
        ((3, 5, 7000), 4, (1, 1, 4)),  # 7000 = 8 x 875 but 8 tiles would be under 64 KiB
        ((100_000,), 4, (4,)),
        ((96, 96, 96, 96), 2, (4, 2, 2, 4)),  # 64 tiles at most
        ((511, 511), 4, (1, 1)),  # no axis divides: one tile (no tile digests)
        ((64, 64), 4, (1, 1)),  # 16 KiB: too small for two tiles
        ((), 4, ()),
        ((0, 1024), 4, (1, 1)),
    ],
)
def test_the_grid_cuts_the_first_and_last_axes_first_into_tiles_of_at_least_64_kib(
    shape, itemsize, expected
):
    assert grid(shape, itemsize) == expected


@pytest.fixture
def saved(tmp_path):
    rng = np.random.default_rng(0)
    values = {
        "a": rng.standard_normal((512, 512), np.float32),  # tiles (4, 4)
        "b": rng.standard_normal((64, 2048), np.float32),  # tiles (4, 2)
        "c": rng.standard_normal((100_000,), np.float32),  # tiles (4,)
        "small": rng.standard_normal((8, 8), np.float32),  # no tiles
    }
    path = tmp_path / "tiles.safetensors"
    save_safetensors(path, values)
    return values, path


def test_each_tiles_digest_is_the_xxh3_128_of_its_bytes_in_row_major_order(saved):
    values, path = saved
    record = tiles_of(path)
    assert record["algorithm"] == "xxh3_128"
    assert set(record["tensors"]) == {"a", "b", "c"}  # "small" is one tile
    for name, entry in record["tensors"].items():
        value, parts = values[name], entry["grid"]
        sizes = [n // p for n, p in zip(value.shape, parts, strict=True)]
        expected = ""
        for index in np.ndindex(*parts):  # row-major over the grid
            tile = value[
                tuple(slice(i * s, (i + 1) * s) for i, s in zip(index, sizes, strict=True))
            ]
            expected += xxhash.xxh3_128_hexdigest(np.ascontiguousarray(tile).tobytes())
        assert entry["digests"] == expected
        tensor = open_safetensors(path)[name]
        assert tensor.tiles == (tuple(parts), expected)
    assert open_safetensors(path)["small"].tiles is None


def flip(path, name, at):
    """Flips the lowest bit of element `at` (an index) of tensor `name` in the file."""
    header, start = header_of(path)
    entry = header[name]
    item = np.dtype(entry["dtype"].lower().replace("f32", "float32")).itemsize
    flat = int(np.ravel_multi_index(at, entry["shape"]))
    data = bytearray(path.read_bytes())
    data[start + entry["data_offsets"][0] + flat * item] ^= 1
    path.write_bytes(bytes(data))


def test_a_damaged_tile_fails_the_reads_that_touch_it_and_no_other(saved):
    values, path = saved
    flip(path, "a", (200, 300))  # in tile (1, 2): rows 128-256, columns 256-384
    tensor = open_safetensors(path)["a"]
    message = (
        rf"{path}: the bytes of 'a' are damaged: the checksum of its tile \[128:256, "
        rf"256:384\] is [0-9a-f]{{32}}, and the header records [0-9a-f]{{32}} \(xxh3_128\)"
    )
    with pytest.raises(SafetensorsError, match=message):
        tensor.read([slice(200, 201), slice(300, 301)])  # one element of the tile
    with pytest.raises(SafetensorsError, match=message):
        tensor.read_blocks([[(0, 256), (0, 512)], [(256, 512), (0, 512)]][:1])
    with pytest.raises(SafetensorsError, match=message):  # a block that spans tiles
        tensor.read_blocks([[(0, 512), (0, 128)], [(0, 512), (128, 512)]][1:])
    # blocks that miss the tile read and verify: their bytes are intact
    assert np.array_equal(tensor.read([slice(256, 512), slice(None)]), values["a"][256:])
    left = tensor.read_blocks([[(0, 512), (0, 128)], [(0, 512), (128, 256)]])
    assert np.array_equal(np.concatenate(left, axis=1), values["a"][:, :256])
    # the whole tensor is checked against its own digest
    with pytest.raises(SafetensorsError, match=r"'a' are damaged: their checksum is"):
        tensor.read()
    assert tensor.read([slice(200, 201), slice(300, 301)], verify=False).shape == (1, 1)


@pytest.mark.parametrize(
    ("name", "blocks"),
    [
        ("a", [[(0, 256), (0, 512)]]),  # the first two rows of tiles: one run of bytes
        ("a", [[(0, 512), (128, 256)], [(0, 512), (256, 384)]]),  # two columns of tiles
        ("a", [[(100, 300), (10, 20)]]),  # inside rows 0-384, columns 0-128 of tiles
        ("b", [[(0, 64), (1024, 2048)]]),  # an inner-axis half
        ("c", [[(25_000, 50_000)], [(75_000, 100_000)]]),
    ],
)
def test_a_partial_read_reads_only_the_bytes_of_the_tiles_it_touches_each_once(
    saved, monkeypatch, name, blocks
):
    from taktiny.io import _read

    values, path = saved
    tensor = open_safetensors(path)[name]
    parts, _ = tensor.tiles
    size = [n // p for n, p in zip(tensor.shape, parts, strict=True)]
    touched = np.zeros(tensor.shape, bool)
    for b in blocks:
        touched[
            tuple(slice(lo // s * s, -(-hi // s) * s) for (lo, hi), s in zip(b, size, strict=True))
        ] = True
    wanted = np.flatnonzero(touched.reshape(-1)) * 4 + tensor.offset
    real, ranges = _read._pread, []

    def logged(fd, to, at, *args, **kwargs):
        ranges.append((at, memoryview(to).nbytes))
        return real(fd, to, at, *args, **kwargs)

    monkeypatch.setattr(_read, "_pread", logged)
    outs = tensor.read_blocks(blocks)
    read = np.concatenate([np.arange(at, at + n, 4) for at, n in ranges])
    assert np.array_equal(np.sort(read), wanted)  # the tiles' bytes, each once, no other
    for out, b in zip(outs, blocks, strict=True):
        assert np.array_equal(out, values[name][tuple(slice(*x) for x in b)])
        assert not out.flags.writeable


def test_a_packed_4_bit_tensor_checks_the_tiles_of_its_stored_bytes(tmp_path):
    value = np.arange(512 * 1024, dtype=np.int64).reshape(512, 1024) % 15 - 7
    path = tmp_path / "q.safetensors"
    save_safetensors(path, {"q": value.astype(ml_dtypes.int4)})
    tensor = open_safetensors(path)["q"]
    assert tensor.packed and tensor.stored.tiles[0] == (2, 2)  # 512 x 512 bytes stored
    block = [slice(0, 128), slice(0, 512)]
    assert np.array_equal(tensor.read(block).astype(np.int64), value[:128, :512])
    header, start = header_of(path)
    data = bytearray(path.read_bytes())
    data[start + header["q"]["data_offsets"][0] + 300 * 512 + 400] ^= 1  # tile (1, 1)
    path.write_bytes(bytes(data))
    tensor = open_safetensors(path)["q"]
    assert np.array_equal(tensor.read(block).astype(np.int64), value[:128, :512])
    damaged = r"'q' are damaged: the checksum of its tile \[256:512, 256:512\] is"
    with pytest.raises(SafetensorsError, match=damaged):
        tensor.read([slice(256, 512), slice(512, 1024)])
    with pytest.raises(SafetensorsError, match=damaged):
        tensor.read_blocks([[(0, 256), (0, 1024)], [(256, 512), (0, 1024)]])


def digests(n):
    return '"' + "0" * 32 * n + '"'


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("not json", r"'taktiny_tile_checksums' is not valid JSON"),
        ('{"algorithm": "md5", "tensors": {}}', r"names the algorithm 'md5'"),
        ('{"algorithm": "xxh3_128", "tensors": []}', r"'tensors' must map tensor names"),
        ('{"algorithm": "xxh3_128"}', r"must be a JSON object with 'algorithm' and 'tensors'"),
        (
            '{"algorithm": "xxh3_128", "tensors": {"x": {"grid": [2, 1], "digests": ""}}}',
            r"gives tiles for 'x', which the file does not hold",
        ),
        (
            '{"algorithm": "xxh3_128", "tensors": {"w": {"grid": [3, 1], "digests": ""}}}',
            r"gives 'w' \(stored shape \[64, 8\]\) the tiles \{'digests': '', 'grid': \[3, 1\]\}: "
            r"expected \{'grid': \[parts per axis, each dividing the axis",
        ),
        (
            '{"algorithm": "xxh3_128", "tensors": {"w": {"grid": [2], "digests": ""}}}',
            r"gives 'w' \(stored shape \[64, 8\]\) the tiles",
        ),
        (
            '{"algorithm": "xxh3_128", "tensors": {"w": {"grid": [1, 1], "digests": ""}}}',
            r"gives 'w' \(stored shape \[64, 8\]\) the tiles",  # one tile is no grid
        ),
        (
            '{"algorithm": "xxh3_128", "tensors": {"w": {"grid": [2.0, 1], "digests": ""}}}',
            r"gives 'w' \(stored shape \[64, 8\]\) the tiles",
        ),
        (
            '{"algorithm": "xxh3_128", "tensors": {"w": {"grid": [0, 1], "digests": ""}}}',
            r"gives 'w' \(stored shape \[64, 8\]\) the tiles",
        ),
        (
            '{"algorithm": "xxh3_128", "tensors": {"w": [2, 1]}}',
            r"gives 'w' \(stored shape \[64, 8\]\) the tiles \[2, 1\]",
        ),
        (
            '{"algorithm": "xxh3_128", "tensors": {"w": {"grid": [64, 8], "digests": "", "x": 1}}}',
            r"gives 'w' \(stored shape \[64, 8\]\) the tiles",
        ),
        (
            '{"algorithm": "xxh3_128", "tensors": {"w": {"grid": [2, 1], "digests": '
            + digests(3)
            + "}}}",
            r"gives 'w' the tile digests '0{37}\.\.\.0{38}': expected 2 digests of 32 hex digits, "
            r"one per tile of its grid \[2, 1\]",
        ),
        (
            '{"algorithm": "xxh3_128", "tensors": {"w": {"grid": [2, 1], "digests": "'
            + "0" * 32
            + "G" * 32
            + '"}}}',
            r"gives 'w' the tile digests .*: expected 2 digests of 32 hex digits",
        ),
    ],
)
def test_a_malformed_tile_record_is_refused_when_the_file_is_opened(tmp_path, record, message):
    path = tmp_path / "m.safetensors"
    w = np.ones((64, 8), np.float32)
    safetensors.numpy.save_file({"w": w}, path, {"taktiny_tile_checksums": record})
    with pytest.raises(SafetensorsError, match=rf"m\.safetensors: .*{message}.*header is corrupt"):
        open_safetensors(path)


def test_the_tile_checksum_key_is_taktinys_own(tmp_path):
    with pytest.raises(ValueError, match=r"metadata key 'taktiny_tile_checksums' is Taktiny's"):
        save_safetensors(
            tmp_path / "m.safetensors",
            {"w": np.ones(2, np.float32)},
            metadata={"taktiny_tile_checksums": "{}"},
        )


def test_verify_checks_the_tiles_digests_too(saved):
    """``taktiny verify`` (and Tensor.verify) checks each tile's digest besides the whole
    tensor's: a header whose tile digest is wrong for intact bytes is reported, as a host
    reading that tile would find it."""
    from taktiny.io._verify import verify

    _, path = saved
    assert verify(path) == (4, 0, [])
    header, start = header_of(path)
    record = json.loads(header["__metadata__"]["taktiny_tile_checksums"])
    digests = record["tensors"]["b"]["digests"]
    wrong = digests[:32] + ("1" if digests[32] == "0" else "0") + digests[33:]  # tile (0, 1)
    record["tensors"]["b"]["digests"] = wrong
    header["__metadata__"]["taktiny_tile_checksums"] = json.dumps(record)
    # (without the header's own digest, as an older Taktiny wrote it: a header it seals is
    # refused as damaged before a tile's digest is read)
    del header["__metadata__"]["taktiny_header_checksums"]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[start:])
    report = verify(path)
    assert report.checked == 3 and len(report.damaged) == 1
    assert re.fullmatch(
        rf"{re.escape(str(path))}: the bytes of 'b' are damaged: the checksum of its tile "
        rf"\[0:16, 1024:2048\] is {digests[32:64]}, and the header records {wrong[32:64]} "
        r"\(xxh3_128\)\. .*",
        report.damaged[0],
    )
    tensor = open_safetensors(path)["b"]
    tensor.read()  # the whole tensor matches its own digest
    with pytest.raises(SafetensorsError, match=r"the checksum of its tile \[0:16, 1024:2048\]"):
        tensor.verify()
