"""The two ways an FP8 step reaches an accelerator, and what the load before each costs it
(issue 52 point 3; bench/FINDINGS.md section 14, sixteenth session). In one process, the
FP8 twin of ``bench/device_load.py``'s file loaded into bfloat16 and into int8, each step's
weights and scales taken by its program as its arguments (``arguments``: the loader as it
is) or each copied first by a ``jax.device_put`` of its own (``calls``: the loader before),
in rounds whose order is shuffled (seeded), every load checked bitwise against the other
way's. Prints one JSON object: GiB/s of each way and target (medians), the same by the load
that came just before (whose ratios say whether a load pays for the one before it), and the
file's raw pipeline beside them. On a CPU the staging path is forced (its figures mean
little there).

    python bench/device_fp8_paths.py FOLDER [ROUNDS]    # on an accelerator's host
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import device_load as dl  # (the path first: bench as a package)

WAYS = ("arguments", "calls")
TARGETS = ("bf16", "int8")


@contextlib.contextmanager
def way(name: str) -> Iterator[None]:
    """FP8 steps read the way `name` says (see the module's doc) for the block."""
    import taktiny.loading._ways as ways

    real = ways.Fp8Blocks._source
    if name == "calls":
        ways.Fp8Blocks._source = ways.Transformed._source  # (a device_put of each)
    try:
        yield
    finally:
        ways.Fp8Blocks._source = real


def main(folder: Path, rounds: int = 12) -> dict[str, Any]:
    from taktiny.io import load_safetensors

    fp8, rules, targets = dl._fp8_targets(folder)
    keys = [(w, t) for w in WAYS for t in TARGETS]

    def load(key: tuple[str, str]) -> Any:
        with way(key[0]):
            model = load_safetensors(targets[key[1]], fp8.parent, rules=rules, progress=False)
            return jax.block_until_ready(model)

    times: dict[Any, list[float]] = {key: [] for key in keys}
    after: dict[Any, list[float]] = {}
    with dl._staged_on_cpu():
        made = {key: load(key) for key in keys}  # (each compiles, once)
        bitwise = all(dl._bitwise(made[("arguments", t)], made[("calls", t)]) for t in TARGETS)
        del made
        order, previous = random.Random(0), None
        for _ in range(rounds):
            for key in order.sample(keys, len(keys)):
                start = time.perf_counter()
                load(key)
                seconds = time.perf_counter() - start
                times[key].append(seconds)
                after.setdefault((key, previous), []).append(seconds)
                previous = key
    size = fp8.stat().st_size / 2**30
    name = lambda key: "_".join(key)
    return {
        "device": str(jax.devices()[0].device_kind),
        "GiB": size,
        "bitwise": bitwise,
        **{f"{name(k)}_GiBps": size / statistics.median(t) for k, t in times.items()},
        "after": {
            f"{name(k)} after {name(p)}": size / statistics.median(t)
            for (k, p), t in sorted(after.items(), key=str)
            if p is not None
        },
        "raw_pipeline_GiBps": dl._raw_pipeline(fp8),
    }


if __name__ == "__main__":
    here = Path(sys.argv[1])
    print(json.dumps(main(here, *map(int, sys.argv[2:3])), indent=1))
