"""Object storage: ``taktiny.io.load_safetensors`` of a float32 checkpoint from an ``s3://``
URL (512 MiB, 16 tensors of 32 MiB; quick: 64 MiB), against the limit (concurrent ranged
GETs of the same object with obstore) and the peers, all from one local S3-compatible
server on 127.0.0.1.

- The server is ``bench._s3_stub`` (a read-only S3 stub that sends each range with
  ``sendfile``) in a process of its own, serving the scratch folder: the checkpoint is
  "uploaded" by ``save_safetensors`` writing it there. moto is no use here: it reads the
  whole object for every ranged GET (about 47 MiB/s, object-store-clients.md). The file
  stays in the page cache, so what is measured is the clients and the loopback, not a disk.
- raw: every 8 MiB part of the object fetched with ``obstore.get_range_async`` behind an
  ``asyncio.Semaphore(N)`` and copied into one preallocated, already faulted-in buffer; N
  is 8, 16 and 32, and the fastest (by median) is the limit the others are held against.
  Beside it, for context (no target): the same reads (N=8) into fresh memory mapped for
  each sample as the loader maps a tensor's (``MAP_POPULATE``): a load makes the model's
  memory, which the preallocated buffer does not (FINDINGS.md, section 10).
- Taktiny: ``load_safetensors(abstract_model, "s3://bench/model.safetensors")`` with
  ``verify=True`` (the default: every tensor's checksum) and ``verify=False``.
- Run:ai's Model Streamer (``runai_model_streamer.SafetensorsStreamer``, its C++ S3 reader),
  as its docs set it up for an S3-compatible server (``AWS_ENDPOINT_URL`` and
  ``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``), its other settings left at their defaults
  (8 reader threads, 8 MiB chunks for object storage); each tensor it yields is turned into
  a NumPy array and ``jax.device_put``.
- s3fs: the whole object read through ``fs.open(...).read()`` (one GET), then
  ``safetensors.numpy.load(bytes)`` and ``jax.device_put`` of every array.

Times are interleaved round by round (``bench._timing.compare``); ratios against raw are
medians of per-round ratios. Memory: each load again in a fresh subprocess, peak RSS growth
over the process's memory just before the load (``VmHWM``, as ``bench.memory``), against
the model's size; Taktiny's bound is 1.05x the model plus its in-flight budget (IN_FLIGHT
parts of PART bytes, ``taktiny/io/_object_store.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ._results import Config, Group, Table, Target
from ._timing import compare, paired_ratio

MiB = 1 << 20
# (width, depth): depth x Linear(width, width) float32; 2896^2 x 4 B = 32.0 MiB a kernel
SIZES = {"full": (2896, 16), "quick": (1024, 16), "smoke": (256, 4)}
BUCKET, KEY = "bench", "model.safetensors"
URL = f"s3://{BUCKET}/{KEY}"
PART = 8 * MiB  # the raw reads' part, as Taktiny's
IN_FLIGHT = (8, 16, 32)  # the raw reads' concurrency, the best taken
RAW = "raw obstore ranged GETs"
RAW_FRESH = "raw, into fresh memory"
FRESH_N = 8  # the fresh-memory raw reads' concurrency
TT, TT_FAST = "Taktiny", "Taktiny, verify=False"
RUNAI, S3FS = "Run:ai Model Streamer", "s3fs + safetensors"
SYSTEMS = [RAW, RAW_FRESH, TT, TT_FAST, RUNAI, S3FS]
MEASURED = [RAW, TT, TT_FAST, RUNAI, S3FS]  # in the memory workers
PEERS = [RUNAI, S3FS]
SHARE, GROWTH = 0.85, 1.05  # the targets of issue 38 point 7
CALLS = {
    RAW: "obstore.get_range_async(store, key, start, end) of every 8 MiB part, N at a time "
    "(asyncio.Semaphore), each copied into one preallocated buffer",
    RAW_FRESH: f"the same, N={FRESH_N}, into mmap(-1, size, MAP_PRIVATE | MAP_ANONYMOUS | "
    "MAP_POPULATE) made for each sample",
    TT: f"taktiny.io.load_safetensors(abstract, {URL!r}, progress=False)",
    TT_FAST: f"taktiny.io.load_safetensors(abstract, {URL!r}, progress=False, verify=False)",
    RUNAI: f"SafetensorsStreamer().stream_file({URL!r}); "
    "{name: jax.device_put(t.numpy()) for name, t in get_tensors()}",
    S3FS: "fs.open('bench/model.safetensors').read(); "
    "{k: jax.device_put(v) for k, v in safetensors.numpy.load(data).items()}",
}
NEEDS = {  # the modules a case imports on first use: the memory worker imports them first
    RAW: ["obstore"],
    TT: ["taktiny.io", "obstore"],
    TT_FAST: ["taktiny.io", "obstore"],
    RUNAI: ["runai_model_streamer", "torch"],
    S3FS: ["s3fs", "safetensors.numpy"],
}


# --- the systems ------------------------------------------------------------------------
class Raw:
    """Concurrent ranged GETs of the object into one preallocated buffer: the limit."""

    def __init__(self, size: int) -> None:
        from obstore.store import from_url

        self.store = from_url(f"s3://{BUCKET}", client_options={"allow_http": True})
        self.size = size
        self.buffer = np.empty(size, np.uint8)
        self.buffer.fill(0)  # faulted in: the reads land in resident pages

    def __call__(self, n: int, fresh: bool = False) -> np.ndarray:
        import mmap

        import obstore

        buffer = self.buffer
        if fresh:  # as the loader maps a tensor's memory (taktiny/io/_read.py, _buffer)
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            buffer = np.frombuffer(mmap.mmap(-1, self.size, flags=flags), np.uint8)

        async def part(slots: asyncio.Semaphore, start: int) -> None:
            end = min(start + PART, self.size)
            async with slots:
                data = await obstore.get_range_async(self.store, KEY, start=start, end=end)
                buffer[start:end] = np.frombuffer(data, np.uint8)

        async def main() -> None:
            slots = asyncio.Semaphore(n)
            await asyncio.gather(*(part(slots, at) for at in range(0, self.size, PART)))

        asyncio.run(main())
        return buffer


def load_taktiny(abstract: Any, verify: bool = True) -> Any:
    import taktiny.io as tio

    return jax.block_until_ready(tio.load_safetensors(abstract, URL, progress=False, verify=verify))


def load_runai() -> dict[str, Any]:
    from runai_model_streamer import SafetensorsStreamer

    out = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_file(URL)
        for name, tensor in streamer.get_tensors():
            out[name] = jax.device_put(tensor.numpy())
    return jax.block_until_ready(out)


def load_s3fs(fs: Any) -> dict[str, Any]:
    import safetensors.numpy

    with fs.open(f"{BUCKET}/{KEY}", "rb") as f:
        data = f.read()
    arrays = safetensors.numpy.load(data)
    return jax.block_until_ready({k: jax.device_put(v) for k, v in arrays.items()})


def _s3fs() -> Any:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)  # endpoint and keys from the environment


def _loaders(case: str, abstract: Any, size: int, n: int) -> Any:
    """`case`'s load as a zero-argument callable (its clients made first, untimed)."""
    if case == RAW:
        raw = Raw(size)
        return lambda: raw(n)
    if case in (TT, TT_FAST):
        return lambda: load_taktiny(abstract, verify=case == TT)
    if case == RUNAI:
        return load_runai
    fs = _s3fs()
    return lambda: load_s3fs(fs)


# --- memory, in a fresh process per case ------------------------------------------------
def _worker(case: str, width: int, depth: int, size: int, n: int) -> None:
    """Loads once and prints the memory figures as JSON (runs in the subprocess)."""
    from . import _formats, memory

    for module in NEEDS[case]:
        importlib.import_module(module)
    load = _loaders(case, _formats.abstract(width, depth), size, n)
    before = memory._rss()
    start = time.perf_counter()
    result = load()
    seconds = time.perf_counter() - start
    peak = max(memory._peak(), before)
    del result
    print(json.dumps({"before": before, "peak": peak, "seconds": seconds}))


def _measure(
    case: str, width: int, depth: int, size: int, n: int, env: dict[str, str]
) -> dict[str, float]:
    from . import memory

    environment = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join([str(memory.ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    args = [sys.executable, "-X", "faulthandler", "-m", "bench.storage", "--worker", case]
    args += [str(width), str(depth), str(size), str(n)]
    done = subprocess.run(
        args, capture_output=True, text=True, cwd=memory.ROOT, env=environment, check=False
    )
    if done.returncode != 0:  # (a negative code: the signal that ended it)
        raise RuntimeError(
            f"storage memory worker {case!r} failed (exit code {done.returncode}):\n"
            f"{done.stderr[-3000:]}\nits output: {done.stdout[-500:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the group --------------------------------------------------------------------------
def _write(folder: Path, width: int, depth: int) -> dict[str, np.ndarray]:
    """The checkpoint, written into the stub's folder (its "upload"), and its values."""
    import taktiny.io as tio

    rng = np.random.default_rng(0)
    flat = {}
    for i in range(depth):
        flat[f"layers.{i}.kernel"] = rng.standard_normal((width, width), np.float32)
        flat[f"layers.{i}.bias"] = rng.standard_normal((width,), np.float32)
    tio.save_safetensors(folder / KEY, flat)
    return flat


def _check(want: dict[str, np.ndarray], loaders: dict[str, Any], size: int) -> None:
    """Every system's load gives the checkpoint's values (checked once, before the timing)."""
    for system, load in loaders.items():
        got = load()
        if system.startswith((RAW, RAW_FRESH)):
            head = 8 + int.from_bytes(got[:8].tobytes(), "little")
            assert len(got) == size and head < size, system
            continue
        flat = got.flat_state_dict() if hasattr(got, "flat_state_dict") else got
        assert sorted(flat) == sorted(want), system
        for name, value in want.items():
            assert np.array_equal(np.asarray(flat[name]), value), (system, name)
        del got, flat


def _versions() -> str:
    from importlib.metadata import version

    names = ["obstore", "s3fs", "runai-model-streamer", "runai-model-streamer-s3", "safetensors"]
    return ", ".join(f"{n} {version(n)}" for n in names)


def run(config: Config) -> Group:
    """Writes the checkpoint into the stub's folder, then times and measures each load."""
    from . import _formats
    from ._s3_stub import Stub

    start = time.perf_counter()
    load_before = os.getloadavg()
    width, depth = SIZES[config.mode]
    folder = Path(config.scratch) / "s3"
    folder.mkdir(parents=True, exist_ok=True)
    saved: dict[str, str | None] = {}
    try:
        want = _write(folder, width, depth)
        size = (folder / KEY).stat().st_size
        nbytes = sum(v.nbytes for v in want.values())
        abstract = _formats.abstract(width, depth)
        with Stub(folder) as stub:
            env = {**stub.environment(), "RUNAI_STREAMER_LOG_LEVEL": "WARNING"}  # (its INFO lines)
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            raw = Raw(size)
            fs = _s3fs()
            raws = {f"{RAW}, N={n}": (lambda n=n: raw(n)) for n in IN_FLIGHT}
            loaders = {
                **raws,
                RAW_FRESH: lambda: raw(FRESH_N, fresh=True),
                TT: lambda: load_taktiny(abstract, True),
                TT_FAST: lambda: load_taktiny(abstract, False),
                RUNAI: load_runai,
                S3FS: lambda: load_s3fs(fs),
            }
            _check(want, loaders, size)
            del want
            stats = compare(loaders, repeat=config.pick(3, 1, 1))
            best = min(raws, key=lambda name: stats[name].median)
            n = int(best.rsplit("=", 1)[1])
            stats[RAW] = stats[best]
            systems = [TT] if config.mode == "smoke" else MEASURED
            memories = {s: _measure(s, width, depth, size, n, env) for s in systems}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        (folder / KEY).unlink(missing_ok=True)
        folder.rmdir()
    load_after = os.getloadavg()

    mib = size / MiB
    group = Group("storage", f"Loading a {mib:,.0f} MiB safetensors checkpoint from S3")
    title = f"{depth} x Linear({width}, {width}), float32, {mib:,.0f} MiB"
    times = Table(
        f"Load from a local S3 server (sendfile stub), {title}", SYSTEMS, reference=RAW, log=True
    )
    for s in SYSTEMS:
        call = CALLS[RAW] + f", N={n}" if s == RAW else CALLS[s]
        times.add("load", s, call, stats[s].median, (stats[s].low, stats[s].high))
    by_n = Table(
        f"Raw ranged GETs of the {mib:,.0f} MiB object by requests in flight (N)",
        [f"{RAW}, N={k}" for k in IN_FLIGHT],
        reference=best,
        log=False,
    )
    for k in IN_FLIGHT:
        name = f"{RAW}, N={k}"
        by_n.add("read", name, CALLS[RAW], stats[name].median, (stats[name].low, stats[name].high))
    shares = {s: paired_ratio(stats[RAW], stats[s]) for s in SYSTEMS}
    share = Table(
        "Share of the raw ranged reads' throughput (raw time / time, median of per-round ratios)",
        SYSTEMS,
        unit="x",
        log=False,
        line=SHARE,
        label="raw time / time",
    )
    for s in SYSTEMS:
        share.add("raw time / time", s, CALLS[s], shares[s])
    measured = [s for s in SYSTEMS if s in memories]
    budget = 32 * 8 * MiB  # IN_FLIGHT x PART of taktiny/io/_object_store.py
    mem = Table(f"Peak resident memory (MB) of one load, {mib:,.0f} MiB", measured, unit="B")
    growth = {}
    for s in measured:
        r = memories[s]
        growth[s] = (r["peak"] - r["before"]) / nbytes
        mem.add("model size", s, CALLS[s], nbytes)
        mem.add("process RSS before the load", s, CALLS[s], r["before"])
        mem.add("peak RSS", s, CALLS[s], r["peak"])
        mem.add("peak RSS growth (peak - before)", s, CALLS[s], r["peak"] - r["before"])
    ratios = Table(
        "Peak RSS growth relative to the model's size",
        measured,
        unit="x",
        log=False,
        line=GROWTH + budget / nbytes,
    )
    for s in measured:
        ratios.add("growth / model size", s, CALLS[s], growth[s])
    group.tables += [times, by_n, share, mem, ratios]

    paired = "median of per-round ratios"
    group.targets += [
        Target(
            f"Taktiny load from S3 of the {mib:,.0f} MiB checkpoint (verify=True) >= "
            f"{SHARE:g}x the raw ranged reads' throughput",
            shares[TT],
            SHARE,
            True,
            f"raw time (best N, {n}) / Taktiny time, {paired}",
        ),
        Target(
            f"Taktiny load from S3 with verify=False >= {SHARE:g}x the raw ranged reads' "
            "throughput",
            shares[TT_FAST],
            SHARE,
            True,
            f"raw time (best N, {n}) / Taktiny time, {paired}",
        ),
        Target(
            f"Taktiny load from S3: peak RSS growth <= {GROWTH:g}x the model + the in-flight "
            f"budget ({budget // MiB} MiB: {budget / nbytes:.2f}x this model)",
            growth[TT],
            round(GROWTH + budget / nbytes, 3),
            False,
            "(peak RSS - RSS just before the load) / model bytes",
        ),
    ]
    group.targets += [
        Target(
            f"Taktiny load from S3 faster than {peer}",
            paired_ratio(stats[peer], stats[TT]),
            1.0,
            True,
            f"{peer} time / Taktiny time (verify=True), {paired}",
        )
        for peer in PEERS
    ]

    def rate(s: str) -> str:
        return f"{s} {mib / stats[s].median:,.0f}"

    group.notes += [
        f"Throughput (MiB/s, median): {', '.join(rate(s) for s in SYSTEMS)}; raw by N: "
        + ", ".join(f"N={k} {mib / stats[f'{RAW}, N={k}'].median:,.0f}" for k in IN_FLIGHT)
        + f". Object: {size:,} B ({nbytes:,} B of tensors, {2 * depth} tensors). Against "
        f"{RAW_FRESH} (N={FRESH_N}), raw-fresh time / time: Taktiny "
        f"{paired_ratio(stats[RAW_FRESH], stats[TT]):.2f}, verify=False "
        f"{paired_ratio(stats[RAW_FRESH], stats[TT_FAST]):.2f} (the model's memory is made by "
        "every load, not by the preallocated raw reads: FINDINGS.md, section 10).",
        "Server: bench/_s3_stub.py (read-only S3 stub: HEAD, ranged GET with If-Match, "
        "ListObjectsV2; bodies sent with sendfile from the page cache) in its own process on "
        "127.0.0.1, sharing the machine's cores with the client; the checkpoint written into "
        "its folder by taktiny.io.save_safetensors (with checksums). Every load is checked "
        "against the written values once before the timing; one warm-up sample per case, then "
        f"{config.pick(3, 1, 1)} interleaved round(s). Versions: {_versions()}.",
        "Peers: Run:ai's streamer reaches the server through AWS_ENDPOINT_URL and "
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0 (path-style, as its docs say for "
        "S3-compatible stores), its concurrency and chunk size left at their defaults; it "
        "yields torch tensors, turned into NumPy arrays and put on the device one by one, so it "
        "ends with a flat dict of arrays, not a model. s3fs reads the whole object with one GET "
        "(fs.open().read()), safetensors.numpy.load copies each tensor out of those bytes, and "
        "each array is put on the device. Taktiny ends with the model.",
        "Memory: each load in a fresh subprocess, 'before' being its resident memory after its "
        "imports, its client and the abstract target (raw: its buffer, faulted in, is counted "
        "in 'before'); peak is VmHWM. Load time inside the worker: "
        + ", ".join(f"{s} {r['seconds']:.2f} s" for s, r in memories.items())
        + ".",
        f"Load average (1, 5, 15 min) at the group's start "
        f"{', '.join(f'{x:.2f}' for x in load_before)}, at its end "
        f"{', '.join(f'{x:.2f}' for x in load_after)}, on {os.cpu_count()} cores. Raw time / "
        "time round by round: "
        + "; ".join(
            f"{s} "
            + ", ".join(
                f"{r / x:.2f}" for r, x in zip(stats[RAW].samples, stats[s].samples, strict=True)
            )
            for s in SYSTEMS[1:]
        )
        + ".",
    ]
    group.seconds = time.perf_counter() - start
    return group


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("numbers", nargs=4, type=int)
    args = parser.parse_args()
    _worker(args.worker, *args.numbers)
