"""`MultiHeadAttention`: scaled dot-product attention with learned projections, grouped
key/value heads, rotary position embeddings and a decoding cache."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int

from ..arrays import Spec, placement
from ..module import Module, Rngs
from ._cache import KVCache, check_cache, empty_cache, visible, write
from ._dot_product_attention import attend, check_inputs, fold_mask, split_heads
from ._explicit import explicit_axes, typed_spec
from ._layer_checks import divisors
from ._linear import Linear
from ._norm import RMSNorm
from ._precision import DTYPE, PRECISION, compute_dtype, static_dtype, static_precision
from ._rotary import RotaryEmbedding, fold_positions

_NAME = "MultiHeadAttention"
Output = Float[Array, "*batch q_length out_features"]


class MultiHeadAttention(Module):
    """Multi-head attention: project, attend per head, concatenate the heads, project.

    With ``num_heads`` heads of ``head_dim = qkv_features // num_heads``, the query
    projection produces ``qkv_features`` features and the key and value projections
    ``num_kv_heads * head_dim``, split into heads as consecutive blocks of ``head_dim``
    (head ``h`` uses features ``h * head_dim`` to ``(h + 1) * head_dim``), as PyTorch and
    Hugging Face models do, so converting their weights needs no reordering. With fewer
    key/value heads than query heads (grouped-query attention; multi-query with one),
    query head ``h`` attends with key/value head ``h // (num_heads // num_kv_heads)``, as
    Hugging Face's ``repeat_kv`` pairs them; no repeated weights are stored. Attention
    weights are ``softmax(q @ k.T / sqrt(head_dim))`` per head, logits and softmax in
    float32 (at least).

    The four projections are plain :class:`Linear` layers. Their state names follow,
    with the names they convert from in PyTorch's ``nn.MultiheadAttention`` and in
    Hugging Face's Llama (``model.layers.{i}.self_attn``); every PyTorch weight
    ``[out, in]`` is transposed. Kernels are LeCun-normal, biases zeros (absent with
    ``use_bias=False``, as Llama's ``attention_bias=False``; Qwen2's query, key and value
    projections have biases and its output projection none: ``use_out_bias=False``).
    With ``qk_norm_epsilon`` each query and key head is RMS-normalised over its
    ``head_dim`` features before the rotary embeddings, as Qwen3's ``q_norm`` and
    ``k_norm`` do.

    Attributes:
        query: ``kernel [in_features, qkv_features]``, ``bias [qkv_features]``; torch
            ``in_proj_weight`` / ``in_proj_bias`` rows ``0:E``; Llama ``q_proj``.
        key: ``kernel [kv_features, num_kv_heads * head_dim]``, ``bias``; torch rows
            ``E:2E``; Llama ``k_proj``.
        value: ``kernel [kv_features, num_kv_heads * head_dim]``, ``bias``; torch rows
            ``2E:3E``; Llama ``v_proj``.
        out: ``kernel [qkv_features, out_features]``, ``bias [out_features]``; torch
            ``out_proj``; Llama ``o_proj``.
        query_norm: an :class:`RMSNorm` of ``scale [head_dim]`` shared by the query
            heads with ``qk_norm_epsilon``, else None; Qwen3 ``q_norm``.
        key_norm: the same for the key heads; Qwen3 ``k_norm``.
        rotary: a :class:`RotaryEmbedding` when ``rope_theta`` is given, else None. It
            has no parameters (Hugging Face keeps its rotary ``inv_freq`` out of
            checkpoints too).

    Args:
        num_heads: the number of query heads; must divide ``qkv_features``.
        in_features: features of the queries' input (and, by default, of the keys').
        qkv_features: total features of the queries across heads (default
            ``in_features``; Llama's ``num_attention_heads * head_dim``).
        out_features: features of the output (default ``in_features``).
        kv_features: features of the key/value input in cross-attention (default
            ``in_features``; PyTorch's ``kdim``/``vdim`` when they are equal).
        num_kv_heads: the number of key/value heads (default ``num_heads``); must divide
            ``num_heads``. Llama's ``num_key_value_heads``.
        rope_theta: rotary position embeddings with this base (Llama's ``rope_theta``)
            on queries and keys; None (the default) for none.
        rope_scaling: their scaling, as Hugging Face's ``rope_parameters`` (or
            ``rope_scaling``) dict gives it: "linear", "dynamic", "llama3" or "yarn" (see
            :class:`RotaryEmbedding`); None for none.
        use_bias: whether the four projections have biases.
        use_out_bias: whether the output projection has a bias; None (the default) as
            `use_bias` says.
        qk_norm_epsilon: RMS-normalise each query and key head before the rotary
            embeddings (:class:`RMSNorm`, with this epsilon: Qwen3's ``rms_norm_eps``);
            None (the default) for no such norm.
        dropout_rate: the dropout applied to attention weights when a ``key`` is given.
        dtype: the dtype the layer computes in and returns; None (the default) computes
            in the parameters' dtype.
        param_dtype: the dtype the parameters are created and stored in.
        precision: the precision of the four projections and of the attention's
            products (``"highest"`` for full float32 on GPUs and TPUs); None uses JAX's
            default, which is TF32 for float32 on recent NVIDIA GPUs.
        query_kernel_sharding: how ``query.kernel`` is split over the mesh of an
            enclosing ``jax.set_mesh``, as :class:`Linear`'s ``kernel_sharding``:
            ``(None, "model")`` splits the heads (with numbers of query and key/value
            heads the mesh axis divides, each device holds whole heads). Ignored without
            a mesh.
        query_bias_sharding: the same for ``query.bias`` (``("model",)``).
        key_kernel_sharding: the same for ``key.kernel``.
        key_bias_sharding: the same for ``key.bias``.
        value_kernel_sharding: the same for ``value.kernel``.
        value_bias_sharding: the same for ``value.bias``.
        out_kernel_sharding: the same for ``out.kernel``; ``("model", None)`` splits
            its inputs, the heads.
        out_bias_sharding: the same for ``out.bias``.
        rngs: the key stream for the initialisation.

    Raises:
        ValueError: `num_heads` does not divide `qkv_features`, `num_kv_heads` does not
            divide `num_heads`, `dropout_rate` is outside ``[0, 1)``, `rope_scaling` comes
            without `rope_theta`, or a sharding does not fit its parameter.
    """

    query: Linear
    key: Linear
    value: Linear
    out: Linear
    query_norm: RMSNorm | None
    key_norm: RMSNorm | None
    rotary: RotaryEmbedding | None
    num_heads: int
    num_kv_heads: int
    dropout_rate: float
    dtype: jnp.dtype | None = DTYPE
    precision: jax.lax.PrecisionLike = PRECISION

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        *,
        qkv_features: int | None = None,
        out_features: int | None = None,
        kv_features: int | None = None,
        num_kv_heads: int | None = None,
        rope_theta: float | None = None,
        rope_scaling: Mapping[str, Any] | None = None,
        use_bias: bool = True,
        use_out_bias: bool | None = None,
        qk_norm_epsilon: float | None = None,
        dropout_rate: float = 0.0,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        query_kernel_sharding: Spec | None = None,
        query_bias_sharding: Spec | None = None,
        key_kernel_sharding: Spec | None = None,
        key_bias_sharding: Spec | None = None,
        value_kernel_sharding: Spec | None = None,
        value_bias_sharding: Spec | None = None,
        out_kernel_sharding: Spec | None = None,
        out_bias_sharding: Spec | None = None,
        rngs: Rngs,
    ):
        precision = static_precision(precision, _NAME)  # checked first: the error names us
        qkv = in_features if qkv_features is None else qkv_features
        if num_heads < 1 or qkv % num_heads:
            raise ValueError(
                f"{_NAME}'s num_heads ({num_heads}) must divide qkv_features ({qkv}) into "
                f"heads of equal size; change one of them."
            )
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if kv_heads < 1 or num_heads % kv_heads:
            raise ValueError(
                f"{_NAME}'s num_kv_heads ({kv_heads}) must be at least 1 and divide num_heads "
                f"({num_heads}), so that each key/value head serves the same number of query "
                f"heads; pass one of {divisors(num_heads)}."
            )
        if not 0.0 <= dropout_rate < 1.0:
            raise ValueError(f"{_NAME}'s dropout_rate must be in [0, 1), got {dropout_rate!r}.")
        head_dim = qkv // num_heads
        kv, kv_out = in_features if kv_features is None else kv_features, kv_heads * head_dim
        out = in_features if out_features is None else out_features
        out_bias = use_bias if use_out_bias is None else use_out_bias
        shardings = {
            "query": (in_features, qkv, query_kernel_sharding, query_bias_sharding, use_bias),
            "key": (kv, kv_out, key_kernel_sharding, key_bias_sharding, use_bias),
            "value": (kv, kv_out, value_kernel_sharding, value_bias_sharding, use_bias),
            "out": (qkv, out, out_kernel_sharding, out_bias_sharding, out_bias),
        }
        for name, (n_in, n_out, kernel, bias, biased) in shardings.items():
            # checked here first, so that an error names the projection
            placement(kernel, (n_in, n_out), f"{_NAME}.{name}.kernel")
            placement(bias if biased else None, (n_out,), f"{_NAME}.{name}.bias")
        self.query, self.key, self.value, self.out = (
            Linear(
                n_in,
                n_out,
                use_bias=biased,
                dtype=dtype,
                param_dtype=param_dtype,
                precision=precision,
                kernel_sharding=kernel,
                bias_sharding=bias,
                rngs=rngs,
            )
            for n_in, n_out, kernel, bias, biased in shardings.values()
        )
        self.query_norm = self.key_norm = None
        if qk_norm_epsilon is not None:
            eps = qk_norm_epsilon
            self.query_norm = RMSNorm(head_dim, epsilon=eps, dtype=dtype, param_dtype=param_dtype)
            self.key_norm = RMSNorm(head_dim, epsilon=eps, dtype=dtype, param_dtype=param_dtype)
        if rope_scaling is not None and rope_theta is None:
            raise ValueError(
                f"{_NAME} got rope_scaling without rope_theta: scaling stretches rotary "
                f"embeddings, so pass rope_theta too (Hugging Face's rope_theta, 10000.0 by "
                f"default)."
            )
        self.rotary = (
            None
            if rope_theta is None
            else RotaryEmbedding(head_dim, theta=rope_theta, scaling=rope_scaling)
        )
        self.num_heads, self.num_kv_heads = num_heads, kv_heads
        self.dropout_rate = dropout_rate
        self.dtype, self.precision = static_dtype(dtype), precision

    @property
    def head_dim(self) -> int:
        """The features of each head: ``qkv_features // num_heads``."""
        return self.query.kernel.shape[1] // self.num_heads

    def init_cache(
        self,
        batch: int,
        max_length: int,
        *,
        dtype: DTypeLike | None = None,
        sharding: Spec | None = None,
    ) -> KVCache:
        """An empty :class:`KVCache` for `batch` sequences of up to `max_length` tokens
        (prompt and generated tokens together).

        Args:
            batch: the number of sequences: for inputs with several batch axes, their
                product; for an unbatched input, 1.
            max_length: the positions the cache holds.
            dtype: the dtype of the keys and values; None (the default) is the dtype the
                layer computes in.
            sharding: under ``jax.set_mesh``, how the keys and values are split, as a
                parameter's sharding argument (``("data", None, "model", None)``:
                sequences and heads); the new keys are written split so.

        Returns:
            A cache of length 0, its keys and values zeros ``[batch, max_length,
            num_kv_heads, head_dim]``.

        Raises:
            ValueError: `batch` or `max_length` is not a positive int.
        """
        dtype = compute_dtype(self.dtype, self.query.kernel) if dtype is None else dtype
        kv_heads, head_dim = self.num_kv_heads, self.head_dim
        return empty_cache(_NAME, batch, max_length, kv_heads, head_dim, jnp.dtype(dtype), sharding)

    def __call__(
        self,
        inputs_q: Float[Array, "*batch q_length in_features"],
        inputs_kv: Float[Array, "*batch kv_length kv_features"] | None = None,
        *,
        mask: Bool[Array, "..."] | None = None,
        causal: bool = False,
        positions: Int[Array, "*#batch q_length"] | None = None,
        cache: KVCache | None = None,
        key: Any = None,
    ) -> Output | tuple[Output, KVCache]:
        """Attends from ``inputs_q`` to ``inputs_kv`` (to ``inputs_q`` itself when None).

        Args:
            inputs_q: ``[*batch, q_length, in_features]``.
            inputs_kv: ``[*batch, kv_length, kv_features]``, or None for self-attention
                (which rotary embeddings and a cache require).
            mask: booleans broadcastable to ``[*batch, num_heads, q_length, kv_length]``
                (with a cache, ``kv_length`` is its ``max_length``: the mask covers every
                position of the cache, the filled ones and those to come); True lets a
                query attend to a key (the opposite of PyTorch's boolean ``attn_mask``).
                A padding mask over keys is ``valid[..., None, None, :]``, ``valid``
                ``[*batch, kv_length]``; it combines with ``causal``. A query that may
                attend to nothing gets the mean of the values rather than NaN.
            causal: also forbid a query to attend to keys after its own position.
            positions: integer position ids of the queries (and keys) for the rotary
                embeddings, ``[*batch, q_length]`` or broadcastable to it (``[q_length]``);
                default ``arange(q_length)``, plus the cache's length with a cache. Only
                for a layer built with ``rope_theta``.
            cache: a :class:`KVCache` from :meth:`init_cache` (self-attention only). The
                new keys and values are written at its ``length``, and the queries, at
                positions ``length`` to ``length + q_length - 1``, attend to the filled
                positions: causally up to their own with ``causal=True``, all
                ``length + q_length`` of them without. Shapes never change, so a prompt
                and then one token at a time compile once each under ``jax.jit``.
            key: a PRNG key for dropout on the attention weights; without one (or with
                ``dropout_rate=0``) there is no dropout.

        Returns:
            ``y`` ``[*batch, q_length, out_features]``; with a cache, ``(y, cache)``,
            the cache holding the new keys and values and its length advanced.

        Raises:
            ValueError: the inputs' shapes do not fit the layer, or each other; a cache
                or rotary embeddings with `inputs_kv`; `positions` for a layer without
                rotary embeddings; a cache that does not fit the inputs; or a mask that
                does not broadcast.
            RuntimeError: the new tokens do not fit in the cache (raised when the step
                runs, under ``jax.jit`` too).
        """
        with jax.named_scope(_NAME):
            self_attention = inputs_kv is None
            inputs_kv = inputs_q if inputs_kv is None else inputs_kv
            check_inputs(_NAME, self.query.kernel, self.key.kernel, inputs_q, inputs_kv)
            if not self_attention and (cache is not None or self.rotary is not None):
                what = "a cache" if cache is not None else "rotary embeddings (rope_theta)"
                raise ValueError(
                    f"{_NAME} with {what} attends from inputs_q to itself, but inputs_kv was "
                    f"given; leave inputs_kv out, or use a layer without {what}."
                )
            batch, q_length = inputs_q.shape[:-2], inputs_q.shape[-2]
            heads, kv_heads = self.num_heads, self.num_kv_heads
            if cache is not None:
                check_cache(_NAME, cache, batch, q_length, kv_heads, self.head_dim)
            if self.rotary is None and positions is not None:
                raise ValueError(
                    f"{_NAME} got positions, but it has no rotary embeddings to use them "
                    f"(rope_theta=None); build it with rope_theta=10000.0 (say), or leave "
                    f"positions out."
                )
            q = split_heads(self.query(inputs_q), heads, kv_heads, whole_time=False)
            k = split_heads(self.key(inputs_kv), kv_heads, kv_heads, whole_time=True)
            v = split_heads(self.value(inputs_kv), kv_heads, kv_heads, whole_time=True)
            if self.query_norm is not None and self.key_norm is not None:  # (per head)
                q, k = self.query_norm(q), self.key_norm(k)
            if self.rotary is not None:
                offset = None if cache is None else cache.length
                at = fold_positions(_NAME, positions, batch, q_length, offset)
                q, k = self.rotary(q, at), self.rotary(k, at)
            kv_length = k.shape[1] if cache is None else cache.max_length
            if mask is not None:
                mask = fold_mask(_NAME, mask, batch, heads, q_length, kv_length)
            if cache is not None:
                length, cache = cache.length, write(_NAME, cache, k, v)
                k, v = cache.keys.astype(q.dtype), cache.values.astype(q.dtype)
                seen = visible(length, q_length, kv_length, causal)
                mask, causal = seen if mask is None else mask & seen, False
            y = attend(
                q,
                k,
                v,
                mask,
                causal,
                precision=self.precision,
                dropout_rate=self.dropout_rate,
                key=key,
            )
            merged_heads = (*batch, q_length, -1)
            if not explicit_axes():
                y = self.out(y.reshape(merged_heads))
            else:  # the batch and time axes split as the queries', the features as the heads
                split = P(*typed_spec(inputs_q)[:-1], typed_spec(y)[2])
                y = self.out(y.reshape(merged_heads, out_sharding=split))
            return y if cache is None else (y, cache)
