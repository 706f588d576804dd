"""Checksums of the data: save_safetensors writes an XXH3-128 digest of every tensor's bytes
into each file's header; every read verifies it (load_safetensors into concrete, abstract
and sharded models, with and without rules; Tensor reads of a whole tensor or a block;
4-bit packed tensors), a damaged byte is a SafetensorsError naming the file, the tensor and
both checksums before anything is returned, ``verify=False`` turns it off, and files
without checksums load as before. The property over every bit is in
property_tests/test_checksum.py; ``taktiny verify`` is in tests/package/test_cli.py."""

import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import xxhash
from _models import MLP
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import convert as cv
from taktiny import nn
from taktiny.io import (
    SafetensorsError,
    load_safetensors,
    open_safetensors,
    save_safetensors,
)
from taktiny.io._verify import verify


def abstract_mlp():
    return jax.eval_shape(lambda: MLP(rngs=nn.Rngs(0)))


def flip(path, name, byte=0, bit=0):
    """Flips one bit of tensor `name`'s bytes in the file at `path`; returns the tensor's
    digest as the header records it."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    begin, _ = header[name]["data_offsets"]
    data[8 + length + begin + byte] ^= 1 << bit
    path.write_bytes(bytes(data))
    return json.loads(header["__metadata__"]["taktiny_checksums"])["tensors"][name]


@pytest.fixture
def saved(tmp_path):
    model = MLP(rngs=nn.Rngs(1))
    path = tmp_path / "mlp.safetensors"
    save_safetensors(path, model)
    return model, path


def damaged(path, name, expected):
    """The message a damaged tensor gives: its file, its name, both checksums."""
    return rf"{path}: the bytes of '{name}' are damaged: their checksum is [0-9a-f]{{32}}, and the header records {expected} \(xxh3_128\)"


def test_the_header_records_each_tensors_digest_of_its_stored_bytes(saved):
    _, path = saved
    checkpoint = open_safetensors(path)
    for tensor in checkpoint.values():
        stored = np.asarray(tensor, dtype=None).tobytes()
        assert tensor.checksum == xxhash.xxh3_128_hexdigest(stored)


@pytest.mark.parametrize("abstract", [True, False], ids=["abstract", "concrete"])
def test_a_flipped_bit_fails_the_load_naming_file_tensor_and_both_checksums(saved, abstract):
    model, path = saved
    expected = flip(path, "output.kernel", byte=37, bit=5)
    target = abstract_mlp() if abstract else MLP(rngs=nn.Rngs(2))
    with pytest.raises(SafetensorsError, match=damaged(path, "output.kernel", expected)):
        load_safetensors(target, path)
    # turned off, the damaged value loads: the check is what refused it
    loaded = load_safetensors(target, path, verify=False)
    got, want = np.asarray(loaded.output.kernel), np.asarray(model.output.kernel)
    assert (got != want).sum() == 1


def test_damage_is_found_on_every_path_of_the_loader(saved):
    _, path = saved
    expected = flip(path, "input.kernel", byte=1000)
    mesh = jax.make_mesh((2, 4), ("rows", "cols"))
    match = damaged(path, "input.kernel", expected)
    # read block by block onto a sharded leaf
    sharded = tt.shard(abstract_mlp(), [("input.kernel", P(None, "cols"))], mesh)
    with pytest.raises(SafetensorsError, match=match):
        load_safetensors(sharded, path)
    got = load_safetensors(sharded, path, verify=False)  # no check: the bytes as they are
    stored = open_safetensors(path)["input.kernel"].read(verify=False)
    assert np.asarray(got.input.kernel).tobytes() == stored.tobytes()
    # replicated on a mesh
    replicated = tt.shard(abstract_mlp(), [("input.kernel", P())], mesh)
    with pytest.raises(SafetensorsError, match=match):
        load_safetensors(replicated, path)
    # through a transforming rule (the scratch buffers)
    rules = [
        cv.Rule("{layer}.kernel", "{layer}.kernel", cv.cast(jnp.float32)),
        cv.Rule("{layer}.bias", "{layer}.bias"),
    ]
    with pytest.raises(SafetensorsError, match=match):
        load_safetensors(abstract_mlp(), path, rules=rules)


def test_tensor_reads_verify_whole_tensors_and_blocks(saved):
    _, path = saved
    expected = flip(path, "input.kernel", byte=4 * 64 * 31 + 3)  # in the last row
    tensor = open_safetensors(path)["input.kernel"]
    assert tensor.checksum == expected
    match = damaged(path, "input.kernel", expected)
    with pytest.raises(SafetensorsError, match=match):
        tensor.read()
    with pytest.raises(SafetensorsError, match=match):
        np.asarray(tensor)
    with pytest.raises(SafetensorsError, match=match):  # a block elsewhere: the whole is checked
        tensor.read([slice(0, 2), slice(None)])
    with pytest.raises(SafetensorsError, match=match):
        tensor.read_into(bytearray(tensor.nbytes))
    with pytest.raises(SafetensorsError, match=match):
        tensor.verify()
    assert tensor.read([slice(0, 2), slice(None)], verify=False).shape == (2, 64)
    assert tensor.read(verify=False).shape == (32, 64)
    # the other tensors are intact
    open_safetensors(path)["input.bias"].verify()


def test_a_read_checks_the_bytes_it_returns_and_a_block_reads_only_its_own(saved, monkeypatch):
    from taktiny.io import _read

    _, path = saved
    tensor = open_safetensors(path)["input.kernel"]  # float32[32, 64], with a checksum
    real, read = _read._pread, []

    def counted(fd, to, at, *args, **kwargs):
        read.append(memoryview(to).nbytes)
        return real(fd, to, at, *args, **kwargs)

    monkeypatch.setattr(_read, "_pread", counted)
    whole = tensor.read()
    assert sum(read) == tensor.nbytes  # read once: the bytes checked are those returned
    read.clear()
    block = tensor.read([slice(1, 32), slice(1, 64)])  # the whole streamed through, then it
    assert sum(read) == tensor.nbytes + 31 * 63 * 4
    assert np.array_equal(block, np.asarray(whole)[1:, 1:])
    read.clear()
    tensor.read([slice(2, 5), slice(8, 16)], verify=False)
    assert read == [8 * 4] * 3  # each row's run of the block, and nothing else


def test_verify_false_reads_no_checksum_even_of_an_empty_source(tmp_path):
    path = tmp_path / "wrong.safetensors"
    save_safetensors(path, {"e": np.zeros(0, np.float32), "w": np.arange(4, dtype=np.float32)})
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    record = json.loads(header["__metadata__"]["taktiny_checksums"])
    record["tensors"] = {name: "0" * 32 for name in record["tensors"]}  # every digest wrong
    header["__metadata__"]["taktiny_checksums"] = json.dumps(record)
    # (without the header's own digest, as an older Taktiny wrote it: a header it seals is
    # refused as damaged before a tensor's checksum is read)
    del header["__metadata__"]["taktiny_header_checksums"]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    rules = [cv.Rule(["e", "w"], "w", cv.concatenate())]
    target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    with pytest.raises(SafetensorsError, match=damaged(path, "w", "0" * 32)):
        load_safetensors(target, path, rules=rules)
    loaded = load_safetensors(target, path, rules=rules, verify=False)
    assert np.array_equal(loaded["w"], np.arange(4, dtype=np.float32))


def test_a_tensor_of_several_pieces_is_verified_piece_by_piece(tmp_path):
    path = tmp_path / "big.safetensors"
    big = np.arange(2**20 + 3, dtype=np.float32)  # 4 MiB and 12 bytes: two pieces of the hash
    save_safetensors(path, {"big": big, "after": np.ones(5, np.float32)})
    tensor = open_safetensors(path)["big"]
    tensor.verify()  # both pieces, each where it is
    assert np.array_equal(tensor.read([slice(1, 3)]), big[1:3])  # verified whole first
    expected = flip(path, "big", byte=big.nbytes - 1)  # in the last, short piece
    with pytest.raises(SafetensorsError, match=damaged(path, "big", expected)):
        open_safetensors(path)["big"].verify()
    flip(path, "big", byte=big.nbytes - 1)  # intact again
    tensor = open_safetensors(path)["big"]
    path.write_bytes(path.read_bytes()[:-30])  # cut after it was opened
    with pytest.raises(
        SafetensorsError,
        match=rf"^{path}: the file ends inside the bytes of 'big'; it was truncated after it "
        r"was opened\. Write it again\.$",
    ):
        tensor.verify()


@pytest.mark.parametrize("verify", [True, False])
def test_a_tensor_of_several_pieces_loads_whole(tmp_path, verify):
    """The loader streams a tensor to the hash 4 MiB at a time, as it reads it."""
    path = tmp_path / "big.safetensors"
    big = np.arange(2**21 + 3, dtype=np.float32).reshape(-1, 1)  # two pieces and 12 bytes
    save_safetensors(path, {"big": big, "after": np.ones(5, np.float32)})
    target = {"big": jnp.zeros_like(big), "after": jnp.zeros(5, jnp.float32)}
    loaded = load_safetensors(target, path, progress=False, verify=verify)
    assert np.array_equal(loaded["big"], big) and np.array_equal(loaded["after"], np.ones(5))


def test_packed_4_bit_tensors_check_and_read_into_their_packed_bytes(tmp_path):
    path = tmp_path / "q.safetensors"
    values = jnp.array([[-8, 7, -1], [3, 0, 5]], jnp.int4)
    save_safetensors(path, {"q": values, "s": jnp.array(-3, jnp.int4), "w": jnp.ones(3)})
    checkpoint = open_safetensors(path)
    tensor, scalar = checkpoint["q"], checkpoint["s"]
    assert tensor.packed and scalar.packed and scalar.shape == ()
    memory = bytearray(tensor.nbytes)
    got = tensor.read_into(memory)
    assert got.dtype == jnp.int4 and np.array_equal(got, np.asarray(values))
    assert scalar.read().shape == () and scalar.read() == -3
    tensor.check(memory)  # its packed bytes, as stored
    with pytest.raises(SafetensorsError, match=damaged(path, "q", tensor.checksum)):
        tensor.check(bytes(tensor.nbytes))
    flip(path, "q", byte=1, bit=7)  # the padding nibble of the first row
    expected = flip(path, "s", bit=7)  # the padding nibble of the scalar's byte
    checkpoint = open_safetensors(path)
    with pytest.raises(SafetensorsError, match=damaged(path, "q", tensor.checksum)):
        checkpoint["q"].read_into(bytearray(tensor.nbytes))
    with pytest.raises(SafetensorsError, match=damaged(path, "s", expected)):
        checkpoint["s"].read()
    got = checkpoint["q"].read_into(bytearray(tensor.nbytes), verify=False)
    assert np.array_equal(got, np.asarray(values))
    block = checkpoint["q"].read([slice(0, 1), slice(1, 3)], verify=False)
    assert np.array_equal(block, np.asarray(values)[:1, 1:])
    assert checkpoint["s"].read(verify=False) == -3


def test_packed_4_bit_tensors_are_verified_over_their_packed_bytes(tmp_path):
    path = tmp_path / "q.safetensors"
    values = jnp.array([[-8, 7, -1], [3, 0, 5]], jnp.int4)
    save_safetensors(path, {"q": values, "w": jnp.ones(3)})
    tensor = open_safetensors(path)["q"]
    assert tensor.packed and np.array_equal(tensor.read(), np.asarray(values))
    expected = flip(path, "q", byte=1, bit=7)  # the padding nibble of the first row
    tensor = open_safetensors(path)["q"]
    match = damaged(path, "q", expected)
    for read in (lambda: tensor.read(), lambda: tensor.read([slice(1, 2), slice(None)])):
        with pytest.raises(SafetensorsError, match=match):
            read()
    with pytest.raises(SafetensorsError, match=match):
        load_safetensors({"q": jax.ShapeDtypeStruct((2, 3), jnp.int4), "w": jnp.zeros(3)}, path)


def test_each_shard_records_its_own_tensors_and_verify_lists_every_damaged_one(tmp_path):
    path = tmp_path / "model.safetensors"
    written = save_safetensors(path, MLP(rngs=nn.Rngs(0)), max_shard_size=1200)
    assert len(written) == 4  # three shards and the index
    for shard in written[:-1]:
        checkpoint = open_safetensors(shard)
        assert all(t.checksum for t in checkpoint.values())
    assert verify(path) == (4, 0, [])
    shards = {t.name: t.file for t in open_safetensors(path).values()}
    flip(shards["input.kernel"], "input.kernel")
    flip(shards["output.bias"], "output.bias", byte=3, bit=7)
    report = verify(tmp_path)
    assert report.checked == 2 and report.unchecked == 0
    assert [line.split(": the bytes of ")[1][:15] for line in report.damaged] == [
        "'input.kernel' ",
        "'output.bias' a",
    ]
    with pytest.raises(SafetensorsError, match=r"'input\.kernel' are damaged"):
        load_safetensors(abstract_mlp(), path)


def test_files_without_checksums_load_as_before(tmp_path):
    model = MLP(rngs=nn.Rngs(3))
    path = tmp_path / "hf.safetensors"
    safetensors.numpy.save_file(
        {k: np.asarray(v) for k, v in tt.flat_state_dict(model).items()}, path, {"format": "pt"}
    )
    checkpoint = open_safetensors(path)
    assert all(t.checksum is None for t in checkpoint.values())
    loaded = load_safetensors(abstract_mlp(), path)
    assert np.array_equal(loaded.input.kernel, model.input.kernel)
    assert verify(path) == (0, 4, [])


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("not json", r"'taktiny_checksums' is not valid JSON"),
        ('{"algorithm": "md5", "tensors": {}}', r"names the algorithm 'md5'"),
        ('{"algorithm": "xxh3_128", "tensors": []}', r"'tensors' must map tensor names"),
        ('{"algorithm": "xxh3_128", "tensors": {"w": 7}}', r"gives 'w' the digest 7, not 32"),
        ('{"algorithm": "xxh3_128", "tensors": {"x": "' + "0" * 32 + '"}}', r"for 'x', which"),
        ('["xxh3_128"]', r"must be a JSON object with 'algorithm' and 'tensors'"),
        ('{"algorithm": "xxh3_128", "tensors": {}, "more": 1}', r"must be a JSON object with"),
        (
            '{"algorithm": "xxh3_128", "tensors": {"w": "' + "A" * 32 + '"}}',
            r"gives 'w' the digest 'A{32}', not 32 hex digits",
        ),
        (
            "[" * 100_000,
            r"'taktiny_checksums' is not valid JSON \(maximum recursion depth exceeded",
        ),
    ],
)
def test_a_malformed_checksum_record_is_refused_when_the_file_is_opened(tmp_path, record, message):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, path, {"taktiny_checksums": record})
    with pytest.raises(SafetensorsError, match=rf"m\.safetensors: .*{message}.*header is corrupt"):
        open_safetensors(path)


def test_the_checksum_key_is_taktinys_own(tmp_path):
    with pytest.raises(ValueError, match=r"metadata key 'taktiny_checksums' is Taktiny's own"):
        save_safetensors(
            tmp_path / "m.safetensors", {"w": jnp.ones(2)}, metadata={"taktiny_checksums": "{}"}
        )


def test_a_read_refuses_a_slice_step_other_than_one(saved):
    _, path = saved
    tensor = open_safetensors(path)["input.kernel"]
    with pytest.raises(
        ValueError, match=r"slices with a step of 1, got slice\(None, None, 2\).*array\[::2\]"
    ):
        tensor.read([slice(None), slice(None, None, 2)])
    with pytest.raises(
        ValueError, match=r"one slice per axis \(2\), got \(slice\(None, None, None\),\)"
    ):
        tensor.read([slice(None)])
    assert tensor.read([slice(5, 2), slice(None)]).shape == (0, 64)  # empty, as NumPy slices


@pytest.mark.parametrize("step", [0, 2])
def test_a_read_that_fails_before_its_first_byte_raises_and_does_not_hang_the_load(
    saved, monkeypatch, step
):
    """The reader thread tells the checksum drainer that each step ended, whatever it
    raises: an error before the step reads anything (here the read-ahead's, as opening a
    file fails with too many files open) is the load's error, not a load that waits on."""
    import errno
    import threading

    from taktiny.loading import _readers

    _, path = saved
    reached = _readers.Readahead.reached

    def failing(self, index):
        if index >= step:
            raise OSError(errno.EMFILE, "Too many open files")
        reached(self, index)

    monkeypatch.setattr(_readers.Readahead, "reached", failing)
    raised = []

    def load():
        try:
            load_safetensors(abstract_mlp(), path, progress=False)
        except OSError as error:
            raised.append(error)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the load waits forever on a step that failed"
    assert [str(e) for e in raised] == ["[Errno 24] Too many open files"]


def test_each_source_of_a_step_is_verified_not_only_its_last(tmp_path):
    path = tmp_path / "two.safetensors"
    a, b = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    save_safetensors(path, {"a": a, "b": b})
    rules = [cv.Rule(["a", "b"], "s", cv.stack())]
    target = {"s": jax.ShapeDtypeStruct((2, 4), jnp.float32)}
    expected = flip(path, "a", byte=5)  # the first of the step's two sources
    with pytest.raises(SafetensorsError, match=damaged(path, "a", expected)):
        load_safetensors(target, path, rules=rules)


# the header's own digest: a header Taktiny wrote is checked whole when the file is opened

HEADER = "taktiny_header_checksums"


@pytest.fixture
def sealed(tmp_path):
    """A file with tiles, a zero-size tensor and user metadata, and its tensors' and its
    header's recorded digests."""
    path = tmp_path / "sealed.safetensors"
    tensors = {"big": np.arange(256 * 256, dtype=np.float32).reshape(256, 256),
               "empty": np.zeros((0, 4), np.float32), "w": np.ones(3, np.int8)}  # fmt: skip
    save_safetensors(path, tensors, metadata={"note": "kept"})
    checkpoint = open_safetensors(path)
    assert checkpoint["big"].tiles is not None
    recorded = json.loads(checkpoint.metadata[HEADER])
    return path, tensors, checkpoint["w"].checksum, checkpoint["big"].tiles[1], recorded


def flip_after(path, found, offset=0, bit=0):
    """Flips bit `bit` of the byte `offset` bytes after the start of the one occurrence of
    `found` in the file (offset None: its first decimal digit, which stays one)."""
    data = bytearray(path.read_bytes())
    assert data.count(found) == 1, found
    if offset is None:
        offset = next(k for k, c in enumerate(found) if chr(c).isdigit())
    data[data.index(found) + offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def recorded_digest(sealed, which):
    """The bytes to find in the header for each damaged place of the `sealed` file."""
    _, _, digest, tiles, record = sealed
    return {
        "schema": b'\\"fingerprint\\":\\"',
        "checksum": digest.encode(),
        "tiles": tiles[32:64].encode(),
        "empty shape": b'"empty":{"dtype":"F32","shape":[0,4]',
        "record name": f'"{HEADER}":"'.encode(),
        "record": b"metadata_digest",
        "header digest": record["header"].encode(),
        "note name": b'"note":"kept"',
        "note": b'"note":"kept"',
        "version": b'"taktiny_version":"',
    }[which]


@pytest.mark.parametrize(
    ("which", "offset", "bit", "message"),
    [
        ("schema", 18, 0, r"its metadata entry 'taktiny_schema' is not the one Taktiny wrote\."),
        (  # not "the bytes of 'w' are damaged": the record is, and the header says so
            "checksum",
            0,
            0,
            r"the checksums it records for its tensors \('taktiny_checksums'\) are not those "
            r"Taktiny wrote: that record is damaged, not \(as far as the header tells\) the "
            r"tensors' bytes\.",
        ),
        (
            "tiles",
            5,
            1,
            r"the checksums it records for its tensors' tiles \('taktiny_tile_checksums'\) "
            r"are not those Taktiny wrote",
        ),
        (  # [0, 4] -> [0, 5]: as many bytes (none), and a header as valid as before
            "empty shape",
            34,
            0,
            r"its metadata entries are as Taktiny wrote them, so the damage lies in a tensor's entry",
        ),
        (
            "record name",
            3,
            0,
            rf"its metadata holds 'tajtiny_header_checksums', one bit from Taktiny's "
            rf"'{HEADER}', which it lacks: that entry's name is damaged\.",
        ),
        (
            "record",
            1,
            0,
            rf"its record '{HEADER}' \(the digests of the header and of its metadata\) is "
            r"not one Taktiny wrote\.",
        ),
        (
            "header digest",
            None,
            0,
            r"its bytes hash to [0-9a-f]{32}, and it records [0-9a-f]{32} "
            r"\('taktiny_header_checksums', xxh3_128\); its metadata entries are as Taktiny "
            r"wrote them",
        ),
        (
            "note name",
            2,
            0,
            r"its metadata entry 'nnte' was written as 'note': its name is damaged\.",
        ),
        ("note", 10, 0, r"its metadata entry 'note' is not the one Taktiny wrote\."),
        (
            "version",
            19,
            0,
            r"its metadata entry 'taktiny_version' is not the one Taktiny wrote\.",
        ),
    ],
)
def test_a_bit_flipped_in_a_sealed_header_is_found_when_the_file_is_opened(
    sealed, which, offset, bit, message
):
    path, tensors, *_ = sealed
    flip_after(path, recorded_digest(sealed, which), offset, bit)
    full = rf"{path}: the header is damaged: .*{message}.* copy it again or write it again\."
    with pytest.raises(SafetensorsError, match=full):
        open_safetensors(path)
    target = {n: jax.ShapeDtypeStruct(t.shape, t.dtype) for n, t in tensors.items()}
    for check in (True, False):  # (whatever verify= says: the header is read either way)
        with pytest.raises(SafetensorsError, match=full):
            load_safetensors(target, path, verify=check)
    with pytest.raises(SafetensorsError, match=full):
        verify(path)


def test_a_sealed_header_opens_and_a_header_without_its_digest_opens_as_before(sealed):
    # an older Taktiny's file records no digest of its header: it opens and loads as before
    path, tensors, *_ = sealed
    assert verify(path) == (3, 0, [])
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    del header["__metadata__"][HEADER]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    assert HEADER not in open_safetensors(path).metadata
    assert verify(path) == (3, 0, [])
    target = {n: jax.ShapeDtypeStruct(t.shape, t.dtype) for n, t in tensors.items()}
    loaded = load_safetensors(target, path)
    assert all(np.array_equal(loaded[n], t) for n, t in tensors.items())
    # the name of one of its records damaged, though, is damage: not a file without it
    flip_after(path, b'"taktiny_checksums":"', 1, 1)
    with pytest.raises(SafetensorsError, match=r"holds 'vaktiny_checksums', one bit from Taktiny's 'taktiny_checksums', which it lacks"):  # fmt: skip
        open_safetensors(path)


def test_an_older_file_s_damaged_schema_is_found_by_verify_through_its_fingerprint(sealed):
    path, *_ = sealed
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    del header["__metadata__"][HEADER]  # (an older Taktiny's file)
    schema = json.loads(header["__metadata__"]["taktiny_schema"])
    schema["tensors"]["w"]["shape"] = [4]
    header["__metadata__"]["taktiny_schema"] = json.dumps(schema)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    open_safetensors(path)  # (the schema is read when asked for)
    with pytest.raises(SafetensorsError, match=r"'taktiny_schema' is not a schema Taktiny wrote: the schema's fingerprint"):  # fmt: skip
        verify(path)


def test_other_programs_files_with_keys_like_taktiny_s_open(tmp_path):
    path = tmp_path / "other.safetensors"
    metadata = {"format": "pt", "taktiny_scheme": "theirs", "taktiny_checksumr": "x"}
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, path, metadata)
    assert open_safetensors(path).metadata == metadata
    assert verify(path) == (0, 1, [])


def test_the_schema_key_the_header_path_knows_is_the_schema_s():
    from taktiny.io import _header
    from taktiny.state import KEY

    assert _header.SCHEMA_KEY == KEY
