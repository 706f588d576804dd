"""A ResNet built from Taktiny layers, loaded from Hugging Face's `ResNetModel`.

The references are two small random `transformers.ResNetModel`s (nothing is downloaded):
one of basic blocks (two 3x3 convolutions) and one of bottleneck blocks (1x1, 3x3, 1x1).
Every convolution is a `Conv` without bias followed by a `BatchNorm`, which infers with
its running statistics; the stem's max pooling is a `MaxPool` and the pooled output a
`GlobalAvgPool`. Taktiny is channels-last, so the NCHW pixel values transpose to NHWC on
the way in, and the reference's last hidden state [batch, channels, height, width]
transposes to [batch, height, width, channels] to be compared. `RULES` converts the state
dict (checked name by name, loaded strictly into a model built without initialising it)
and exports the model back into a fresh `ResNetModel` (strict=True); `convert.parity`
compares the last hidden state and the pooled output both times, at full float32
precision. Run `python examples/resnet.py`: it prints the largest differences.
"""

import jax
import numpy as np
import torch
from transformers import ResNetConfig, ResNetModel

from taktiny import convert, nn


class ConvNorm(nn.Module):
    """Transformers' ResNetConvLayer (and its shortcut) without the activation: a square
    convolution without bias padded by half its window, as PyTorch pads, then BatchNorm."""

    def __init__(self, in_features: int, out_features: int, window: int, strides: int = 1,
                 *, rngs: nn.Rngs):  # fmt: skip
        self.conv = nn.Conv(
            in_features, out_features, (window, window), strides=strides,
            padding=window // 2, use_bias=False, rngs=rngs,
        )  # fmt: skip
        self.norm = nn.BatchNorm(out_features)  # epsilon 1e-5, as torch's BatchNorm2d

    def __call__(self, x):
        return self.norm(self.conv(x))


class Block(nn.Module):
    """A residual block: basic (3x3, 3x3) or bottleneck (1x1 down to a quarter of the
    channels, 3x3, 1x1 back up); a 1x1 shortcut where the channels or the size change."""

    def __init__(self, config: ResNetConfig, in_features: int, out_features: int,
                 strides: int, *, rngs: nn.Rngs):  # fmt: skip
        if config.layer_type == "bottleneck":
            inner, early = out_features // 4, config.downsample_in_bottleneck
            self.layers = [  # the stride on the first 1x1 (early) or on the 3x3
                ConvNorm(in_features, inner, 1, strides if early else 1, rngs=rngs),
                ConvNorm(inner, inner, 3, 1 if early else strides, rngs=rngs),
                ConvNorm(inner, out_features, 1, rngs=rngs),
            ]
        else:
            self.layers = [
                ConvNorm(in_features, out_features, 3, strides, rngs=rngs),
                ConvNorm(out_features, out_features, 3, rngs=rngs),
            ]
        self.shortcut = None
        if in_features != out_features or strides != 1:
            self.shortcut = ConvNorm(in_features, out_features, 1, strides, rngs=rngs)

    def __call__(self, x):
        residual = x if self.shortcut is None else self.shortcut(x)
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return jax.nn.relu(self.layers[-1](x) + residual)


class ResNet(nn.Module):
    """Images [batch, height, width, channels] (channels last) -> the last hidden state
    [batch, height / 2^(1 + stages), width / 2^(1 + stages), hidden_sizes[-1]] (halved,
    rounded up, by the stem, the max pool and every stage but the first) and its mean
    over the spatial axes [batch, hidden_sizes[-1]]."""

    def __init__(self, config: ResNetConfig, *, rngs: nn.Rngs):
        self.stem = ConvNorm(config.num_channels, config.embedding_size, 7, 2, rngs=rngs)
        self.pool = nn.MaxPool((3, 3), strides=2, padding=1)
        # typed optional in ResNetConfig, but always set (its defaults are ResNet-50's)
        depths, widths = list(config.depths or ()), list(config.hidden_sizes or ())
        sizes = [config.embedding_size, *widths]
        self.stages = []
        for stage, depth in enumerate(depths):  # each stage but the first halves
            halves = stage > 0 or config.downsample_in_first_stage
            inputs, outputs = sizes[stage], sizes[stage + 1]
            first = Block(config, inputs, outputs, 2 if halves else 1, rngs=rngs)
            rest = [Block(config, outputs, outputs, 1, rngs=rngs) for _ in range(depth - 1)]
            self.stages.append([first, *rest])
        self.pooler = nn.GlobalAvgPool()

    def __call__(self, images):
        x = self.pool(jax.nn.relu(self.stem(images)))
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return x, self.pooler(x)


def conv_norm(source: str, target: str):
    """One ConvNorm: `convert.conv` moves the weight [out, in, h, w] to the kernel
    [h, w, in, out]; `convert.batch_norm` renames weight, bias, running_mean and
    running_var to scale, bias, mean and var (and ignores num_batches_tracked, exporting 0)."""
    return [
        *convert.conv(source + ".convolution", target + ".conv", dims=2, bias=False),
        *convert.batch_norm(source + ".normalization", target + ".norm"),
    ]


# Hugging Face name -> Taktiny name; {s} and {b} carry the stage and block numbers across,
# {k} the convolution within a block. The max and average pools have no state.
HF, OURS = "encoder.stages.{s}.layers.{b}.", "stages.{s}.{b}."
RULES = [
    *conv_norm("embedder.embedder", "stem"),
    *conv_norm(HF + "layer.{k}", OURS + "layers.{k}"),
    *conv_norm(HF + "shortcut", OURS + "shortcut"),
]


def randomised(config: ResNetConfig) -> ResNetModel:
    """A ResNetModel for inference, every parameter and running statistic moved off its
    init (a zero bias, a unit variance or a zero mean would hide a mistake)."""
    model = ResNetModel(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
        for name, buffer in model.named_buffers():  # the BatchNorms' running statistics
            if name.endswith("running_mean"):
                buffer.normal_(0.0, 0.5)
            elif name.endswith("running_var"):
                buffer.uniform_(1.0, 4.0)  # positive, and activations stay O(10)
    return model


def compare(name: str, config: ResNetConfig, pixels: np.ndarray):
    """Converts a random ResNetModel of `config`, compares, exports back and compares again."""
    torch.manual_seed(0)
    reference = randomised(config)
    abstract = jax.eval_shape(lambda: ResNet(config, rngs=nn.Rngs(0)))  # no initialisation
    # every name checked (used once, every leaf made, shapes right) before anything converts
    flat = convert.convert(RULES, reference.state_dict(), target=abstract)
    model = abstract.load_flat_state_dict(flat, strict=True)

    forward = jax.jit(lambda model, images: model(images))
    ours = lambda pixels: forward(model, pixels.transpose(0, 2, 3, 1))  # NCHW -> NHWC

    def theirs(torch_model):
        def run(pixels):
            out = torch_model(torch.from_numpy(pixels))
            return {  # channels last, and the pooled [batch, channels, 1, 1] flattened
                "last_hidden_state": out.last_hidden_state.permute(0, 2, 3, 1),
                "pooler_output": out.pooler_output.flatten(1),
            }

        return run

    # full float32 convolutions: a GPU would otherwise default to TF32
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        print(f"Taktiny against transformers ({name}):")
        print(convert.parity(ours, theirs(reference), pixels, tolerance=1e-4))

        # and back: torch's layouts and names, num_batches_tracked written as 0
        exported = {
            k: torch.from_numpy(np.array(v)) for k, v in convert.export(RULES, model).items()
        }
        fresh = ResNetModel(config).eval()
        fresh.load_state_dict(exported, strict=True)
        print(f"exported back into a fresh ResNetModel ({name}, strict=True):")
        print(convert.parity(ours, theirs(fresh), pixels, tolerance=1e-4))


def main():
    # not square, so that a swap of height and width shows: 32 x 48 -> 2 x 3 at the end
    pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 48), dtype=np.float32)
    basic = ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64], depths=[2, 1, 1],
        layer_type="basic",
    )  # fmt: skip
    bottleneck = ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[32, 64, 128], depths=[2, 1, 1],
        layer_type="bottleneck", downsample_in_bottleneck=True,  # the stride on the 1st 1x1
    )  # fmt: skip
    compare("basic", basic, pixels)
    compare("bottleneck", bottleneck, pixels)


if __name__ == "__main__":
    main()
