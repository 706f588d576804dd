"""Crash harness for `taktiny.io.save_safetensors`: saves of one checkpoint over another,
failed or killed at every step of the commit, or killed at random moments, each followed by
loads that must give exactly one of the two versions, bitwise, and by a save that must
leave nothing of the failed one behind.

Used in process by tests/io/test_crash.py (faults raised at each step) and run as a program
for the kills (``python tests/_crash.py steps``, ``background [SCENARIO...]`` for
background saves, or ``random N SEED [background]``): the program imports
Taktiny without starting JAX's backend, then forks one child per save, which is killed
with SIGKILL (right after the step it was told, or when the parent's timer runs out), and
prints a JSON summary of the outcomes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from _child import cpu_environment

# each version of the checkpoint: tensors of several dtypes and sizes; shard limits that
# give one file, two shards or three
ONE, TWO, THREE = None, 40_000, 25_000
SCENARIOS = {  # name: (the layout saved first, or no checkpoint; the layout saved over it)
    "new single": ("none", ONE),
    "new shards": ("none", THREE),
    "single over single": (ONE, ONE),
    "shards over single": (ONE, THREE),
    "single over shards": (THREE, ONE),
    "shards over shards": (THREE, THREE),
    "fewer shards over shards": (THREE, TWO),
}
STEPS = ("write_file", "write", "fsync", "replace", "unlink")  # the file operations counted


def version(seed: int, scale: int = 1) -> dict[str, np.ndarray]:
    """A checkpoint's tensors, different for each seed (`scale` times larger)."""
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((64 * scale, 64)).astype(np.float32),
        "block.0.kernel": rng.standard_normal((64 * scale, 32)).astype(ml_dtypes.bfloat16),
        "block.0.bias": rng.standard_normal(32).astype(np.float32),
        "block.1.kernel": rng.integers(-128, 127, (128 * scale, 96), dtype=np.int8),
        "block.1.scale": rng.standard_normal(96).astype(np.float16),
        "head.kernel": rng.standard_normal((48 * scale, 64)).astype(np.float32),
        "step": np.array(seed, np.int64),
    }


def save(
    folder: Path, tensors: dict[str, np.ndarray], limit: int | None, wait: bool = True
) -> list[Path]:
    """Saves `tensors` as the folder's checkpoint; with `wait` False, in the background (the
    steps then run on the save's own thread), waiting for its result."""
    from taktiny.io import save_safetensors

    path = folder / "model.safetensors"
    if not wait:
        return save_safetensors(path, tensors, max_shard_size=limit, wait=False).result()
    return save_safetensors(path, tensors, max_shard_size=limit)


def prepare(folder: Path, old: Any, seed: int = 1, scale: int = 1) -> None:
    """`folder` holding the old version in layout `old` (or none), and a file of the user's."""
    for entry in folder.iterdir():
        entry.unlink()
    (folder / "notes.txt").write_text("not a checkpoint: a save must leave this alone\n")
    if old != "none":
        save(folder, version(seed, scale), old)


def loaded(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]] | None:
    """What `path` loads, tensor by tensor (dtype, shape, bytes); None when it holds no
    checkpoint."""
    from taktiny.io import SafetensorsError, open_safetensors

    try:
        checkpoint = open_safetensors(path)
    except SafetensorsError as error:
        if "no such file" in str(error) or "holds 0" in str(error):
            return None
        raise
    return {n: (t.dtype.name, t.shape, t.read().tobytes()) for n, t in checkpoint.items()}


def as_loaded(tensors: dict[str, np.ndarray]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {n: (a.dtype.name, a.shape, a.tobytes()) for n, a in tensors.items()}


def outcome(folder: Path, old: Any, new: Any) -> str:
    """Which version the checkpoint's path and its folder load: "old" or "new" (both the
    same), else what went wrong."""
    try:
        by_path, by_folder = loaded(folder / "model.safetensors"), loaded(folder)
    except Exception as error:  # noqa: BLE001 - reported, and the test fails on it
        return f"the load failed: {type(error).__name__}: {error}"
    if by_path != by_folder:
        return "the path and its folder load different checkpoints"
    if by_path == old:
        return "old"
    if by_path == new:
        return "new"
    return "a mix, or nothing" if by_path else "nothing"


def tidied(folder: Path) -> str | None:
    """After a failed or killed save: a clean save leaves exactly its files and the user's."""
    written = save(folder, version(3), TWO)
    left = sorted(p.name for p in folder.iterdir())
    expected = sorted([*(p.name for p in written), "notes.txt"])
    if left != expected:
        return f"after the next save the folder holds {left}, not {expected}"
    if (folder / "notes.txt").read_text() != "not a checkpoint: a save must leave this alone\n":
        return "the user's file changed"
    if loaded(folder / "model.safetensors") != as_loaded(version(3)):
        return "the next save does not load back"
    return None


@contextmanager
def steps(hook: Callable[[str, int], None]) -> Iterator[None]:
    """Calls `hook(step, count)` right after each file operation of a save (`count` of
    them so far, from 1); `hook` may raise (a fault) or kill the process."""
    from taktiny.io import _write

    count = 0
    real = {name: getattr(os, name) for name in STEPS if name != "write_file"}
    real_save = _write.write_file
    # the threads already running (the test runner's, a platform's) make no operation of
    # the save's: counted, they would shift every step after theirs (on the TPU host, the
    # child killed after step k ran fewer steps than its parent counted; a forked child
    # runs no other thread)
    others = set(threading.enumerate()) - {threading.current_thread()}

    def wrap(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            nonlocal count
            result = call(*args, **kwargs)
            if threading.current_thread() in others:
                return result
            count += 1
            hook(name, count)
            return result

        return step

    for name, call in real.items():
        setattr(os, name, wrap(name, call))
    _write.write_file = wrap("write_file", real_save)
    try:
        yield
    finally:
        for name, call in real.items():
            setattr(os, name, call)
        _write.write_file = real_save


def count_steps(folder: Path, scenario: str) -> list[str]:
    """The file operations an unbroken save of `scenario` makes, in order."""
    old, limit = SCENARIOS[scenario]
    # one save first, not counted: what a process does once, at its first save, its
    # children (forked after this) do not do again (on the TPU host: Python choosing its
    # temporary folder, a file written and removed, and filelock probing the file system,
    # two files removed; counted, they made 4 steps no child ran)
    prepare(folder, old)
    save(folder, version(2), limit)
    prepare(folder, old)
    made: list[str] = []
    with steps(lambda name, _: made.append(name)):
        save(folder, version(2), limit)
    return made


def _killed_child(run: Callable[[], None]) -> int:
    """Forks; the child runs `run` and exits 0 (unless it is killed). Returns the child's
    pid."""
    pid = os.fork()
    if pid == 0:  # the child: no JAX backend was started, so forking is safe
        try:
            run()
        finally:
            os._exit(0)
    return pid


def kill_after_each_step(
    folder: Path, scenarios: list[str] | None = None, wait: bool = True
) -> dict[str, Any]:
    """For each scenario (all, unless named) and each step of its save: a child killed
    right after that step, then the loads and the next save checked. With `wait` False the
    saves run in the background, and the save's own thread kills the child."""
    results: dict[str, Any] = {"kills": 0, "old": 0, "new": 0, "failures": []}
    for scenario in scenarios or list(SCENARIOS):
        old_layout, limit = SCENARIOS[scenario]
        made = count_steps(folder, scenario)
        old = None if old_layout == "none" else as_loaded(version(1))
        new = as_loaded(version(2))
        for k in range(1, len(made) + 1):
            prepare(folder, old_layout)

            def run(k: int = k, limit: Any = limit) -> None:
                def hook(name: str, count: int) -> None:
                    if count == k:
                        os.kill(os.getpid(), signal.SIGKILL)

                with steps(hook):
                    save(folder, version(2), limit, wait)

            _, status = os.waitpid(_killed_child(run), 0)
            if not os.WIFSIGNALED(status):
                results["failures"].append(
                    f"{scenario}: the child was not killed at step {k} of {made}"
                )
                continue
            results["kills"] += 1
            got = outcome(folder, old, new)
            if got not in ("old", "new"):  # ("old" when there was none: still nothing)
                results["failures"].append(f"{scenario}, killed after {made[k - 1]} {k}: {got}")
            else:
                results[got] += 1
            problem = tidied(folder)
            if problem:
                results["failures"].append(f"{scenario}, killed after step {k}: {problem}")
    return results


def kill_at_random(folder: Path, kills: int, seed: int, wait: bool = True) -> dict[str, Any]:
    """`kills` saves of a larger checkpoint (shards over shards, or a layout drawn at
    random) killed at a random moment of their run, each then loaded and tidied; with
    `wait` False, background saves (the child waits for their result)."""
    draw = random.Random(seed)
    results: dict[str, Any] = {"kills": 0, "old": 0, "new": 0, "failures": []}
    layouts = [ONE, 600_000, 1_500_000]
    for _ in range(kills):
        old_layout, limit = draw.choice(layouts), draw.choice(layouts)

        def run(limit: Any = limit) -> None:
            save(folder, version(2, 64), limit, wait)

        prepare(folder, old_layout, seed=1, scale=64)
        start = time.perf_counter()
        os.waitpid(_killed_child(run), 0)  # how long a child takes to save, unbroken
        duration = time.perf_counter() - start
        prepare(folder, old_layout, seed=1, scale=64)
        pid = _killed_child(run)
        time.sleep(draw.uniform(0, duration * 1.2))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        results["kills"] += 1
        got = outcome(folder, as_loaded(version(1, 64)), as_loaded(version(2, 64)))
        if got not in ("old", "new"):
            results["failures"].append(f"{old_layout} -> {limit}, killed at random: {got}")
        else:
            results[got] += 1
        problem = tidied(folder)
        if problem:
            results["failures"].append(f"{old_layout} -> {limit}, killed at random: {problem}")
    return results


def run_program(*argv: str, timeout: float = 600) -> dict[str, Any]:
    """Runs this file as a program (``steps FOLDER``, ``random ...``, ``background ...``)
    without a device platform to start; returns its JSON summary, after checking that it
    exited cleanly and that no killed save left anything but one whole version."""
    import subprocess

    run = subprocess.run(
        [sys.executable, __file__, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cpu_environment(),
    )
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)
    assert results["failures"] == [], results["failures"]
    return results


def main(argv: list[str]) -> None:
    folder = Path(argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    if argv[0] == "steps":
        results = kill_after_each_step(folder)
    elif argv[0] == "background":  # background saves of the scenarios named after the folder
        results = kill_after_each_step(folder, argv[2:] or None, wait=False)
    else:  # random N SEED [background]
        results = kill_at_random(folder, int(argv[2]), int(argv[3]), argv[4:5] != ["background"])
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
