"""Before and after: the loads of ``bench/device_load.py`` (the 1 GiB bfloat16 file as it is,
and its FP8 twin into bfloat16 and into int8) by two versions of Taktiny, each in processes
of its own, alternating, each process measuring its own raw pipelines beside its loads
(issue 52 point 3; FINDINGS 14). One process's yardstick moved by 1.7x within minutes on
the lent TPU's host, so a change is judged by rounds, not by one run.

The other version is a folder holding its ``taktiny`` package (``git archive REV taktiny |
tar -x -C FOLDER`` on a machine with the repository; the checkout's own is the other).
Prints a line of JSON for each process (``label``: ``before`` or ``after``; GiB/s of each
load, median of 5 taken in rotated orders, and of the raw pipelines) and the medians by
version.

    python bench/device_load_ab.py DIR BEFORE_FOLDER [ROUNDS]    # on an accelerator's host
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOADS = ("plain", "fp8_bf16", "fp8_int8")


def one(folder: Path, label: str) -> dict[str, Any]:
    """This process's figures (its `taktiny` is whichever comes first on the path)."""
    import jax
    import jax.numpy as jnp

    import taktiny as tt
    from taktiny.io import load_safetensors

    sys.path.append(str(ROOT))  # (after the version under test)
    from bench import device_load as dl

    plain, fp8 = folder / "model.safetensors", folder / "fp8" / "model.safetensors"
    names = [f"layers.{i}.kernel" for i in range(dl.LAYERS)]
    flat = dl._abstract({n: ((dl.WIDTH, dl.WIDTH), jnp.bfloat16) for n in names})
    layers = dl._modules(stacked=False)
    rules = dl._fp8_rules(fp8.parent)
    int8 = tt.quantize(layers)
    loads = {
        "plain": (plain, lambda: load_safetensors(flat, plain, progress=False)),
        "fp8_bf16": (
            fp8,
            lambda: load_safetensors(layers, fp8.parent, rules=rules, progress=False),
        ),
        "fp8_int8": (fp8, lambda: load_safetensors(int8, fp8.parent, rules=rules, progress=False)),
    }
    times: dict[str, list[float]] = {name: [] for name in loads}
    for _, load in loads.values():
        jax.block_until_ready(load())  # (compiles)
    names = list(loads)
    # each load after each of the others in turn: in a fixed order, the FP8 load into
    # bfloat16, always after the plain one, ran at 0.7x its speed alone (FINDINGS 14)
    for k in range(5):
        for name in names[k % 3 :] + names[: k % 3]:
            load = loads[name][1]
            start = time.perf_counter()
            jax.block_until_ready(load())
            times[name].append(time.perf_counter() - start)
    figures: dict[str, Any] = {"label": label, "taktiny": str(Path(tt.__file__).parent)}
    for name, (path, _) in loads.items():
        figures[name] = path.stat().st_size / 2**30 / statistics.median(times[name])
    figures["pipeline_plain"] = dl._raw_pipeline(plain)
    figures["pipeline_fp8"] = dl._raw_pipeline(fp8)
    return figures


def _write(folder: Path) -> None:
    """The files, once (in a process of the checkout's version)."""
    sys.path.append(str(ROOT))
    from bench import device_load as dl
    from taktiny.io import save_safetensors

    arrays = dl._arrays()
    save_safetensors(folder / "model.safetensors", arrays)
    dl._write_fp8(folder, arrays)


def main(argv: list[str]) -> None:
    if argv[0] == "--one":  # (a process of its own)
        print("AB " + json.dumps(one(Path(argv[1]), argv[2])), flush=True)
        return
    if argv[0] == "--write":
        _write(Path(argv[1]))
        return
    folder, before = Path(argv[0]), Path(argv[1]).resolve()
    rounds = int(argv[2]) if len(argv) > 2 else 3
    if not (before / "taktiny" / "__init__.py").exists():
        raise SystemExit(f"{before} holds no taktiny package: git archive REV taktiny | tar -x")
    folder.mkdir(parents=True, exist_ok=True)
    script, here = str(Path(__file__).resolve()), os.environ.get("PYTHONPATH", "")
    path = {"before": str(before), "after": str(ROOT)}
    if not (folder / "fp8" / "model.safetensors").exists():
        subprocess.run([sys.executable, script, "--write", str(folder)], check=True)
    results: list[dict[str, Any]] = []
    for _ in range(rounds):
        for label in ("before", "after"):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path[label], here]))}
            run = subprocess.run(
                [sys.executable, script, "--one", str(folder), label],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            line = next(x for x in run.stdout.splitlines() if x.startswith("AB "))
            results.append(json.loads(line[3:]))
            print(line, flush=True)
    for label in ("before", "after"):
        mine = [r for r in results if r["label"] == label]
        keys = [*LOADS, "pipeline_plain", "pipeline_fp8"]
        medians = {k: round(statistics.median(r[k] for r in mine), 2) for k in keys}
        print(f"{label}: median GiB/s {json.dumps(medians)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
