"""Background saves: how long ``save_safetensors(path, tree, wait=False)`` blocks its caller,
against a plain copy of the same arrays to host memory (the issue's target: at most 1.2x),
and what the whole save takes (the call, then ``result()``) against a save that waits.

    python bench/run.py --only background --out /tmp/report   # in the report
    python -m bench.background_save                            # 200 MiB, printed

- The tree: a flat dict of float32 JAX arrays on the CPU device, 4 MiB each (200 MiB in
  a full run).
- The host copy: ``np.array(x, copy=True)`` of each array, what a background save must do
  before it returns (``np.asarray`` of an array on the CPU device may be a view of its
  buffer).
- Each save goes over the checkpoint the previous one left (a training loop's saves),
  fsyncs included. Interleaved rounds; each ratio is the median of per-round ratios.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np

from bench import _disk
from bench._results import Config, Group, Table, Target
from bench._timing import Case, compare, paired_ratio

BACKGROUND = "wait=False"
WAITING = "wait=True"
COPY = "host copy"
BLOCKED, WHOLE = "the caller blocked", "the whole save"
TARGET = 1.2  # the bound: the call's time / the host copy's


def tree(mib: int) -> dict[str, jax.Array]:
    """`mib` MiB of float32 JAX arrays, 4 MiB each."""
    key = jax.random.key(0)
    return {
        f"layers.{i}.kernel": jax.random.normal(jax.random.fold_in(key, i), (1024, 1024))
        for i in range(max(mib // 4, 1))
    }


def run(config: Config) -> Group:
    from taktiny.io import save_safetensors

    start = time.perf_counter()
    mib = config.pick(200, 64, 4)
    arrays = jax.block_until_ready(tree(mib))
    nbytes = sum(a.nbytes for a in arrays.values())
    root = Path(config.scratch)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "background.safetensors"

    def copies(kept: list[Any]) -> None:  # (kept until after the sample, as a save keeps them)
        kept.extend(np.array(value, copy=True) for value in arrays.values())

    def call(handles: list[Any]) -> None:
        handles.append(save_safetensors(path, arrays, wait=False))

    def total(_: Any) -> None:
        save_safetensors(path, arrays, wait=False).result()

    def waits(_: Any) -> None:
        save_safetensors(path, arrays)

    try:
        save_safetensors(path, arrays)  # (the rounds save over it)
        times = compare(
            {
                "copy": Case(copies, list, lambda kept: kept.clear()),
                "call": Case(call, list, lambda handles: handles[0].result()),
                "total": Case(total, lambda: None),
                "waits": Case(waits, lambda: None),
            },
            repeat=config.pick(9, 3, 1),
        )
    finally:
        _disk.remove(path)
    blocking = paired_ratio(times["call"], times["copy"])
    whole = paired_ratio(times["total"], times["waits"])
    group = Group("background", f"Background saves of {nbytes / 2**20:,.0f} MiB of float32")
    table = Table(
        f"save_safetensors of {len(arrays)} float32 arrays of 4 MiB (CPU)",
        [BACKGROUND, WAITING, COPY],
        reference=BACKGROUND,
    )
    cells = [
        (BLOCKED, BACKGROUND, "call", "save_safetensors(path, tree, wait=False)"),
        (BLOCKED, WAITING, "waits", "save_safetensors(path, tree)"),
        (BLOCKED, COPY, "copy", "[np.array(x, copy=True) for x in leaves]"),
        (WHOLE, BACKGROUND, "total", "save_safetensors(path, tree, wait=False).result()"),
        (WHOLE, WAITING, "waits", "save_safetensors(path, tree)"),
    ]
    for op, system, case, code in cells:
        st = times[case]
        table.add(op, system, code, st.median, (st.low, st.high))
    group.tables.append(table)
    group.targets.append(
        Target(
            f"a background save blocks its caller at most {TARGET}x a host copy of the arrays",
            blocking,
            TARGET,
            False,
            "save_safetensors(..., wait=False)'s time / the host copies', median of per-round "
            "ratios",
        )
    )
    group.notes.append(
        f"The whole background save (the call, then result()) / a save that waits: "
        f"{whole:.2f}x: it copies the arrays first (a save that waits writes from views of "
        f"them) and shares the cores with its caller. Load average at the end "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores."
    )
    group.seconds = time.perf_counter() - start
    return group


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        group = run(Config("full", Path(folder)))
    print(group.title)
    for op, row in group.tables[0].rows.items():
        for system, cell in row.items():
            print(f"  {op}, {system:<34} {cell.value * 1e3:8.1f} ms")
    for target in group.targets:
        print(f"  {'met' if target.met else 'MISSED'}: {target.goal}: {target.value:.2f}x")
    print(f"  {group.notes[0]}")


if __name__ == "__main__":
    main()
