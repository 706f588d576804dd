"""Memory: the peak resident memory of restoring a 1 GB checkpoint, one subprocess per case.

Each case runs in a fresh interpreter (``python -m bench.memory --worker ...``) that
imports everything and builds its abstract target first, notes its resident memory,
restores, and reports its peak. The peak is the kernel's high-water mark of the
process's own memory (``VmHWM``); ``ru_maxrss`` would be wrong here, because Linux
carries the parent's resident size at fork into the child's ``ru_maxrss`` across
``exec``, and the parent holds the 1 GB models. The report gives the peak against the
checkpoint's size, both as the whole process and as the growth over the process's
memory just before the restore began (interpreter, JAX, PyTorch and Orbax themselves).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ._results import Config, Group, Table, Target

ROOT = Path(__file__).resolve().parent.parent
TT, TUNED, CHUNKED = "Taktiny + Orbax", "Taktiny + Orbax tuned", "Taktiny + Orbax chunked"


def _status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # reported in kB


def _rss() -> int:
    """This process's resident memory now, in bytes."""
    return _status("VmRSS")


def _peak() -> int:
    """This process's peak resident memory since its exec, in bytes."""
    return _status("VmHWM")


def _worker(case: str, path: str, width: int, depth: int, registry: str = "bench._formats") -> None:
    """Restores one checkpoint and prints its memory figures as JSON (runs in the subprocess).

    The case is looked up in `registry`, a module with ``RESTORE`` (case -> (call,
    restore(path, abstracts))) and ``NEEDS`` (case -> modules to import first) tables:
    ``bench._formats``, or another group's (``bench.streaming``). A registry may also have
    ``PREPARE`` (case -> prepare(abstracts) -> abstracts), run before the memory is noted:
    a case's own target (``bench.quantized``'s quantized model); and ``ABSTRACTS`` (case ->
    abstracts(width, depth)), a case's own abstract targets in place of
    ``_formats.abstracts`` (``bench.scanned``'s Llama, `width` wide and `depth` layers deep).
    """
    import jax

    from . import _formats

    cases = importlib.import_module(registry)
    for module in cases.NEEDS[case]:
        importlib.import_module(module)
    abstracts = getattr(cases, "ABSTRACTS", {}).get(case, _formats.abstracts)(width, depth)
    prepare = getattr(cases, "PREPARE", {}).get(case)
    if prepare is not None:
        abstracts = prepare(abstracts)
    before = _rss()
    start = time.perf_counter()
    restored = cases.RESTORE[case][1](Path(path), abstracts)
    jax.block_until_ready(restored)
    seconds = time.perf_counter() - start
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    # VmHWM and VmRSS are sampled separately: a load that grows by less than a page can read a
    # high-water mark a page under the RSS read before it; the peak is at least "before"
    peak = max(_peak(), before)
    print(json.dumps({"before": before, "peak": peak, "maxrss": maxrss, "seconds": seconds}))


def _measure(
    case: str, path: Path, width: int, depth: int, *, registry: str = "bench._formats"
) -> dict[str, float]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    args = [
        sys.executable,
        "-m",
        "bench.memory",
        "--worker",
        case,
        str(path),
        str(width),
        str(depth),
        "--registry",
        registry,
    ]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory worker {case!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(config: Config) -> Group:
    """Saves one checkpoint per system, then measures each restore's peak RSS."""
    import jax

    from . import _disk, _formats

    start = time.perf_counter()
    width, depth = _formats.SIZES[config.mode]
    models = _formats.models(width, depth)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(models["taktiny"]))
    group = Group("memory", f"Peak memory of restoring a {nbytes / 1e9:.2f} GB checkpoint")
    root = Path(config.scratch)
    root.mkdir(parents=True, exist_ok=True)
    # the smoke test runs the Orbax cases only (every restore function also runs in the
    # checkpoint group's smoke test); each subprocess costs seconds of imports
    systems = [TT, TUNED, CHUNKED] if config.mode == "smoke" else list(_formats.SAVE)
    paths = {s: root / f"memory-{i}" for i, s in enumerate(systems)}
    try:
        for system, path in paths.items():
            _formats.SAVE[system][1](path, models)
        del models
        sizes = {s: _disk.size(p) for s, p in paths.items()}
        with ThreadPoolExecutor(config.pick(2, 3, len(paths))) as pool:
            futures = {s: pool.submit(_measure, s, p, width, depth) for s, p in paths.items()}
            results = {s: f.result() for s, f in futures.items()}
    finally:
        for path in paths.values():
            _disk.remove(path)
    table = Table(
        f"Peak resident memory (MB) of one restore, {nbytes / 1e6:,.0f} MB of float32",
        systems,
        unit="B",
    )
    for s, r in results.items():
        call = _formats.RESTORE[s][0]
        table.add("checkpoint size on disk", s, call, sizes[s])
        table.add("process RSS before the restore", s, call, r["before"])
        table.add("peak RSS", s, call, r["peak"])
        table.add("peak RSS growth (peak - before)", s, call, r["peak"] - r["before"])
    ratios = Table(
        "Peak RSS relative to the checkpoint's size", systems, unit="x", log=False, line=1.3
    )
    for s, r in results.items():
        call = _formats.RESTORE[s][0]
        ratios.add("growth / checkpoint size", s, call, (r["peak"] - r["before"]) / sizes[s])
        ratios.add("whole process / checkpoint size", s, call, r["peak"] / sizes[s])
    group.tables += [table, ratios]
    for system in (TT, TUNED, CHUNKED):
        r, size = results[system], sizes[system]
        group.targets += [
            Target(
                f"{system} restore into an abstract model: peak RSS growth <= 1.3x checkpoint size",
                (r["peak"] - r["before"]) / size,
                1.3,
                False,
                "(peak RSS - RSS just before the restore) / checkpoint bytes",
            ),
            Target(
                f"{system} restore into an abstract model: whole-process peak RSS <= 1.3x "
                "checkpoint size",
                r["peak"] / size,
                1.3,
                False,
                "peak RSS / checkpoint bytes, interpreter and libraries included",
            ),
        ]
    group.notes += [
        f"One fresh subprocess per case ({config.pick(2, 3, len(paths))} at a time); 'before' is "
        "the process's resident memory after importing what its case needs (JAX and Taktiny; "
        "Orbax, PyTorch or safetensors only for theirs) and building the abstract target, "
        "just before the restore; peak is the process's VmHWM (see the module docstring for why "
        "not ru_maxrss, which here reads "
        + f"{max(r['maxrss'] for r in results.values()) / 1e6:,.0f} MB in every worker: the "
        "parent's size at fork).",
        "Restore time inside the worker (warm page cache, so only indicative): "
        + ", ".join(f"{s} {r['seconds']:.2f} s" for s, r in results.items())
        + ".",
    ]
    group.seconds = time.perf_counter() - start
    return group


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--worker", nargs=4, metavar=("CASE", "PATH", "WIDTH", "DEPTH"), required=True
    )
    parser.add_argument("--registry", default="bench._formats", help="the module of the cases")
    args = parser.parse_args()
    case, path, width, depth = args.worker
    _worker(case, path, int(width), int(depth), args.registry)
