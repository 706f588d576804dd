"""A BERT encoder built from Taktiny layers, loaded from a Hugging Face `BertModel`.

The reference is a small random `transformers.BertModel` (nothing is downloaded). Its
state dict is converted by explicit name rules that refuse any name they do not know,
loaded strictly into a model built without initialising it, and both models run on the
same padded batch. Run `python examples/bert.py`: it prints the largest differences.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import BertConfig, BertModel

from taktiny import nn


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


# Hugging Face name -> Taktiny name. A 2D `weight` becomes a transposed `kernel` (torch's
# Linear is [out, in]); a 1D `weight` (LayerNorm) becomes `scale`.
LAYER = r"encoder\.layer\.(\d+)\."
RULES = [
    (r"embeddings\.(word|position|token_type)_embeddings\.weight", r"\1.embedding"),
    (r"embeddings\.LayerNorm\.(\w+)", r"embed_norm.\1"),
    (LAYER + r"attention\.self\.(query|key|value)\.(\w+)", r"layers.\1.attention.\2.\3"),
    (LAYER + r"attention\.output\.dense\.(\w+)", r"layers.\1.attention.out.\2"),
    (LAYER + r"attention\.output\.LayerNorm\.(\w+)", r"layers.\1.attention_norm.\2"),
    (LAYER + r"intermediate\.dense\.(\w+)", r"layers.\1.intermediate.\2"),
    (LAYER + r"output\.dense\.(\w+)", r"layers.\1.output.\2"),
    (LAYER + r"output\.LayerNorm\.(\w+)", r"layers.\1.output_norm.\2"),
    (r"pooler\.dense\.(\w+)", r"pooler.\1"),
]


def convert(torch_state):
    """A Hugging Face BertModel state dict -> a flat Taktiny state dict."""
    flat = {}
    for name, tensor in torch_state.items():
        rule = next((rule for rule in RULES if re.fullmatch(rule[0], name)), None)
        if rule is None:
            raise KeyError(f"no rule converts {name!r}; add one to RULES")
        target, value = re.sub(rule[0], rule[1], name), tensor.detach().numpy()
        if target.endswith(".weight"):
            stem = target.removesuffix(".weight")
            is_kernel = value.ndim == 2  # .T leaves a 1D scale as it is
            target, value = (stem + (".kernel" if is_kernel else ".scale"), value.T)
        flat[target] = value
    return flat


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
    model = abstract.load_flat_state_dict(convert(reference.state_dict()), strict=True)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (2, 9))
    token_types = rng.integers(0, 2, (2, 9))
    valid = np.ones((2, 9), bool)
    valid[1, 6:] = False  # the second sequence is padded
    with torch.no_grad():
        expected = reference(
            torch.from_numpy(ids),
            attention_mask=torch.from_numpy(valid).long(),
            token_type_ids=torch.from_numpy(token_types),
        )
    forward = jax.jit(lambda model, *inputs, key=None: model(*inputs, key=key))
    inputs = (jnp.asarray(ids), jnp.asarray(token_types), jnp.asarray(valid))
    hidden, pooled = forward(model, *inputs)
    errors = {
        "last_hidden_state": np.abs(hidden - expected.last_hidden_state.numpy()).max(),
        "pooler_output": np.abs(pooled - expected.pooler_output.numpy()).max(),
    }
    for name, error in errors.items():
        print(f"{name:18} max abs error {error:.2e}")
    assert max(errors.values()) <= 1e-5, errors
    dropped, _ = forward(model, *inputs, key=jax.random.key(0))  # training: dropout on
    print(f"with dropout (training), hidden states move by {np.abs(dropped - hidden).mean():.3f}")


if __name__ == "__main__":
    main()
