"""A BERT encoder (`taktiny.models.Encoder`), loaded from a Hugging Face `BertModel`.

The reference is a small random `transformers.BertModel` (nothing is downloaded). Its
state dict is converted by `RULES` (`models.rules`, built from `taktiny.convert`'s
presets for PyTorch's layers); the conversion is checked name by name before anything
converts, loaded strictly into a model built without initialising it, and both models run
on the same padded batch (`convert.parity`). The model is then exported back into a fresh
`BertModel`, loaded with strict=True, and compared again.

Then the scanned variant (`Bert(config, rngs=..., scanned=True)`): its encoder layers are one
`nn.Stack` (each parameter [layers, ...]) run by `jax.lax.scan`, the padding mask given to
every layer as it is. The same `RULES` load the folder `save_pretrained` writes straight into
it (each layer's tensors streamed into their slices of the stacked arrays, checked name by
name and loaded strictly into a model built without initialising it), and export it back
into a folder that `BertModel.from_pretrained` loads with no missing or unexpected names;
`convert.parity` compares it with transformers both times. Its per-layer state
(`tt.flat_state_dict(scanned, unstacked=True)`) is the unrolled model's, bit for bit, and
with the same dropout key both variants drop the same activations. Run
`python examples/bert.py`: it prints the largest differences. docs/converting.md walks
through the unrolled model.
"""

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import BertConfig, BertModel

import taktiny as tt
from taktiny import convert, models, nn
from taktiny.io import load_safetensors, save_safetensors

EncoderLayer = models.EncoderLayer  # (the package's: one layer of the Encoder)


def Bert(config: BertConfig, *, rngs: nn.Rngs, scanned: bool = False) -> models.Encoder:
    """Token ids [batch, length] -> hidden states [batch, length, hidden] and the pooled
    first token [batch, hidden]: `taktiny.models.Encoder`, built from transformers'
    `BertConfig` (its `to_dict()` is what a config.json holds). Dropout runs only when a
    `key` is given.

    `scanned=True` holds the encoder layers as one `nn.Stack` (each parameter
    [layers, ...]) run by `jax.lax.scan`: jit compiles one layer whatever the depth. Its
    per-layer names (`layers.1.attention.query.kernel`) are those of the list of layers,
    so the same rules load and export both; with the same `key`, both drop the same
    activations (each layer's key is split from one key for all the layers)."""
    return models.Encoder(
        models.EncoderConfig.from_hf(config.to_dict()), scanned=scanned, rngs=rngs
    )


# The small random BERT this example builds (nothing is downloaded).
CONFIG = BertConfig(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
    attn_implementation="eager",
)
# Hugging Face name -> Taktiny name, from `taktiny.models.rules`: written with the
# presets for PyTorch's layers, each mapping one layer's parameters (a Linear's weight
# [out, in] to a kernel [in, out], a LayerNorm's weight to scale), {i} carrying the layer
# number across; `embeddings.position_ids` and the like, in older files, dropped. Every
# BERT's rules are the same (they load the other configs of tests/convert too).
RULES = models.rules(models.EncoderConfig.from_hf(CONFIG.to_dict()))


def main():
    config = CONFIG
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

        # scanned: the layers one nn.Stack, loaded by the same rules from the folder that
        # save_pretrained writes (the files people download), each layer's tensors streamed
        # into their slices; every name checked before anything loads, strictly
        with tempfile.TemporaryDirectory() as folder:
            reference.save_pretrained(folder)
            abstract = jax.eval_shape(lambda: Bert(config, rngs=nn.Rngs(0), scanned=True))
            scanned = load_safetensors(abstract, folder, rules=RULES)
        stacked = lambda *inputs: forward(scanned, *inputs)
        print("Taktiny against transformers (scanned):")
        print(convert.parity(stacked, theirs(reference), ids, token_types, valid, tolerance=1e-5))

        # and back: export names the layers one by one, as BertModel does
        with tempfile.TemporaryDirectory() as folder:
            save_safetensors(Path(folder) / "model.safetensors", convert.export(RULES, scanned))
            config.save_pretrained(folder)
            loaded, info = BertModel.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mis-shaped names
        loaded.eval().set_attn_implementation("eager")
        print("exported back through save_safetensors into BertModel.from_pretrained (scanned):")
        print(convert.parity(stacked, theirs(loaded), ids, token_types, valid, tolerance=1e-5))

    # read per layer, the stacked arrays are the unrolled model's: same names in the same
    # order, same dtypes, same bits
    unrolled, per_layer = tt.flat_state_dict(model), tt.flat_state_dict(scanned, unstacked=True)
    same = list(unrolled) == list(per_layer) and all(
        unrolled[name].dtype == per_layer[name].dtype
        and np.array_equal(unrolled[name], per_layer[name])
        for name in unrolled
    )
    print(f"scanned per-layer state equals the unrolled model's, bit for bit: {same}")

    inputs = (jnp.asarray(ids), jnp.asarray(token_types), jnp.asarray(valid))
    hidden, _ = forward(model, *inputs)
    dropped, _ = forward(model, *inputs, key=jax.random.key(0))  # training: dropout on
    print(f"with dropout (training), hidden states move by {np.abs(dropped - hidden).mean():.3f}")
    scanned_dropped, _ = forward(scanned, *inputs, key=jax.random.key(0))
    apart = np.abs(scanned_dropped - dropped).max()
    print(f"with the same dropout key, scanned and unrolled differ by at most {apart:.2e}")


if __name__ == "__main__":
    main()
