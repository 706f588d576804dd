"""Readers racing saves: one process saves two known states in turn over one path, in
layouts that change with each save (4 shards, 6 shards, one file), while another opens and
loads the path again and again and compares each result bitwise with both states.

Used by tests/io/test_race.py (a few seconds) and property_tests/test_race.py (larger
tensors, longer under ``make property``). The saving side runs as a program
(``python tests/_race.py FOLDER STOP SCALE``): it saves state A once, prints ``ready``,
then saves B, A, B, ... until the file STOP exists, and prints a JSON line with the
(start, end) of each save on the system's monotonic clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from _child import cpu_environment

HERE = Path(__file__).parent
# tensors of 8, 8, 8, 8, 16 and 16 KiB (times the scale): shard limits of 16 KiB give 4
# shards, of 12 KiB 6 shards; None, one file. Names without dots, so that a plain dict
# loads them.
LAYOUTS = (16, 12, None)


def state(seed: int, scale: int = 1) -> dict[str, np.ndarray]:
    """A checkpoint's tensors, different for each seed (`scale` times larger)."""
    rng = np.random.default_rng(seed)
    return {
        "w0": rng.standard_normal(2048 * scale).astype(np.float32),
        "w1": rng.standard_normal((64 * scale, 64)).astype(ml_dtypes.bfloat16),
        "w2": rng.integers(-128, 127, (128 * scale, 64), dtype=np.int8),
        "w3": rng.integers(-8, 8, (128 * scale, 128)).astype(ml_dtypes.int4),  # packed
        "w4": rng.standard_normal((128 * scale, 32)).astype(np.float32),
        "w5": rng.integers(-(2**31), 2**31 - 1, (256 * scale, 16), dtype=np.int32),
    }


def limit(layout: int | None, scale: int) -> int | None:
    return None if layout is None else layout * 1024 * scale


def as_bytes(tensors: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Each tensor's dtype, shape and bytes: what two reads must share to be equal."""
    out = {}
    for name, value in tensors.items():
        array = np.asarray(value)
        out[name] = (array.dtype.name, array.shape, array.tobytes())
    return out


def saving(folder: Path, stop: Path, scale: int) -> None:
    """Saves A, says ``ready``, then B, A, B, ... in the layouts in turn until `stop`
    exists; prints the saves' (start, end) times."""
    from taktiny.io import save_safetensors

    path = folder / "model.safetensors"
    states = [state(0, scale), state(1, scale)]
    save_safetensors(path, states[0], max_shard_size=limit(LAYOUTS[0], scale))
    print("ready", flush=True)
    times = []
    k = 1
    while not stop.exists():
        start = time.monotonic()
        save_safetensors(path, states[k % 2], max_shard_size=limit(LAYOUTS[k % 3], scale))
        times.append((start, time.monotonic()))
        k += 1
    print(json.dumps(times), flush=True)


def race(folder: Path, seconds: float, scale: int = 1, reads: int = 0) -> dict[str, Any]:
    """Runs the saving program against `folder` while this process reads it for
    `seconds`, and on until it has read `reads` times (on a busy machine; 10 times as
    long at most): by its path with ``open_safetensors`` (every tensor read), by its
    folder, and with ``load_safetensors`` into a dict of arrays. Returns the counts:
    reads, those equal to A and to B, the wrong ones and the errors (with the first few),
    the saves, and the reads that overlapped a save."""
    import jax.numpy as jnp

    from taktiny.io import load_safetensors, open_safetensors

    expected = [as_bytes(state(0, scale)), as_bytes(state(1, scale))]
    target = {n: jnp.zeros(s, jnp.dtype(d)) for n, (d, s, _) in expected[0].items()}
    path = folder / "model.safetensors"
    stop = folder.parent / f"{folder.name}.stop"
    writer = subprocess.Popen(
        [sys.executable, str(HERE / "_race.py"), str(folder), str(stop), str(scale)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cpu_environment(),
    )
    counts: dict[str, Any] = {"reads": 0, "A": 0, "B": 0, "wrong": 0, "errors": 0}
    problems: list[str] = []
    spans: list[tuple[float, float]] = []
    try:
        assert writer.stdout is not None
        line = writer.stdout.readline()
        assert line == "ready\n", f"the saving process: {line!r} {writer.stderr.read()}"  # type: ignore[union-attr]
        kinds = ("path", "folder", "load")
        start = time.monotonic()
        deadline, most = start + seconds, start + 10 * seconds
        while (now := time.monotonic()) < deadline or (counts["reads"] < reads and now < most):
            kind = kinds[counts["reads"] % 3]
            start = time.monotonic()
            try:
                if kind == "load":
                    got = as_bytes(load_safetensors(target, path))
                else:
                    checkpoint = open_safetensors(path if kind == "path" else folder)
                    got = as_bytes({n: t.read() for n, t in checkpoint.items()})
            except Exception as error:  # noqa: BLE001 - counted, and the test fails on it
                counts["errors"] += 1
                problems.append(f"{kind}: {type(error).__name__}: {error}")
                got = None
            spans.append((start, time.monotonic()))
            counts["reads"] += 1
            if got == expected[0]:
                counts["A"] += 1
            elif got == expected[1]:
                counts["B"] += 1
            elif got is not None:
                counts["wrong"] += 1
                problems.append(f"{kind}: a read equal to neither state")
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    saves = json.loads(out)
    counts["saves"] = len(saves)
    counts["overlapping"] = sum(any(s < b and a < e for s, e in saves) for a, b in spans)
    counts["problems"] = problems[:5]
    return counts


if __name__ == "__main__":
    saving(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
