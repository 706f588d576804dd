"""Profiles behind the missed targets in results.md, reproducible on their own.

    python bench/diagnose.py load      # cProfile of load_state_dict, 384 and 3,000 leaves
    python bench/diagnose.py orbax     # CPU time, page faults and peak memory of Orbax
                                      # save/restore, default, tuned, chunked, and why
                                      # restores copy
    python bench/diagnose.py orbax --quick
    python bench/diagnose.py sharded   # cProfile of tt.shard (3,000 leaves) and of building
                                      # the sharded restore targets (tt.eval_shape, tt.shard)

(For a sampling view of the load path: ``py-spy record -f raw -o load.raw -- python
bench/diagnose.py load`` and read the inclusive share of each frame under load_state_dict.)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import pstats
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax

jax.config.update("jax_num_cpu_devices", 8)  # for `sharded`; JAX takes it before first use

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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["load", "orbax", "sharded"])
    parser.add_argument("--quick", action="store_true", help="orbax: the 67 MB model")
    args = parser.parse_args()
    if args.what == "sharded":
        profile_sharded()
    else:
        profile_load() if args.what == "load" else profile_orbax(args.quick)
