"""A Vision Transformer encoder built from Taktiny layers, loaded from Hugging Face's `ViTModel`.

The reference is a small random `transformers.ViTModel` with its pooler (nothing is
downloaded). The patch embedding is a `Conv` whose window and stride are the patch size; the
class token and the position embeddings are plain arrays of the model. Taktiny is
channels-last, so the NCHW pixel values transpose to NHWC on the way in. `RULES` loads the
folder `save_pretrained` writes (checked name by name, loaded strictly into a model built
without initialising it) and exports the model back into a folder that
`ViTModel.from_pretrained` loads with no missing or unexpected names; `convert.parity`
compares the hidden states and the pooled output both times, at full float32 matmul
precision. An inference model: examples/bert.py shows how dropout keys thread through a
model for training. Run `python examples/vit.py`: it prints the largest differences.
"""

import functools
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import ViTConfig, ViTModel

from taktiny import convert, nn
from taktiny.io import load_safetensors, save_safetensors


def pair(size: int | Sequence[int]) -> tuple[int, int]:
    """A ViTConfig size: an int for a square, or (height, width)."""
    height, width = (size, size) if isinstance(size, int) else size
    return height, width


class EncoderLayer(nn.Module):
    """Pre-norm: each block normalises its input and adds its output to the residual."""

    def __init__(self, config: ViTConfig, *, rngs: nn.Rngs):
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.layernorm_before = nn.LayerNorm(hidden, epsilon=eps)
        self.attention = nn.MultiHeadAttention(config.num_attention_heads, hidden, rngs=rngs)
        self.layernorm_after = nn.LayerNorm(hidden, epsilon=eps)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, config.intermediate_size, rngs=rngs),
            functools.partial(jax.nn.gelu, approximate=False),  # ViT's "gelu": exact
            nn.Linear(config.intermediate_size, hidden, rngs=rngs),
        )

    def __call__(self, x):
        x = x + self.attention(self.layernorm_before(x))
        return x + self.mlp(self.layernorm_after(x))


class ViT(nn.Module):
    """Images [batch, height, width, channels] (channels last) -> hidden states
    [batch, 1 + patches, hidden] (the class token first) and the pooled class token
    [batch, hidden]."""

    def __init__(self, config: ViTConfig, *, rngs: nn.Rngs):
        hidden, patch = config.hidden_size, pair(config.patch_size)
        (height, width), (rows, columns) = pair(config.image_size), patch
        tokens = 1 + (height // rows) * (width // columns)
        self.patches = nn.Conv(
            config.num_channels, hidden, patch, strides=patch, padding="VALID", rngs=rngs
        )
        normal = lambda shape: 0.02 * jax.random.truncated_normal(rngs(), -2.0, 2.0, shape)
        self.class_token = normal((1, hidden))  # one token, put in front of the patches
        self.position = normal((tokens, hidden))  # one embedding per token
        self.layers = [EncoderLayer(config, rngs=rngs) for _ in range(config.num_hidden_layers)]
        self.layernorm = nn.LayerNorm(hidden, epsilon=config.layer_norm_eps)
        self.pooler = nn.Linear(hidden, hidden, rngs=rngs)

    def __call__(self, images):
        patches = self.patches(images)  # [batch, rows, columns, hidden]: one per patch
        batch, rows, columns, hidden = patches.shape
        if 1 + rows * columns != self.position.shape[0]:
            raise ValueError(
                f"ViT has {self.position.shape[0]} position embeddings (the class token and "
                f"{self.position.shape[0] - 1} patches), but images {images.shape[1:3]} make "
                f"{rows} x {columns} patches; resize the images to the size it was built for."
            )
        patches = patches.reshape(batch, rows * columns, hidden)  # row by row, as torch's
        first = jnp.broadcast_to(self.class_token, (batch, 1, hidden))
        x = jnp.concatenate([first, patches], axis=1) + self.position
        for layer in self.layers:
            x = layer(x)
        x = self.layernorm(x)
        return x, jnp.tanh(self.pooler(x[:, 0]))


# Hugging Face name -> Taktiny name, written with the presets; {i} carries the layer number
# across. The names are those of the files (`save_pretrained` writes them, and every ViT
# checkpoint holds them): transformers 5 renames the modules in memory (to
# `layers.{i}.attention.q_proj`) but reads and writes files under these. The patch
# projection is a Conv2d: `convert.conv` moves its weight [out, in, h, w] to the kernel
# [h, w, in, out]. Torch keeps a leading axis of 1 on the class token [1, 1, hidden] and the
# position embeddings [1, tokens, hidden] to broadcast over the batch; ours have none, so
# `unstack(0)` takes the one array that axis holds (and export stacks it back).
HF, OURS = "encoder.layer.{i}.", "layers.{i}."
RULES = [
    *convert.conv("embeddings.patch_embeddings.projection", "patches", dims=2),
    convert.Rule("embeddings.cls_token", "class_token", convert.unstack(0)),
    convert.Rule("embeddings.position_embeddings", "position", convert.unstack(0)),
    *convert.layer_norm(HF + "layernorm_before", OURS + "layernorm_before"),
    *convert.linear(HF + "attention.attention.query", OURS + "attention.query"),
    *convert.linear(HF + "attention.attention.key", OURS + "attention.key"),
    *convert.linear(HF + "attention.attention.value", OURS + "attention.value"),
    *convert.linear(HF + "attention.output.dense", OURS + "attention.out"),
    *convert.layer_norm(HF + "layernorm_after", OURS + "layernorm_after"),
    *convert.linear(HF + "intermediate.dense", OURS + "mlp.layers.0"),  # layers.1: the gelu
    *convert.linear(HF + "output.dense", OURS + "mlp.layers.2"),
    *convert.layer_norm("layernorm", "layernorm"),
    *convert.linear("pooler.dense", "pooler"),
]


def hugging_face(config: ViTConfig) -> ViTModel:
    """The reference: a ViTModel with its pooler (add_pooling_layer=True), for inference."""
    model = ViTModel(config).eval()
    model.set_attn_implementation("eager")  # attention written out: the plainest reference
    return model


def main():
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )
    torch.manual_seed(0)
    reference = hugging_face(config)
    with torch.no_grad():  # move every parameter off its init (zero biases hide mistakes)
        for parameter in reference.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)

    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)  # the files people download, under their names
        abstract = jax.eval_shape(lambda: ViT(config, rngs=nn.Rngs(0)))  # no initialisation
        # every name checked (used once, every leaf made, shapes right) before anything loads
        model = load_safetensors(abstract, folder, rules=RULES)

    pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)  # NCHW
    forward = jax.jit(lambda model, images: model(images))
    ours = lambda pixels: forward(model, pixels.transpose(0, 2, 3, 1))  # NCHW -> NHWC
    theirs = lambda torch_model: lambda pixels: torch_model(torch.from_numpy(pixels))
    # full float32 matmuls and convolutions: a GPU would otherwise default to TF32
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        print("Taktiny against transformers:")
        print(convert.parity(ours, theirs(reference), pixels, tolerance=1e-5))

        # and back: torch's layouts and the files' names, the leading axes of 1 stacked back
        # on, into a folder from_pretrained reads
        with tempfile.TemporaryDirectory() as folder:
            save_safetensors(Path(folder) / "model.safetensors", convert.export(RULES, model))
            config.save_pretrained(folder)
            fresh, info = ViTModel.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mis-shaped names
        fresh.eval().set_attn_implementation("eager")
        print("exported back through save_safetensors into ViTModel.from_pretrained:")
        print(convert.parity(ours, theirs(fresh), pixels, tolerance=1e-5))


if __name__ == "__main__":
    main()
