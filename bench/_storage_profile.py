#!/usr/bin/env python
"""Where the time of the storage group's Taktiny load goes (FINDINGS.md, section 10): its
parts timed side by side against the S3 stub, interleaved, medians and per-round ratios
against the raw reads into a preallocated buffer.

    python bench/_storage_profile.py            # the 512 MiB checkpoint, 5 rounds
    python bench/_storage_profile.py --quick    # 64 MiB
    python bench/_storage_profile.py --sweep    # also Taktiny with PART 4/16 MiB, IN_FLIGHT 8/16
    python bench/_storage_profile.py --huge     # also the loader's buffers in huge pages

--sweep and --huge patch ``taktiny.io._object_store`` and ``taktiny.io._read._buffer`` in
this process only; no file changes.
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench import _formats, storage
from bench._s3_stub import Stub

MiB = 1 << 20
POPULATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def _huge(size: int) -> mmap.mmap:
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    memory.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
    return memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--huge", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    width, depth = storage.SIZES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory(prefix="taktiny-storage-") as scratch:
        folder = Path(scratch)
        storage._write(folder, width, depth)
        size = (folder / storage.KEY).stat().st_size
        abstract = _formats.abstract(width, depth)
        with Stub(folder) as stub:
            os.environ.update(stub.environment())
            _run(args, abstract, size, depth)


def _run(args: argparse.Namespace, abstract: Any, size: int, depth: int) -> None:
    import taktiny.io._object_store as objects
    import taktiny.io._read as read

    raw = storage.Raw(size)
    url = objects.Url(storage.URL)
    tensor = size // depth  # about one kernel's bytes

    def remote(threads: int | None) -> None:
        file, view = objects.RemoteFile(url), memoryview(raw.buffer)
        if threads is None:
            file.read_into(0, view)
            return
        with ThreadPoolExecutor(threads) as pool:
            starts = range(0, size, tensor)
            list(pool.map(lambda at: file.read_into(at, view[at : at + tensor]), starts))

    def taktiny(verify: bool, part: int = 8 * MiB, most: int = 32, huge: bool = False) -> Any:
        def load() -> None:
            objects.PART, objects.IN_FLIGHT = part, most
            objects._running().slots = objects.asyncio.Semaphore(most)
            original = read._buffer
            if huge:

                def buffer(shape: tuple[int, ...], dtype: np.dtype) -> Any:
                    n = math.prod(shape) * dtype.itemsize
                    if n < 2 * MiB:
                        return original(shape, dtype)
                    memory = _huge(n)
                    array = np.frombuffer(memory, dtype, math.prod(shape)).reshape(shape)
                    return array, memoryview(memory)

                read._buffer = buffer
            try:
                storage.load_taktiny(abstract, verify)
            finally:
                read._buffer = original
                objects.PART, objects.IN_FLIGHT = 8 * MiB, 32
                objects._running().slots = objects.asyncio.Semaphore(32)

        return load

    cases: dict[str, Callable[[], Any]] = {
        f"raw N={n}, preallocated": (lambda n=n: raw(n)) for n in storage.IN_FLIGHT
    }
    cases |= {
        "raw N=8, fresh MAP_POPULATE memory": lambda: raw(8, fresh=True),
        "mmap MAP_POPULATE alone": lambda: mmap.mmap(-1, size, flags=POPULATE).close(),
        "mmap MADV_HUGEPAGE + POPULATE_WRITE alone": lambda: _huge(size).close(),
        "RemoteFile.read_into, whole object": lambda: remote(None),
        "RemoteFile.read_into, by tensor, 2 threads": lambda: remote(2),
        "RemoteFile.read_into, by tensor, 8 threads": lambda: remote(8),
        "Taktiny, verify": taktiny(True),
        "Taktiny, verify=False": taktiny(False),
    }
    if args.sweep:
        for part, most in (
            (1 * MiB, 32),
            (2 * MiB, 32),
            (4 * MiB, 32),
            (16 * MiB, 32),
            (8 * MiB, 8),
            (8 * MiB, 16),
        ):
            name = f"Taktiny, verify, PART {part // MiB} MiB, IN_FLIGHT {most}"
            cases[name] = taktiny(True, part, most)
    if args.huge:
        cases["Taktiny, verify, huge pages"] = taktiny(True, huge=True)
        cases["Taktiny, verify=False, huge pages"] = taktiny(False, huge=True)
    for case in cases.values():  # warm-up
        case()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            start = time.perf_counter()
            case()
            times[name].append(time.perf_counter() - start)
    reference = times["raw N=8, preallocated"]
    print(f"{size / MiB:,.0f} MiB object, {args.rounds} rounds, load average {os.getloadavg()}")
    for name, samples in times.items():
        median = statistics.median(samples)
        share = statistics.median(r / s for r, s in zip(reference, samples, strict=True))
        print(
            f"{name:48s} {median * 1e3:7.0f} ms {size / MiB / median:7,.0f} MiB/s"
            f"  raw N=8 time / time {share:.2f}"
        )


if __name__ == "__main__":
    main()
