"""Profiles behind the missed targets in results.md, reproducible on their own.

    python bench/diagnose.py load      # cProfile of load_state_dict, 384 and 3,000 leaves
    python bench/diagnose.py orbax     # CPU time, page faults and peak memory of Orbax
                                      # save/restore, default, tuned, chunked, and why
                                      # restores copy
    python bench/diagnose.py orbax --quick
    python bench/diagnose.py sharded   # cProfile of tt.shard (3,000 leaves) and of building
                                      # the sharded restore targets (tt.eval_shape, tt.shard)
    python bench/diagnose.py streaming # taktiny.io.load_safetensors of the 1 GB model from a
                                      # cold page cache: how far its prefetch reaches, where
                                      # the time goes, and what-ifs against the raw read
    python bench/diagnose.py streaming --quick

(For a sampling view of the load path: ``py-spy record -f raw -o load.raw -- python
bench/diagnose.py load`` and read the inclusive share of each frame under load_state_dict.)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import functools
import mmap
import os
import pstats
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax

jax.config.update("jax_num_cpu_devices", 8)  # for `sharded`; JAX takes it before first use

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import _disk, _formats, _models  # noqa: E402


def profile_load(seconds: float = 3.0, blocks: tuple[int, ...] = (64, 500)) -> None:
    """Where a full load_state_dict spends its time, by function (cProfile, own time)."""
    for n in blocks:
        model = _models.build("taktiny", n, 0)
        state = jax.tree.map(lambda x: x * 0.5 + 1.0, model).state_dict()
        load = functools.partial(model.load_state_dict, state)
        _own_time(f"{n * 6:,} leaves, a full load_state_dict", load, seconds * 2 / 3)


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def _measure(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and minor page faults of one call."""
    cpu, faults = _usage()
    start = time.perf_counter()
    fn(*args, **kwargs)
    wall = time.perf_counter() - start
    cpu2, faults2 = _usage()
    return wall, cpu2 - cpu, faults2 - faults


def _save(path: Path, state: Any, tuned: bool, chunk: int | None) -> None:
    _formats.save_orbax(path, state, tuned=tuned, chunk=chunk)
    _disk.sync(path)


def _restore(path: Path, abstracts: Any, tuned: bool) -> None:
    jax.block_until_ready(_formats._load_orbax(path, abstracts, tuned=tuned))


def _aligned_zeros(shape: Any, dtype: Any) -> np.ndarray:
    """np.zeros, but starting on a 64-byte boundary, as XLA's CPU client needs to alias it."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + 64, np.uint8)
    return raw[-raw.ctypes.data % 64 :][:nbytes].view(dtype).reshape(shape)


@contextlib.contextmanager
def _orbax_reads_aligned() -> Any:
    """A what-if, not a fix to ship: Orbax's _read_shard allocating its buffer aligned."""
    from orbax.checkpoint._src.serialization import serialization

    class AlignedNumpy:
        def __getattr__(self, name: str) -> Any:
            return _aligned_zeros if name == "zeros" else getattr(np, name)

    saved = serialization.np
    serialization.np = AlignedNumpy()  # pyright: ignore[reportAttributeAccessIssue]
    try:
        yield
    finally:
        serialization.np = saved


def profile_orbax(quick: bool, rounds: int = 3) -> None:
    """Wall and CPU time and minor page faults of Orbax save/restore, default vs tuned vs
    chunked (the best of `rounds` each), and whether Orbax's read buffers can be handed to
    JAX uncopied."""
    width, depth = _formats.SIZES["quick" if quick else "full"]
    models, abstracts = _formats.models(width, depth), _formats.abstracts(width, depth)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(models["taktiny"]))
    print(f"model: {nbytes / 1e6:,.0f} MB in {depth} arrays; best of {rounds} rounds")
    variants = {
        "default": (False, None),
        "tuned": (True, None),
        "chunked": (True, _formats.CHUNK_BYTES),
    }
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, (tuned, chunk) in variants.items():
            saves = []
            for i in range(rounds):
                if i:  # freed blocks are rewritten fast; this VM's disk is slow on fresh ones
                    _disk.remove(paths[name])
                paths[name] = Path(tmp, f"{name}-{i}")
                state = models["taktiny"].state_dict()
                saves.append(_measure(_save, paths[name], state, tuned, chunk))
            wall, cpu, _ = min(saves)
            size = _disk.size(paths[name])
            print(f"save    {name:8} wall {wall:5.2f} s  CPU {cpu:5.2f} s  bytes {size:,}")
        cases = {
            "default": ("default", False),
            "tuned": ("tuned", False),
            "chunked": ("chunked", False),
            "chunked, aligned reads (a what-if: Orbax patched)": ("chunked", True),
        }
        for label, (name, aligned) in cases.items():
            restores = []
            for _ in range(rounds):
                _disk.evict(paths[name])
                with _orbax_reads_aligned() if aligned else contextlib.nullcontext():
                    tuned = variants[name][0]
                    restores.append(_measure(_restore, paths[name], abstracts, tuned))
            wall, cpu, faults = min(restores)
            print(
                f"restore {label:8} wall {wall:5.2f} s  CPU {cpu:5.2f} s  minor page faults "
                f"{faults:,} = {faults * 4096 / nbytes:.2f}x the model's bytes in 4 KiB pages"
            )
    # Orbax reads each array into np.zeros(...) and then calls jax.device_put on it.
    zeros = np.zeros((width, width), np.float32)
    aligned = _aligned_zeros(zeros.shape, zeros.dtype)
    for name, host in (("np.zeros (what Orbax reads into)", zeros), ("64-byte aligned", aligned)):
        device = jax.device_put(host)
        shared = device.unsafe_buffer_pointer() == host.ctypes.data
        print(
            f"{name}: address % 64 = {host.ctypes.data % 64}; jax.device_put "
            f"{'aliases it (no copy)' if shared else 'copies it'}"
        )


def _own_time(label: str, fn: Any, seconds: float) -> None:
    """Times `fn` unprofiled, then prints cProfile's ten biggest own times in a loop of it."""
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds / 2:
        fn()
        calls += 1
    per_call = (time.perf_counter() - start) / calls
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = sum(row[2] for row in stats.stats.values())  # pyright: ignore[reportAttributeAccessIssue]
    print(f"\n{label}: {per_call * 1e3:.2f} ms per call (unprofiled); own time:")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # pyright: ignore[reportAttributeAccessIssue]
    for (file, line, name), (_, ncalls, own, *_rest) in rows[:10]:
        where = f"{Path(file).name}:{line}({name})"
        print(f"  {own / total:6.1%}  {ncalls / calls:8.1f} calls/call  {where}")


def profile_sharded(seconds: float = 6.0, blocks: int = 500, width: int = 4096) -> None:
    """Where tt.shard of the small-blocks model and the build of the sharded restore
    targets spend their time (cProfile, own time), on the (2, 4) mesh of 8 CPU devices."""
    import optax

    import taktiny as tt
    from bench import sharded
    from taktiny import nn

    where = sharded.mesh()
    model = _models.build("taktiny", blocks, 0)
    _own_time(
        f"tt.shard, {blocks * 6:,} leaves",
        lambda: jax.block_until_ready(tt.shard(model, sharded.BLOCK_RULES, where)),
        seconds,
    )
    _own_time(
        f"tt.sharding_plan, {blocks * 6:,} leaves",
        lambda: tt.sharding_plan(model, sharded.BLOCK_RULES, where),
        seconds,
    )

    def targets() -> Any:
        abstract = tt.eval_shape(lambda: _formats.Big(width, 16, rngs=nn.Rngs(0)))
        abstract = tt.shard(abstract, sharded.BIG_RULES, where)
        opt_abstract = tt.eval_shape(optax.adam(1e-3).init, abstract)
        return abstract.state_dict(), tt.state_dict(opt_abstract)

    _own_time(f"the sharded restore's targets, 16 x Linear({width}, {width})", targets, seconds)


def _resident(path: Path, offset: int, length: int) -> int:
    """How many bytes of the range are in the page cache (mincore on a mapping of the file)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = offset // page * page
    size = offset + length - start
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        pages = (ctypes.c_ubyte * ((size + page - 1) // page))()
        libc.mincore(addr, size, pages)
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(p & 1 for p in pages) * page


def _readahead_kb(path: Path) -> str:
    dev = os.stat(path).st_dev
    knob = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    return knob.read_text().strip() + " KiB" if knob.exists() else "unknown"


@contextlib.contextmanager
def _phases() -> Any:
    """Adds up the seconds a load spends in each part of taktiny.io's read path (the
    device work blocked on, so that it is counted where it is started)."""
    from taktiny.convert import _transforms
    from taktiny.io import _read
    from taktiny.loading import _readers
    from taktiny.state import _state

    spent: dict[str, float] = {}

    def timed(name: str, fn: Any, block: bool = False) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if block:
                jax.block_until_ready(out)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
            return out

        return wrapper

    patches = [
        (_read, "_buffer", "fresh buffers (mmap MAP_POPULATE)", False),
        (_read, "_pread", "preadv (disk wait + copy)", False),
        (_readers.Readahead, "reached", "readahead calls (WILLNEED)", False),
        (jax, "device_put", "jax.device_put (blocked)", True),
        (_transforms.transpose, "one", "transpose in XLA (blocked)", True),
        (_state, "load_resolved", "the placed leaves written into the model", False),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _, _ in patches]
    for owner, name, label, block in patches:
        setattr(owner, name, timed(label, getattr(owner, name), block))
    try:
        yield spent
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


class _Window:
    """Keeps the OS reading the next `ahead` bytes of a file from a tensor on, in WILLNEED
    calls of `chunk` bytes (the kernel cuts each call to the disk's readahead size), never
    asking twice for the same bytes."""

    def __init__(self, ahead: int = 128 * 2**20, chunk: int = 2**20):
        self.ahead, self.chunk = ahead, chunk
        self.reached: dict[Path, int] = {}

    def __call__(self, tensor: Any) -> None:
        end = min(tensor.file.stat().st_size, tensor.offset + max(tensor.nbytes, self.ahead))
        start = max(tensor.offset, self.reached.get(tensor.file, 0))
        if start >= end:
            return
        fd = os.open(tensor.file, os.O_RDONLY)
        try:
            for at in range(start, end, self.chunk):
                os.posix_fadvise(fd, at, min(self.chunk, end - at), os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
        self.reached[tensor.file] = end


def _cold_rounds(cases: dict[str, tuple[Any, Path]], rounds: int) -> dict[str, list[float]]:
    """Wall seconds of each case from a cold page cache, one warm-up, interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn, _ in cases.values():
        fn()
    for r in range(rounds):
        order = list(cases)
        random.Random(r).shuffle(order)
        for name in order:
            fn, path = cases[name]
            os.sync()
            _disk.evict(path)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _print_rounds(times: dict[str, list[float]], raw: str) -> None:
    for name, ts in times.items():
        share = statistics.median(r / t for r, t in zip(times[raw], ts, strict=True))
        print(
            f"  {name:48} median {statistics.median(ts):5.2f} s  raw/this {share:4.2f}  "
            f"(rounds: {', '.join(f'{t:.2f}' for t in ts)})"
        )


def profile_streaming(quick: bool = False, rounds: int = 5, size: Any = None) -> None:
    """Why a cold taktiny.io.load_safetensors trails the raw read: how much of a tensor its
    prefetch brings in, the seconds in each part of the read path, and what-ifs."""
    import taktiny.convert as cv
    import taktiny.io as tio
    from bench import streaming

    width, depth = size or _formats.SIZES["quick" if quick else "full"]
    model = _formats.Big(width, depth, rngs=_formats.nn.Rngs(0))
    abstract = _formats.abstract(width, depth)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(model))
    rules = [cv.Rule(*streaming.RULE, cv.transpose())]
    print(f"model: {nbytes / 1e6:,.0f} MB in {2 * depth} tensors; load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {k: Path(tmp, f"{k}.safetensors") for k in ("raw", "safetensors", "transposed")}
        for kind, path in paths.items():
            streaming._write(kind, path, model)
        del model
        plain, transposed = paths["safetensors"], paths["transposed"]

        def raw() -> Any:
            return _disk.read_raw(paths["raw"], jax.tree.leaves(abstract))

        def load(path: Path = plain, **kw: Any) -> Any:
            return jax.block_until_ready(tio.load_safetensors(abstract, path, progress=False, **kw))

        # 1. how much of a tensor one WILLNEED call over all of it brings in
        biggest = max(tio.open_safetensors(plain).values(), key=lambda t: t.nbytes)
        _disk.evict(plain)
        fd = os.open(plain, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, biggest.offset, biggest.nbytes, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
        time.sleep(0.5)
        got = _resident(plain, biggest.offset, biggest.nbytes)
        print(
            f"\none posix_fadvise(WILLNEED) over all of {biggest.name} "
            f"({biggest.nbytes / 2**20:.1f} MiB), 0.5 s later: {got / 2**20:.1f} MiB of it in "
            f"the page cache ({got / biggest.nbytes:.0%}); the disk's read_ahead_kb is "
            f"{_readahead_kb(plain)} (the kernel cuts a WILLNEED call to about that)"
        )
        order = [
            t.name for t in sorted(tio.open_safetensors(plain).values(), key=lambda t: t.offset)
        ]
        print(f"tensors in file order: {', '.join(order[:4])}, ...")

        # 2. the seconds in each part, from a cold page cache
        for label, kw, path in (
            ("no rules", {}, plain),
            ("transposing rule", {"rules": rules}, transposed),
        ):
            load(path, **kw)
            parts: list[dict[str, float]] = []
            walls = []
            for _ in range(max(rounds // 2, 1)):
                os.sync()
                _disk.evict(path)
                with _phases() as spent:
                    start = time.perf_counter()
                    load(path, **kw)
                    walls.append(time.perf_counter() - start)
                parts.append(dict(spent))
            print(
                f"\ncold load, {label}: {statistics.median(walls):.2f} s (median of {len(walls)})"
            )
            for name in parts[0]:
                s = statistics.median(p.get(name, 0.0) for p in parts)
                print(f"  {s:6.3f} s  {name}")
            rest = statistics.median(walls) - sum(
                statistics.median(p.get(n, 0.0) for p in parts) for n in parts[0]
            )
            print(f"  {rest:6.3f} s  the rest (Python, planning, checks)")

        # 3. the loader against the raw read, interleaved from a cold page cache
        cases = {
            "raw read": (raw, paths["raw"]),
            "load_safetensors as is": (load, plain),
            "transposing rule as is": (lambda: load(transposed, rules=rules), transposed),
        }
        print(f"\ncold loads against the raw read, {rounds} interleaved rounds:")
        _print_rounds(_cold_rounds(cases, rounds), "raw read")

        # 4. the read path alone, without taktiny's planning: one thread, or a reader thread
        # reading at most two tensors ahead while the main thread places (and transposes)
        def pipeline(path: Path, transpose: bool, ahead: int) -> Any:
            tensors = sorted(tio.open_safetensors(path).values(), key=lambda t: t.offset)
            device = jax.devices()[0]

            window = _Window()

            def read(t: Any) -> Any:
                window(t)  # 128 MiB past this tensor
                return t.read()

            def place(host: Any) -> Any:
                value = jax.device_put(host, device)
                return jnp.transpose(value) if transpose else value

            def run() -> Any:
                window.reached.clear()
                with ThreadPoolExecutor(1) as pool:
                    if not ahead:
                        return jax.block_until_ready([place(read(t)) for t in tensors])
                    pending = deque(pool.submit(read, t) for t in tensors[:ahead])
                    placed = []
                    for t in tensors[ahead:] + [None] * ahead:
                        host = pending.popleft().result()
                        if t is not None:
                            pending.append(pool.submit(read, t))
                        placed.append(place(host))
                    return jax.block_until_ready(placed)

            return run

        print("\nthe read path alone (what-ifs, all with the 128 MiB-ahead prefetch):")
        _print_rounds(
            _cold_rounds(
                {
                    "raw read": (raw, paths["raw"]),
                    "one thread: read, place, read, ...": (pipeline(plain, False, 0), plain),
                    "reader thread 2 tensors ahead, main places": (
                        pipeline(plain, False, 2),
                        plain,
                    ),
                    "one thread: read, place, transpose, ...": (
                        pipeline(transposed, True, 0),
                        transposed,
                    ),
                    "reader thread 2 ahead, main places, transposes": (
                        pipeline(transposed, True, 2),
                        transposed,
                    ),
                },
                rounds,
            ),
            "raw read",
        )
    # 5. the memory a first load costs besides its arrays, in a fresh interpreter
    code = (
        "from bench.memory import _rss; import jax; rss = _rss(); "
        "from taktiny.state import _values; _values.array_type(); print(_rss() - rss)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    grown = int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else -1
    print(
        f"\nfirst use of taktiny.state._values.array_type() (a load's first check) in a fresh "
        f"interpreter: RSS +{grown / 1e6:.1f} MB, counted in a first load's growth"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["load", "orbax", "sharded", "streaming"])
    parser.add_argument("--quick", action="store_true", help="orbax, streaming: the 67 MB model")
    args = parser.parse_args()
    if args.what == "sharded":
        profile_sharded()
    elif args.what == "streaming":
        profile_streaming(args.quick)
    else:
        profile_load() if args.what == "load" else profile_orbax(args.quick)
