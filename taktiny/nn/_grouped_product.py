"""The product of an input with an int4 kernel quantized in groups of 128 along its input
axis, on a TPU, by a Pallas kernel that reads the integers from HBM once and dequantizes
them tile by tile in VMEM. XLA's product, the path everywhere else, first writes the whole
dequantized kernel to memory and reads it back: on a TPU v5e at batches of 1 and 16 that
took 0.90x and 0.77x bfloat16's time, the kernel 0.60x and 0.62x (1.15x against 1.21x at
256; bench/FINDINGS.md section 16).

It is taken only for what was measured there: bfloat16 inputs of at most `ROWS` rows, an
int4 kernel in groups of 128 whose axes tile by `TILE_K` and `TILE_N`, where arrays go to
a TPU by default and the run has one TPU device (a Pallas call is not partitioned across
devices: XLA would gather a sharded kernel onto each). `lax.platform_dependent` still
picks XLA's product wherever the computation runs on another platform, and the gradients
are those of XLA's product (`jax.custom_jvp`: forward and reverse mode), so training
through it is unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer

from ..arrays import default_device
from ..quant import QArray, dequantize_array
from ._explicit import project

TILE_K = 1024  # input rows a program reads at a time (whole groups)
TILE_N = 512  # output columns a program computes
ROWS = 256  # the most input rows the kernel takes (they are one block in VMEM)
GROUP = 128  # the group size it serves


def takes(x: jax.Array, weight: QArray) -> bool:
    """Whether the product of `x` (``[*batch, in]``, in the layer's dtype) and `weight`
    (``[in, out]``, quantized along axis 0) goes through the kernel on a TPU."""
    value = weight.value
    if jnp.dtype(value.dtype) != jnp.dtype(jnp.int4) or weight.group_size != GROUP:
        return False
    if weight.axis != 0 or value.ndim != 2 or x.dtype != jnp.bfloat16:
        return False
    k, n = value.shape
    rows = int(np.prod(x.shape[:-1]))
    if k % TILE_K or n % TILE_N or not 0 < rows <= ROWS:
        return False
    return _one_tpu()


def _one_tpu() -> bool:
    """Whether arrays go to a TPU by default (`default_device`: ``jax.default_device``'s,
    or the first device), and it is the only TPU device of the run."""
    return default_device().platform == "tpu" and len(jax.devices("tpu")) == 1


def grouped_product(
    x: Float[Array, "*batch in"], weight: QArray, precision: jax.lax.PrecisionLike
) -> Float[Array, "*batch out"]:
    """``x @ dequantize(weight)`` for a kernel `takes` accepts: the Pallas kernel where the
    computation runs on a TPU, XLA's product elsewhere; the gradients XLA's.

    Args:
        x: ``[*batch, in]``, bfloat16.
        weight: ``[in, out]``, int4 in groups of 128 along axis 0.
        precision: the precision of XLA's product.

    Returns:
        ``[*batch, out]``, bfloat16.
    """
    rows = x.reshape(-1, x.shape[-1])
    out = cast("jax.Array", _product(rows, weight.value, weight.scale, precision))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _xla(x: jax.Array, value: jax.Array, scale: jax.Array, precision: Any) -> jax.Array:
    """XLA's product: the kernel dequantized into `x`'s dtype, then multiplied."""
    table = dequantize_array(value, scale, axis=0, group_size=GROUP, dtype=x.dtype)
    return project(x, table, None, precision)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _product(x: jax.Array, value: jax.Array, scale: jax.Array, precision: Any) -> jax.Array:
    return jax.lax.platform_dependent(
        x, value, scale, tpu=kernel, default=functools.partial(_xla, precision=precision)
    )


@_product.defjvp
def _tangent(precision: Any, primals: Any, tangents: Any) -> tuple[jax.Array, jax.Array]:
    """The product's, and the tangent of XLA's product (in the input and the scales; the
    integers have none): linear, so JAX transposes it for the gradients."""
    (x, value, scale), (dx, _, dscale) = primals, tangents
    xla = lambda x, scale: _xla(x, value, scale, precision)
    return _product(x, value, scale, precision), jax.jvp(xla, (x, scale), (dx, dscale))[1]


def kernel(
    x: Float[Array, "rows in"],
    value: Integer[Array, "in out"],
    scale: Float[Array, "groups out"],
    interpret: bool = False,
) -> Float[Array, "rows out"]:
    """The Pallas kernel: ``x @ (value * scale)``, each group's partial product taken in
    float32 from its integers converted in VMEM, scaled and summed there, rounded into
    `x`'s dtype once. `interpret` runs it in Pallas's interpreter (any platform: tests).

    Args:
        x: ``[rows, in]``, at most `ROWS` rows.
        value: ``[in, out]``, int4 (or int8), `in` a multiple of `TILE_K` and `out` of
            `TILE_N` (or smaller than them: one tile).
        scale: ``[in // GROUP, out]``.
        interpret: whether to interpret it.

    Returns:
        ``[rows, out]``, in `x`'s dtype.
    """
    batch, k = x.shape
    rows = -(-batch // 16) * 16  # (whole tiles of bfloat16 rows)
    padded = jnp.pad(x, ((0, rows - batch), (0, 0)))
    call = _call(rows, k, value.shape[1], jnp.dtype(x.dtype), interpret)
    return call(padded, value, scale.astype(jnp.float32))[:batch]


@functools.lru_cache(maxsize=64)
def _call(rows: int, k: int, n: int, dtype: Any, interpret: bool) -> Any:
    from jax.experimental import pallas as pl  # (imported when a product is first traced)
    from jax.experimental.pallas import tpu as pltpu

    tile_k, tile_n = min(TILE_K, k), min(TILE_N, n)
    groups = tile_k // GROUP

    def body(x_ref: Any, w_ref: Any, s_ref: Any, o_ref: Any, acc_ref: Any) -> None:
        step = pl.program_id(1)

        @pl.when(step == 0)
        def _start() -> None:
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc = acc_ref[...]
        for g in range(groups):  # (each group's rows, scaled by their product's scales)
            w = w_ref[g * GROUP : (g + 1) * GROUP, :].astype(x_ref.dtype)
            part = jnp.dot(
                x_ref[:, g * GROUP : (g + 1) * GROUP], w, preferred_element_type=jnp.float32
            )
            acc = acc + part * s_ref[g : g + 1, :]
        acc_ref[...] = acc

        @pl.when(step == pl.num_programs(1) - 1)
        def _end() -> None:
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return pl.pallas_call(
        body,
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
