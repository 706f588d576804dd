"""What a load onto an accelerator pays for the one before it (issue 52 point 3; bench/FINDINGS.md
section 14, seventeenth session): the FP8 twin of ``bench/device_load.py``'s file loaded into
bfloat16 and into int8, each right after a load into bfloat16, a load into int8 or a run of
the file's raw pipeline, with nothing between them, a ``gc.collect()``, a sleep of 0.3 s, or
both; GiB/s of each (median of the rounds) and the milliseconds its planning took
(``steps_of``, timed inside it). Before f940565 every load left its plan in a cycle, the
file's mappings with it, and the load after it paid the collector's pass: 11-22 ms of
planning against 3, loads up to 1.2x slower; with nothing left for the collector, the
``none`` and ``gc`` columns should agree. Prints one JSON object.

    python bench/device_load_gaps.py FOLDER [ROUNDS]    # on an accelerator's host
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import device_load as dl  # (the path first: bench as a package)

TARGETS = ("int8", "bf16")
GAPS: dict[str, Callable[[], Any]] = {
    "none": lambda: None,
    "gc": gc.collect,
    "sleep": lambda: time.sleep(0.3),
    "gc_sleep": lambda: (gc.collect(), time.sleep(0.3)),
}


def main(folder: Path, rounds: int = 6) -> dict[str, Any]:
    import taktiny.loading._load as load_module
    from taktiny.io import load_safetensors

    fp8, rules, targets = dl._fp8_targets(folder)
    planned: list[float] = []
    real = load_module.steps_of

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            planned.append(time.perf_counter() - start)

    def load(target: str) -> Any:
        model = load_safetensors(targets[target], fp8.parent, rules=rules, progress=False)
        return jax.block_until_ready(model)

    before = {
        "bf16": lambda: load("bf16"),
        "int8": lambda: load("int8"),
        "pipeline": lambda: dl._raw_pipeline(fp8, repeats=1),
    }
    samples: dict[str, list[tuple[float, float]]] = {}
    with dl._staged_on_cpu():
        for target in TARGETS:
            load(target)  # (compiles)
        load_module.steps_of = timed
        try:
            for _ in range(rounds):
                for gap_name, gap in GAPS.items():
                    for first_name, first in before.items():
                        for target in TARGETS:
                            first()
                            gap()
                            planned.clear()
                            start = time.perf_counter()
                            load(target)
                            seconds = time.perf_counter() - start
                            key = f"{target} after {first_name}, {gap_name}"
                            samples.setdefault(key, []).append((seconds, planned[-1]))
        finally:
            load_module.steps_of = real
    size = fp8.stat().st_size / 2**30
    figures: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "GiB": size}
    for key, values in samples.items():
        figures[key] = {
            "GiBps": size / statistics.median(s for s, _ in values),
            "planning_ms": 1e3 * statistics.median(p for _, p in values),
        }
    figures["raw_pipeline_GiBps"] = dl._raw_pipeline(fp8)
    return figures


if __name__ == "__main__":
    here = Path(sys.argv[1])
    print(json.dumps(main(here, *map(int, sys.argv[2:3])), indent=1))
