"""A BERT encoder built from Taktiny layers, loaded from a Hugging Face `BertModel`.

The reference is a small random `transformers.BertModel` (nothing is downloaded). Its
state dict is converted by `RULES`, built from `taktiny.convert`'s presets for PyTorch's
layers; the conversion is checked name by name before anything converts, loaded strictly
into a model built without initialising it, and both models run on the same padded batch
(`convert.parity`). The model is then exported back into a fresh `BertModel`, loaded with
strict=True, and compared again. Run `python examples/bert.py`: it prints the largest
differences. docs/converting.md walks through it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import BertConfig, BertModel

from taktiny import convert, nn


class EncoderLayer(nn.Module):
    def __init__(self, config: BertConfig, *, rngs: nn.Rngs):
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.attention = nn.MultiHeadAttention(
            config.num_attention_heads,
            hidden,
            dropout_rate=config.attention_probs_dropout_prob,
            rngs=rngs,
        )
        self.attention_norm = nn.LayerNorm(hidden, epsilon=eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size, rngs=rngs)
        self.output = nn.Linear(config.intermediate_size, hidden, rngs=rngs)
        self.output_norm = nn.LayerNorm(hidden, epsilon=eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def __call__(self, x, mask, *, key=None):
        keys = jax.random.split(key, 3) if key is not None else [None] * 3
        attended = self.attention(x, mask=mask, key=keys[0])
        x = self.attention_norm(x + self.dropout(attended, key=keys[1]))
        h = self.output(jax.nn.gelu(self.intermediate(x), approximate=False))
        return self.output_norm(x + self.dropout(h, key=keys[2]))


class Bert(nn.Module):
    """Token ids [batch, length] -> hidden states [batch, length, hidden] and the pooled
    first token [batch, hidden]. Dropout runs only when a `key` is given."""

    def __init__(self, config: BertConfig, *, rngs: nn.Rngs):
        hidden = config.hidden_size
        self.word = nn.Embed(config.vocab_size, hidden, rngs=rngs)
        self.position = nn.Embed(config.max_position_embeddings, hidden, rngs=rngs)
        self.token_type = nn.Embed(config.type_vocab_size, hidden, rngs=rngs)
        self.embed_norm = nn.LayerNorm(hidden, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.layers = [EncoderLayer(config, rngs=rngs) for _ in range(config.num_hidden_layers)]
        self.pooler = nn.Linear(hidden, hidden, rngs=rngs)

    def __call__(self, ids, token_types, valid, *, key=None):
        keys = [None] * (len(self.layers) + 1)
        if key is not None:
            keys = list(jax.random.split(key, len(keys)))
        positions = jnp.arange(ids.shape[-1])
        x = self.word(ids) + self.position(positions) + self.token_type(token_types)
        x = self.dropout(self.embed_norm(x), key=keys[0])
        mask = valid[:, None, None, :]  # padding: no query attends to a padded key
        for layer, layer_key in zip(self.layers, keys[1:], strict=True):
            x = layer(x, mask, key=layer_key)
        return x, jnp.tanh(self.pooler(x[:, 0]))


# Hugging Face name -> Taktiny name, written with the presets for PyTorch's layers: each
# maps one layer's parameters (a Linear's weight [out, in] to a kernel [in, out], a
# LayerNorm's weight to scale), and {i} carries the layer number across.
HF, OURS = "encoder.layer.{i}.", "layers.{i}."
RULES = [
    *convert.embedding("embeddings.word_embeddings", "word"),
    *convert.embedding("embeddings.position_embeddings", "position"),
    *convert.embedding("embeddings.token_type_embeddings", "token_type"),
    *convert.layer_norm("embeddings.LayerNorm", "embed_norm"),
    *convert.linear(HF + "attention.self.query", OURS + "attention.query"),
    *convert.linear(HF + "attention.self.key", OURS + "attention.key"),
    *convert.linear(HF + "attention.self.value", OURS + "attention.value"),
    *convert.linear(HF + "attention.output.dense", OURS + "attention.out"),
    *convert.layer_norm(HF + "attention.output.LayerNorm", OURS + "attention_norm"),
    *convert.linear(HF + "intermediate.dense", OURS + "intermediate"),
    *convert.linear(HF + "output.dense", OURS + "output"),
    *convert.layer_norm(HF + "output.LayerNorm", OURS + "output_norm"),
    *convert.linear("pooler.dense", "pooler"),
    *convert.buffers(),  # `embeddings.position_ids` and the like, in older files: dropped
]


def main():
    config = BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    reference = BertModel(config).eval()
    with torch.no_grad():  # move every parameter off its init (zero biases hide mistakes)
        for parameter in reference.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)

    abstract = jax.eval_shape(lambda: Bert(config, rngs=nn.Rngs(0)))  # no initialisation
    # every name checked (used once, every leaf made, shapes right) before anything converts
    flat = convert.convert(RULES, reference.state_dict(), target=abstract)
    model = abstract.load_flat_state_dict(flat, strict=True)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (2, 9))
    token_types = rng.integers(0, 2, (2, 9))
    valid = np.ones((2, 9), bool)
    valid[1, 6:] = False  # the second sequence is padded
    forward = jax.jit(lambda model, *inputs, key=None: model(*inputs, key=key))

    def theirs(torch_model):
        return lambda ids, token_types, valid: torch_model(
            torch.from_numpy(ids),
            attention_mask=torch.from_numpy(valid).long(),
            token_type_ids=torch.from_numpy(token_types),
        )

    ours = lambda *inputs: forward(model, *inputs)  # (hidden, pooled): paired in order
    # full float32 products: a GPU would otherwise multiply float32 in TF32 (docs/layers.md)
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        print("Taktiny against transformers:")
        print(convert.parity(ours, theirs(reference), ids, token_types, valid, tolerance=1e-5))

        # and back: Hugging Face's names and layouts, loaded strictly into a fresh BertModel
        exported = {
            k: torch.from_numpy(np.array(v)) for k, v in convert.export(RULES, model).items()
        }
        fresh = BertModel(config).eval()
        fresh.load_state_dict(exported, strict=True)
        print("exported back into a fresh BertModel (strict=True):")
        print(convert.parity(ours, theirs(fresh), ids, token_types, valid, tolerance=1e-5))

    inputs = (jnp.asarray(ids), jnp.asarray(token_types), jnp.asarray(valid))
    hidden, _ = forward(model, *inputs)
    dropped, _ = forward(model, *inputs, key=jax.random.key(0))  # training: dropout on
    print(f"with dropout (training), hidden states move by {np.abs(dropped - hidden).mean():.3f}")


if __name__ == "__main__":
    main()
