"""`KVCache`: the keys and values an attention layer has seen, kept for decoding token by
token, preallocated so that every decoding step has the same shapes (and compiles once)."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from ..arrays import Spec
from ..module import Module
from ._explicit import explicit_axes, typed_spec
from ._random import constant


class KVCache(Module):
    """The keys and values of one attention layer for a batch of sequences being decoded.

    A plain module (a PyTree): pass it into and out of ``jax.jit``; its arrays are its
    state (``keys``, ``values``, ``length``), so it saves and loads as any module does. Make
    one with :meth:`MultiHeadAttention.init_cache`; calling the layer with ``cache=``
    returns the next one.

    Attributes:
        keys: ``[batch, max_length, num_kv_heads, head_dim]``; positions ``0`` to
            ``length - 1`` hold the keys seen so far (rotated, when the layer has rotary
            embeddings), the rest zeros.
        values: ``[batch, max_length, num_kv_heads, head_dim]``, likewise.
        length: an int32 scalar: how many positions are filled, the same for every
            sequence of the batch (pad prompts to one length, and mask the padding).

    Decoding compiles one step for the prompt's shape and one for a single token::

        step = jax.jit(lambda layer, x, cache: layer(x, causal=True, cache=cache))
        cache = layer.init_cache(batch, max_length)
        y, cache = step(layer, prompt, cache)  # prompt [batch, prompt_length, features]
        y, cache = step(layer, token, cache)  # token [batch, 1, features], and so on
    """

    keys: Float[Array, "batch max_length kv_heads head_dim"]
    values: Float[Array, "batch max_length kv_heads head_dim"]
    length: Int[Array, ""]

    @property
    def max_length(self) -> int:
        """How many positions the cache holds in all."""
        return self.keys.shape[1]


def empty_cache(
    layer: str,
    batch: int,
    max_length: int,
    kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype,
    sharding: Spec | None,
) -> KVCache:
    """An empty cache (zeros, length 0) for `layer` (named in errors), its keys and values
    split by `sharding` on the ambient mesh."""
    for name, value in (("batch", batch), ("max_length", max_length)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{layer}.init_cache's {name} must be a positive int, got {value!r}.")
    shape = (batch, max_length, kv_heads, head_dim)
    keys, values = (constant(0, shape, dtype, sharding, f"KVCache.{n}") for n in ("keys", "values"))
    return KVCache(keys=keys, values=values, length=jnp.zeros((), jnp.int32))


def check_cache(
    layer: str,
    cache: KVCache,
    batch: tuple[int, ...],
    q_length: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    """Raises a ValueError naming `layer` when `cache` does not fit inputs of batch axes
    `batch` and `q_length` tokens (a static check: shapes only)."""
    if not isinstance(cache, KVCache):
        raise ValueError(
            f"{layer}'s cache must be a KVCache made by layer.init_cache(batch, max_length), "
            f"got {type(cache).__name__}."
        )
    keys, values, length = cache.keys, cache.values, cache.length
    size = math.prod(batch)
    want = [size, "max_length", kv_heads, head_dim]
    fits = keys.ndim == 4 and [keys.shape[0], *keys.shape[2:]] == [size, kv_heads, head_dim]
    if not fits or values.shape != keys.shape or jnp.shape(length) != ():
        raise ValueError(
            f"{layer}'s cache must hold keys and values of shape [batch, max_length, "
            f"num_kv_heads, head_dim] = {want} (batch: the product of the input's batch "
            f"axes {list(batch)}) and a scalar length, got keys {list(keys.shape)}, values "
            f"{list(values.shape)} and length {list(jnp.shape(length))}. Make the cache with "
            f"this layer's init_cache({size}, max_length)."
        )
    if q_length > cache.max_length:
        raise ValueError(
            f"{layer}'s cache holds max_length={cache.max_length} positions, fewer than the "
            f"{q_length} tokens of this input (its q_length); make a longer cache with "
            f"init_cache({size}, max_length) where max_length is at least {q_length} plus "
            f"the tokens to be generated."
        )


def write(layer: str, cache: KVCache, keys: jax.Array, values: jax.Array) -> KVCache:
    """`cache` with `keys` and `values` ``[batch, q_length, kv_heads, head_dim]`` written at
    its length, and its length advanced by ``q_length``. Writing past the end raises at
    run time, under ``jax.jit`` too (the length is traced)."""
    q_length = keys.shape[1]
    # checked on the length, a scalar, so that the keys never pass through the check's
    # callback (which runs on one device)
    length = eqx.error_if(
        cache.length,
        cache.length + q_length > cache.max_length,
        f"{layer}'s cache is full: writing {q_length} more token(s) at its length would pass "
        f"its max_length={cache.max_length}. Make a longer cache with init_cache(batch, "
        f"max_length), or start the sequences again from an empty one.",
    )
    zero = jnp.zeros((), length.dtype)  # a Python 0 is int64 under x64: the indices must match
    new = []
    for old, update in ((cache.keys, keys), (cache.values, values)):
        update = update.astype(old.dtype)
        if explicit_axes():  # written split as the cache is
            update = jax.sharding.reshard(update, P(*typed_spec(old)))
        new.append(jax.lax.dynamic_update_slice(old, update, (zero, length, zero, zero)))
    return KVCache(keys=new[0], values=new[1], length=length + q_length)


def visible(
    length: Int[Array, ""], q_length: int, max_length: int, causal: bool
) -> Bool[Array, "1 1 q s"]:
    """Which of a cache's `max_length` positions each of `q_length` new queries sees, after
    they were written at `length`: ``[1, 1, q_length, max_length]`` (``q_length`` 1 when not
    causal). Query ``i`` sits at position ``length + i``; causally it sees positions up to
    its own, otherwise every filled one (below ``length + q_length``)."""
    slots = jnp.arange(max_length, dtype=jnp.int32)
    if causal:
        last = length + jnp.arange(q_length, dtype=jnp.int32)[:, None]
        return (slots <= last)[None, None]
    return (slots < length + q_length)[None, None, None]
