"""How much of a file a load maps at once (issue 52 point 3; bench/FINDINGS.md section 14,
twentieth session). The loads of ``bench/device_load_ab.py`` (the 1 GiB bfloat16 file as it
is, and its FP8 twin into bfloat16 and into int8) in one process, with each of the windows
in ``WINDOWS`` (``io._storage.MAP_WINDOW``, 1 GiB as the loader is), in rotated rounds,
each load timed right after a run of its file's raw pipeline (``device_load``'s yardstick,
measured beside each load as its ``_figure`` does). A smaller window maps the file in
more, smaller mappings, each unmapped as soon as the load lets go of it.

Every load is checked bit for bit against the loader's own. Prints one JSON object: per
window and load, GiB/s (median) and the median of its rounds' ratios to the pipeline.

    python bench/device_windows.py FOLDER [ROUNDS]    # on an accelerator's host

On a CPU, whose device adopts host memory, the loads are made to copy from mapped pages
(``device_load._staged_on_cpu``) so that the code runs: the figures mean nothing there.
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import device_load as dl  # (the path first: bench as a package)

MiB = 2**20
WINDOWS = {"window_64MiB": 64 * MiB, "window_256MiB": 256 * MiB, "window_1GiB": 1024 * MiB}


@contextlib.contextmanager
def _window(size: int) -> Iterator[None]:
    import taktiny.io._storage as storage

    old, storage.MAP_WINDOW = storage.MAP_WINDOW, size
    try:
        yield
    finally:
        storage.MAP_WINDOW = old


def main(folder: Path, rounds: int = 6) -> dict[str, Any]:
    with dl._staged_on_cpu():
        return _main(folder, rounds)


def _main(folder: Path, rounds: int) -> dict[str, Any]:
    import taktiny as tt
    from taktiny.io import load_safetensors, save_safetensors

    folder.mkdir(parents=True, exist_ok=True)
    plain, fp8 = folder / "model.safetensors", folder / "fp8" / "model.safetensors"
    if not fp8.exists():
        arrays = dl._arrays()
        save_safetensors(plain, arrays)
        dl._write_fp8(folder, arrays)
        del arrays
    for file in (plain, fp8):
        file.read_bytes()  # (in the page cache)
    names = [f"layers.{i}.kernel" for i in range(dl.LAYERS)]
    flat = dl._abstract({n: ((dl.WIDTH, dl.WIDTH), jnp.bfloat16) for n in names})
    layers = dl._modules(stacked=False)
    rules = dl._fp8_rules(fp8.parent)
    int8 = tt.quantize(layers)
    loads: dict[str, tuple[Path, Callable[[], Any]]] = {
        "plain": (plain, lambda: load_safetensors(flat, plain, progress=False)),
        "fp8_bf16": (
            fp8,
            lambda: load_safetensors(layers, fp8.parent, rules=rules, progress=False),
        ),
        "fp8_int8": (fp8, lambda: load_safetensors(int8, fp8.parent, rules=rules, progress=False)),
    }
    first = {name: load() for name, (_, load) in loads.items()}  # (compiles; the reference)
    pairs = [(w, name) for w in WINDOWS for name in loads]
    bitwise = True
    for window, name in pairs:
        with _window(WINDOWS[window]):
            bitwise &= dl._bitwise(loads[name][1](), first[name])
    del first
    times = {pair: [] for pair in pairs}
    ratios: dict[tuple[str, str], list[float]] = {pair: [] for pair in pairs}
    for r in range(rounds):
        for window, name in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:  # (rotated)
            path, load = loads[name]
            pipeline = dl._raw_pipeline(path, repeats=1)
            gc.collect()  # (untimed: JAX lets go of what the pipeline's copies read)
            with _window(WINDOWS[window]):
                start = time.perf_counter()
                jax.block_until_ready(load())
                seconds = time.perf_counter() - start
            gib = path.stat().st_size / 2**30
            times[window, name].append(seconds)
            ratios[window, name].append(gib / seconds / pipeline)
    figures: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "bitwise": bitwise}
    for window, name in pairs:
        gib = loads[name][0].stat().st_size / 2**30
        figures.setdefault(window, {})[name] = {
            "GiBps": gib / statistics.median(times[window, name]),
            "vs_raw_pipeline": statistics.median(ratios[window, name]),
        }
    return figures


if __name__ == "__main__":
    figures = main(Path(sys.argv[1]), *map(int, sys.argv[2:3]))
    print(json.dumps(figures, indent=1))
