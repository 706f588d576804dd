"""A GPT-2 causal decoder built from Taktiny layers, loaded from Hugging Face's `GPT2LMHeadModel`.

The reference is a small random `transformers.GPT2LMHeadModel` (nothing is downloaded).
GPT-2 stores its projections as `Conv1D` weights [in, out], which is already Taktiny's
kernel layout; its fused query/key/value projection `c_attn` is split in three. The output
projection is tied to the token embedding (`Embed.attend`). `RULES` loads the folder
`save_pretrained` writes (which leaves the tied `lm_head.weight` out) and exports the model
back into a folder that `GPT2LMHeadModel.from_pretrained` loads with no missing or
unexpected names; `convert.parity` compares the logits both times. An inference model:
examples/bert.py shows how dropout keys thread through a model for training. Run `python
examples/gpt2.py`: it prints the largest difference in the logits.
"""

import functools
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from taktiny import convert, nn
from taktiny.io import load_safetensors, save_safetensors


class Block(nn.Module):
    def __init__(self, config: GPT2Config, *, rngs: nn.Rngs):
        width, eps = config.n_embd, config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(width, epsilon=eps)
        self.attention = nn.MultiHeadAttention(config.n_head, width, rngs=rngs)
        self.ln_2 = nn.LayerNorm(width, epsilon=eps)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width, rngs=rngs),
            functools.partial(jax.nn.gelu, approximate=True),  # GPT-2's "gelu_new"
            nn.Linear(4 * width, width, rngs=rngs),
        )

    def __call__(self, x):
        x = x + self.attention(self.ln_1(x), causal=True)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """Token ids [batch, length] -> next-token logits [batch, length, vocab]."""

    def __init__(self, config: GPT2Config, *, rngs: nn.Rngs):
        self.token = nn.Embed(config.vocab_size, config.n_embd, rngs=rngs)
        self.position = nn.Embed(config.n_positions, config.n_embd, rngs=rngs)
        self.blocks = [Block(config, rngs=rngs) for _ in range(config.n_layer)]
        self.ln_f = nn.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon)

    def __call__(self, ids):
        x = self.token(ids) + self.position(jnp.arange(ids.shape[-1]))
        for block in self.blocks:
            x = block(x)
        return self.token.attend(self.ln_f(x))  # the output projection is the embedding


def conv1d(source, target):
    """Hugging Face's `Conv1D` (GPT-2's linear layer) stores its weight [in, out]: already
    Taktiny's kernel layout, so unlike `convert.linear` nothing is transposed."""
    return [
        convert.Rule(f"{source}.weight", f"{target}.kernel"),
        convert.Rule(f"{source}.bias", f"{target}.bias"),
    ]


# Hugging Face name -> Taktiny name, written with the presets; {i} carries the block
# number across. `c_attn` holds query, key and value side by side on its output axis: split
# in three. `lm_head.weight` is the token embedding itself: a Tie reads it as that (checking
# that both are equal where a file holds both) and, as save_pretrained, exports it once.
HF, OURS = "transformer.h.{i}.", "blocks.{i}."
QKV = ("query", "key", "value")
RULES = [
    *convert.embedding("transformer.wte", "token"),
    *convert.embedding("transformer.wpe", "position"),
    *convert.layer_norm(HF + "ln_1", OURS + "ln_1"),
    convert.Rule(
        HF + "attn.c_attn.weight",
        [OURS + f"attention.{name}.kernel" for name in QKV],
        convert.split(axis=1),
    ),
    convert.Rule(
        HF + "attn.c_attn.bias",
        [OURS + f"attention.{name}.bias" for name in QKV],
        convert.split(axis=0),
    ),
    *conv1d(HF + "attn.c_proj", OURS + "attention.out"),
    *convert.layer_norm(HF + "ln_2", OURS + "ln_2"),
    *conv1d(HF + "mlp.c_fc", OURS + "mlp.layers.0"),  # a Sequential: layers.1 is the gelu
    *conv1d(HF + "mlp.c_proj", OURS + "mlp.layers.2"),
    *convert.layer_norm("transformer.ln_f", "ln_f"),
    convert.Tie("lm_head.weight", same_as="transformer.wte.weight"),
    *convert.buffers(),  # the causal masks `attn.bias` of older files: dropped
]


def main():
    config = GPT2Config(
        vocab_size=99,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # move every parameter off its init (zero biases hide mistakes)
        for parameter in reference.parameters():  # (the tied embedding appears once)
            parameter.add_(torch.randn_like(parameter) * 0.1)

    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)  # what people download: no lm_head.weight in it
        abstract = jax.eval_shape(lambda: GPT2(config, rngs=nn.Rngs(0)))  # no initialisation
        model = load_safetensors(abstract, folder, rules=RULES)  # every name checked first

    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 11))
    forward = jax.jit(lambda model, ids: model(ids))
    ours = lambda ids: forward(model, ids)
    # without the cache, a GPT2LMHeadModel's output holds the logits only: named "logits"
    theirs = lambda torch_model: lambda ids: torch_model(torch.from_numpy(ids), use_cache=False)
    # full float32 products: a GPU would otherwise multiply float32 in TF32 (docs/layers.md)
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        print("Taktiny against transformers:")
        print(convert.parity(ours, theirs(reference), ids, tolerance=1e-5))

        # and back: Conv1D layouts, c_attn joined again, into a folder from_pretrained reads
        with tempfile.TemporaryDirectory() as folder:
            save_safetensors(Path(folder) / "model.safetensors", convert.export(RULES, model))
            config.save_pretrained(folder)
            fresh, info = GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mis-shaped names
        print("exported back through save_safetensors into GPT2LMHeadModel.from_pretrained:")
        print(convert.parity(ours, theirs(fresh.eval()), ids, tolerance=1e-5))

    logits = forward(model, jnp.asarray(ids))
    # causal: changing the last token leaves every earlier position's logits as they were
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % config.vocab_size
    other = forward(model, jnp.asarray(changed))
    assert np.array_equal(other[:, :-1], logits[:, :-1]) and not np.allclose(other, logits)
    print("causal: earlier positions do not see later tokens")


if __name__ == "__main__":
    main()
