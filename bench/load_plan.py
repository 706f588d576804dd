"""Load plans (issue 25): the peak host memory ``taktiny.io.plan_load`` predicts from the
headers, against the peak RSS growth the same load measures, for the plain, sharded,
transposing and quantizing loads of the 1 GB checkpoint.

- Predicted: ``plan_load(target, path, rules=...).peak_host_bytes``, in this process.
- Measured: the load in a fresh subprocess (``bench.memory``'s worker, with the streaming,
  sharded-streaming and quantizing groups' registries, so each case is exactly the load
  those groups time): its peak resident memory (``VmHWM``) less its memory just before the
  load, which holds everything the load leaves behind (the model) and whatever it used on
  the way.
- The target: the prediction within 10% of the measurement.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from . import _disk, _formats, memory, quantized, streaming, streaming_sharded
from ._results import Config, Group, Table, Target

WITHIN = 0.10  # the bound on |predicted / measured - 1|
# case -> (the registry whose load is measured, its case there, the file it reads)
CASES = {
    "plain, one device": ("bench.streaming", streaming.TT, "safetensors"),
    "sharded, inner split on 8 devices": (
        "bench.streaming_sharded",
        streaming_sharded.TT[streaming_sharded.INNER],
        "safetensors",
    ),
    "transposing rule": ("bench.streaming", streaming.TRANSPOSED, "transposed"),
    "quantizing to int8": ("bench.quantized", quantized.QUANTIZING, "safetensors"),
}


def _planned(case: str, path: Path, abstracts: dict[str, Any]) -> Any:
    """The plan of `case`'s load: the same target and rules its registry loads with."""
    import taktiny.convert as cv
    import taktiny.io as tio

    if case.startswith("sharded"):
        target = streaming_sharded.sharded(abstracts["taktiny"], streaming_sharded.INNER)
        return tio.plan_load(target, path)
    if case.startswith("transposing"):
        return tio.plan_load(
            abstracts["taktiny"], path, rules=[cv.Rule(*streaming.RULE, cv.transpose())]
        )
    if case.startswith("quantizing"):
        return tio.plan_load(quantized._quantized_target(abstracts, 8, None), path)
    return tio.plan_load(abstracts["taktiny"], path)


def run(config: Config) -> Group:
    """Predicts and measures each case's peak host memory."""
    start = time.perf_counter()
    width, depth = _formats.SIZES[config.mode]
    model = _formats.Big(width, depth, rngs=_formats.nn.Rngs(0))
    abstracts = _formats.abstracts(width, depth)
    group = Group("plan", "Load plans: predicted and measured peak host memory")
    root = Path(config.scratch)
    root.mkdir(parents=True, exist_ok=True)
    paths = {kind: root / f"plan-{kind}.safetensors" for kind in ("safetensors", "transposed")}
    rows: dict[str, tuple[int, int]] = {}
    try:
        for kind, path in paths.items():
            streaming._write(kind, path, model)
        del model
        for case, (registry, name, kind) in CASES.items():
            plan = _planned(case, paths[kind], abstracts)
            assert plan.error is None, plan.error
            found = memory._measure(name, paths[kind], width, depth, registry=registry)
            rows[case] = (plan.peak_host_bytes, int(found["peak"] - found["before"]))
    finally:
        for path in paths.values():
            _disk.remove(path)
    table = Table(
        "Peak host memory of a load, predicted from the headers and measured (MB)",
        ["predicted", "measured"],
        unit="x",
        log=False,
        reference="measured",
        label="MB",
    )
    calls = {
        "predicted": "taktiny.io.plan_load(target, path).peak_host_bytes",
        "measured": "peak RSS growth of the load (VmHWM - RSS before)",
    }
    for case, (predicted, measured) in rows.items():
        for system, value in (("predicted", predicted), ("measured", measured)):
            table.add(case, system, calls[system], value / 1e6)
        group.targets.append(
            Target(
                f"the predicted peak host memory of the {case} load within {WITHIN:.0%} of "
                f"the measured",
                abs(predicted / max(measured, 1) - 1),
                WITHIN,
                False,
                "|predicted / measured - 1|",
            )
        )
    group.tables.append(table)
    group.notes.append(
        "Each measurement is one load in a fresh interpreter (bench.memory's worker), the "
        "same load the streaming, sharded-streaming and quantizing groups time; "
        + "; ".join(
            f"{case}: predicted {p / 1e6:,.1f} MB, measured {m / 1e6:,.1f} MB"
            for case, (p, m) in rows.items()
        )
        + "."
    )
    group.seconds = time.perf_counter() - start
    return group
