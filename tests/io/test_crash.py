"""Crash-safe saves: a save over a checkpoint, failed at each of its file operations (each
write, fsync, rename and removal raising an OSError, or a KeyboardInterrupt arriving), or
killed right after each of them, leaves exactly the previous checkpoint or exactly the new
one, bitwise, whether it is loaded by its path or its folder; a failed save raises the
original error and leaves the previous checkpoint byte for byte; the next save removes what
a killed one left, and nothing else. The harness is tests/_crash.py; random kills are in
property_tests/test_crash.py."""

import errno
import os
import re
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from _crash import (
    SCENARIOS,
    as_loaded,
    count_steps,
    loaded,
    outcome,
    prepare,
    run_program,
    save,
    steps,
    tidied,
    version,
)

from taktiny.io import _write, save_safetensors

HERE = Path(__file__).parents[1]


class Injected(OSError):
    """The fault a test raises from a file operation."""


def _faults():
    for scenario in SCENARIOS:
        for kind in (Injected, KeyboardInterrupt):
            yield pytest.param(scenario, kind, id=f"{scenario}-{kind.__name__}")


@pytest.mark.parametrize(("scenario", "kind"), list(_faults()))
def test_a_save_failing_at_any_step_leaves_one_whole_version(tmp_path, scenario, kind):
    old_layout, limit = SCENARIOS[scenario]
    made = count_steps(tmp_path, scenario)
    assert len(made) >= 4 and {"write_file", "fsync", "replace"} <= set(made)
    old = None if old_layout == "none" else as_loaded(version(1))
    new = as_loaded(version(2))
    seen = {"old": 0, "new": 0}
    for k in range(1, len(made) + 1):
        prepare(tmp_path, old_layout)
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        fault = kind(f"fault injected after step {k}")

        def hook(name, count, k=k, fault=fault):
            if count == k:
                raise fault

        raised = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with steps(hook):
                    save(tmp_path, version(2), limit)
            except (OSError, KeyboardInterrupt) as error:
                raised = error
        got = outcome(tmp_path, old, new)
        where = f"{scenario}: {kind.__name__} after {made[k - 1]} (step {k} of {len(made)})"
        assert got in ("old", "new"), where  # ("old" when there was none: still nothing)
        if raised is not None and got != "new":
            # a failed save raises the original error and leaves the old files byte for byte
            assert raised is fault or raised.__cause__ is fault, where
            assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before, where
        if raised is None:  # a fault after the commit: the new checkpoint, and a warning
            assert got == "new", where
            assert [str(w.message) for w in caught if "is saved, but" in str(w.message)], where
        seen["new" if got == "new" else "old"] += 1
        assert tidied(tmp_path) is None, where
    assert seen["old"] and seen["new"]  # faults fell both before and after the commit


def test_a_write_that_fails_is_named_and_chained(tmp_path, monkeypatch):
    prepare(tmp_path, None)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full(tensors, filename, metadata):
        Path(filename).write_bytes(b"partial")
        raise RuntimeError("No space left on device")

    monkeypatch.setattr(_write, "write_file", full)
    with pytest.raises(OSError, match=r"writing .*model\.safetensors: No space left") as info:
        save(tmp_path, version(2), None)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("limit", [None, 25_000], ids=["one file", "shards"])
def test_a_full_disk_raises_enospc_naming_the_file_and_keeps_the_checkpoint(small_disk, limit):
    prepare(small_disk, limit)  # 45 KB, on a disk of 1 MiB
    before = {p.name: p.read_bytes() for p in small_disk.iterdir()}
    with pytest.raises(OSError, match=r"No space left on device .*left as it was") as info:
        save(small_disk, version(2, 32), limit)  # 1.4 MB
    assert info.value.errno == errno.ENOSPC
    assert re.fullmatch(
        r"model(-\d{5}-of-\d{5}(-[0-9a-f]{8})?)?\.safetensors", Path(info.value.filename).name
    )
    assert Path(info.value.filename).parent == small_disk
    assert info.value.__cause__.errno == errno.ENOSPC  # the write's own error, chained
    assert {p.name: p.read_bytes() for p in small_disk.iterdir()} == before
    assert loaded(small_disk / "model.safetensors") == as_loaded(version(1))


def test_a_writer_that_fails_with_an_os_error_gives_its_errno(tmp_path, monkeypatch):
    # what a write raises when the disk is full, as the test above meets it
    prepare(tmp_path, 25_000)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full(tensors, filename, metadata):
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_write, "write_file", full)
    with pytest.raises(OSError, match=r"^\[Errno 28\] save_safetensors: No space left on") as info:
        save(tmp_path, version(2), 25_000)
    assert info.value.errno == errno.ENOSPC and type(info.value) is OSError
    file = Path(info.value.filename)  # the first shard, under its name beside the old ones
    assert file.parent == tmp_path
    assert re.fullmatch(r"model-00001-of-\d{5}-[0-9a-f]{8}\.safetensors", file.name), file
    assert info.value.__cause__.errno == errno.ENOSPC and info.value.__cause__ is not info.value
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_an_index_that_cannot_be_written_gives_the_errno_and_names_the_index(
    tmp_path, monkeypatch, code
):
    prepare(tmp_path, 25_000)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    write = os.write
    fault = OSError(code, os.strerror(code))

    def failing(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".index.json"):
            raise fault
        return write(fd, data)

    monkeypatch.setattr(os, "write", failing)
    with pytest.raises(OSError, match=re.escape(os.strerror(code))) as info:
        save(tmp_path, version(2), 25_000)
    monkeypatch.undo()
    assert info.value.errno == code and info.value.__cause__ is fault
    assert info.value.filename == str(tmp_path / "model.safetensors.index.json")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_killed_saves_leftovers_are_ignored_by_loads_and_removed_by_the_next_save(tmp_path):
    prepare(tmp_path, 25_000)
    committed = sorted(p.name for p in tmp_path.iterdir())
    # what a save killed before its commit leaves: temporaries, and renamed shards that no
    # index names; and a user's files that look alike but are not this checkpoint's
    leftovers = [
        ".model-00001-of-00002.safetensors.0123456789ab.tmp",
        ".model.safetensors.index.json.ba9876543210.tmp",
        "model-00001-of-00002-1a2b3c4d.safetensors",
        "model-00002-of-00002-1a2b3c4d.safetensors",
    ]
    theirs = ["model-ema.safetensors.bak", ".model.tmp", "model-00001-of-00002.txt",
              ".other.safetensors.0123456789ab.tmp", "~model.safetensors.old.bak"]  # fmt: skip
    for name in leftovers + theirs:
        (tmp_path / name).write_bytes(b"\0" * 100)
    assert outcome(tmp_path, as_loaded(version(1)), None) == "old"
    save(tmp_path, version(2), 40_000)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not set(leftovers) & set(left) and set(theirs) <= set(left)
    assert not set(committed) - {"notes.txt", "model.safetensors.index.json"} & set(left)
    assert outcome(tmp_path, None, as_loaded(version(2))) == "new"


def test_an_index_shadowed_by_a_committed_file_is_stale(tmp_path):
    # a save of one file over shards, killed after its commit (the rename of the file):
    # the file is the checkpoint, as Hugging Face's loaders read it; the next save removes
    # the index and its shards
    prepare(tmp_path, 25_000)
    shards = [p.name for p in tmp_path.iterdir() if p.name.startswith("model-")]
    single = tmp_path / "single"
    single.mkdir()
    save(single, version(2), None)
    os.replace(single / "model.safetensors", tmp_path / "model.safetensors")
    single.rmdir()
    assert outcome(tmp_path, None, as_loaded(version(2))) == "new"
    save(tmp_path, version(3), None)
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"model.safetensors", "notes.txt"} and not set(shards) & left


@pytest.mark.program
def test_a_save_killed_right_after_any_step_leaves_one_whole_version(tmp_path):
    results = run_program("steps", str(tmp_path))
    assert results["kills"] >= 60 and results["old"] and results["new"]
    print(f"killed after each step: {results}")


def test_hugging_face_reads_what_each_kind_of_save_leaves(tmp_path):
    # transformers' own loader, on the folder after saves that replace one another: shards
    # under Hugging Face's names, shards under a save's own suffix, then one file
    import torch
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8)
    config.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    for seed, limit in [(0, 4000), (1, 4000), (2, None)]:
        with torch.random.fork_rng():  # (the process's own generator left as it was)
            torch.manual_seed(seed)
            model = transformers.GPT2Model(config)
        state = {k: v.numpy() for k, v in model.state_dict().items()}
        written = save_safetensors(path, state, max_shard_size=limit)
        assert (len(written) > 2) == (limit is not None)
        suffixed = [re.search(r"-[0-9a-f]{8}\.safetensors$", p.name) for p in written[:-1]]
        assert limit is None or all(suffixed) == (seed == 1)  # the second save's suffix
        loaded = transformers.GPT2Model.from_pretrained(tmp_path).state_dict()
        for name, value in state.items():
            assert np.array_equal(loaded[name].numpy(), value), (seed, name)
        assert torch.equal(loaded["wte.weight"], torch.from_numpy(state["wte.weight"]))


def test_saves_running_at_once_in_one_folder_take_turns(tmp_path):
    # without the folder's lock, each save would take the other's new files for leftovers
    # of a killed save and remove them, leaving an index that names missing shards
    prepare(tmp_path, None)
    versions = {seed: as_loaded(version(seed)) for seed in range(4, 12)}
    errors = []

    def saves(seeds):
        try:
            for seed in seeds:
                save(tmp_path, version(seed), [None, 25_000, 40_000][seed % 3])
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=saves, args=(range(k, 12, 2),)) for k in (4, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert loaded(tmp_path / "model.safetensors") in versions.values()
    assert tidied(tmp_path) is None


def test_the_folder_must_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"the folder .*missing does not exist; create it"):
        save(tmp_path / "missing", version(1), None)
