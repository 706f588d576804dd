"""The networks of the training-step benchmark: an MLP and a small transformer.

The forward passes are written once, as plain functions over objects whose linear
layers are callable and whose other parameters support ``p[...]`` (JAX arrays and
NNX Variables both do); each system supplies its own module classes holding the
same parameter tree. Taktiny has only ``nn.Linear`` for now, so layer norm,
attention and the embedding lookup are plain JAX here.
"""

from __future__ import annotations

import itertools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

from taktiny import nn

HEADS = 4


def mlp_fields(sizes: list[int], linear: Any) -> dict[str, Any]:
    """The MLP's fields: ``layers``, a list of linear layers between `sizes`."""
    return {"layers": [linear(a, b) for a, b in itertools.pairwise(sizes)]}


def mlp(model: Any, x: jax.Array) -> jax.Array:
    """ReLU between the linear layers."""
    *hidden, last = model.layers
    for layer in hidden:
        x = jax.nn.relu(layer(x))
    return last(x)


def block_fields(d: int, hidden: int, linear: Any, param: Any) -> dict[str, Any]:
    """One pre-norm transformer block's fields."""
    return {
        "ln1_scale": param(jnp.ones((d,))),
        "ln1_bias": param(jnp.zeros((d,))),
        "query": linear(d, d),
        "key": linear(d, d),
        "value": linear(d, d),
        "out": linear(d, d),
        "ln2_scale": param(jnp.ones((d,))),
        "ln2_bias": param(jnp.zeros((d,))),
        "up": linear(d, hidden),
        "down": linear(hidden, d),
    }


def transformer_fields(
    vocab: int, seq: int, d: int, hidden: int, depth: int, *, linear: Any, param: Any, block: Any
) -> dict[str, Any]:
    """The transformer's fields: embeddings, `depth` blocks, final norm and output head."""
    key = jax.random.key(depth)
    return {
        "embed": param(jax.random.normal(key, (vocab, d)) * 0.02),
        "pos": param(jax.random.normal(jax.random.fold_in(key, 1), (seq, d)) * 0.02),
        "blocks": [block(d, hidden) for _ in range(depth)],
        "ln_scale": param(jnp.ones((d,))),
        "ln_bias": param(jnp.zeros((d,))),
        "head": linear(d, vocab),
    }


def _norm(scale: Any, bias: Any, x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale[...] + bias[...]


def _attention(b: Any, x: jax.Array) -> jax.Array:
    batch, t, d = x.shape
    q, k, v = (f(x).reshape(batch, t, HEADS, d // HEADS) for f in (b.query, b.key, b.value))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * (d // HEADS) ** -0.5
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    mixed = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v)
    return b.out(mixed.reshape(batch, t, d))


def transformer(model: Any, tokens: jax.Array) -> jax.Array:
    """Causal next-token logits ``[batch, seq, vocab]``."""
    x = model.embed[...][tokens] + model.pos[...][: tokens.shape[1]]
    for b in model.blocks:
        x = x + _attention(b, _norm(b.ln1_scale, b.ln1_bias, x))
        x = x + b.down(jax.nn.gelu(b.up(_norm(b.ln2_scale, b.ln2_bias, x))))
    return model.head(_norm(model.ln_scale, model.ln_bias, x))


def loss(net: str, model: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean squared error (MLP) or next-token cross-entropy (transformer)."""
    x, y = batch
    if net == "mlp":
        return jnp.mean(jnp.square(mlp(model, x) - y))
    logp = jax.nn.log_softmax(transformer(model, x)[:, :-1], -1)
    return -jnp.mean(jnp.take_along_axis(logp, x[:, 1:, None], -1))


# --- each system's classes: same fields, its own module machinery -----------------------


class TaktinyNet(nn.Module):
    def __init__(self, fields: dict[str, Any]):
        for name, value in fields.items():
            setattr(self, name, value)


class NNXNet(nnx.Module):
    def __init__(self, fields: dict[str, Any]):
        for name, value in fields.items():
            setattr(self, name, value)


class EqxLinear(eqx.Module):
    kernel: jax.Array
    bias: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel + self.bias


class EqxMLP(eqx.Module):
    layers: list[EqxLinear]


class EqxBlock(eqx.Module):
    ln1_scale: jax.Array
    ln1_bias: jax.Array
    query: EqxLinear
    key: EqxLinear
    value: EqxLinear
    out: EqxLinear
    ln2_scale: jax.Array
    ln2_bias: jax.Array
    up: EqxLinear
    down: EqxLinear


class EqxTransformer(eqx.Module):
    embed: jax.Array
    pos: jax.Array
    blocks: list[EqxBlock]
    ln_scale: jax.Array
    ln_bias: jax.Array
    head: EqxLinear


def _nnx_lists(fields: dict[str, Any]) -> dict[str, Any]:
    """NNX wants lists of modules as ``nnx.List``."""
    return {k: nnx.List(v) if isinstance(v, list) else v for k, v in fields.items()}


_EQX = {"mlp": EqxMLP, "block": EqxBlock, "transformer": EqxTransformer}


def build(system: str, net: str, sizes: dict[str, Any]) -> Any:
    """`system`'s ("taktiny", "nnx" or "equinox") `net` ("mlp" or "transformer")."""
    if system == "taktiny":
        rngs = nn.Rngs(0)
        linear = lambda a, b: nn.Linear(a, b, rngs=rngs)
        param, node = (lambda x: x), lambda kind, fields: TaktinyNet(fields)
    elif system == "nnx":
        nrngs = nnx.Rngs(0)
        linear = lambda a, b: nnx.Linear(a, b, rngs=nrngs)
        param, node = nnx.Param, lambda kind, fields: NNXNet(_nnx_lists(fields))
    elif system == "equinox":
        keys = (jax.random.key(i) for i in itertools.count())
        init = jax.nn.initializers.lecun_normal()
        linear = lambda a, b: EqxLinear(init(next(keys), (a, b)), jnp.zeros((b,)))
        param, node = (lambda x: x), lambda kind, fields: _EQX[kind](**fields)
    else:
        raise ValueError(f"unknown system {system!r}")
    if net == "mlp":
        return node("mlp", mlp_fields(sizes["mlp"], linear))
    block = lambda d, hidden: node("block", block_fields(d, hidden, linear, param))
    return node(
        "transformer",
        transformer_fields(**sizes["transformer"], linear=linear, param=param, block=block),
    )
