"""How many steps a load reads at once: `Readers` learns it from the rate the steps finish
at (doubling while a doubling pays), and the loader keeps that many reads in flight,
whatever order they finish in, with the same result as one reader."""

import threading
import time

import jax
import numpy as np
import pytest
from _reads import in_flight
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import nn
from taktiny.io import load_safetensors, save_safetensors
from taktiny.loading import _layers, _load, _place, _readers, _ways
from taktiny.loading._readers import Readers

MiB = 2**20


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(_readers.time, "perf_counter", clock)
    return clock


def run(readers, clock, seconds_per_window):
    """Finishes one window of bytes per entry, taking that many seconds: the widths seen."""
    widths = []
    for seconds in seconds_per_window:
        clock.now += seconds
        readers.finished(readers.window)
        widths.append(readers.width)
    return widths


def test_readers_double_while_a_doubling_pays_up_to_the_most(clock):
    readers = Readers(most=16, window=64 * MiB)
    assert readers.width == 2
    # each doubling reads 1.5x faster: 2 -> 4 -> 8 -> 16, then no more
    widths = run(readers, clock, [1.0, 1 / 1.5, 1 / 1.5**2, 1 / 1.5**3, 1.0])
    assert widths == [4, 8, 16, 16, 16]
    assert readers.settled


def test_readers_go_back_when_a_doubling_does_not_pay(clock):
    readers = Readers(most=16, window=64 * MiB)
    # 2 readers: 1 s a window; 4: 0.95 s (5% faster, under the 10% a doubling must gain)
    assert run(readers, clock, [1.0, 0.95]) == [4, 2]
    assert readers.settled
    assert run(readers, clock, [0.5, 2.0]) == [2, 2]  # settled: it stays
    assert "width=2, settled=True" in repr(readers)


def test_readers_measure_only_whole_windows_and_pace_the_read_ahead(clock):
    readers = Readers(most=4, window=64 * MiB)
    clock.now = 10.0
    readers.finished(32 * MiB)  # half a window: nothing measured yet
    assert readers.width == 2 and not readers.rates
    readers.finished(32 * MiB)  # 64 MiB in 10 s: 6.7 MB/s; the read-ahead at its floor
    assert readers.rates == {2: pytest.approx(64 * MiB / 10.0)}
    assert readers.ahead == 32 * MiB and readers.width == 4
    clock.now += 0.05  # 64 MiB in 50 ms: 1.3 GB/s, a quarter second of it ahead
    readers.finished(64 * MiB)
    assert readers.ahead == pytest.approx(0.25 * 64 * MiB / 0.05, rel=1e-6)
    clock.now += 0.001  # 67 GB/s: the read-ahead at its ceiling, 1 GiB
    readers.finished(64 * MiB)
    assert readers.ahead == 1024 * MiB
    assert readers.width == 4 and readers.settled  # the most: no further doubling


@pytest.mark.parametrize("width", [1, 3, 8])
def test_a_load_keeps_width_reads_in_flight_and_gives_the_same_model(tmp_path, monkeypatch, width):
    """The loader reads `width` steps at once (readers finishing in any order), and the
    model is the same as one reader's."""
    values = {f"w{i}": np.full((64, 64), i, np.float32) for i in range(12)}
    path = tmp_path / "w.safetensors"
    save_safetensors(path, values)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in values.items()}

    class Fixed(Readers):
        def __init__(self, start):
            super().__init__(most=width)
            self.width = width

        def finished(self, nbytes):  # never changes its width
            pass

    lock, in_flight, most = threading.Lock(), [0], [0]
    placed = _place.placed_by_device

    def slow(tensor, sharding, verify):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.1 + 0.03 * (int(tensor.name[1:]) % 3))  # later ones may finish first
        try:
            return placed(tensor, sharding, verify)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(_load, "Readers", Fixed)
    monkeypatch.setattr(_ways, "placed_by_device", slow)
    loaded = load_safetensors(target, path)
    assert most[0] == width
    for name, value in values.items():
        assert np.array_equal(loaded[name], value)


@pytest.mark.parametrize("slices_on_host", [True, False])
def test_a_load_into_stacks_on_devices_keeps_few_slices_in_flight_only_on_the_host(
    tmp_path, monkeypatch, slices_on_host
):
    """A stack on the 8 CPU devices, replicated: each layer's slice is placed on them and
    waits in host memory until it is written into the stacked leaf, so the load keeps
    `SLICES_AT_ONCE` reads in flight; on devices that copy host memory (a TPU's: here the
    CPU devices taken for such) the slices wait in the devices' own memory, and the
    readers' width holds."""

    class Wide(nn.Module):
        def __init__(self, *, rngs):
            linear = lambda rngs: nn.Linear(64, 64, use_bias=False, rngs=rngs)
            self.layers = nn.Stack(linear, 6, rngs=rngs)

    model = Wide(rngs=nn.Rngs(0))
    path = tmp_path / "layers.safetensors"
    save_safetensors(path, model.flat_state_dict(unstacked=True))
    replicated = jax.sharding.NamedSharding(jax.make_mesh((8,), ("x",)), P())
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
        tt.eval_shape(lambda: Wide(rngs=nn.Rngs(0))),
    )

    class Fixed(Readers):
        def __init__(self, start):
            super().__init__(most=6)
            self.width = 6

        def finished(self, nbytes):  # never changes its width
            pass

    monkeypatch.setattr(_load, "Readers", Fixed)
    most = in_flight(monkeypatch, _ways, "placed_by_device")
    if not slices_on_host:
        monkeypatch.setattr(_layers, "on_host", lambda sharding: False)
    loaded = load_safetensors(target, path)
    assert most[0] == (_layers.SLICES_AT_ONCE if slices_on_host else 6)
    assert np.array_equal(loaded.layers.block.kernel, model.layers.block.kernel)


def _saved(tmp_path, count=12):
    values = {f"w{i}": np.full((64, 64), i, np.float32) for i in range(count)}
    path = tmp_path / "w.safetensors"
    save_safetensors(path, values)
    return values, path, {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in values.items()}


def test_loads_read_with_the_process_s_threads_started_once(tmp_path, monkeypatch):
    """The threads a load reads with are the process's (`reader_pool`), kept: a load after
    another starts no reader (only its read-ahead's thread, before any reader runs)."""
    values, path, target = _saved(tmp_path)
    load_safetensors(target, path)  # (the threads it needs, started)
    time.sleep(0.2)  # (each thread counts itself idle just after its last task)
    started, start = [], threading.Thread.start

    def counted(thread):
        started.append(thread.name)
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    loaded = load_safetensors(target, path)
    assert started == ["taktiny-readahead"]
    for name, value in values.items():
        assert np.array_equal(loaded[name], value)


def test_loads_at_once_from_several_threads_share_the_readers_and_each_gets_its_model(tmp_path):
    values, path, target = _saved(tmp_path)
    others = {k: v + 100 for k, v in values.items()}
    second = tmp_path / "second.safetensors"
    save_safetensors(second, others)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as callers:
        loads = [callers.submit(load_safetensors, target, p) for p in [path, second] * 4]
        results = [f.result() for f in loads]
    for k, loaded in enumerate(results):
        want = values if k % 2 == 0 else others
        assert all(np.array_equal(loaded[n], v) for n, v in want.items())


def test_loads_end_with_a_pool_of_one_thread(tmp_path, monkeypatch):
    """Loads at once beyond the pool's threads take turns and all end: no task of theirs
    waits in the pool for one queued behind it (the read-ahead keeps its own thread)."""
    from concurrent.futures import ThreadPoolExecutor

    values, path, target = _saved(tmp_path)
    one = ThreadPoolExecutor(1, thread_name_prefix="taktiny-read")
    monkeypatch.setattr(_readers, "_pool", one)
    try:
        with ThreadPoolExecutor(2) as callers:
            loads = [callers.submit(load_safetensors, target, path) for _ in range(2)]
            results = [f.result(timeout=60) for f in loads]
    finally:
        one.shutdown(wait=False, cancel_futures=True)
    for loaded in results:
        assert all(np.array_equal(loaded[n], v) for n, v in values.items())


@pytest.mark.filterwarnings(
    "ignore:os.fork:RuntimeWarning"  # (JAX's warning at a fork: the child here runs no JAX)
)
def test_a_forked_child_reads_with_threads_of_its_own(tmp_path):
    """The parent's reader threads are not in a child it forks: the child's first use of
    the pool starts its own (a pool that counted the parent's idle threads would queue the
    child's tasks for threads that never run them)."""
    import os

    _readers.reader_pool().submit(int).result()  # (the parent's pool, with an idle thread)
    time.sleep(0.2)
    pid = os.fork()
    if pid == 0:  # the child: exits 0 when its task ran
        try:
            ran = _readers.reader_pool().submit(int, "7").result(timeout=10) == 7
        except BaseException:  # noqa: BLE001  (any failure is the exit status)
            ran = False
        os._exit(0 if ran else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
