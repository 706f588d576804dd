"""Decoding: the Llama of ``examples/llama.py`` against the same model in plain JAX, and a
cached decoding step against a full forward.

The model is the example's own classes (imported from ``examples/``) at the example's size
(vocab 128, width 64, MLP 176, 2 layers, 4 query heads sharing 2 key/value heads, its own
``lm_head``), float32, randomly initialised.

- Forward: ``jax.jit(lambda model, ids: model(ids))`` over a batch of token ids, against
  ``jax.jit(plain_forward)`` on the model's flat state dict: the same computation written in
  ``jax.numpy`` on the same arrays (embedding gather, RMSNorm, rotary embeddings, grouped
  attention through ``jax.nn.dot_product_attention``, SwiGLU, the head), checked equal to
  the model's logits first. Interleaved rounds; the ratio is the median of per-round ratios.
- Decoding step: one token through ``model(token, caches=caches)`` (jitted), the caches
  (max_length 256) filled to 128 positions by a prefill, against a full forward over 128
  tokens, same batch. Every call takes the same filled caches and returns the next ones.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._results import Config, Group, Table, Target
from ._timing import compare, paired_ratio

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:  # the examples are scripts, not a package
    sys.path.insert(0, str(EXAMPLES))

import llama  # noqa: E402  # pyright: ignore[reportMissingImports]

PLAIN_RATIO, STEP_SHARE = 1.1, 0.25  # the targets of issue 14


def plain_forward(w: dict[str, jax.Array], ids: jax.Array, config: Any) -> jax.Array:
    """The Llama forward in plain ``jax.numpy``, on a flat dict of the model's arrays (the
    names of ``Llama.flat_state_dict()``): token ids [batch, length] -> logits."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    width, eps = config.hidden_size, config.rms_norm_eps
    d, (b, t) = width // heads, ids.shape

    def rms(x: jax.Array, scale: jax.Array) -> jax.Array:
        return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps) * scale

    parsed = llama.models.DecoderConfig.from_hf(config.to_dict())  # (the model's own reading)
    scaling = None if parsed.rope_scaling is None else dict(parsed.rope_scaling)
    rotary = llama.nn.RotaryEmbedding(d, theta=parsed.rope_theta, scaling=scaling)
    inv_freq = rotary.inv_freq()  # (Llama 3.1's scaled frequencies: a constant)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq  # [t, d / 2]
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]  # [t, 1, d / 2]

    def rope(x: jax.Array) -> jax.Array:  # [b, t, heads, d]: the halves turn in pairs
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    x = w["embed.embedding"][ids]
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        h = rms(x, w[p + "attention_norm.scale"])
        q = rope((h @ w[p + "attention.query.kernel"]).reshape(b, t, heads, d))
        k = rope((h @ w[p + "attention.key.kernel"]).reshape(b, t, kv_heads, d))
        v = (h @ w[p + "attention.value.kernel"]).reshape(b, t, kv_heads, d)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + a.reshape(b, t, width) @ w[p + "attention.out.kernel"]
        h = rms(x, w[p + "mlp_norm.scale"])
        gated = jax.nn.silu(h @ w[p + "mlp.gate.kernel"]) * (h @ w[p + "mlp.up.kernel"])
        x = x + gated @ w[p + "mlp.down.kernel"]
    return rms(x, w["norm.scale"]) @ w["lm_head.kernel"]


def run(config: Config) -> Group:
    """Times the forward against plain JAX and the cached step against the forward."""
    start = time.perf_counter()
    group = Group("decoding", "Decoding with the Llama example")
    batch, length, max_length = config.pick((8, 128, 256), (8, 128, 256), (2, 8, 16))
    llama_config = llama.llama_config(tied=False)
    model = llama.Llama(llama_config, rngs=llama.nn.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (batch, length)), jnp.int32)

    forward = jax.jit(lambda model, ids: model(ids))
    plain = jax.jit(lambda w, ids: plain_forward(w, ids, llama_config))
    flat = model.flat_state_dict()
    ours, theirs = np.asarray(forward(model, ids)), np.asarray(plain(flat, ids))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)  # the same computation

    stats = compare(
        {
            "Taktiny": lambda: forward(model, ids).block_until_ready(),
            "plain JAX": lambda: plain(flat, ids).block_until_ready(),
        },
        repeat=config.repeat,
        warmup=2,
    )
    op = f"forward, {batch} x {length} tokens"
    table = Table(
        f"Llama forward (jitted), batch {batch} x {length} tokens", ["Taktiny", "plain JAX"]
    )
    calls = {
        "Taktiny": "jax.jit(lambda model, ids: model(ids))(model, ids)",
        "plain JAX": "jax.jit(plain_forward)(model.flat_state_dict(), ids)",
    }
    for system, st in stats.items():
        table.add(op, system, calls[system], st.median, (st.low, st.high))
    group.tables.append(table)
    group.targets.append(
        Target(
            f"Llama example forward within {PLAIN_RATIO}x of the same model in plain JAX "
            f"({batch} x {length} tokens)",
            paired_ratio(stats["Taktiny"], stats["plain JAX"]),
            PLAIN_RATIO,
            False,
            "Taktiny time / plain JAX time, median of per-round ratios",
        )
    )

    prefill = jax.jit(lambda model, ids, caches: model(ids, caches=caches))
    _, caches = prefill(model, ids, model.init_caches(batch, max_length))  # filled to `length`
    step = jax.jit(lambda model, token, caches: model(token, caches=caches))
    token = ids[:, -1:]
    full, one = "full forward", "one cached step"
    stats = compare(
        {
            full: lambda: forward(model, ids).block_until_ready(),
            one: lambda: jax.block_until_ready(step(model, token, caches)),
        },
        repeat=config.repeat,
        warmup=2,
    )
    op = f"batch {batch}, cache {max_length} filled to {length}"
    steps = Table("Cached decoding step against a full forward", [full, one], reference=full)
    steps.add(op, full, f"forward(model, ids), ids [{batch}, {length}]", stats[full].median,
              (stats[full].low, stats[full].high))  # fmt: skip
    steps.add(op, one, "jax.jit(lambda model, token, caches: model(token, caches=caches))",
              stats[one].median, (stats[one].low, stats[one].high))  # fmt: skip
    group.tables.append(steps)
    group.targets.append(
        Target(
            f"one cached decoding step under {STEP_SHARE}x a full forward over {length} tokens "
            f"(batch {batch}, cache of {max_length})",
            paired_ratio(stats[one], stats[full]),
            STEP_SHARE,
            False,
            "step time / full forward time, median of per-round ratios",
        )
    )
    group.notes += [
        f"The model: examples/llama.py's Llama at the example's size (vocab "
        f"{llama_config.vocab_size}, width {llama_config.hidden_size}, MLP "
        f"{llama_config.intermediate_size}, {llama_config.num_hidden_layers} layers, "
        f"{llama_config.num_attention_heads} query heads sharing "
        f"{llama_config.num_key_value_heads} key/value heads, untied head), float32, random.",
        "plain_forward (bench/decoding.py) is the same computation in jax.numpy on the model's "
        "flat state dict; the run checks its logits equal the model's before timing.",
        "The cached step returns the logits and the advanced caches (not donated): every call "
        "starts from the same caches, filled by one prefill.",
    ]
    group.seconds = time.perf_counter() - start
    return group
