"""A candidate for issue 53's grouped path, measured before the library takes it: a Pallas
kernel for ``x @ dequantize(w)`` with an int4 or int8 weight in groups along its input
axis, that reads the weight's integers from HBM once and dequantizes them in VMEM, tile by
tile, never writing a float weight (the layer today dequantizes the whole weight first).

On a TPU it compiles through Mosaic; anywhere else it runs in Pallas's interpreter (slow:
for checking, not timing). `bench/device_quantized.py` times it as the
``group_kernel`` path and checks it against the bfloat16 forward of the dequantized
weights.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

TILE_N = 512  # output columns a program computes
TILE_K = 1024  # input rows a program reads at a time (whole groups)


def grouped_matmul(x: jax.Array, value: jax.Array, scale: jax.Array, group: int) -> jax.Array:
    """``x @ (value * scale)`` with `scale` per group of `group` rows of `value`, in
    `x`'s dtype, the products of each group accumulated in float32 and scaled there.

    Args:
        x: ``[batch, in]``, float.
        value: ``[in, out]``, int8 or int4.
        scale: ``[in // group, out]``.
        group: rows per scale; divides `in`.

    Returns:
        ``[batch, out]``, in `x`'s dtype.
    """
    batch, k = x.shape
    n = value.shape[1]
    rows = -(-batch // 16) * 16  # (whole tiles of bfloat16 rows)
    padded = jnp.pad(x, ((0, rows - batch), (0, 0)))
    tile_k = min(TILE_K, k)
    tile_n = min(TILE_N, n)
    if k % tile_k or tile_k % group or n % tile_n:
        raise ValueError(f"shapes {x.shape} @ {value.shape} do not tile by {tile_k}, {tile_n}")
    out = _call(rows, k, n, tile_k, tile_n, group, jnp.dtype(x.dtype))(
        padded, value, scale.astype(jnp.float32)
    )
    return out[:batch]


@functools.lru_cache(maxsize=64)
def _call(rows: int, k: int, n: int, tile_k: int, tile_n: int, group: int, dtype: Any) -> Any:
    groups = tile_k // group
    interpret = jax.devices()[0].platform != "tpu"

    def kernel(x_ref: Any, w_ref: Any, s_ref: Any, o_ref: Any, acc_ref: Any) -> None:
        step = pl.program_id(1)

        @pl.when(step == 0)
        def _start() -> None:
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc = acc_ref[...]
        for g in range(groups):  # (each group's rows, dequantized by their product's scale)
            w = w_ref[g * group : (g + 1) * group, :].astype(x_ref.dtype)
            part = jnp.dot(
                x_ref[:, g * group : (g + 1) * group], w, preferred_element_type=jnp.float32
            )
            acc = acc + part * s_ref[g : g + 1, :]
        acc_ref[...] = acc

        @pl.when(step == pl.num_programs(1) - 1)
        def _end() -> None:
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    from jax.experimental.pallas import tpu as pltpu

    return jax.jit(
        pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((rows, n), dtype),
            grid=(n // tile_n, k // tile_k),
            in_specs=[
                pl.BlockSpec((rows, tile_k), lambda j, s: (0, s)),
                pl.BlockSpec((tile_k, tile_n), lambda j, s: (s, j)),
                pl.BlockSpec((groups, tile_n), lambda j, s: (s, j)),
            ],
            out_specs=pl.BlockSpec((rows, tile_n), lambda j, s: (0, j)),
            scratch_shapes=[pltpu.VMEM((rows, tile_n), jnp.float32)],
            interpret=interpret,
        )
    )
