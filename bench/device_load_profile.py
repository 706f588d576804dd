"""Where a load onto an accelerator spends its time (issue 52 point 3; FINDINGS 14): each
case loaded once to warm up, then once with the loader's steps wrapped in clocks, and the
seconds summed by thread: the load's own thread (planning, waiting for each unit, placing
it, starting reads, the final resolve, and what it spent outside all of them), the reader
threads (read-ahead claims, mappings, copies onto the device, checksums, a staged piece's
read and hash, the wait for a ring buffer, each unit's whole read) and the read-ahead's
thread (its requests to the OS), and every ``Thread.start`` (a thread the load made). Then
alternating rounds of the load as it is (its reader threads kept across loads) and with
threads started for each load (``threads_kept``): what starting them costs a load.

The cases: the 1 GiB bfloat16 file of ``bench/device_load.py`` loaded as it is
(``plain``: its tensors copied from the file's mapped pages onto a TPU or a GPU), the same
staged through the ring as a tensor in object storage is (``staged``), and its FP8 twin
into bfloat16 (``fp8_bf16``) and into int8 (``fp8_int8``). ``DEVICE_LOAD_LAYERS`` and
``DEVICE_LOAD_WIDTH`` make them smaller. Prints one JSON object of the figures, each case's
thread-seconds in milliseconds. On a CPU the figures mean little: a CPU device adopts host
memory, so no tensor is mapped, staged or copied there.

    python bench/device_load_profile.py FOLDER [CASE ...]    # on an accelerator's host
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import device_load as dl  # (the path first: bench as a package)

CASES = ("plain", "staged", "fp8_bf16", "fp8_int8")


class Clocks:
    """Seconds summed by (thread kind, step) of the calls wrapped with :meth:`wrap`."""

    def __init__(self) -> None:
        self.spent: dict[tuple[str, str], float] = {}
        self.calls: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()

    def add(self, step: str, seconds: float) -> None:
        name = threading.current_thread().name
        kind = "main" if name == "MainThread" else name.rstrip("_0123456789")
        with self.lock:
            key = (kind, step)
            self.spent[key] = self.spent.get(key, 0.0) + seconds
            self.calls[key] = self.calls.get(key, 0) + 1

    @contextlib.contextmanager
    def wrap(self, owner: Any, attribute: str, step: str) -> Iterator[None]:
        """`owner.attribute` timed as `step` for the block (a generator's each step)."""
        real = owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)
        generator = getattr(real, "__code__", None) is not None and real.__code__.co_flags & 0x20

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.add(step, time.perf_counter() - start)

        def timed_steps(*args: Any, **kwargs: Any) -> Any:
            steps = real(*args, **kwargs)
            while True:
                start = time.perf_counter()
                try:
                    item = next(steps)
                except StopIteration:
                    return
                finally:
                    self.add(step, time.perf_counter() - start)
                yield item

        setattr(owner, attribute, timed_steps if generator else timed)
        try:
            yield
        finally:
            setattr(owner, attribute, real)

    def table(self) -> dict[str, dict[str, float]]:
        """{thread kind: {step: milliseconds}}, and each step's calls under "calls"."""
        out: dict[str, dict[str, Any]] = {}
        for (kind, step), seconds in sorted(self.spent.items()):
            out.setdefault(kind, {})[step] = round(seconds * 1e3, 2)
            out.setdefault("calls", {})[f"{kind}: {step}"] = self.calls[(kind, step)]
        return out


def _wrapped(clocks: Clocks) -> contextlib.ExitStack:
    """Every step the profile times, wrapped (restored when the stack closes)."""
    import concurrent.futures

    import taktiny.io._read as read
    import taktiny.io._storage as storage
    import taktiny.loading._load as load
    import taktiny.loading._readers as readers
    import taktiny.loading._ways as ways

    stack = contextlib.ExitStack()
    steps: list[tuple[Any, str, str]] = [
        (load, "open_load", "planning: the record"),
        (load, "migrated", "planning: migrations"),
        (load, "steps_of", "planning: the steps"),
        (load, "Ways", "planning: the ways"),
        (load, "result_of", "waiting for a unit"),
        (load, "loaded", "the final resolve"),
        (concurrent.futures.ThreadPoolExecutor, "submit", "starting a read"),
        (threading.Thread, "start", "Thread.start"),
        (readers.Readahead, "reached", "read-ahead claims"),
        (readers.Readers, "finished", "the readers' count"),
        (storage.OpenFile, "advise", "read-ahead requests"),
        (read.Tensor, "mapped", "mapping"),
        (read.Tensor, "check", "checksum of mapped bytes"),
        (read.Tensor, "read_rows", "a staged piece read and hashed"),
        (ways.Ring, "take", "waiting for a ring buffer"),
        (ways, "_copied", "copy onto the device"),
    ]
    for cls in (ways.Way, *_subclasses(ways.Way)):
        for method, step in (("read", "a unit's whole read"), ("place", "placing a unit")):
            if method in cls.__dict__:
                steps.append((cls, method, f"{step} ({cls.__name__})"))
    for owner, attribute, step in steps:
        stack.enter_context(clocks.wrap(owner, attribute, step))
    return stack


def _subclasses(cls: type) -> list[type]:
    return [s for c in cls.__subclasses__() for s in (c, *_subclasses(c))]


def _loads(folder: Path, cases: list[str]) -> dict[str, tuple[int, Callable[[], Any], Any]]:
    """Each case's (bytes, load, settings) over files written in `folder`."""
    import taktiny as tt
    from taktiny.io import load_safetensors, save_safetensors

    arrays = dl._arrays()
    path = folder / "model.safetensors"
    save_safetensors(path, arrays)
    flat = dl._abstract({n: (a.shape, a.dtype) for n, a in arrays.items()})
    out: dict[str, tuple[int, Callable[[], Any], Any]] = {}
    nbytes = path.stat().st_size
    plain = lambda: load_safetensors(flat, path, progress=False)
    out["plain"] = (nbytes, plain, {})
    out["staged"] = (nbytes, plain, {"_ways._local": lambda tensor: False})
    if any(c.startswith("fp8") for c in cases):
        fp8, _ = dl._write_fp8(folder, arrays)
        layers = dl._modules(stacked=False)
        rules = dl._fp8_rules(fp8.parent)
        int8, size = tt.quantize(layers), fp8.stat().st_size
        load = lambda model: load_safetensors(model, fp8.parent, rules=rules, progress=False)
        out["fp8_bf16"] = (size, lambda: load(layers), {})
        out["fp8_int8"] = (size, lambda: load(int8), {})
    return {c: out[c] for c in cases}


def profile(folder: Path, cases: list[str]) -> dict[str, Any]:
    """The figures of each case (see the module's doc)."""
    figures: dict[str, Any] = {"device": str(jax.devices()[0].device_kind)}
    for case, (nbytes, load, settings) in _loads(folder, cases).items():
        with dl._settings(settings):
            jax.block_until_ready(load())  # (compiles; the file in the page cache)
            clocks = Clocks()
            with _wrapped(clocks):
                start = time.perf_counter()
                jax.block_until_ready(load())
                wall = time.perf_counter() - start
        table = clocks.table()
        main = table.get("main", {})
        inner = ("Thread.start", "the readers' count")  # (inside the steps around them)
        accounted = sum(ms for step, ms in main.items() if step not in inner)
        main["outside the steps timed"] = round(wall * 1e3 - accounted, 2)
        figures[case] = {"GiBps": nbytes / 2**30 / wall, "ms": round(wall * 1e3, 2), **table}
        with dl._settings(settings):
            figures[case]["threads_kept"] = _threads_kept(nbytes, load)
    return figures


def _threads_kept(nbytes: int, load: Callable[[], Any], rounds: int = 5) -> dict[str, float]:
    """The load as it is (its reader threads the process's, kept across loads:
    ``taktiny.loading._readers.reader_pool``) against the same with threads started for
    each load (a pool of its own, shut down after it, as loads had before), in alternating
    rounds: GiB/s of each (medians) and the median of the rounds' ratios. What starting a
    load's threads costs it."""
    made: list[concurrent.futures.ThreadPoolExecutor] = []

    def own_pool() -> concurrent.futures.ThreadPoolExecutor:
        made.append(concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="taktiny-read"))
        return made[-1]

    own = {"_load.reader_pool": own_pool}  # (the read-ahead keeps a thread of its own)
    times: dict[str, list[float]] = {"kept": [], "started": []}
    for _ in range(rounds):
        for way in times:
            with dl._settings(own if way == "started" else {}):
                start = time.perf_counter()
                jax.block_until_ready(load())
                times[way].append(time.perf_counter() - start)
            while made:
                made.pop().shutdown()
    ratios = [s / k for s, k in zip(times["started"], times["kept"], strict=True)]
    return {
        "kept_GiBps": nbytes / 2**30 / statistics.median(times["kept"]),
        "started_GiBps": nbytes / 2**30 / statistics.median(times["started"]),
        "kept_vs_started": statistics.median(ratios),
    }


def main(argv: list[str]) -> None:
    folder = Path(argv[0])
    folder.mkdir(parents=True, exist_ok=True)
    cases = argv[1:] or list(CASES)
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; the cases are {list(CASES)}")
    print(json.dumps(profile(folder, cases), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
