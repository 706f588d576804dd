"""LoRA and QLoRA training steps on an accelerator (issue 53 point 3): rank-8 adapters on
every layer of an MLP of 32 ``Linear(4096, 4096)`` layers (float32 parameters, ReLU between
them), 2,048 rows a step, against full fine-tuning of the same MLP; the adapters on an int8
base and on an int4 base in groups of 128 (``tt.quantize``, then ``tt.lora``).

Each step is ``jax.jit`` of ``jax.value_and_grad`` and ``optax.adam``, its parameters and
Adam state donated; the LoRA steps differentiate the adapters alone
(``eqx.partition(model, tt.trainable(model))``, the step of docs/adapters.md). Prints, for
each: the median step time over 10 steps, its ratio to full fine-tuning, and XLA's bytes
for the compiled step (arguments + outputs not donated + temporaries).

    python bench/device_lora.py             # on the accelerator's host
    python bench/device_lora.py --smoke     # 4 layers of 64, any machine
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import taktiny as tt
from taktiny import nn

RANK = 8


class MLP(nn.Module):
    """``depth`` Linear(width, width) layers, ReLU between them."""

    def __init__(self, width: int, depth: int, *, rngs: nn.Rngs):
        self.layers = [nn.Linear(width, width, rngs=rngs) for _ in range(depth)]

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def _peak(compiled: Any) -> int | None:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    out = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    return analysis.argument_size_in_bytes + out + analysis.temp_size_in_bytes


def main(smoke: bool) -> dict[str, Any]:
    width, depth, rows = (64, 4, 16) if smoke else (4096, 32, 2048)
    base = MLP(width, depth, rngs=nn.Rngs(0))
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.normal(size=(rows, width)), jnp.float32) for _ in range(2))
    loss = lambda model, x, y: jnp.mean((model(x) - y) ** 2)
    optimizer = optax.adam(1e-4)

    def full(params: Any, state: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    def adapted(params: Any, frozen: Any, state: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(lambda p: loss(eqx.combine(p, frozen), x, y))(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    group = None if smoke else 128
    bases = {
        "lora": base,
        "qlora_int8": tt.quantize(base, bits=8),
        "qlora_int4_g128": tt.quantize(base, bits=4, group_size=group),
    }
    out: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "rows": rows}
    own = jax.tree.map(jnp.copy, base)
    state = optimizer.init(own)
    compiled = jax.jit(full, donate_argnums=(0, 1)).lower(own, state, x, y).compile()
    runs: dict[str, Any] = {"full": (compiled, [own, state], None)}
    for name, model in bases.items():
        lora = tt.lora(model, RANK, where="layers.*", alpha=16, rngs=nn.Rngs(1))
        params, frozen = eqx.partition(lora, tt.trainable(lora))
        params = jax.tree.map(jnp.copy, params)
        state = optimizer.init(params)
        step = jax.jit(adapted, donate_argnums=(0, 2))
        runs[name] = (step.lower(params, frozen, state, x, y).compile(), [params, state], frozen)
    for name, (compiled, held, frozen) in runs.items():
        times = []
        for i in range(4 if smoke else 11):
            start = time.perf_counter()
            args = (held[0], held[1]) if frozen is None else (held[0], frozen, held[1])
            new, state, value = compiled(*args, x, y)
            held[0], held[1] = new, state
            jax.block_until_ready(value)
            if i:  # (the first: warm-up)
                times.append(time.perf_counter() - start)
        out[name] = {"step_ms": statistics.median(times) * 1e3, "peak_bytes": _peak(compiled)}
        held.clear()  # (its parameters and Adam state: room for the next step's)
        print(name, out[name], file=sys.stderr, flush=True)
    for name in bases:
        out[name]["x_full"] = out[name]["step_ms"] / out["full"]["step_ms"]
        out[name]["x_lora"] = out[name]["step_ms"] / out["lora"]["step_ms"]
    return out


if __name__ == "__main__":
    print(json.dumps(main("--smoke" in sys.argv), indent=1))
