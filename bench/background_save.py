"""Background saves: how long ``save_safetensors(path, tree, wait=False)`` blocks its caller,
against a plain copy of the same arrays to host memory (the issue's target: at most 1.2x),
and what the whole save takes (the call, then ``result()``) against a save that waits.

    python -m bench.background_save                   # 200 MiB of float32, 7 rounds
    python -m bench.background_save --mib 50 --rounds 3 --scratch /tmp/bg

The tree is a flat dict of JAX arrays on the CPU device (4 MiB each). The host copy is
``np.array(x, copy=True)`` of each, what a background save must do before it returns
(``np.asarray`` of a CPU array may be a view of its buffer). Each save goes over the
checkpoint the previous one left (a training loop's saves), fsyncs included. Rounds are
interleaved; each ratio is the median of per-round ratios. Not part of ``bench/run.py``'s
report (yet): it prints its table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

TARGET = 1.2  # the bound: blocking time / host copy time


def tree(mib: int) -> dict[str, jax.Array]:
    """`mib` MiB of float32 JAX arrays, 4 MiB each."""
    key = jax.random.key(0)
    return {
        f"layers.{i}.kernel": jax.random.normal(jax.random.fold_in(key, i), (1024, 1024))
        for i in range(mib // 4)
    }


def run(mib: int, rounds: int, scratch: Path) -> dict[str, float]:
    from taktiny.io import save_safetensors

    arrays = tree(mib)
    jax.block_until_ready(arrays)
    path = scratch / "model.safetensors"
    save_safetensors(path, arrays)  # (the first save: the rounds save over it)
    samples: dict[str, list[float]] = {"copy": [], "call": [], "total": [], "blocking": []}
    for _ in range(rounds + 1):  # (the first round warms up, and is dropped)
        start = time.perf_counter()
        copies = {k: np.array(v, copy=True) for k, v in arrays.items()}
        samples["copy"].append(time.perf_counter() - start)
        del copies
        start = time.perf_counter()
        saving = save_safetensors(path, arrays, wait=False)
        samples["call"].append(time.perf_counter() - start)
        saving.result()
        samples["total"].append(time.perf_counter() - start)
        start = time.perf_counter()
        save_safetensors(path, arrays)
        samples["blocking"].append(time.perf_counter() - start)
    kept = {name: times[1:] for name, times in samples.items()}

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(kept[a], kept[b], strict=True))

    return {
        **{f"{name} s": statistics.median(times) for name, times in kept.items()},
        "call / copy": ratio("call", "copy"),
        "total / blocking": ratio("total", "blocking"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--scratch", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.scratch) as folder:
        results = run(args.mib, args.rounds, Path(folder))
    print(f"{args.mib} MiB of float32 ({args.mib // 4} arrays of 4 MiB), {args.rounds} rounds, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"  host copy (np.array(x, copy=True) of each)   {results['copy s'] * 1e3:8.1f} ms")
    print(f"  save_safetensors(..., wait=False) returns    {results['call s'] * 1e3:8.1f} ms")
    print(f"    ... and its result() (the whole save)      {results['total s'] * 1e3:8.1f} ms")
    print(f"  save_safetensors(...) (waits)                {results['blocking s'] * 1e3:8.1f} ms")
    verdict = "meets" if results["call / copy"] <= TARGET else "misses"
    print(f"  blocking / host copy: {results['call / copy']:.2f}x ({verdict} the {TARGET}x target)")
    print(f"  background total / blocking save: {results['total / blocking']:.2f}x")


if __name__ == "__main__":
    jnp.zeros(())  # (the backend, before the timings)
    main()
