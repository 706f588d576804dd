"""Background saves (``save_safetensors(..., wait=False)``): the call returns once the
arrays are copied (copies of the save's own), the files are written and committed on the
save's thread with the guarantees of a save that waits, one save per path runs at a time,
and a failure is never silent: `result()` raises it, else the next save to the path, else
the interpreter's exit (stderr, status 1)."""

import errno
import inspect
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _child import cpu_environment
from _crash import SCENARIOS, as_loaded, loaded, prepare, run_program, version

from taktiny.io import BackgroundSave, _background, _write, open_safetensors, save_safetensors

HERE = Path(__file__).parents[1]
ENOSPC = (errno.ENOSPC, "No space left on device")  # (what a full disk's write raises)


@pytest.fixture(autouse=True)
def every_failure_reported():
    """Each test gets what its background saves raised: one left unreported would end the
    test process with status 1 at its exit."""
    yield
    left = list(_background._saves.values())
    for save in left:
        assert save._finished.wait(30), f"{save} still running after its test"
    unreported = [s for s in left if not s._reported and (s._error or s._warnings)]
    for save in unreported:
        save._report()
    assert unreported == []


@pytest.fixture
def gate(monkeypatch):
    """Holds every write of a save (each file's) until the test opens the gate."""
    opened = threading.Event()
    real = _write.write_file

    def held(tensors, filename, metadata):
        assert opened.wait(30), "the test never opened the gate"
        real(tensors, filename, metadata)

    monkeypatch.setattr(_write, "write_file", held)
    yield opened
    opened.set()


@pytest.fixture
def fill_disk(monkeypatch):
    """Called, makes the writer fail as it does on a full disk."""

    def full(tensors, filename, metadata):
        raise OSError(*ENOSPC)

    return lambda: monkeypatch.setattr(_write, "write_file", full)


def values(path):
    return {n: t.read() for n, t in open_safetensors(path).items()}


def test_the_call_returns_a_running_save_and_result_gives_the_files(tmp_path, gate):
    path = tmp_path / "model.safetensors"
    saving = save_safetensors(path, version(2), wait=False)
    assert isinstance(saving, BackgroundSave) and saving.path == path
    assert not saving.done()
    assert repr(saving) == f"BackgroundSave('{path}', running)"
    assert not path.exists()
    gate.set()
    assert saving.result(timeout=30) == [path]
    assert saving.done() and saving.result() == [path]
    assert repr(saving) == f"BackgroundSave('{path}', saved, 1 file)"
    assert loaded(path) == as_loaded(version(2))
    # shards, and a save that waits: as before, the list of files
    sharded = save_safetensors(path, version(3), max_shard_size=25_000, wait=False).result()
    assert [p.name for p in sharded] == [
        *(f"model-0000{i}-of-00002.safetensors" for i in (1, 2)),
        "model.safetensors.index.json",
    ]
    assert loaded(path) == as_loaded(version(3))
    assert save_safetensors(path, version(4)) == [path]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def contents(file):
    """A file's header (but the digest of its own bytes) and its tensors' bytes."""
    data = file.read_bytes()
    if file.suffix == ".json":
        return json.loads(data)
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    sealed = json.loads(header["__metadata__"].pop("taktiny_header_checksums"))
    del sealed["header"]
    return header, sealed, data[8 + length :]


@pytest.mark.parametrize("limit", [None, 500], ids=["one file", "shards"])
def test_a_background_save_writes_what_a_save_that_waits_writes(tmp_path, limit, platform):
    # a model with 4-bit quantized layers (packed two per byte) and float32 ones
    import taktiny as tt
    from taktiny import nn

    model = tt.quantize(
        nn.Sequential(nn.Linear(32, 64, rngs=nn.Rngs(0)), nn.Linear(64, 5, rngs=nn.Rngs(1))),
        bits=4,
        group_size=16,
    )
    (tmp_path / "waits").mkdir()
    (tmp_path / "background").mkdir()
    waited = save_safetensors(tmp_path / "waits" / "m.safetensors", model, max_shard_size=limit)
    saving = save_safetensors(
        tmp_path / "background" / "m.safetensors", model, max_shard_size=limit, wait=False
    )
    written = saving.result(timeout=30)
    assert [p.name for p in written] == [p.name for p in waited]
    assert len(written) == (1 if limit is None else 5)  # (4 shards and the index)
    assert [contents(p) for p in written] == [contents(p) for p in waited]


def test_the_save_holds_the_values_at_the_call(tmp_path, gate):
    tensors = version(2)
    path = tmp_path / "model.safetensors"
    saving = save_safetensors(path, tensors, wait=False)
    for array in tensors.values():  # the caller's arrays, overwritten before the write
        array[...] = 0
    gate.set()
    saving.result(timeout=30)
    assert loaded(path) == as_loaded(version(2))


def test_a_jax_arrays_buffer_may_be_donated_at_once(tmp_path, gate, platform):
    weights = jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)
    expected = np.arange(4096, dtype=np.float32).reshape(64, 64)
    path = tmp_path / "model.safetensors"
    saving = save_safetensors(path, {"w": weights}, wait=False)
    step = jax.jit(lambda w: w * 2 + 1, donate_argnums=0)
    stepped = step(weights)
    # (JAX donates no buffer that a NumPy view of it still holds: a save that kept one
    # would keep the training step from donating)
    assert weights.is_deleted()
    gate.set()
    saving.result(timeout=30)
    assert np.array_equal(values(path)["w"], expected)
    assert np.array_equal(np.asarray(stepped), expected * 2 + 1)


def test_result_raises_the_saves_own_error(tmp_path, fill_disk):
    prepare(tmp_path, None)
    fill_disk()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    saving = save_safetensors(tmp_path / "model.safetensors", version(2), wait=False)
    with pytest.raises(OSError, match=r"No space left on device .*left as it was") as info:
        saving.result(timeout=30)
    assert info.value.errno == errno.ENOSPC and type(info.value) is OSError
    assert info.value.filename == str(tmp_path / "model.safetensors")
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__ is not info.value
    with pytest.raises(OSError, match=r"No space left") as again:
        saving.result()
    assert again.value is info.value  # the same error, each time
    assert repr(saving).startswith(
        f"BackgroundSave('{tmp_path / 'model.safetensors'}', failed: OSError: [Errno 28]"
    )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # reported: the next save to the path goes on (and fails as its own)
    with pytest.raises(OSError, match=r"No space left") as third:
        save_safetensors(tmp_path / "model.safetensors", version(3))
    assert third.value is not info.value and not getattr(third.value, "__notes__", None)


def test_a_failed_save_keeps_no_copy_of_the_arrays_while_its_error_waits(tmp_path, fill_disk):
    import gc
    import tracemalloc

    fill_disk()
    tensors = {f"w{i}": np.ones((512, 1024), np.float32) for i in range(8)}  # 16 MiB
    tracemalloc.start()
    try:
        saving = save_safetensors(tmp_path / "m.safetensors", tensors, wait=False)
        while not saving.done():
            time.sleep(0.01)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 2**20  # (the error's frames held the copies: 16 MiB)
    with pytest.raises(OSError, match=r"No space left on device"):
        saving.result()


@pytest.mark.parametrize("wait", [True, False], ids=["then a save that waits", "in background"])
def test_an_unreported_failure_is_raised_by_the_next_save_to_the_path(
    tmp_path, monkeypatch, fill_disk, wait
):
    prepare(tmp_path, None)
    fill_disk()
    path = tmp_path / "model.safetensors"
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    failing = save_safetensors(path, version(2), wait=False)
    while not failing.done():  # (done() reports nothing: the error is still unread)
        time.sleep(0.01)
    monkeypatch.undo()  # the disk has room again
    other = save_safetensors(tmp_path / "other.safetensors", version(3), wait=wait)
    if not wait:  # (another path: not this one's to raise)
        assert isinstance(other, BackgroundSave)
        other.result(timeout=30)
    note = (
        rf"the error of the background save to {path}, raised by the next save to that path "
        rf"\(which did not start\)"
    )
    with pytest.raises(OSError, match=r"No space left on device") as info:
        save_safetensors(path, version(3), wait=wait)
    assert info.value.errno == errno.ENOSPC
    assert any(re.search(note, n) for n in info.value.__notes__)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "other.safetensors"}
    assert after == before  # the next save did not start
    saved = save_safetensors(path, version(3), wait=wait)  # raised once: this one saves
    if not wait:
        assert isinstance(saved, BackgroundSave)
        saved.result(timeout=30)
    assert loaded(path) == as_loaded(version(3))
    with pytest.raises(OSError, match=r"No space left on device") as later:
        failing.result()  # its own error still, for whoever asks
    assert later.value is info.value


@pytest.fixture
def held_checksums(monkeypatch):
    """Holds background saves in their checksums, before they write or lock anything,
    until the test opens the gate (the folder's lock alone would make saves to one folder
    take turns); saves that wait are not held."""
    from taktiny.io import _checksum

    opened = threading.Event()
    real = _checksum.digest

    def held(data):
        if threading.current_thread().name.startswith("taktiny save"):
            assert opened.wait(30), "the test never opened the gate"
        return real(data)

    monkeypatch.setattr(_checksum, "digest", held)
    yield opened
    opened.set()


@pytest.mark.parametrize("wait", [True, False], ids=["a save that waits", "in background"])
def test_a_save_to_a_path_waits_for_the_one_in_flight_to_it(tmp_path, held_checksums, wait):
    gate = held_checksums
    path = tmp_path / "model.safetensors"
    first = save_safetensors(path, version(2), wait=False)
    called, returned = [], []

    def second():
        got = save_safetensors(path, version(3), wait=wait)
        called.append(got)
        returned.append(got.result(timeout=30) if isinstance(got, BackgroundSave) else got)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and not called and not first.done()  # (the call itself waits)
    gate.set()
    thread.join(30)
    assert first.result(timeout=30) == [path] and returned == [[path]]
    assert loaded(path) == as_loaded(version(3))  # the later save, last


def test_saves_to_different_paths_run_at_once(tmp_path, monkeypatch):
    real = _write.write_file
    opened = threading.Event()

    def held_in_a(tensors, filename, metadata):
        if Path(filename).parent.parent.name == "a":  # (its staging folder's folder)
            assert opened.wait(30)
        real(tensors, filename, metadata)

    monkeypatch.setattr(_write, "write_file", held_in_a)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    held = save_safetensors(tmp_path / "a" / "model.safetensors", version(2), wait=False)
    assert save_safetensors(tmp_path / "b" / "model.safetensors", version(3)) == [
        tmp_path / "b" / "model.safetensors"
    ]
    background = save_safetensors(tmp_path / "b" / "other.safetensors", version(4), wait=False)
    background.result(timeout=30)
    assert not held.done()
    opened.set()
    held.result(timeout=30)
    assert loaded(tmp_path / "a" / "model.safetensors") == as_loaded(version(2))


@pytest.mark.usefixtures("without_type_checks")
@pytest.mark.parametrize(
    ("name", "options", "tree", "error", "match"),
    [
        ("model.bin", {}, None, ValueError, r"must name a '\*\.safetensors' file: .*model\.bin"),
        ("missing/m.safetensors", {}, None, FileNotFoundError, r"missing does not exist; create"),
        ("m.safetensors", {"max_shard_size": "5 parsecs"}, None, ValueError, r"'5 parsecs' is not"),
        ("m.safetensors", {"max_shard_size": 0}, None, ValueError, r"must be positive, got 0"),
        ("m.safetensors", {"metadata": {"step": 12}}, None, TypeError, r"strings to strings.*12"),
        ("m.safetensors", {"metadata": {"format": "pt"}}, None, ValueError, r"'format' is Takt"),
        ("m.safetensors", {}, "complex", TypeError, r"'w' has dtype complex128, which safet"),
        ("m.safetensors", {}, "keys", TypeError, r"'w' is an array of PRNG keys"),
        ("m.safetensors", {}, "names", TypeError, r"tensor names must be strings, got 3"),
    ],
    ids=["suffix", "folder", "size", "zero", "metadata", "reserved", "dtype", "keys", "names"],
)
def test_what_can_be_checked_first_is_raised_by_the_call(
    tmp_path, name, options, tree, error, match
):
    trees = {
        None: lambda: {"w": np.ones(2, np.float32)},
        "complex": lambda: {"w": np.ones(2, np.complex128)},
        "keys": lambda: {"w": jax.random.key(0)},
        "names": lambda: {3: np.ones(2, np.float32)},
    }

    def saves():
        return {t for t in threading.enumerate() if t.name.startswith("taktiny save")}

    before = saves()
    with pytest.raises(error, match=match):
        save_safetensors(tmp_path / name, trees[tree](), wait=False, **options)
    assert saves() <= before and list(tmp_path.iterdir()) == []  # no save started


def test_warnings_after_the_commit_come_from_result(tmp_path, monkeypatch):
    from taktiny.io import _save

    sync = _save._Commit._sync

    def failing(folder):  # the folder's own flushes fail, after the commit
        if folder == tmp_path:
            raise OSError("the disk is gone")
        sync(folder)

    monkeypatch.setattr(_save._Commit, "_sync", staticmethod(failing))
    path = tmp_path / "w.safetensors"
    saving = save_safetensors(path, {"w": np.ones(2, np.float32)}, wait=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # (unwrapped: the test-time type checks wrap it in frames of their own)
        assert inspect.unwrap(BackgroundSave.result)(saving, timeout=30) == [path]
        assert saving.result() == [path]  # (given once)
    assert [w.filename for w in caught] == [__file__, __file__]
    assert [str(w.message) for w in caught] == [
        f"save_safetensors: {path} is saved, but flushing its directory to disk failed (the "
        f"disk is gone): it may not survive a power loss.",
        f"save_safetensors: {path} is saved, but removing the previous checkpoint's files "
        f"failed (the disk is gone); the next save to it removes them.",
    ]
    # unread, they come from the next save to the path
    unread = save_safetensors(path, {"w": np.ones(2, np.float32)}, wait=False)
    while not unread.done():
        time.sleep(0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_safetensors(path, {"w": np.zeros(2, np.float32)})  # (which warns its own too)
    assert [str(w.message) for w in caught] == 2 * [
        f"save_safetensors: {path} is saved, but flushing its directory to disk failed (the "
        f"disk is gone): it may not survive a power loss.",
        f"save_safetensors: {path} is saved, but removing the previous checkpoint's files "
        f"failed (the disk is gone); the next save to it removes them.",
    ]


def test_any_commit_with_save_and_warnings_runs_in_the_background(tmp_path):
    # (a commit to an object store, say: the machinery takes files and a commit, not a folder)
    class Commit:
        def __init__(self):
            self.warnings = ["save_safetensors: s3://bucket/m.safetensors is saved, but slowly."]
            self.saved = []

        def save(self, files):
            self.saved = [(sorted(tensors), metadata) for tensors, metadata in files]
            return ["s3://bucket/m.safetensors"]

    commit = Commit()
    files = [({"w": np.ones(2, np.float32)}, {"format": "taktiny"})]
    path = tmp_path / "m.safetensors"
    assert isinstance(commit, _background.Commit)
    saving = _background.start(path, lambda: files, commit)
    with pytest.warns(UserWarning, match=r"^save_safetensors: s3://bucket/m\.safetensors is"):
        assert saving.result(timeout=30) == ["s3://bucket/m.safetensors"]
    assert commit.saved == [(["w"], {"format": "taktiny"})]
    assert list(tmp_path.iterdir()) == []


def test_result_waits_at_most_its_timeout(tmp_path, gate):
    saving = save_safetensors(tmp_path / "m.safetensors", {"w": np.ones(2)}, wait=False)
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"the background save to .*m\.safetensors is still"):
        saving.result(timeout=0.2)
    assert 0.2 <= time.perf_counter() - start < 5 and not saving.done()
    gate.set()
    assert saving.result(timeout=30) == [tmp_path / "m.safetensors"]


def test_the_exit_handler_reports_what_nobody_was_given(tmp_path, monkeypatch, capsys):
    # (in process, the handler's own steps; the tests below exit real interpreters)
    import logging

    from taktiny.io import _save

    exits, shutdowns = [], []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(logging, "shutdown", lambda: shutdowns.append(True))
    path = tmp_path / "model.safetensors"
    save_safetensors(path, version(2), wait=False).result(timeout=30)
    _background._at_exit()  # nothing unreported: nothing said, no exit
    assert exits == [] and capsys.readouterr().err == ""
    real = _write.write_file

    def full(tensors, filename, metadata):
        raise OSError(*ENOSPC)

    monkeypatch.setattr(_write, "write_file", full)
    failing = save_safetensors(path, version(3), wait=False)
    while not failing.done():
        time.sleep(0.01)
    monkeypatch.setattr(_write, "write_file", real)
    other = tmp_path / "other.safetensors"
    sync = _save._Commit._sync

    def flush(folder):  # a second path, saved with warnings only: its folder's flushes fail
        if folder == tmp_path:
            raise OSError("the disk is gone")
        sync(folder)

    monkeypatch.setattr(_save._Commit, "_sync", staticmethod(flush))
    warned = save_safetensors(other, version(4), wait=False)
    _background._at_exit()  # (it waits for the save still running first)
    assert warned.done()
    err = capsys.readouterr().err
    assert exits == [1] and shutdowns == [True]
    assert (
        f"taktiny.io: warning: the background save to {path} failed, and nobody asked for its "
        f"result(): OSError: [Errno 28] save_safetensors: No space left on device"
    ) in err
    assert f"taktiny.io: warning: save_safetensors: {other} is saved, but flushing" in err
    assert "(the process exits with status 1)" in err and "Traceback" in err
    _background._at_exit()  # reported now: said once
    assert exits == [1] and capsys.readouterr().err == ""
    with pytest.raises(OSError, match=r"No space left on device"):
        failing.result()


def run_python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=cpu_environment(),
    )


FAILING = """
    import sys
    import numpy as np
    from taktiny.io import _write, save_safetensors

    def full(tensors, filename, metadata):
        raise OSError(*{enospc!r})

    _write.write_file = full
    saving = save_safetensors(sys.argv[1], {{"w": np.ones(3, np.float32)}}, wait=False)
    if sys.argv[2] == "asked":
        try:
            saving.result()
        except OSError as error:
            print("caught", error.errno)
    print("the program ends")
"""


@pytest.mark.program
def test_a_failure_nobody_asked_for_makes_the_process_exit_with_status_1(tmp_path):
    path = tmp_path / "model.safetensors"
    run = run_python(FAILING.format(enospc=ENOSPC), str(path), "unasked")
    assert run.returncode == 1, run.stderr
    assert run.stdout == "the program ends\n"
    assert (
        f"taktiny.io: warning: the background save to {path} failed, and nobody asked for its "
        f"result(): OSError: [Errno 28] save_safetensors: No space left on device"
    ) in run.stderr
    assert "(the process exits with status 1)" in run.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.program
def test_a_failure_the_program_asked_for_is_the_programs_to_handle(tmp_path):
    path = tmp_path / "model.safetensors"
    asked = run_python(FAILING.format(enospc=ENOSPC), str(path), "asked")
    assert asked.returncode == 0 and asked.stderr == ""
    assert asked.stdout == "caught 28\nthe program ends\n"


@pytest.mark.program
def test_a_full_disk_nobody_asked_about_makes_the_process_exit_with_status_1(small_disk):
    prepare(small_disk, None)  # 45 KB on a disk of 1 MiB
    before = {p.name: p.read_bytes() for p in small_disk.iterdir()}
    script = """
        import sys
        sys.path.insert(0, sys.argv[2])
        from pathlib import Path
        from _crash import version
        from taktiny.io import save_safetensors

        save_safetensors(Path(sys.argv[1]) / "model.safetensors", version(2, 32), wait=False)
    """
    run = run_python(script, str(small_disk), str(HERE))
    assert run.returncode == 1, run.stderr
    assert f"the background save to {small_disk / 'model.safetensors'} failed" in run.stderr
    assert "No space left on device (the previous checkpoint is left as it was)" in run.stderr
    assert "OSError: [Errno 28] No space left on device\n" in run.stderr  # the write's own
    assert {p.name: p.read_bytes() for p in small_disk.iterdir()} == before
    assert loaded(small_disk / "model.safetensors") == as_loaded(version(1))


@pytest.mark.program
def test_a_save_still_running_at_the_exit_is_waited_for(tmp_path):
    script = """
        import sys
        import numpy as np
        from taktiny.io import save_safetensors

        rng = np.random.default_rng(0)
        tensors = {f"w{i}": rng.standard_normal((1024, 1024), np.float32) for i in range(8)}
        save_safetensors(sys.argv[1], tensors, max_shard_size="10MB", wait=False)
    """
    path = tmp_path / "model.safetensors"
    run = run_python(script, str(path))
    assert run.returncode == 0 and run.stderr == "", run.stderr
    rng = np.random.default_rng(0)
    expected = {f"w{i}": rng.standard_normal((1024, 1024), np.float32) for i in range(8)}
    assert loaded(path) == as_loaded(expected)  # 32 MiB, in 4 shards, all there
    assert len(json.loads(Path(f"{path}.index.json").read_text())["weight_map"]) == 8


@pytest.mark.program
def test_a_child_forked_during_a_save_does_not_hold_its_folders_lock(tmp_path):
    # the lock belongs to the open folder, which a forked child shares: were the child's
    # copy kept open, the parent's next save would wait for the child to exit
    script = """
        import os, signal, sys, threading, time
        import numpy as np
        from taktiny.io import _write, save_safetensors

        path = sys.argv[1]
        opened = threading.Event()
        real = _write.write_file

        def held(tensors, filename, metadata):
            opened.wait(30)
            real(tensors, filename, metadata)

        _write.write_file = held
        saving = save_safetensors(path, {"w": np.ones(4, np.float32)}, wait=False)
        time.sleep(0.3)  # the save holds its folder's lock, waiting to write
        pid = os.fork()
        if pid == 0:  # a worker that lives on (a data loader's, say)
            time.sleep(60)
            os._exit(0)
        opened.set()
        saving.result()
        after = threading.Thread(target=save_safetensors, args=(path, {"w": np.zeros(4)}))
        after.start()
        after.join(5)
        print("blocked" if after.is_alive() else "saved")
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        after.join()
    """
    run = run_python(script, str(tmp_path / "model.safetensors"))
    assert run.returncode == 0, run.stderr
    assert run.stdout == "saved\n"
    assert values(tmp_path / "model.safetensors")["w"].tolist() == [0.0] * 4


def _kill_background_saves(folder, scenarios):
    results = run_program("background", str(folder), *scenarios)
    assert results["old"] and results["new"]
    return results


@pytest.mark.program
def test_a_background_save_killed_right_after_any_step_leaves_one_whole_version(tmp_path):
    results = _kill_background_saves(tmp_path, ["shards over single"])
    assert results["kills"] >= 10


@pytest.mark.program
@pytest.mark.thorough
def test_a_background_save_of_any_layout_killed_after_any_step_leaves_one_version(tmp_path):
    assert _kill_background_saves(tmp_path, list(SCENARIOS))["kills"] >= 60
