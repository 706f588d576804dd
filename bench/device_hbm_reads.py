"""How fast a TPU's kernels read weights out of its memory (issue 53 point 1; bench/FINDINGS.md
section 16): ``LAYERS`` weights of ``WIDTH`` x ``WIDTH`` in bfloat16 and in int8, each read
from HBM into VMEM by a Pallas kernel that only copies (blocks of 256, 512 or 1,024 rows,
two in flight, nothing computed), and summed by XLA (``jnp.sum`` of each in float32), in
one jitted program per figure; GB/s and µs a weight, median of 10 calls; then arrays of
other sizes in both dtypes (``by_size``). int8 weights went into products at about 0.65x
bfloat16's rate in bytes, by XLA and by every kernel tried; on the chip the copy alone ran
at that rate, and arrays of the same bytes read at the same rate whatever their dtype, 16
MiB at 0.75x the rate of 32 MiB (about 20 µs an array: FINDINGS 16). Off a TPU the
kernel is interpreted, small: the figures mean nothing there.

    python bench/device_hbm_reads.py    # on a TPU's host
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LAYERS, WIDTH = 32, 4096
ROWS = (256, 512, 1024)
# (rows as a multiple of WIDTH, dtype) of the arrays `by_size` reads
SIZES = ((0.5, jnp.int8), (0.5, jnp.bfloat16), (1, jnp.int8), (2, jnp.int8), (1, jnp.bfloat16),
         (2, jnp.bfloat16), (8, jnp.int8), (8, jnp.bfloat16))  # fmt: skip


def copying(dtype: Any, rows: int, interpret: bool) -> Callable[[list[jax.Array]], jax.Array]:
    """A jitted program copying each weight of `dtype` (`WIDTH` columns) from HBM into VMEM,
    `rows` rows at a time into two buffers in turns (the next copy started before the
    current one is waited for); its result, the sum over the weights of their last
    block's first 8 rows and 128 columns as float32, keeps it from being dropped."""
    width = WIDTH

    def kernel(w_hbm: Any, out: Any, buffers: Any, done: Any) -> None:
        steps = w_hbm.shape[0] // rows

        def copy(i: Any, slot: Any) -> Any:
            block = w_hbm.at[pl.ds(i * rows, rows)]
            return pltpu.make_async_copy(block, buffers.at[slot], done.at[slot])

        copy(0, 0).start()

        def step(i: Any, carry: Any) -> Any:
            @pl.when(i + 1 < steps)
            def _() -> None:
                copy(i + 1, 1 - i % 2).start()

            copy(i, i % 2).wait()
            return carry

        jax.lax.fori_loop(0, steps, step, 0)
        out[...] = buffers[(steps - 1) % 2, :8, :128].astype(jnp.float32)

    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((2, rows, width), dtype), pltpu.SemaphoreType.DMA((2,))],
        interpret=interpret,
    )
    return jax.jit(lambda weights: sum(call(w) for w in weights))


def _median(fn: Callable[[], Any]) -> float:
    jax.block_until_ready(fn())  # (compiles)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> dict[str, Any]:
    device = jax.devices()[0]
    interpret = device.platform != "tpu"
    figures: dict[str, Any] = {"device": str(device.device_kind), "interpreted": interpret}
    key = jax.random.key(0)
    summed = jax.jit(lambda weights: sum(jnp.sum(w.astype(jnp.float32)) for w in weights))
    for dtype in (jnp.bfloat16, jnp.int8):
        name = jnp.dtype(dtype).name
        weights = [
            jax.random.randint(jax.random.fold_in(key, i), (WIDTH, WIDTH), -100, 100).astype(dtype)
            for i in range(LAYERS)
        ]
        nbytes = sum(w.nbytes for w in weights)
        seconds = _median(lambda w=weights: summed(w))
        figures[f"xla_sum_{name}_GBps"] = round(nbytes / seconds / 1e9, 1)
        for rows in (r for r in ROWS if r <= WIDTH):
            copy = copying(dtype, rows, interpret)
            seconds = _median(lambda c=copy, w=weights: c(w))
            figures[f"copy_{name}_{rows}rows_GBps"] = round(nbytes / seconds / 1e9, 1)
            figures[f"copy_{name}_{rows}rows_us_a_weight"] = round(seconds / LAYERS * 1e6, 1)
        del weights
    figures["by_size"] = by_size(key, interpret)
    return figures


def by_size(key: Any, interpret: bool) -> dict[str, Any]:
    """Arrays of `WIDTH` columns and 1/2 to 8 times as many rows, int8 and bfloat16, each
    copied (256-row blocks) and summed as above, as many as fit 512 MiB (at most
    `LAYERS`): ``{"<dtype> <rows>x<cols>": [MiB, GB/s copied, µs an array, GB/s summed]}``.
    On the chip the rate was the size's, whatever the dtype (FINDINGS 16)."""
    summed = jax.jit(lambda weights: sum(jnp.sum(w.astype(jnp.float32)) for w in weights))
    figures: dict[str, Any] = {}
    for factor, dtype in SIZES:
        shape = (int(WIDTH * factor), WIDTH)
        one = shape[0] * shape[1] * jnp.dtype(dtype).itemsize
        count = max(1, min(LAYERS, 2**29 // one))
        weights = [
            jax.random.randint(jax.random.fold_in(key, i), shape, -100, 100).astype(dtype)
            for i in range(count)
        ]
        copy = copying(dtype, min(256, shape[0]), interpret)
        copied = _median(lambda c=copy, w=weights: c(w))
        added = _median(lambda w=weights: summed(w))
        figures[f"{jnp.dtype(dtype).name} {shape[0]}x{shape[1]}"] = [
            one / 2**20,
            round(one * count / copied / 1e9, 1),
            round(copied / count * 1e6, 1),
            round(one * count / added / 1e9, 1),
        ]
        del weights
    return figures


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
