"""`Encoder`: the BERT family of bidirectional encoders as Hugging Face configures them
(``model_type`` ``"bert"``: BERT, MiniLM and the sentence-transformers models built on
them), built from a ``config.json``, with its conversion rules both ways and
sentence-transformers' mean pooling (`mean_pool`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int

from .. import convert, nn
from ._decoder import TYPES as DECODER_TYPES

TYPES = ("bert",)
"""The ``model_type`` values of the ``config.json`` files :class:`Encoder` builds."""
_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # name -> tanh approximation


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """What an encoder of the BERT family is built from: the fields of its Hugging Face
    ``config.json`` that shape it (:meth:`from_hf` reads them, :meth:`to_hf` writes them).

    Attributes:
        model_type: ``"bert"``.
        vocab_size: the tokens.
        hidden_size: the hidden states' features.
        num_hidden_layers: the encoder layers.
        num_attention_heads: the attention heads.
        intermediate_size: the MLP's inner features.
        hidden_act: the MLP's activation: ``"gelu"`` (exact, through erf), or
            ``"gelu_new"`` and ``"gelu_pytorch_tanh"`` (its tanh approximation).
        max_position_embeddings: the positions embedded: the longest input.
        type_vocab_size: the token types (segments).
        layer_norm_eps: the LayerNorms' epsilon.
        hidden_dropout_prob: the dropout rate of the embeddings and of each layer's two
            residual branches (applied only with a key).
        attention_probs_dropout_prob: the dropout rate of the attention weights.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | Path) -> EncoderConfig:
        """The config of a Hugging Face ``config.json`` (``transformers.BertConfig``'s
        ``to_dict()`` too); fields it leaves out take transformers' defaults.

        Args:
            config: the ``config.json``'s dict, its path, or its folder.

        Returns:
            The config.

        Raises:
            ValueError: its ``model_type`` is not one of the BERT family's (the message
                lists the families :class:`Encoder` and
                :class:`~taktiny.models.Decoder` build), it asks
                for what this encoder does not compute (an activation but GELU, position
                embeddings other than absolute ones, a decoder's causal attention), or a
                field is missing.
        """
        if isinstance(config, Mapping):
            values: Mapping[str, Any] = config
        else:
            path = Path(config) / "config.json" if Path(config).is_dir() else Path(config)
            values = json.loads(path.read_text())
        family = values.get("model_type")
        if family not in TYPES:
            raise ValueError(
                f"taktiny.models.Encoder got a config.json of model_type {family!r}; it builds "
                f"{', '.join(map(repr, TYPES))} (the BERT family), and "
                f"taktiny.models.Decoder builds {', '.join(map(repr, DECODER_TYPES))}. For "
                f"another model, write its modules and rules (docs/converting.md)."
            )
        act = values.get("hidden_act", "gelu")
        if act not in _GELU:
            raise ValueError(
                f"taktiny.models.Encoder computes GELU MLPs ({', '.join(map(repr, _GELU))}); "
                f"this {family} config.json asks for hidden_act={act!r}."
            )
        position = values.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ValueError(
                f"taktiny.models.Encoder adds absolute position embeddings; this {family} "
                f"config.json asks for position_embedding_type={position!r}. Build it from "
                f'a config.json with "absolute" (the default).'
            )
        if values.get("is_decoder") or values.get("add_cross_attention"):
            raise ValueError(
                f"taktiny.models.Encoder attends both ways, without cross-attention; this "
                f"{family} config.json makes a decoder (is_decoder={values.get('is_decoder')!r}, "
                f"add_cross_attention={values.get('add_cross_attention')!r}). For a causal "
                f"decoder, see taktiny.models.Decoder."
            )
        try:
            return cls(
                model_type=family,
                vocab_size=int(values["vocab_size"]),
                hidden_size=int(values["hidden_size"]),
                num_hidden_layers=int(values["num_hidden_layers"]),
                num_attention_heads=int(values["num_attention_heads"]),
                intermediate_size=int(values["intermediate_size"]),
                hidden_act=act,
                max_position_embeddings=int(values.get("max_position_embeddings", 512)),
                type_vocab_size=int(values.get("type_vocab_size", 2)),
                layer_norm_eps=float(values.get("layer_norm_eps", 1e-12)),
                hidden_dropout_prob=float(values.get("hidden_dropout_prob", 0.1)),
                attention_probs_dropout_prob=float(values.get("attention_probs_dropout_prob", 0.1)),
            )
        except KeyError as missing:
            raise ValueError(
                f"taktiny.models.Encoder: the {family} config.json has no {missing.args[0]!r}, "
                f"which shapes the model; give it."
            ) from None

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` that transformers builds the same model from.

        Returns:
            Its dict (``architectures`` ``["BertModel"]``, ``model_type`` and the fields
            that shape the model; transformers fills in the rest).
        """
        return {
            "architectures": ["BertModel"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "type_vocab_size": self.type_vocab_size,
            "layer_norm_eps": self.layer_norm_eps,
            "hidden_dropout_prob": self.hidden_dropout_prob,
            "attention_probs_dropout_prob": self.attention_probs_dropout_prob,
            "position_embedding_type": "absolute",
        }


class EncoderLayer(nn.Module):
    """One layer of an :class:`Encoder`, post-norm: attention, then a GELU MLP
    (``output(gelu(intermediate(x)))``), each added to the residual stream and then
    normalised.

    Attributes:
        attention: the self-attention (``attention.self`` and ``attention.output.dense``).
        attention_norm: the LayerNorm after it (``attention.output.LayerNorm``).
        intermediate: the MLP's first projection (``intermediate.dense``).
        output: its second (``output.dense``).
        output_norm: the LayerNorm after the MLP (``output.LayerNorm``).
        dropout: the dropout of both residual branches.
        approximate: whether the GELU is its tanh approximation (``gelu_new``).

    Args:
        config: what the encoder is built from.
        param_dtype: the parameters' dtype.
        rngs: the key stream for the initialisation.
    """

    attention: nn.MultiHeadAttention
    attention_norm: nn.LayerNorm
    intermediate: nn.Linear
    output: nn.Linear
    output_norm: nn.LayerNorm
    dropout: nn.Dropout
    approximate: bool

    def __init__(self, config: EncoderConfig, *, param_dtype: DTypeLike, rngs: nn.Rngs):
        hidden, inner, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
        self.attention = nn.MultiHeadAttention(
            config.num_attention_heads,
            hidden,
            dropout_rate=config.attention_probs_dropout_prob,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.attention_norm = nn.LayerNorm(hidden, epsilon=eps, param_dtype=param_dtype)
        self.intermediate = nn.Linear(hidden, inner, param_dtype=param_dtype, rngs=rngs)
        self.output = nn.Linear(inner, hidden, param_dtype=param_dtype, rngs=rngs)
        self.output_norm = nn.LayerNorm(hidden, epsilon=eps, param_dtype=param_dtype)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.approximate = _GELU[config.hidden_act]

    def __call__(
        self,
        x: Float[Array, "batch length hidden"],
        *,
        mask: Bool[Array, "batch 1 1 length"] | None = None,
        key: Any = None,
    ) -> Float[Array, "batch length hidden"]:
        """The layer on ``x``.

        Args:
            x: ``[batch, length, hidden_size]``.
            mask: the padding mask ``[batch, 1, 1, length]`` (True: a key that may be
                attended to), or None.
            key: a PRNG key for dropout, or None for none.

        Returns:
            ``[batch, length, hidden_size]``.
        """
        with jax.named_scope("EncoderLayer"):
            keys = [None] * 3 if key is None else list(jax.random.split(key, 3))
            attended: Any = self.attention(x, mask=mask, key=keys[0])  # (no cache: y alone)
            x = self.attention_norm(x + self.dropout(attended, key=keys[1]))
            h = self.output(jax.nn.gelu(self.intermediate(x), approximate=self.approximate))
            return self.output_norm(x + self.dropout(h, key=keys[2]))


class Encoder(nn.Module):
    """A bidirectional encoder of the BERT family: token ids ``[batch, length]`` to hidden
    states ``[batch, length, hidden_size]`` and the pooled first token
    ``[batch, hidden_size]``. Dropout runs only when a ``key`` is given.

    Its state's names are Hugging Face's with :func:`~taktiny.models.rules`
    (``layers.3.attention.query.kernel`` for
    ``encoder.layer.3.attention.self.query.weight``), scanned or not; with the same `key`,
    both variants drop the same activations (each layer's key is split from one key for
    all the layers, as ``nn.Stack`` splits it).

    Attributes:
        config: what it was built from.
        word: the token embedding ``embedding [vocab_size, hidden_size]``.
        position: the position embedding ``[max_position_embeddings, hidden_size]``.
        token_type: the token-type embedding ``[type_vocab_size, hidden_size]``.
        embed_norm: the LayerNorm of the embeddings' sum.
        dropout: the embeddings' dropout.
        layers: a list of :class:`EncoderLayer`, or one ``nn.Stack`` of them (scanned).
        pooler: the pooler's dense layer (``tanh(pooler(hidden[:, 0]))``), or None.

    Args:
        config: an :class:`EncoderConfig`, or what :meth:`EncoderConfig.from_hf` reads.
        scanned: hold the layers as one ``nn.Stack`` run by ``jax.lax.scan`` (jit
            compiles one layer whatever the depth).
        param_dtype: the parameters' dtype.
        pooler: whether the model has BERT's pooler (a ``BertModel``'s do;
            ``BertForMaskedLM``'s and many sentence encoders' checkpoints do not need one).
        rngs: the key stream for the initialisation.
    """

    config: EncoderConfig
    word: nn.Embed
    position: nn.Embed
    token_type: nn.Embed
    embed_norm: nn.LayerNorm
    dropout: nn.Dropout
    layers: Any
    pooler: nn.Linear | None

    def __init__(
        self,
        config: EncoderConfig | Mapping[str, Any] | str | Path,
        *,
        scanned: bool = False,
        param_dtype: DTypeLike = jnp.float32,
        pooler: bool = True,
        rngs: nn.Rngs,
    ):
        config = config if isinstance(config, EncoderConfig) else EncoderConfig.from_hf(config)
        self.config = config
        hidden = config.hidden_size
        kw: dict[str, Any] = {"param_dtype": param_dtype, "rngs": rngs}
        self.word = nn.Embed(config.vocab_size, hidden, **kw)
        self.position = nn.Embed(config.max_position_embeddings, hidden, **kw)
        self.token_type = nn.Embed(config.type_vocab_size, hidden, **kw)
        self.embed_norm = nn.LayerNorm(
            hidden, epsilon=config.layer_norm_eps, param_dtype=param_dtype
        )
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        make = lambda rngs: EncoderLayer(config, param_dtype=param_dtype, rngs=rngs)
        count = config.num_hidden_layers
        self.layers = (
            nn.Stack(make, count, rngs=rngs) if scanned else [make(rngs) for _ in range(count)]
        )
        self.pooler = nn.Linear(hidden, hidden, **kw) if pooler else None

    def __call__(
        self,
        ids: Int[Array, "batch length"],
        token_types: Int[Array, "batch length"] | None = None,
        valid: Bool[Array, "batch length"] | Int[Array, "batch length"] | None = None,
        *,
        key: Any = None,
    ) -> tuple[Float[Array, "batch length hidden"], Float[Array, "batch hidden"] | None]:
        """The hidden states of every token, and the pooled first token.

        Args:
            ids: token ids ``[batch, length]``, ``length`` at most
                ``max_position_embeddings``.
            token_types: the token types (segments) ``[batch, length]``, or None for all 0.
            valid: which tokens are real ``[batch, length]`` (booleans, or Hugging Face's
                0/1 ``attention_mask``): no token attends to a padded one. None: all are.
            key: a PRNG key for dropout (training), or None for none.

        Returns:
            ``(hidden, pooled)``: ``hidden [batch, length, hidden_size]`` (the padded
            tokens' too, which nothing attended to); ``pooled [batch, hidden_size]``,
            ``tanh(pooler(hidden[:, 0]))``, or None without a pooler.

        Raises:
            ValueError: `ids` is longer than ``max_position_embeddings``.
        """
        with jax.named_scope("Encoder"):
            length, most = ids.shape[-1], self.config.max_position_embeddings
            if length > most:
                raise ValueError(
                    f"taktiny.models.Encoder got {length} tokens a sequence; its position "
                    f"embeddings cover max_position_embeddings={most}. Truncate the inputs "
                    f"to {most} tokens."
                )
            embed_key, layers_key = (None, None) if key is None else jax.random.split(key)
            x = self.word(ids) + self.position(jnp.arange(length))
            x = x + self.token_type(jnp.zeros_like(ids) if token_types is None else token_types)
            x = self.dropout(self.embed_norm(x), key=embed_key)
            # padding: no query attends to a padded key
            mask = None if valid is None else jnp.asarray(valid).astype(bool)[:, None, None, :]
            if isinstance(self.layers, nn.Stack):  # the stack splits layers_key, one per layer
                x = self.layers(x, mask=mask, key=layers_key)
            else:
                keys = [None] * len(self.layers)
                if layers_key is not None:  # as nn.Stack splits it
                    keys = list(jax.random.split(layers_key, len(self.layers)))
                for layer, layer_key in zip(self.layers, keys, strict=True):
                    x = layer(x, mask=mask, key=layer_key)
            pooled = None if self.pooler is None else jnp.tanh(self.pooler(x[:, 0]))
            return x, pooled


def mean_pool(
    hidden: Float[Array, "batch length hidden"],
    valid: Bool[Array, "batch length"] | Int[Array, "batch length"] | None = None,
    *,
    normalize: bool = True,
) -> Float[Array, "batch hidden"]:
    """Sentence embeddings as sentence-transformers makes them (its ``Pooling`` in mean
    mode, then its ``Normalize``): the mean of each sequence's valid tokens'
    hidden states, ``sum(hidden * valid) / max(sum(valid), 1e-9)``, then divided by its
    L2 norm (at least 1e-12).

    Args:
        hidden: an :class:`Encoder`'s hidden states ``[batch, length, hidden_size]``.
        valid: which tokens are real ``[batch, length]`` (booleans, or the 0/1
            ``attention_mask``); None: all are.
        normalize: divide each embedding by its L2 norm (sentence-transformers'
            ``Normalize``, which all-MiniLM-L6-v2 and its kin end with); False: the mean.

    Returns:
        The embeddings ``[batch, hidden_size]``, in `hidden`'s dtype.
    """
    with jax.named_scope("mean_pool"):
        if valid is None:
            valid = jnp.ones(hidden.shape[:-1], bool)
        weights = jnp.asarray(valid).astype(hidden.dtype)[..., None]
        total = jnp.sum(hidden * weights, axis=-2)
        pooled = total / jnp.maximum(jnp.sum(weights, axis=-2), 1e-9)
        if not normalize:
            return pooled
        norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
        return pooled / jnp.maximum(norm, 1e-12)


def rules(config: EncoderConfig, *, prefix: str = "", pooler: bool = True) -> list[Any]:
    """The conversion rules between Hugging Face's BERT names and :class:`Encoder`'s, both
    ways (``convert.convert`` or ``load_safetensors(rules=)`` in, ``convert.export`` out).

    Args:
        config: the encoder's config (every BERT's rules are alike today).
        prefix: what every Hugging Face name starts with: ``""`` for a ``BertModel``'s
            files, ``"bert."`` for those of ``BertForPreTraining``, ``BertForMaskedLM`` and
            the other heads on a BERT; with a prefix, the heads' ``cls.**`` names are
            dropped. A prefix is for loading: export with ``prefix=""`` to write a
            ``BertModel``'s names.
        pooler: whether the model has a pooler (``pooler.dense``); False for an
            ``Encoder(pooler=False)``, such as one loaded from ``BertForMaskedLM``, which
            has none.

    Returns:
        The rules: each weight ``[out, in]`` transposed into a kernel, the LayerNorms'
        ``weight`` into ``scale``, and the ``position_ids`` buffer older files hold dropped.

    Raises:
        ValueError: `prefix` is neither empty nor ends with a dot.
    """
    if prefix and not prefix.endswith("."):
        raise ValueError(
            f"taktiny.models.rules: prefix {prefix!r} is the start of every name, "
            f"up to its dot: pass {prefix + '.'!r}."
        )
    hf, ours = prefix + "encoder.layer.{i}.", "layers.{i}."
    made = [
        *convert.embedding(prefix + "embeddings.word_embeddings", "word"),
        *convert.embedding(prefix + "embeddings.position_embeddings", "position"),
        *convert.embedding(prefix + "embeddings.token_type_embeddings", "token_type"),
        *convert.layer_norm(prefix + "embeddings.LayerNorm", "embed_norm"),
        *convert.linear(hf + "attention.self.query", ours + "attention.query"),
        *convert.linear(hf + "attention.self.key", ours + "attention.key"),
        *convert.linear(hf + "attention.self.value", ours + "attention.value"),
        *convert.linear(hf + "attention.output.dense", ours + "attention.out"),
        *convert.layer_norm(hf + "attention.output.LayerNorm", ours + "attention_norm"),
        *convert.linear(hf + "intermediate.dense", ours + "intermediate"),
        *convert.linear(hf + "output.dense", ours + "output"),
        *convert.layer_norm(hf + "output.LayerNorm", ours + "output_norm"),
    ]
    if pooler:
        made += convert.linear(prefix + "pooler.dense", "pooler")
    if prefix:
        made.append(convert.Ignore("cls.**"))  # the pre-training and masked-LM heads
    return [*made, *convert.buffers()]  # `embeddings.position_ids` in older files: dropped
