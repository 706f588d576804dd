"""What copying a file's mapped pages onto an accelerator costs in all, unmapping included,
against reading it into reused buffers (issue 52 point 3; bench/FINDINGS.md section 14,
eighteenth session). On the lent TPU v5e's host, unmapping the 0.5 GiB FP8 file of
``bench/device_load.py`` took 17-18 ms after a load copied from it, and a load copying from
mapped pages came out even with the raw pipeline once that was counted. This times, in
rotated rounds, the same bytes copied onto the default device by 8 threads in pieces of
16 MiB:

- ``mapped_whole``: from one mapping of the file, unmapped once every copy has ended (as a
  load does now, its windows let go as it ends; ``unmap_ms``: the unmapping alone);
- ``mapped_windows``: from windows of 64 MiB, each mapped by the thread that copies it and
  unmapped as soon as its copies have ended, so that the unmapping overlaps the others'
  copies;
- ``mapped_populate``: as ``mapped_whole``, mapped with ``MAP_POPULATE`` (the page tables
  filled by one call, not a fault per page), where the OS has it;
- ``pipeline``: ``device_load``'s raw pipeline (reads into reused buffers, no mapping).

Each way's copies are checked against the file's bytes once. Prints one JSON object:
GiB/s of each (median), and each against the pipeline. A CPU device adopts host memory
rather than copying it, so there each way copies its pieces first: figures mean nothing
there.

    python bench/device_map_costs.py FOLDER [ROUNDS]    # on an accelerator's host
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import device_load as dl  # (the path first: bench as a package)

MiB = 2**20
SIZE = int(os.environ.get("DEVICE_MAP_MIB", "512")) * MiB
PIECE, WINDOW, THREADS = 16 * MiB, 64 * MiB, 8


def main(folder: Path, rounds: int = 7) -> dict[str, Any]:
    path = folder / "bytes.bin"
    folder.mkdir(parents=True, exist_ok=True)
    want = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    path.write_bytes(want.tobytes())
    path.read_bytes()  # (in the page cache)
    device = jax.devices()[0]
    copies = device.platform != "cpu"  # (a CPU device adopts: copy first, so it cannot)

    def put(piece: np.ndarray) -> jax.Array:
        return jax.device_put(piece if copies else piece.copy(), device)

    fd = os.open(path, os.O_RDONLY)
    pool = ThreadPoolExecutor(THREADS)
    unmapped: list[float] = []

    def whole(flags: int = mmap.MAP_SHARED) -> list[jax.Array]:
        memory = mmap.mmap(fd, SIZE, flags=flags, prot=mmap.PROT_READ)
        view = np.frombuffer(memory, np.uint8)
        pieces = [view[k : k + PIECE] for k in range(0, SIZE, PIECE)]
        out = jax.block_until_ready(list(pool.map(put, pieces)))
        del view, pieces
        gc.collect(0)  # (JAX lets go of the views its copies read)
        start = time.perf_counter()
        _close(memory)
        unmapped.append(time.perf_counter() - start)
        return out

    def window(offset: int) -> list[jax.Array]:
        size = min(WINDOW, SIZE - offset)
        memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=offset)
        view = np.frombuffer(memory, np.uint8)
        out = jax.block_until_ready([put(view[k : k + PIECE]) for k in range(0, size, PIECE)])
        del view
        gc.collect(0)
        _close(memory)
        return out

    def windows() -> list[jax.Array]:
        return [a for part in pool.map(window, range(0, SIZE, WINDOW)) for a in part]

    ways: dict[str, Callable[[], Any]] = {"mapped_whole": whole, "mapped_windows": windows}
    if hasattr(mmap, "MAP_POPULATE"):
        ways["mapped_populate"] = lambda: whole(mmap.MAP_SHARED | mmap.MAP_POPULATE)
    bitwise = all(
        np.array_equal(np.concatenate([np.asarray(a) for a in way()]), want)
        for way in ways.values()
    )
    ways["pipeline"] = lambda: dl._raw_pipeline(path, threads=THREADS, piece=PIECE, repeats=1)
    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # (rotated)
            gc.collect()
            start = time.perf_counter()
            out = ways[name]()
            times[name].append(time.perf_counter() - start)
            del out
    os.close(fd)
    pool.shutdown()
    gib = SIZE / 2**30
    figures: dict[str, Any] = {"device": str(device.device_kind), "GiB": gib, "bitwise": bitwise}
    for name, seconds in times.items():
        figures[f"{name}_GiBps"] = gib / statistics.median(seconds)
    for name in names[:-1]:
        figures[f"{name}_vs_pipeline"] = figures[f"{name}_GiBps"] / figures["pipeline_GiBps"]
    figures["unmap_ms"] = 1e3 * statistics.median(unmapped)
    figures["still_held"] = len(_held)  # (mappings JAX had not let go of when closed)
    _held.clear()
    path.unlink()
    return figures


_held: list[mmap.mmap] = []


def _close(memory: mmap.mmap) -> None:
    """Unmaps `memory` now; if JAX still holds a view of it, leaves it to go when JAX lets go
    (counted in ``still_held``: then the unmapping was not timed where it says)."""
    try:
        memory.close()
    except BufferError:
        _held.append(memory)


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), *map(int, sys.argv[2:3])), indent=1))
