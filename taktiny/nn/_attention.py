"""`MultiHeadAttention`: scaled dot-product attention with learned projections."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float

from .._module import Module
from .._rngs import Rngs
from .._sharding import Spec, placement
from ._checks import check_features
from ._explicit import explicit_axes, merged, typed_spec
from ._linear import Linear
from ._random import keep_mask

# Compiled as one unit, so that calls outside jax.jit compile once per shape instead of
# once per operation inside it; inside jax.jit it is simply inlined.
_dot_product_attention = jax.jit(jax.nn.dot_product_attention, static_argnames=("is_causal",))


class MultiHeadAttention(Module):
    """Multi-head attention: project, attend per head, concatenate the heads, project.

    With ``num_heads`` heads of ``head_dim = qkv_features // num_heads``, the query,
    key and value projections produce ``qkv_features`` features that are split into
    heads as consecutive blocks of ``head_dim`` (head ``h`` uses features
    ``h * head_dim`` to ``(h + 1) * head_dim``), as PyTorch and Hugging Face models do, so
    converting their weights needs no reordering. Attention weights are
    ``softmax(q @ k.T / sqrt(head_dim))`` per head.

    Submodules (state names; all plain :class:`Linear` layers):
        query: ``kernel [in_features, qkv_features]``, ``bias [qkv_features]``.
        key: ``kernel [kv_features, qkv_features]``, ``bias [qkv_features]``.
        value: ``kernel [kv_features, qkv_features]``, ``bias [qkv_features]``.
        out: ``kernel [qkv_features, out_features]``, ``bias [out_features]``.
        Kernels are LeCun-normal, biases zeros (absent with ``use_bias=False``).
        PyTorch's ``nn.MultiheadAttention`` stores ``in_proj_weight [3 * E, E]``: split it
        in three along its first axis and transpose each part for query, key and value;
        ``out_proj.weight`` transposed is ``out.kernel``.

    Args:
        num_heads: the number of heads; must divide ``qkv_features``.
        in_features: features of the queries' input (and, by default, of the keys').
        qkv_features: total features of queries, keys and values across heads
            (default ``in_features``).
        out_features: features of the output (default ``in_features``).
        kv_features: features of the key/value input in cross-attention (default
            ``in_features``; PyTorch's ``kdim``/``vdim`` when they are equal).
        use_bias: whether the four projections have biases.
        dropout_rate: the dropout applied to attention weights when a ``key`` is given.
        dtype: the parameters' dtype, which is also the dtype the layer computes in.
        query_kernel_sharding: how ``query.kernel`` is split over the mesh of an
            enclosing ``jax.set_mesh``, as :class:`Linear`'s ``kernel_sharding``:
            ``(None, "model")`` splits the heads (with a number of heads the mesh axis
            divides, each device holds whole heads). Ignored without a mesh.
        query_bias_sharding: the same for ``query.bias`` (``("model",)``).
        key_kernel_sharding, key_bias_sharding, value_kernel_sharding,
        value_bias_sharding: the same for ``key`` and ``value``.
        out_kernel_sharding: the same for ``out.kernel``; ``("model", None)`` splits
            its inputs, the heads.
        out_bias_sharding: the same for ``out.bias``.
        rngs: the key stream for the initialisation.
    """

    query: Linear
    key: Linear
    value: Linear
    out: Linear
    num_heads: int
    dropout_rate: float

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        *,
        qkv_features: int | None = None,
        out_features: int | None = None,
        kv_features: int | None = None,
        use_bias: bool = True,
        dropout_rate: float = 0.0,
        dtype: DTypeLike = jnp.float32,
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
        qkv = in_features if qkv_features is None else qkv_features
        if num_heads < 1 or qkv % num_heads:
            raise ValueError(
                f"MultiHeadAttention's num_heads ({num_heads}) must divide qkv_features "
                f"({qkv}) into heads of equal size; change one of them."
            )
        if not 0.0 <= dropout_rate < 1.0:
            raise ValueError(
                f"MultiHeadAttention's dropout_rate must be in [0, 1), got {dropout_rate!r}."
            )
        kv = in_features if kv_features is None else kv_features
        out = in_features if out_features is None else out_features
        shardings = {
            "query": (in_features, qkv, query_kernel_sharding, query_bias_sharding),
            "key": (kv, qkv, key_kernel_sharding, key_bias_sharding),
            "value": (kv, qkv, value_kernel_sharding, value_bias_sharding),
            "out": (qkv, out, out_kernel_sharding, out_bias_sharding),
        }
        for name, (n_in, n_out, kernel, bias) in shardings.items():
            # checked here first, so that an error names the projection
            placement(kernel, (n_in, n_out), f"MultiHeadAttention.{name}.kernel")
            placement(bias if use_bias else None, (n_out,), f"MultiHeadAttention.{name}.bias")
        self.query, self.key, self.value, self.out = (
            Linear(n_in, n_out, use_bias=use_bias, dtype=dtype, kernel_sharding=kernel,
                   bias_sharding=bias, rngs=rngs)
            for n_in, n_out, kernel, bias in shardings.values()
        )  # fmt: skip
        self.num_heads = num_heads
        self.dropout_rate = dropout_rate

    def __call__(
        self,
        inputs_q: Float[Array, "*batch q_length in_features"],
        inputs_kv: Float[Array, "*batch kv_length kv_features"] | None = None,
        *,
        mask: Bool[Array, "..."] | None = None,
        causal: bool = False,
        key: Any = None,
    ) -> Float[Array, "*batch q_length out_features"]:
        """Attends from ``inputs_q`` to ``inputs_kv`` (to ``inputs_q`` itself when None).

        Args:
            inputs_q: ``[*batch, q_length, in_features]``.
            inputs_kv: ``[*batch, kv_length, kv_features]``, or None for self-attention.
            mask: booleans broadcastable to ``[*batch, num_heads, q_length, kv_length]``;
                True lets a query attend to a key (the opposite of PyTorch's boolean
                ``attn_mask``). A padding mask over keys is ``valid[..., None, None, :]``.
                A query that may attend to nothing gets the mean of the values rather
                than NaN.
            causal: also forbid query ``i`` to attend to keys after position ``i``.
            key: a PRNG key for dropout on the attention weights; without one (or with
                ``dropout_rate=0``) there is no dropout.

        Returns:
            ``[*batch, q_length, out_features]``.
        """
        with jax.named_scope("MultiHeadAttention"):
            inputs_kv = inputs_q if inputs_kv is None else inputs_kv
            q_in, kv_in = self.query.kernel.shape[0], self.key.kernel.shape[0]
            why = "its {} kernel is {}"
            check_features(
                "MultiHeadAttention",
                inputs_q,
                q_in,
                why=why.format("query", tuple(self.query.kernel.shape)),
                argument="in_features",
            )
            check_features(
                "MultiHeadAttention",
                inputs_kv,
                kv_in,
                why=why.format("key", tuple(self.key.kernel.shape)),
                argument="kv_features",
            )
            if inputs_q.ndim < 2 or inputs_kv.shape[:-2] != inputs_q.shape[:-2]:
                raise ValueError(
                    f"MultiHeadAttention expects inputs_q [*batch, q_length, features] and "
                    f"inputs_kv [*batch, kv_length, features] with the same batch axes, got "
                    f"shapes {tuple(inputs_q.shape)} and {tuple(inputs_kv.shape)}."
                )
            batch = inputs_q.shape[:-2]
            q = self._split(self.query(inputs_q))
            k, v = self._split(self.key(inputs_kv)), self._split(self.value(inputs_kv))
            if mask is not None:
                mask = self._fold_mask(mask, batch, q.shape[1], k.shape[1])
            if key is None or self.dropout_rate == 0.0:
                # it promotes low-precision inputs against float32 internally, which
                # jax_numpy_dtype_promotion="strict" would reject
                with jax.numpy_dtype_promotion("standard"):
                    y = _dot_product_attention(q, k, v, mask=mask, is_causal=causal)
            else:
                y = self._attend_with_dropout(q, k, v, mask, causal, key)
            merged_heads = (*batch, q.shape[1], -1)
            if not explicit_axes():
                return self.out(y.reshape(merged_heads))
            # the batch and time axes split as the queries', the features as the heads were
            split = P(*typed_spec(inputs_q)[:-1], typed_spec(y)[2])
            return self.out(y.reshape(merged_heads, out_sharding=split))

    def _split(self, x: jax.Array) -> jax.Array:
        """``[*batch, t, f]`` to ``[B, t, heads, f / heads]``. Under Explicit axes the batch
        axes' splits are merged, and the heads are split as the features were when the mesh
        axes divide the number of heads (unsplit otherwise)."""
        heads = self.num_heads
        shape = (-1, x.shape[-2], heads, x.shape[-1] // heads)
        if not explicit_axes():
            return x.reshape(shape)
        *batch, time, features = typed_spec(x)
        names = features if isinstance(features, tuple) else (features,)
        parts = math.prod(jax.sharding.get_abstract_mesh().shape[n] for n in names if n)
        split = features if heads % parts == 0 else None
        return x.reshape(shape, out_sharding=P(merged(batch), time, split, None))

    def _fold_mask(self, mask: Any, batch: tuple[int, ...], q: int, k: int) -> jax.Array:
        """Checks `mask` against [*batch, heads, q, k] and folds its batch axes into one."""
        target = (*batch, self.num_heads, q, k)
        ok = mask.dtype == jnp.bool_ and mask.ndim <= len(target)
        ok = ok and all(m in (1, t) for m, t in zip(mask.shape[::-1], target[::-1], strict=False))
        if not ok:
            raise ValueError(
                f"MultiHeadAttention's mask must be booleans broadcastable to [*batch, "
                f"num_heads, q_length, kv_length] = {list(target)}, got {mask.dtype}"
                f"{list(mask.shape)}. True means 'may attend'; for a padding mask `valid` "
                f"[*batch, kv_length] pass valid[..., None, None, :]."
            )
        mask = mask.reshape((1,) * (len(target) - mask.ndim) + mask.shape)
        if len(batch) != 1:
            mask = jnp.broadcast_to(mask, (*batch, *mask.shape[len(batch) :]))
            mask = mask.reshape(-1, *mask.shape[len(batch) :])
        return mask

    def _attend_with_dropout(
        self, q: jax.Array, k: jax.Array, v: jax.Array, mask: Any, causal: bool, key: Any
    ) -> jax.Array:
        """Attention with dropout on the weights ([B, t, heads, d] layouts), which
        ``jax.nn.dot_product_attention`` does not offer; masked as it masks."""
        # logits and softmax in float32 (at least), as jax.nn.dot_product_attention does
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        logits = logits / jnp.sqrt(jnp.float32(q.shape[-1]))
        allowed = jnp.ones((1, 1, q.shape[1], k.shape[1]), jnp.bool_)
        if mask is not None:
            allowed = allowed & mask
        if causal:
            allowed = allowed & jnp.tril(jnp.ones((q.shape[1], k.shape[1]), jnp.bool_))
        logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        keep = keep_mask(key, self.dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / jnp.asarray(1.0 - self.dropout_rate, weights.dtype), 0)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v)
