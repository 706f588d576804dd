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
- A training loop (a 4-layer MLP of 1024-wide float32 layers, 16 MiB of weights, Adam,
  batches of 256, the step jitted with its parameters and optimizer state donated) runs
  the same steps saving its weights every `EVERY` steps in the background, saving them
  with saves that wait, and not saving: its steps per second each way. On 2 CPU cores the
  save's hashing and writing compete with the step's compute; no target (a GPU run gives
  the real figure).
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
WHOLE_TARGET = 1.1  # the bound: the whole background save / a save that waits
EVERY = 10  # the training loop saves its weights every this many steps


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
    group.targets.append(
        Target(
            f"a background save takes at most {WHOLE_TARGET}x a save that waits, in all",
            whole,
            WHOLE_TARGET,
            False,
            "(save_safetensors(..., wait=False).result())'s time / save_safetensors(...)'s, "
            "median of per-round ratios",
        )
    )
    extra = times["total"].median - times["waits"].median
    group.notes.append(
        f"The whole background save (the call, then result()) / a save that waits: "
        f"{whole:.2f}x; it takes {extra * 1e3:.0f} ms more, and the host copy takes "
        f"{times['copy'].median * 1e3:.0f} ms: on the CPU device a save that waits writes from "
        f"views of the arrays' own buffers, which a background save may not keep (the caller "
        f"may donate them), so it pays the copy the other does not (bench/FINDINGS.md, "
        f"section 11). "
        f"Load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())} on "
        f"{os.cpu_count()} cores."
    )
    group.tables.append(_training(config, root))
    group.seconds = time.perf_counter() - start
    return group


def _training(config: Config, root: Path) -> Table:
    """The time per step of a training loop saving its weights every `EVERY` steps in the
    background, with saves that wait, and without saving (the saves' time spread over the
    steps)."""
    import jax.numpy as jnp
    import optax

    from taktiny.io import save_safetensors

    width, depth, batch = 1024, 4, 256
    steps = config.pick(60, 20, 4)
    keys = jax.random.split(jax.random.key(1), depth)
    start_params = {
        f"layers.{i}.kernel": jax.random.normal(k, (width, width)) / width**0.5
        for i, k in enumerate(keys)
    }
    optimizer = optax.adam(1e-3)
    x = jax.random.normal(jax.random.key(2), (batch, width))

    def loss(params: dict[str, jax.Array]) -> jax.Array:
        h = x
        for i in range(depth):
            h = jnp.tanh(h @ params[f"layers.{i}.kernel"])
        return jnp.mean(h**2)

    @jax.jit
    def step(params: Any, state: Any) -> Any:
        grads = jax.grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step.__wrapped__, donate_argnums=(0, 1))  # (the buffers reused each step)
    path = root / "training.safetensors"

    def loop(how: str) -> float:
        params = jax.tree.map(jnp.copy, start_params)
        state = optimizer.init(params)
        params, state = jax.block_until_ready(step(params, state))  # (compiled, warm)
        pending = None
        began = time.perf_counter()
        for i in range(steps):
            params, state = step(params, state)
            if (i + 1) % EVERY == 0 and how != "none":
                if how == BACKGROUND:
                    pending = save_safetensors(path, params, wait=False)
                else:
                    save_safetensors(path, params)
        jax.block_until_ready(params)
        if pending is not None:
            pending.result()  # (its time is the loop's: the last save ends inside it)
        return (time.perf_counter() - began) / steps

    try:
        with jax.numpy_dtype_promotion("standard"):  # (optax's adam mixes int32 and float32)
            rates = {how: [] for how in (BACKGROUND, WAITING, "none")}
            for _ in range(config.pick(3, 1, 1)):  # interleaved rounds
                for how, got in rates.items():
                    got.append(loop(how))
    finally:
        _disk.remove(path)
    table = Table(
        f"a training loop's time per step, saving its 16 MiB of weights every {EVERY} steps",
        [BACKGROUND, WAITING, "no saves"],
        reference=BACKGROUND,
    )
    for how, name in ((BACKGROUND, BACKGROUND), (WAITING, WAITING), ("none", "no saves")):
        median = float(np.median(rates[how]))
        spread = (min(rates[how]), max(rates[how]))
        table.add("a step", name, f"{steps} steps, saving: {how}", median, spread)
    return table


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        group = run(Config("full", Path(folder)))
    print(group.title)
    for table in group.tables:
        for op, row in table.rows.items():
            for system, cell in row.items():
                print(f"  {op}, {system:<34} {cell.value * 1e3:8.1f} ms")
    for target in group.targets:
        print(f"  {'met' if target.met else 'MISSED'}: {target.goal}: {target.value:.2f}x")
    print(f"  {group.notes[0]}")


if __name__ == "__main__":
    main()
