"""`Decoder`: the Llama family of causal decoders as Hugging Face configures them (Llama 2,
3, 3.1 and 3.2, Mistral, Qwen2 and Qwen2.5, Qwen3), built from a ``config.json``, with
its conversion rules both ways."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int

from .. import convert, nn

TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""The ``model_type`` values of the ``config.json`` files :class:`Decoder` builds."""
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# what config.json may leave out, by family (transformers' configuration defaults)
_KV_HEADS = {"mistral": 8, "qwen2": 32, "qwen3": 32}  # llama: as many as the heads
_HEAD_DIM = {"qwen3": 128}  # the others: hidden_size // num_attention_heads


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """What a decoder of the Llama family is built from: the fields of its Hugging Face
    ``config.json`` that shape it (:meth:`from_hf` reads them, :meth:`to_hf` writes them).

    Attributes:
        model_type: ``"llama"``, ``"mistral"``, ``"qwen2"`` or ``"qwen3"``.
        vocab_size: the tokens.
        hidden_size: the residual stream's features.
        intermediate_size: the MLP's inner features.
        num_hidden_layers: the decoder layers.
        num_attention_heads: the query heads.
        num_key_value_heads: the key/value heads (grouped-query attention).
        head_dim: each head's features.
        rms_norm_eps: the RMSNorms' epsilon.
        rope_theta: the rotary embeddings' base.
        rope_scaling: their scaling (Hugging Face's ``rope_parameters`` less its
            ``rope_theta``, as sorted key-value pairs), or None for plain ones.
        max_position_embeddings: the context the model was trained for.
        tie_word_embeddings: whether the output projection is the token embedding.
        attention_bias: biases on the four attention projections (Llama's, Qwen3's).
        mlp_bias: biases on the MLP's projections (Llama's).
        sliding_window: each query attends to at most this many keys, its own included
            (Mistral's), or None.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | Path) -> DecoderConfig:
        """The config of a Hugging Face ``config.json``. Reads transformers 5's
        ``rope_parameters`` and 4's ``rope_theta`` and ``rope_scaling`` alike; fields it
        leaves out take transformers' defaults for the family.

        Args:
            config: the ``config.json``'s dict, its path, or its folder.

        Returns:
            The config.

        Raises:
            ValueError: its ``model_type`` is not one of the Llama family's (the message lists
                them), it asks for what this decoder does not compute (an activation but
                SiLU, Qwen's per-layer sliding windows), or a field is missing.
        """
        values: Mapping[str, Any]
        if isinstance(config, Mapping):
            values = config
        else:
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            values = json.loads(path.read_text())
        family = values.get("model_type")
        if family not in TYPES:
            raise ValueError(
                f"taktiny.models.Decoder got a config.json of model_type {family!r}; it builds "
                f"{', '.join(map(repr, TYPES))} (the Llama family), and taktiny.models.Encoder "
                f"builds 'bert'. For another model, write its modules and rules "
                f"(docs/converting.md)."
            )
        if values.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"taktiny.models.Decoder computes SiLU MLPs; this {family} config.json asks "
                f"for hidden_act={values['hidden_act']!r}."
            )
        if family in ("qwen2", "qwen3") and values.get("use_sliding_window"):
            raise ValueError(
                f"taktiny.models.Decoder does not compute {family}'s per-layer sliding windows "
                f"(use_sliding_window=true); build it from a config.json without them."
            )
        try:
            hidden, heads = int(values["hidden_size"]), int(values["num_attention_heads"])
            rope = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", values.get("rope_theta", 10000.0)))
            kind = rope.pop("rope_type", rope.pop("type", "default"))
            if kind == "dynamic":  # (transformers grows theta past the config's context)
                rope.setdefault(
                    "max_position_embeddings", values.get("max_position_embeddings", 2048)
                )
            scaling = (
                None if kind == "default" else tuple(sorted({**rope, "rope_type": kind}.items()))
            )
            window = values.get("sliding_window", 4096) if family == "mistral" else None
            return cls(
                model_type=family,
                vocab_size=int(values["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(values["intermediate_size"]),
                num_hidden_layers=int(values["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(
                    values.get("num_key_value_heads") or _KV_HEADS.get(family, heads)
                ),
                head_dim=int(values.get("head_dim") or _HEAD_DIM.get(family, hidden // heads)),
                rms_norm_eps=float(values.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(values.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(values.get("tie_word_embeddings", False)),
                attention_bias=bool(values.get("attention_bias", False)),
                mlp_bias=bool(values.get("mlp_bias", False)),
                sliding_window=None if window is None else int(window),
            )
        except KeyError as missing:
            raise ValueError(
                f"taktiny.models.Decoder: the {family} config.json has no {missing.args[0]!r}, "
                f"which shapes the model; give it."
            ) from None

    @property
    def qkv_bias(self) -> bool:
        """Whether the query, key and value projections have biases: with
        `attention_bias`, and always in Qwen2 (whose output projection has none)."""
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Whether each query and key head is RMS-normalised before the rotation (Qwen3)."""
        return self.model_type == "qwen3"

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` that transformers builds the same model from.

        Returns:
            Its dict (``architectures``, ``model_type`` and the fields that shape the
            model; transformers fills in the rest).
        """
        rope = {"rope_type": "default", **dict(self.rope_scaling or ())}
        if rope["rope_type"] == "dynamic":  # transformers reads the config's own
            rope.pop("max_position_embeddings")
        out: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {**rope, "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        return out


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear

    def __init__(self, config: DecoderConfig, *, param_dtype: DTypeLike, rngs: nn.Rngs):
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        kw: dict[str, Any] = {"use_bias": bias, "param_dtype": param_dtype, "rngs": rngs}
        self.gate, self.up = nn.Linear(hidden, inner, **kw), nn.Linear(hidden, inner, **kw)
        self.down = nn.Linear(inner, hidden, **kw)

    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        """``[*batch, hidden]`` to ``[*batch, hidden]``."""
        with jax.named_scope("MLP"):
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    """One layer of a :class:`Decoder`, pre-norm: attention, then a SwiGLU MLP
    (``down(silu(gate(x)) * up(x))``), each added to the residual stream.

    Attributes:
        attention_norm: the RMSNorm before the attention (``input_layernorm``).
        attention: the attention (``self_attn``).
        mlp_norm: the RMSNorm before the MLP (``post_attention_layernorm``).
        mlp: the MLP (``mlp``: ``gate``, ``up``, ``down``).

    Args:
        config: what the decoder is built from.
        param_dtype: the parameters' dtype.
        rngs: the key stream for the initialisation.
    """

    attention_norm: nn.RMSNorm
    attention: nn.MultiHeadAttention
    mlp_norm: nn.RMSNorm
    mlp: MLP

    def __init__(self, config: DecoderConfig, *, param_dtype: DTypeLike, rngs: nn.Rngs):
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.attention_norm = nn.RMSNorm(hidden, epsilon=eps, param_dtype=param_dtype)
        self.attention = nn.MultiHeadAttention(
            config.num_attention_heads,
            hidden,
            qkv_features=config.num_attention_heads * config.head_dim,
            num_kv_heads=config.num_key_value_heads,
            rope_theta=config.rope_theta,
            rope_scaling=None if config.rope_scaling is None else dict(config.rope_scaling),
            use_bias=config.qkv_bias,
            use_out_bias=config.attention_bias,
            qk_norm_epsilon=eps if config.qk_norm else None,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.mlp_norm = nn.RMSNorm(hidden, epsilon=eps, param_dtype=param_dtype)
        self.mlp = MLP(config, param_dtype=param_dtype, rngs=rngs)

    def __call__(
        self, x: Float[Array, "batch length hidden"], cache: Any = None, *, mask: Any = None
    ) -> tuple[Float[Array, "batch length hidden"], Any]:
        """The layer on ``x``.

        Args:
            x: ``[batch, length, hidden_size]``.
            cache: the layer's KVCache, or None.
            mask: which keys each query may attend to (True: may), broadcastable to
                ``[batch, 1, length, keys]`` (the sliding window, the padding), or None.

        Returns:
            ``(y, cache)``: ``y`` as `x`; the cache advanced (None without one).
        """
        with jax.named_scope("DecoderLayer"):
            normed = self.attention_norm(x)
            out: Any = self.attention(normed, mask=mask, causal=True, cache=cache)
            y, cache = (out, None) if cache is None else out  # (with a cache: y, the cache)
            x = x + y
            return x + self.mlp(self.mlp_norm(x)), cache


class Decoder(nn.Module):
    """A causal decoder of the Llama family: token ids ``[batch, length]`` to next-token
    logits ``[batch, length, vocab_size]``; with ``caches`` (:meth:`init_caches`),
    ``(logits, caches)`` advanced.

    Its state's names are Hugging Face's with :func:`~taktiny.models.rules`
    (``layers.3.attention.query.kernel`` for ``model.layers.3.self_attn.q_proj.weight``),
    scanned or not.

    Attributes:
        config: what it was built from.
        embed: ``embedding [vocab_size, hidden_size]``.
        layers: a list of :class:`DecoderLayer`, or one ``nn.Stack`` of them (scanned).
        norm: the final RMSNorm.
        lm_head: the output projection, or None when tied to ``embed``.

    Args:
        config: a :class:`DecoderConfig`, or what :meth:`DecoderConfig.from_hf` reads.
        scanned: hold the layers as one ``nn.Stack`` run by ``jax.lax.scan`` (jit
            compiles one layer whatever the depth).
        param_dtype: the parameters' dtype.
        rngs: the key stream for the initialisation.
    """

    config: DecoderConfig
    embed: nn.Embed
    layers: Any
    norm: nn.RMSNorm
    lm_head: nn.Linear | None

    def __init__(
        self,
        config: DecoderConfig | Mapping[str, Any] | str | Path,
        *,
        scanned: bool = False,
        param_dtype: DTypeLike = jnp.float32,
        rngs: nn.Rngs,
    ):
        config = config if isinstance(config, DecoderConfig) else DecoderConfig.from_hf(config)
        self.config = config
        hidden, vocab = config.hidden_size, config.vocab_size
        self.embed = nn.Embed(vocab, hidden, param_dtype=param_dtype, rngs=rngs)
        make = lambda rngs: DecoderLayer(config, param_dtype=param_dtype, rngs=rngs)
        count = config.num_hidden_layers
        self.layers = (
            nn.Stack(make, count, rngs=rngs) if scanned else [make(rngs) for _ in range(count)]
        )
        self.norm = nn.RMSNorm(hidden, epsilon=config.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(hidden, vocab, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        )

    def generate(
        self,
        ids: Int[Array, "batch length"],
        max_new_tokens: int,
        *,
        valid: Bool[Array, "batch length"] | None = None,
        temperature: float = 0.0,
        key: Any = None,
    ) -> Int[Array, "batch max_new_tokens"]:
        """Tokens decoded after the prompt `ids`, through caches: the prompt in one
        step, then one token a step, all in one jitted program (compiled once per prompt
        shape and `max_new_tokens`).

        Args:
            ids: the prompt's token ids ``[batch, length]``; prompts of other lengths
                padded on the left (as transformers pads for ``generate``).
            max_new_tokens: how many tokens to decode.
            valid: which of the prompt's tokens are real ``[batch, length]`` (booleans,
                or a tokenizer's 0/1 ``attention_mask``), the padding False; None: all.
            temperature: 0 (the default) takes the likeliest token each step (greedy, as
                transformers' ``generate(do_sample=False)``); above 0, each token is drawn
                from ``softmax(logits / temperature)``.
            key: a PRNG key for the draws (needed with a temperature above 0).

        Returns:
            The new tokens ``[batch, max_new_tokens]`` (int32).

        Raises:
            ValueError: `max_new_tokens` is below 1, `temperature` below 0, or a
                temperature above 0 comes without a key.
        """
        if int(max_new_tokens) < 1:
            raise ValueError(
                f"Decoder.generate's max_new_tokens must be at least 1, got {max_new_tokens!r}."
            )
        if not temperature >= 0:
            raise ValueError(
                f"Decoder.generate's temperature must be 0 (greedy) or above, got {temperature!r}."
            )
        if temperature > 0 and key is None:
            raise ValueError(
                f"Decoder.generate draws tokens at temperature {temperature!r}: pass "
                f"key=jax.random.key(seed), or temperature=0 for greedy decoding."
            )
        return _generate(
            self,
            jnp.asarray(ids),
            None if valid is None else jnp.asarray(valid).astype(bool),
            None if temperature == 0 else key,
            max_new_tokens=int(max_new_tokens),
            temperature=float(temperature),
        )

    def init_caches(self, batch: int, max_length: int) -> Any:
        """Empty caches for decoding.

        Args:
            batch: the sequences.
            max_length: the tokens each holds at most, prompt and new ones together.

        Returns:
            A KVCache per layer (a list), or one stacked over the layers (scanned).
        """
        make = lambda layer: layer.attention.init_cache(batch, max_length)
        if isinstance(self.layers, nn.Stack):
            return self.layers.map(make)
        return [make(layer) for layer in self.layers]

    def __call__(
        self,
        ids: Int[Array, "batch length"],
        *,
        caches: Any = None,
        valid: Bool[Array, "batch keys"] | None = None,
    ) -> Float[Array, "batch length vocab"] | tuple[Float[Array, "batch length vocab"], Any]:
        """The next-token logits of every position.

        Args:
            ids: token ids ``[batch, length]``.
            caches: from :meth:`init_caches`, or None: the tokens are written at the
                caches' length, and attend to every token before them.
            valid: which places hold real tokens, not padding ``[batch, keys]`` (``keys``
                is `length` without caches, the caches' ``max_length`` with them: the
                places to come included), or None for all: no token attends to padding.
                (The rotary embeddings rotate by the tokens' places; a left-padded
                sequence's are all shifted alike, which leaves every attention score as
                it would be unpadded: the rotation is relative.)

        Returns:
            ``logits [batch, length, vocab_size]``; with ``caches``, ``(logits, caches)``
            advanced.
        """
        with jax.named_scope("Decoder"):
            mask = self._window(ids.shape[1], caches)
            if valid is not None:  # no query attends to a padded key
                padding = jnp.asarray(valid).astype(bool)[:, None, None, :]
                mask = padding if mask is None else padding & mask
            x = self.embed(ids)
            if isinstance(self.layers, nn.Stack):
                x, advanced = (
                    self.layers(x, mask=mask)
                    if caches is None
                    else self.layers(x, caches, mask=mask)
                )
            else:
                advanced = []
                for i, layer in enumerate(self.layers):
                    x, cache = layer(x, None if caches is None else caches[i], mask=mask)
                    advanced.append(cache)
            x = self.norm(x)
            logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
            return logits if caches is None else (logits, advanced)

    def _window(self, length: int, caches: Any) -> jax.Array | None:
        """The sliding window's mask ``[length, keys]`` (True: a query may attend to the
        key; the causal rule is the attention's), or None without a window."""
        window = self.config.sliding_window
        if window is None:
            return None
        if caches is None:
            queries, keys = jnp.arange(length), jnp.arange(length)
        else:
            first = caches[0] if isinstance(caches, list) else caches
            start = first.length[0] if jnp.ndim(first.length) else first.length
            queries = start + jnp.arange(length)
            keys = jnp.arange(first.keys.shape[-3])
        return queries[:, None] - keys[None, :] < window


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "temperature"))
def _generate(
    model: Decoder,
    ids: jax.Array,
    valid: jax.Array | None,
    key: Any,
    *,
    max_new_tokens: int,
    temperature: float,
) -> jax.Array:
    """`Decoder.generate`'s program: the prompt, then ``jax.lax.scan`` over the steps."""
    batch, length = ids.shape
    if valid is not None:  # the places to come hold real tokens
        valid = jnp.concatenate([valid, jnp.ones((batch, max_new_tokens), bool)], axis=1)
    keys = None if key is None else jax.random.split(key, max_new_tokens)

    def pick(logits: jax.Array, at: Any) -> jax.Array:  # logits [batch, vocab] -> [batch]
        if at is None:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.random.categorical(at, logits / temperature, axis=-1).astype(jnp.int32)

    caches = model.init_caches(batch, length + max_new_tokens)
    logits, caches = model(ids, caches=caches, valid=valid)
    first = pick(logits[:, -1], None if keys is None else keys[0])

    def step(carry: Any, at: Any) -> tuple[Any, jax.Array]:
        token, caches = carry
        logits, caches = model(token[:, None], caches=caches, valid=valid)
        return (pick(logits[:, -1], at), caches), token

    rest = None if keys is None else keys[1:]
    (last, _), tokens = jax.lax.scan(step, (first, caches), rest, length=max_new_tokens - 1)
    return jnp.concatenate([tokens.T, last[:, None]], axis=1)


def rules(config: DecoderConfig) -> list[Any]:
    """The conversion rules between Hugging Face's names and :class:`Decoder`'s, both ways
    (``convert.convert`` or ``load_safetensors(rules=)`` in, ``convert.export`` out).

    Args:
        config: the decoder's config: its biases, q/k norms and tied head decide the rules.

    Returns:
        The rules: each weight ``[out, in]`` transposed into a kernel, the norms' ``weight``
        into ``scale``, a tied head read as the embedding (and left out on export), the
        rotary ``inv_freq`` older files hold dropped.
    """
    hf, ours = "model.layers.{i}.", "layers.{i}."
    qkv, out, mlp = config.qkv_bias, config.attention_bias, config.mlp_bias
    made = [
        *convert.embedding("model.embed_tokens", "embed"),
        *convert.layer_norm(hf + "input_layernorm", ours + "attention_norm", bias=False),
        *convert.linear(hf + "self_attn.q_proj", ours + "attention.query", bias=qkv),
        *convert.linear(hf + "self_attn.k_proj", ours + "attention.key", bias=qkv),
        *convert.linear(hf + "self_attn.v_proj", ours + "attention.value", bias=qkv),
        *convert.linear(hf + "self_attn.o_proj", ours + "attention.out", bias=out),
        *convert.layer_norm(hf + "post_attention_layernorm", ours + "mlp_norm", bias=False),
        *convert.linear(hf + "mlp.gate_proj", ours + "mlp.gate", bias=mlp),
        *convert.linear(hf + "mlp.up_proj", ours + "mlp.up", bias=mlp),
        *convert.linear(hf + "mlp.down_proj", ours + "mlp.down", bias=mlp),
        *convert.layer_norm("model.norm", "norm", bias=False),
        *convert.buffers(),
    ]
    if config.qk_norm:
        made += [
            *convert.layer_norm(hf + "self_attn.q_norm", ours + "attention.query_norm", bias=False),
            *convert.layer_norm(hf + "self_attn.k_norm", ours + "attention.key_norm", bias=False),
        ]
    if config.tie_word_embeddings:
        made.append(convert.Tie("lm_head.weight", same_as="model.embed_tokens.weight"))
    else:
        made += convert.linear("lm_head", "lm_head", bias=False)
    return made
