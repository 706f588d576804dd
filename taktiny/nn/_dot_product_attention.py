"""The attention itself, on heads: ``[B, length, heads, head_dim]`` layouts, grouped
key/value heads, masks, dropout and precision. `MultiHeadAttention` projects around it."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from ..quant import QArray
from ._explicit import explicit_axes, merged, typed_spec
from ._layer_checks import check_features
from ._random import keep_mask

# Compiled as one unit, so that calls outside jax.jit compile once per shape instead of
# once per operation inside it; inside jax.jit it is simply inlined.
_dot_product_attention = jax.jit(jax.nn.dot_product_attention, static_argnames=("is_causal",))


def split_heads(x: jax.Array, heads: int, kv_heads: int, *, whole_time: bool) -> jax.Array:
    """``[*batch, t, f]`` to ``[B, t, heads, f / heads]``. Under Explicit axes the batch
    axes' splits are merged, and the heads are split as the features were when the mesh
    axes divide the number of key/value heads `kv_heads` (and so the number of query heads;
    unsplit otherwise), so that query heads group with their key/value head on a device.
    The time axis keeps its split (queries: each device attends from its own positions),
    or with `whole_time` (keys and values, which every query reads) is gathered whole."""
    shape = (-1, x.shape[-2], heads, x.shape[-1] // heads)
    if not explicit_axes():
        return x.reshape(shape)
    *batch, time, features = typed_spec(x)
    names = features if isinstance(features, tuple) else (features,)
    parts = math.prod(jax.sharding.get_abstract_mesh().shape[n] for n in names if n)
    split = features if kv_heads % parts == 0 else None
    time = None if whole_time else time
    return x.reshape(shape, out_sharding=P(merged(batch), time, split, None))


def check_inputs(
    layer: str,
    query: jax.Array | QArray,
    key: jax.Array | QArray,
    inputs_q: jax.Array,
    inputs_kv: jax.Array,
) -> None:
    """Raises a ValueError naming `layer` when the inputs do not fit the `query` and `key`
    kernels (float, or quantized: only their shapes are read), or have different batch
    axes."""
    for x, name, kernel, argument in (
        (inputs_q, "query", query, "in_features"),
        (inputs_kv, "key", key, "kv_features"),
    ):
        why = f"its {name} kernel is {tuple(kernel.shape)}"
        check_features(layer, x, kernel.shape[0], why=why, argument=argument)
    if inputs_q.ndim < 2 or inputs_kv.shape[:-2] != inputs_q.shape[:-2]:
        raise ValueError(
            f"{layer} expects inputs_q [*batch, q_length, features] and inputs_kv "
            f"[*batch, kv_length, features] with the same batch axes, got shapes "
            f"{tuple(inputs_q.shape)} and {tuple(inputs_kv.shape)}."
        )


def fold_mask(
    layer: str, mask: Any, batch: tuple[int, ...], heads: int, q: int, k: int
) -> jax.Array:
    """Checks `mask` against [*batch, heads, q, k] and folds its batch axes into one."""
    target = (*batch, heads, q, k)
    ok = mask.dtype == jnp.bool_ and mask.ndim <= len(target)
    ok = ok and all(m in (1, t) for m, t in zip(mask.shape[::-1], target[::-1], strict=False))
    if not ok:
        raise ValueError(
            f"{layer}'s mask must be booleans broadcastable to [*batch, num_heads, "
            f"q_length, kv_length] = {list(target)}, got {mask.dtype}{list(mask.shape)}. "
            f"True means 'may attend'; for a padding mask `valid` [*batch, kv_length] "
            f"pass valid[..., None, None, :]."
        )
    mask = mask.reshape((1,) * (len(target) - mask.ndim) + mask.shape)
    if len(batch) != 1:
        mask = jnp.broadcast_to(mask, (*batch, *mask.shape[len(batch) :]))
        mask = mask.reshape(-1, *mask.shape[len(batch) :])
    return mask


def attend(
    q: Float[Array, "B t heads d"],
    k: Float[Array, "B s kv_heads d"],
    v: Float[Array, "B s kv_heads d"],
    mask: Bool[Array, "#B #heads #t #s"] | None,
    causal: bool,
    *,
    precision: jax.lax.PrecisionLike,
    dropout_rate: float,
    key: Any,
) -> Float[Array, "B t heads d"]:
    """Attention of `q` ``[B, t, heads, d]`` to `k` and `v` ``[B, s, kv_heads, d]``, `mask`
    ``[B | 1, heads | 1, t | 1, s | 1]`` (True: may attend) and `causal` (query ``i`` sees
    keys up to ``i``), its products at `precision`: ``jax.nn.dot_product_attention``, or,
    for dropout (a `key` and a rate) or a precision other than one ``jax.lax.Precision``
    (a pair, a dot algorithm), the same written out."""
    dropout = (dropout_rate, key) if key is not None and dropout_rate > 0.0 else None
    one = precision is None or isinstance(precision, jax.lax.Precision)
    if dropout is not None or not one:
        return _written_out(q, k, v, mask, causal, precision, dropout)
    # jax.nn.dot_product_attention takes no precision: the scoped default reaches its
    # products (the tests read it in the jaxpr)
    scope = contextlib.nullcontext()
    if isinstance(precision, jax.lax.Precision):
        scope = jax.default_matmul_precision(precision.name.lower())
    # it promotes low-precision inputs against float32 internally, which
    # jax_numpy_dtype_promotion="strict" would reject
    with scope, jax.numpy_dtype_promotion("standard"):
        return _dot_product_attention(q, k, v, mask=mask, is_causal=causal)


def _written_out(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    causal: bool,
    precision: jax.lax.PrecisionLike,
    dropout: tuple[float, Any] | None,
) -> jax.Array:
    """Grouped, masked and scaled as ``jax.nn.dot_product_attention`` does it, with the
    products at `precision`, logits and softmax in float32 and, with `dropout` (its rate
    and key), dropout on the weights."""
    b, t, heads, d = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    grouped = (b, t, kv_heads, heads // kv_heads, d)  # query head h = k * groups + g
    q = _reshape(q, grouped)
    logits = jnp.einsum(
        "btkgd,bskd->bkgts", q, k, precision=precision, preferred_element_type=jnp.float32
    )
    logits = logits * jnp.float32(d**-0.5)
    allowed = jnp.ones((1, 1, 1, t, s), jnp.bool_)
    if mask is not None:
        heads_axes = grouped[2:4] if mask.shape[1] == heads else (1, 1)
        allowed = allowed & mask.reshape(mask.shape[0], *heads_axes, *mask.shape[2:])
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((t, s), jnp.bool_))
    logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    if dropout is not None:
        rate, key = dropout
        keep = keep_mask(key, rate, weights.shape)
        weights = jnp.where(keep, weights / jnp.asarray(1.0 - rate, weights.dtype), 0)
    y = jnp.einsum("bkgts,bskd->btkgd", weights, v, precision=precision)
    return _reshape(y, (b, t, heads, d))


def _reshape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """`x` reshaped where only its third axis (the heads) splits or merges; under Explicit
    axes the first axes keep their splits, and the heads' goes to the first new axis."""
    if not explicit_axes():
        return x.reshape(shape)
    spec = typed_spec(x)
    return x.reshape(shape, out_sharding=P(*spec[:3], *(None,) * (len(shape) - 3)))
