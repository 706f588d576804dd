"""Saves from an accelerator (issue 52, point 4): a 1 GiB bfloat16 model (32 layers of
4096 x 4096) on the default device, saved by ``save_safetensors``, against a raw write of
the same bytes and the copy to host memory alone, measured in the same run.

The cases, each on arrays made fresh on the device before its clock starts (JAX keeps an
array's host copy once made, so a second copy of the same arrays would cost nothing), in
interleaved rounds, each ratio the median of per-round ratios:

- ``d2h``: ``copy_to_host_async()`` of every array, then ``np.asarray`` of each: the
  device-to-host copy alone; ``d2h_serial``: ``np.asarray`` of each in turn.
- ``raw_pipelined``: the same copies started, then each array written to one file as it
  arrives, then ``fsync``; ``raw_serial``: ``np.asarray`` and write of each in turn, then
  ``fsync``. The raw write is the faster of the two (by median).
- ``save``: ``save_safetensors(path, model)``, which returns once the file is on disk.
- ``background``: the time ``save_safetensors(path, model, wait=False)`` blocks its caller;
  ``background_total`` adds its ``result()``.

Every written file is removed, and ``os.sync()`` run, outside the clocks. Targets: the
blocking save at least 0.8x the raw write's speed; the background call at most 1.2x the
copy alone; a training loop (a jitted SGD step of a 32-layer tanh MLP of the model's
matrices, its parameters donated) saving in the background every N steps within 1.1x of
the same loop without saves, N chosen so that about 10 s of training (``Sizes.interval``)
separate two saves. One save is read back and compared bitwise with the device's arrays.

    python bench/device_save.py [folder]                  # prints one JSON object
    DEVICE_SAVE_SMALL=1 python bench/device_save.py       # 4 layers of 1024 x 1024 (CPU)

``DEVICE_SAVE_LAYERS`` sets the layer count, ``DEVICE_SAVE_INTERVAL`` the seconds of
training between two saves (10). On a CPU the figures mean little: its arrays
are host memory already.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TARGETS = {"save_vs_raw": 0.8, "background_vs_d2h": 1.2, "training_vs_none": 1.1}
TRAINING_ROUNDS = 2
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big and how long: the issue's 1 GiB model, or a small one for a CPU."""

    layers: int = 32
    width: int = 4096
    batch: int = 2048  # the training loop's rows
    rounds: int = 5  # rounds of the save cases (fewer when `budget` runs out)
    budget: float = 150.0  # seconds for the save cases, after 3 rounds
    interval: float = 10.0  # seconds of training between two saves

    @classmethod
    def chosen(cls, small: bool | None = None) -> Sizes:
        """The full sizes, or with `small` (default: the environment's
        ``DEVICE_SAVE_SMALL``) 4 layers of 1024 x 1024; ``DEVICE_SAVE_LAYERS`` sets the
        layer count either way, ``DEVICE_SAVE_INTERVAL`` the seconds of training between
        two saves."""
        if small is None:
            small = bool(os.environ.get("DEVICE_SAVE_SMALL"))
        sizes = cls(4, 1024, 64, 3, 30.0, 1.0) if small else cls()
        if layers := os.environ.get("DEVICE_SAVE_LAYERS"):
            sizes = dataclasses.replace(sizes, layers=int(layers))
        if interval := os.environ.get("DEVICE_SAVE_INTERVAL"):
            sizes = dataclasses.replace(sizes, interval=float(interval))
        return sizes


@functools.partial(jax.jit, static_argnums=(1, 2))
def _make(seed: jax.Array, layers: int, width: int) -> dict[str, jax.Array]:
    key = jax.random.key(seed)
    return {
        f"layers.{i}.kernel": jax.random.normal(
            jax.random.fold_in(key, i), (width, width), jnp.bfloat16
        )
        * jnp.bfloat16(width**-0.5)
        for i in range(layers)
    }


def fresh(sizes: Sizes, seed: int) -> dict[str, jax.Array]:
    """The model, made anew on the default device (no host copy yet)."""
    return jax.block_until_ready(_make(jnp.uint32(seed), sizes.layers, sizes.width))


def _bytes(host: np.ndarray) -> memoryview:
    return memoryview(host.reshape(-1).view(np.uint8))


def _write(path: Path, arrays: list[jax.Array], started: bool) -> None:
    """Writes each array's bytes to `path` as it reaches host memory, then fsyncs."""
    if started:
        for a in arrays:
            a.copy_to_host_async()
    with open(path, "wb", buffering=0) as f:
        for a in arrays:
            f.write(_bytes(np.asarray(a)))
        os.fsync(f.fileno())


def _remove(*paths: Path) -> None:
    """Removes what a case wrote, and flushes the removal (outside the clocks)."""
    for path in paths:
        path.unlink(missing_ok=True)
    os.sync()


def _filesystem(folder: Path) -> str:
    """The type of the filesystem `folder` is on (from /proc/mounts), or "?"."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "?"
    real = os.path.realpath(folder)
    best = max(
        (m for m in mounts if len(m) > 2 and (real + "/").startswith(m[1].rstrip("/") + "/")),
        key=lambda m: len(m[1]),
        default=None,
    )
    return f"{best[2]} ({best[0]} on {best[1]})" if best else "?"


def _same(path: Path, model: dict[str, jax.Array]) -> bool:
    from taktiny.io import open_safetensors

    checkpoint = open_safetensors(path)
    return set(checkpoint) == set(model) and all(
        np.array_equal(checkpoint[n].read().view(np.uint16), np.asarray(a).view(np.uint16))
        for n, a in model.items()
    )


def _save_cases(sizes: Sizes, folder: Path) -> tuple[dict[str, list[float]], dict[str, bool]]:
    """Each case's seconds, round by round; and whether the saves read back bitwise."""
    from taktiny.io import save_safetensors

    path = folder / "model.safetensors"
    raw = folder / "raw.bin"
    kept: list[Any] = []  # (what a case made, dropped after its clock)

    def d2h(model: dict[str, jax.Array]) -> None:
        for a in model.values():
            a.copy_to_host_async()
        kept.extend(np.asarray(a) for a in model.values())

    cases: dict[str, Callable[[dict[str, jax.Array]], Any]] = {
        "d2h": d2h,
        "d2h_serial": lambda model: kept.extend(np.asarray(a) for a in model.values()),
        "raw_pipelined": lambda model: _write(raw, list(model.values()), started=True),
        "raw_serial": lambda model: _write(raw, list(model.values()), started=False),
        "save": lambda model: save_safetensors(path, model),
        "background": lambda model: kept.append(save_safetensors(path, model, wait=False)),
    }
    times: dict[str, list[float]] = {name: [] for name in [*cases, "background_total"]}
    checks: dict[str, bool] = {}
    began = time.perf_counter()
    seed = 0
    for r in range(sizes.rounds):
        names = list(cases)
        names = names[r % len(names) :] + names[: r % len(names)]  # (each case first in turn)
        for name in names:
            seed += 1
            model = fresh(sizes, seed)
            start = time.perf_counter()
            cases[name](model)
            times[name].append(time.perf_counter() - start)
            if name == "background":
                kept[-1].result()
                times["background_total"].append(time.perf_counter() - start)
            if r == 0 and name in ("save", "background"):
                checks[f"{name}_bitwise"] = _same(path, model)
            kept.clear()
            del model
            _remove(path, raw)
        if r + 1 >= 3 and time.perf_counter() - began > sizes.budget:
            break
    return times, checks


def _training(sizes: Sizes, folder: Path) -> dict[str, Any]:
    """A training loop's seconds with a background save every N steps and without saves."""
    from taktiny.io import save_safetensors

    def loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        h = x
        for i in range(sizes.layers):
            h = jnp.tanh(h @ params[f"layers.{i}.kernel"])
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(params: dict[str, jax.Array], x: jax.Array) -> dict[str, jax.Array]:
        grads = jax.grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - jnp.bfloat16(0.01) * g, params, grads)

    x = jax.random.normal(jax.random.key(1), (sizes.batch, sizes.width), jnp.bfloat16)
    params = step(fresh(sizes, 100), x)  # (compiled)
    jax.block_until_ready(params)
    start, count = time.perf_counter(), 0
    while count < 3 or time.perf_counter() - start < min(2.0, sizes.interval / 2):
        params = step(params, x)
        jax.block_until_ready(params)  # (a step at a time: its own time, not the queue's)
        count += 1
    step_seconds = (time.perf_counter() - start) / count
    del params
    every = max(1, math.ceil(sizes.interval / step_seconds))
    steps = 3 * every  # two saves, after `every` and `2 * every` steps
    path = folder / "training.safetensors"

    def loop(saving: bool, seed: int) -> float:
        params = fresh(sizes, seed)
        pending = None
        began = time.perf_counter()
        for i in range(steps):
            params = step(params, x)
            if saving and (i + 1) % every == 0 and i + 1 < steps:
                pending = save_safetensors(path, params, wait=False)
        jax.block_until_ready(params)
        if pending is not None:
            pending.result()  # (the last save's end, inside the loop's time)
        seconds = time.perf_counter() - began
        del params
        _remove(path)
        return seconds

    times: dict[str, list[float]] = {"background": [], "none": []}
    for r in range(TRAINING_ROUNDS):
        for name in ["background", "none"][:: 1 if r % 2 == 0 else -1]:
            times[name].append(loop(name == "background", 200 + r))
    ratios = [b / n for b, n in zip(times["background"], times["none"], strict=True)]
    saves = 2
    return {
        "step_seconds": step_seconds,
        "every": every,
        "steps": steps,
        "saves": saves,
        "loop_seconds": {k: statistics.median(v) for k, v in times.items()},
        "stall_per_save_seconds": (
            statistics.median(times["background"]) - statistics.median(times["none"])
        )
        / saves,
        "training_vs_none": statistics.median(ratios),
        "training_vs_none_rounds": ratios,
    }


def main(folder: Path, small: bool | None = None) -> dict[str, Any]:
    """Runs every case in `folder` (removing the files it writes); returns the figures.
    `small`: see `Sizes.chosen`."""
    sizes = Sizes.chosen(small)
    folder.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    times, checks = _save_cases(sizes, folder)
    nbytes = sizes.layers * sizes.width * sizes.width * 2
    medians = {name: statistics.median(t) for name, t in times.items()}
    raw = min(("raw_pipelined", "raw_serial"), key=lambda n: medians[n])
    d2h = min(("d2h", "d2h_serial"), key=lambda n: medians[n])

    def paired(a: str, b: str) -> float:  # the median of per-round ratios a / b
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=False))

    figures: dict[str, Any] = {
        "device": str(device.device_kind),
        "platform": device.platform,
        "GiB": nbytes / GiB,
        "layers": sizes.layers,
        "width": sizes.width,
        "folder": str(folder),
        "filesystem": _filesystem(folder),
        "rounds": len(times["save"]),
        "seconds": medians,
        "GiBps": {name: nbytes / GiB / s for name, s in medians.items()},
        "raw": raw,
        "d2h_reference": d2h,
        "save_vs_raw": paired(raw, "save"),
        "background_vs_d2h": paired("background", d2h),
        "background_total_vs_save": paired("background_total", "save"),
        **checks,
    }
    figures["training"] = _training(sizes, folder)
    figures["training_vs_none"] = figures["training"]["training_vs_none"]
    figures["targets"] = {
        name: {
            "value": figures[name],
            "needed": f"{'>=' if name == 'save_vs_raw' else '<='} {limit}",
            "met": figures[name] >= limit if name == "save_vs_raw" else figures[name] <= limit,
        }
        for name, limit in TARGETS.items()
    }
    return figures


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(main(Path(sys.argv[1])), indent=1))
    else:
        with tempfile.TemporaryDirectory() as scratch:
            print(json.dumps(main(Path(scratch)), indent=1))
