"""A GPT-2 causal decoder built from Taktiny layers, loaded from Hugging Face's `GPT2LMHeadModel`.

The reference is a small random `transformers.GPT2LMHeadModel` (nothing is downloaded).
GPT-2 stores its projections as `Conv1D` weights [in, out], which is already Taktiny's
kernel layout; its fused query/key/value projection `c_attn` is split in three. The
output projection is tied to the token embedding (`Embed.attend`). An inference model:
examples/bert.py shows how dropout keys thread through a model for training. Run
`python examples/gpt2.py`: it prints the largest difference in the logits.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from taktiny import nn


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


# Hugging Face name -> Taktiny name(s); several names split the value in equal parts along
# its last axis. A 2D `weight` is a kernel (Conv1D is [in, out]); a 1D one a LayerNorm scale.
QKV = ("query", "key", "value")
BLOCK = r"transformer\.h\.(\d+)\."
RULES = [
    (r"transformer\.wte\.weight", ["token.embedding"]),
    (r"transformer\.wpe\.weight", ["position.embedding"]),
    (BLOCK + r"(ln_1|ln_2)\.(\w+)", [r"blocks.\1.\2.\3"]),
    (BLOCK + r"attn\.c_attn\.(\w+)", [rf"blocks.\1.attention.{n}.\2" for n in QKV]),
    (BLOCK + r"attn\.c_proj\.(\w+)", [r"blocks.\1.attention.out.\2"]),
    (BLOCK + r"mlp\.c_fc\.(\w+)", [r"blocks.\1.mlp.layers.0.\2"]),
    (BLOCK + r"mlp\.c_proj\.(\w+)", [r"blocks.\1.mlp.layers.2.\2"]),
    (r"transformer\.ln_f\.(\w+)", [r"ln_f.\1"]),
    (r"lm_head\.weight", []),  # tied to transformer.wte.weight: checked, nothing to load
]


def convert(torch_state):
    """A Hugging Face GPT2LMHeadModel state dict -> a flat Taktiny state dict."""
    lm_head, wte = torch_state["lm_head.weight"], torch_state["transformer.wte.weight"]
    if not torch.equal(lm_head, wte):
        raise ValueError("lm_head.weight differs from transformer.wte.weight: not a tied model")
    flat = {}
    for name, tensor in torch_state.items():
        rule = next((rule for rule in RULES if re.fullmatch(rule[0], name)), None)
        if rule is None:
            raise KeyError(f"no rule converts {name!r}; add one to RULES")
        value = tensor.detach().numpy()
        targets = [re.sub(rule[0], target, name) for target in rule[1]]
        for target, part in zip(
            targets, np.split(value, max(len(targets), 1), axis=-1), strict=False
        ):
            if target.endswith(".weight"):
                stem = target.removesuffix(".weight")
                target = stem + (".kernel" if part.ndim == 2 else ".scale")
            flat[target] = part
    return flat


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

    abstract = jax.eval_shape(lambda: GPT2(config, rngs=nn.Rngs(0)))  # no initialisation
    model = abstract.load_flat_state_dict(convert(reference.state_dict()), strict=True)

    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 11))
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)).logits.numpy()
    forward = jax.jit(lambda model, ids: model(ids))
    logits = forward(model, jnp.asarray(ids))
    error = np.abs(logits - expected).max()
    print(f"logits             max abs error {error:.2e}")
    assert error <= 1e-5, error
    # causal: changing the last token leaves every earlier position's logits as they were
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % config.vocab_size
    other = forward(model, jnp.asarray(changed))
    assert np.array_equal(other[:, :-1], logits[:, :-1]) and not np.allclose(other, logits)
    print("causal: earlier positions do not see later tokens")


if __name__ == "__main__":
    main()
