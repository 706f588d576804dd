"""LoRA training: a jitted training step of the Llama of ``examples/llama.py`` with rank-8
adapters on every projection of attention and MLP, against the plain forward and backward
of the base model.

- LoRA step: ``jax.jit`` of ``jax.value_and_grad`` of the mean squared logits of the adapted
  model (``tt.lora(model, 8, targets=["layers.*.attention.*", "layers.*.mlp.*"])``) with
  respect to the leaves ``tt.trainable`` marks (the adapters only): the model is
  split by ``eqx.partition(model, tt.trainable(model))`` and the frozen half passed as a
  second argument, as a masked optimiser would use it.
- Base: the same loss's ``jax.value_and_grad`` over the base model, every weight trained.

Same batch of token ids, interleaved rounds; the ratio is the median of per-round ratios.
"""

from __future__ import annotations

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import taktiny as tt

from ._results import Config, Group, Table, Target
from ._timing import compare, paired_ratio
from .decoding import llama

STEP_RATIO = 1.1  # the target of issue 24
TARGETS = ["layers.*.attention.*", "layers.*.mlp.*"]


def run(config: Config) -> Group:
    """Times the LoRA step against the base's forward and backward."""
    start = time.perf_counter()
    group = Group("lora", "LoRA training step on the Llama example")
    batch, length = config.pick((8, 128), (8, 128), (2, 8))
    llama_config = llama.llama_config(tied=False)
    base = llama.Llama(llama_config, rngs=llama.nn.Rngs(0))
    adapted = tt.lora(base, 8, targets=TARGETS, alpha=16, rngs=llama.nn.Rngs(1))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (batch, length)), jnp.int32)

    loss = lambda model, ids: jnp.mean(model(ids) ** 2)
    step = jax.jit(jax.value_and_grad(loss))
    # the gradients of what tt.trainable marks only (the adapters): the frozen
    # leaves go in as a separate argument, as an optimiser masked by it sees them
    trained, frozen = eqx.partition(adapted, tt.trainable(adapted))
    split = jax.value_and_grad(lambda trained, frozen, ids: loss(eqx.combine(trained, frozen), ids))
    lora_step = jax.jit(split)
    assert np.isclose(float(lora_step(trained, frozen, ids)[0]), float(step(base, ids)[0]))
    lora, plain = "LoRA step (trainable leaves' gradients)", "base forward and backward"
    stats = compare(
        {
            lora: lambda: jax.block_until_ready(lora_step(trained, frozen, ids)),
            plain: lambda: jax.block_until_ready(step(base, ids)),
        },
        repeat=config.repeat,
        warmup=2,
    )
    op = f"batch {batch} x {length} tokens"
    table = Table(
        f"Llama training step (jitted), batch {batch} x {length} tokens",
        [plain, lora],
        reference=plain,
    )
    calls = {
        lora: "jax.jit(jax.value_and_grad(loss))(*eqx.partition(model, tt.trainable(model)), ids)",
        plain: "jax.jit(jax.value_and_grad(loss))(model, ids)",
    }
    for system, st in stats.items():
        table.add(op, system, calls[system], st.median, (st.low, st.high))
    group.tables.append(table)
    group.targets.append(
        Target(
            f"a LoRA training step (rank 8 on every projection) within {STEP_RATIO}x of the "
            f"base's forward and backward ({batch} x {length} tokens)",
            paired_ratio(stats[lora], stats[plain]),
            STEP_RATIO,
            False,
            "LoRA step time / base step time, median of per-round ratios",
        )
    )
    group.notes.append(
        "The model: examples/llama.py's Llama at the example's size (see the decoding group), "
        "float32, random; the loss is the mean squared logits."
    )
    group.seconds = time.perf_counter() - start
    return group
