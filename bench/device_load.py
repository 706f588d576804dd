"""Loads onto an accelerator (issue 52, point 3): a 1 GiB bfloat16 safetensors file (32
layers of 4096 x 4096) loaded onto the default device, against the raw limit measured in
the same run and against the peers.

The raw limit is the slower of the file read into reused host buffers (8 threads, each its
own buffer) and ``jax.device_put`` of host arrays already in memory; the pipeline of the
two (4 threads, each reading into its own reused buffer and copying it onto the device) is
reported beside them. The peers: ``safetensors.flax.load_file``, Orbax's restore of the same
model, and the plain loop (``safetensors.numpy.load_file`` then ``jax.device_put``). Every
load is checked bitwise against the file. ``--peak folder`` then loads the file written
there alone, in a process of its own, for its peak host memory (``ru_maxrss`` after the
load, less before it) and its ways.

Run ``python bench/device_load.py [folder]`` on a machine with an accelerator (on a CPU
the figures mean little: a CPU device adopts host memory). It prints one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

LAYERS = int(os.environ.get("DEVICE_LOAD_LAYERS", "32"))  # (fewer for a quick try on a CPU)
WIDTH = 4096
GiB = 2**30


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i in range(LAYERS):
        bits = rng.integers(0, 2**16, (WIDTH, WIDTH), dtype=np.uint16) & 0x7F7F  # finite
        out[f"layers.{i}.kernel"] = bits.view(ml_dtypes.bfloat16)
    return out


def _abstract(shapes: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, object]:
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    return {n: jax.ShapeDtypeStruct(s, d, sharding=sharding) for n, (s, d) in shapes.items()}


def _timed(fn, repeats: int = 3) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        out = None
        start = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _ranges(path: Path) -> list[tuple[int, int]]:
    """The byte range of each tensor in a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    base = 8 + n
    return [
        (base + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
        for k, v in header.items()
        if k != "__metadata__"
    ]


def _raw(path: Path, threads: int, put: bool) -> float:
    """GiB/s of the file read by `threads` threads, each into its own reused buffer
    (faulted before the clock); with `put`, each tensor then copied onto the device."""
    ranges = _ranges(path)
    buffers = [np.zeros(max(n for _, n in ranges), np.uint8) for _ in range(threads)]
    fd = os.open(path, os.O_RDONLY)
    device = jax.devices()[0]

    def work(k: int) -> None:
        for offset, n in ranges[k::threads]:
            view, got = memoryview(buffers[k])[:n], 0
            while got < n:
                got += os.preadv(fd, [view[got:]], offset + got)
            if put:
                host = buffers[k][:n].view(ml_dtypes.bfloat16)
                jax.device_put(host, device).block_until_ready()

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    seconds = time.perf_counter() - start
    os.close(fd)
    return sum(n for _, n in ranges) / GiB / seconds


def _raw_put(model: dict[str, np.ndarray]) -> float:
    device = jax.devices()[0]
    arrays = list(model.values())
    start = time.perf_counter()
    jax.block_until_ready([jax.device_put(a, device) for a in arrays])
    return sum(a.nbytes for a in arrays) / GiB / (time.perf_counter() - start)


def peak(path: Path) -> dict[str, object]:
    """Taktiny's load alone (run it in a process of its own: one process at a time may
    hold a TPU): its peak host memory beyond what the process held before the load, and
    the way each step was read."""
    import resource

    from taktiny.io import load_safetensors, open_safetensors, plan_load

    checkpoint = open_safetensors(path)
    model = _abstract({n: (tuple(t.shape), t.dtype) for n, t in checkpoint.items()})
    ways = sorted({s.way for s in plan_load(model, path).steps})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    jax.block_until_ready(load_safetensors(model, path))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"taktiny_peak_host_MiB": (after - before) / 1024, "ways": ways}


def main(folder: Path) -> dict[str, object]:
    import orbax.checkpoint as ocp
    from safetensors.flax import load_file as flax_load
    from safetensors.numpy import load_file as numpy_load

    from taktiny.io import load_safetensors, save_safetensors

    model = _model()
    path = folder / "model.safetensors"
    save_safetensors(path, model)  # (with its checksums, which the load verifies)
    path.read_bytes()  # in the page cache, for every reader alike
    abstract = _abstract({n: (a.shape, a.dtype) for n, a in model.items()})
    nbytes = sum(a.nbytes for a in model.values()) / GiB
    on_device = {n: jax.device_put(a, jax.devices()[0]) for n, a in model.items()}
    orbax_path = folder / "orbax"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(orbax_path.resolve(), on_device)
    checkpointer.wait_until_finished()
    del on_device
    figures: dict[str, object] = {"device": str(jax.devices()[0].device_kind), "GiB": nbytes}
    figures["raw_read_GiBps"] = _raw(path, 8, put=False)
    figures["raw_device_put_GiBps"] = _raw_put(model)
    figures["raw_pipeline_GiBps"] = _raw(path, 4, put=True)
    loads = {
        "taktiny": lambda: load_safetensors(abstract, path),
        "safetensors_flax": lambda: flax_load(str(path)),
        "orbax": lambda: checkpointer.restore(orbax_path.resolve(), target=abstract),
        "device_put_loop": lambda: {
            n: jax.device_put(a, jax.devices()[0]) for n, a in numpy_load(str(path)).items()
        },
    }
    if os.environ.get("DEVICE_LOAD_VARIANTS"):  # (what the load's figure depends on)
        import taktiny.loading._ways as ways

        def ring(count: int, verify: bool = True):
            def load():
                default, ways.RING = ways.RING, count
                try:
                    return load_safetensors(abstract, path, verify=verify)
                finally:
                    ways.RING = default

            return load

        loads.update(
            taktiny_ring2=ring(2), taktiny_ring8=ring(8), taktiny_unverified=ring(4, False)
        )
    for name, load in loads.items():
        seconds, out = _timed(load)
        figures[f"{name}_GiBps"] = nbytes / seconds
        same = all(
            np.array_equal(np.asarray(out[n]).view(np.uint16), model[n].view(np.uint16))
            for n in model
        )
        figures[f"{name}_bitwise"] = same
        del out
    limit = min(figures["raw_read_GiBps"], figures["raw_device_put_GiBps"])
    figures["taktiny_vs_raw_limit"] = figures["taktiny_GiBps"] / limit
    return figures


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peak"]:  # (after a run that wrote the file: its folder)
        print(json.dumps(peak(Path(sys.argv[2]) / "model.safetensors"), indent=1))
    elif len(sys.argv) > 1:
        print(json.dumps(main(Path(sys.argv[1])), indent=1))
    else:
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(main(Path(folder)), indent=1))
