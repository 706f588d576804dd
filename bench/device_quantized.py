"""Weight-only quantized layers at decode shapes (issue 53 point 1): a forward through
``LAYERS`` ``nn.QuantizedLinear`` layers of ``WIDTH`` x ``WIDTH`` (32 x 4096: 1 GiB of
bfloat16 weights) on JAX's default device, jitted, against the same layers in bfloat16
(``nn.Linear``), at batches 1, 16 and 256 of bfloat16 inputs.

Each quantized layout is timed two ways in interleaved rounds (median of ``REPEATS``
calls each):

- ``product``: the layer as it computes (one scale per output channel: the integers enter
  the product and the scales multiply its result; int4 in groups of 128 on one TPU, the
  Pallas kernel of ``nn._grouped_product``, which dequantizes tile by tile in VMEM; other
  groups, the weight dequantized first);
- ``weight_first``: the weight dequantized into bfloat16, then multiplied (the layer's path
  before issue 53), as a plain function of the same arrays;
- ``group_products`` (groups only): each group's partial product, scaled, then summed
  (`_group_products`), a candidate for the grouped path; ``group_products_f32`` the same
  in float32, rounded once. (The eighth session moved the earlier candidate
  ``group_kernel``, a Pallas kernel, into the layer: its figures in bench/accelerator.json
  are from before that.)

Each is checked against the bfloat16 layer of the dequantized weights, on the first layer
(within bfloat16's rounding, relative to its largest output). Targets (issue 53, on a TPU):
int8 at most 0.6x the bfloat16 time and int4 (groups of 128) at most 0.35x at batches 1 to
16, neither slower than bfloat16 at 256. Prints one JSON object.

    python bench/device_quantized.py                       # on the accelerator's host
    DEVICE_Q_LAYERS=2 DEVICE_Q_WIDTH=512 python bench/device_quantized.py   # a quick try
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LAYERS = int(os.environ.get("DEVICE_Q_LAYERS", "32"))
WIDTH = int(os.environ.get("DEVICE_Q_WIDTH", "4096"))
REPEATS = int(os.environ.get("DEVICE_Q_REPEATS", "10"))
BATCHES = (1, 16, 256)
LAYOUTS = {"int8": (8, None), "int4_g128": (4, 128)}
TARGETS = {"int8": 0.6, "int4_g128": 0.35, "large_batch": 1.0}  # x the bfloat16 time


def _layers(bits: int | None, group: int | None) -> list[Any]:
    """LAYERS layers of WIDTH x WIDTH with bfloat16 scales and no bias: bfloat16
    ``nn.Linear`` (`bits` None), else the same draw quantized."""
    import taktiny as tt
    from taktiny import nn

    rngs = nn.Rngs(0)
    dense = [
        nn.Linear(WIDTH, WIDTH, use_bias=False, param_dtype=jnp.bfloat16, rngs=rngs)
        for _ in range(LAYERS)
    ]
    return dense if bits is None else tt.quantize(dense, bits=bits, group_size=group)


def _forward(layers: list[Any], x: jax.Array) -> jax.Array:
    for layer in layers:
        x = jnp.tanh(layer(x))
    return x


def _weight_first(layers: list[Any], x: jax.Array) -> jax.Array:
    for layer in layers:
        x = jnp.tanh(x @ layer.kernel.dequantize(jnp.bfloat16))
    return x


def _group_products(layers: list[Any], x: jax.Array, wide: bool = False) -> jax.Array:
    """In groups: each group's rows of the integer kernel times its slice of `x`, the
    partial products scaled by the group's scales, then summed (no float kernel made;
    ``[*batch, groups, out]`` partial products instead): a candidate for the layer's
    grouped path at small batches, measured here first. `wide`: the partial products,
    their scaling and their sum in float32, rounded into bfloat16 once (as the layer's
    per-channel path takes its product), twice the partial products' bytes."""
    work = jnp.float32 if wide else jnp.bfloat16
    for layer in layers:
        kernel = layer.kernel
        groups, size = kernel.scale.shape[0], kernel.group_size
        value = kernel.value.astype(jnp.bfloat16).reshape(groups, size, -1)
        pieces = x.reshape(*x.shape[:-1], groups, size)
        partial = jnp.einsum("...gi,gio->...go", pieces, value, preferred_element_type=work)
        summed = jnp.sum(partial * kernel.scale.astype(work), axis=-2)
        x = jnp.tanh(summed.astype(jnp.bfloat16))
    return x


def _timed(fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _close(got: jax.Array, want: jax.Array) -> bool:
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return bool(np.abs(got64 - want64).max() <= 2**-6 * max(np.abs(want64).max(), 1e-30))


def main() -> dict[str, Any]:
    device = jax.devices()[0]
    out: dict[str, Any] = {"device": device.device_kind, "layers": LAYERS, "width": WIDTH}
    forward, weight_first = jax.jit(_forward), jax.jit(_weight_first)
    candidates = {  # the grouped path's candidates (groups only)
        "group_products": jax.jit(_group_products),
        "group_products_f32": jax.jit(functools.partial(_group_products, wide=True)),
    }
    dense = _layers(None, None)
    quantized = {name: _layers(*layout) for name, layout in LAYOUTS.items()}
    dequantized = {  # (bfloat16 layers of the dequantized weights: the oracle)
        name: [
            d.replace(kernel=q.kernel.dequantize(jnp.bfloat16))
            for d, q in zip(dense, layers, strict=True)
        ]
        for name, layers in quantized.items()
    }
    rng = np.random.default_rng(0)
    for batch in BATCHES:
        x = jnp.asarray(rng.normal(size=(batch, WIDTH)) / np.sqrt(WIDTH), jnp.bfloat16)
        row: dict[str, Any] = {"bf16_ms": 0.0}
        times: dict[str, list[float]] = {"bf16": []}
        for name, layers in quantized.items():
            # checked on the first layer: through all of them, each path's own roundings
            # (where a product is rounded into bfloat16) grow past any one layer's
            first = layers[:1]
            want = forward(dequantized[name][:1], x)
            row[f"{name}_product_close"] = _close(forward(first, x), want)
            row[f"{name}_weight_first_close"] = _close(weight_first(first, x), want)
            times[f"{name}_product"], times[f"{name}_weight_first"] = [], []
            for path, run in candidates.items():
                if layers[0].kernel.group_size is None:
                    continue
                try:  # (a candidate: a kernel Mosaic refuses is recorded, not raised)
                    row[f"{name}_{path}_close"] = _close(run(first, x), want)
                    times[f"{name}_{path}"] = []
                except Exception as error:  # noqa: BLE001 - recorded in the figures
                    row[f"{name}_{path}_error"] = f"{type(error).__name__}: {error}"[:500]
        for _ in range(3):  # (interleaved rounds)
            times["bf16"].append(_timed(lambda x=x: forward(dense, x)))
            for name, layers in quantized.items():
                times[f"{name}_product"].append(_timed(lambda q=layers, x=x: forward(q, x)))
                times[f"{name}_weight_first"].append(
                    _timed(lambda q=layers, x=x: weight_first(q, x))
                )
                for path, run in candidates.items():
                    if f"{name}_{path}" in times:
                        times[f"{name}_{path}"].append(_timed(lambda r=run, q=layers, x=x: r(q, x)))
        bf16 = statistics.median(times["bf16"])
        row["bf16_ms"] = bf16 * 1e3
        for key, values in times.items():
            if key != "bf16":
                row[f"{key}_ms"] = statistics.median(values) * 1e3
                row[f"{key}_vs_bf16"] = statistics.median(values) / bf16
        out[f"batch_{batch}"] = row
    out["targets"] = TARGETS
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
