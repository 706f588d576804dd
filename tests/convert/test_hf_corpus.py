"""Checkpoints as people have them: the folders transformers' `save_pretrained` writes, for
small random Llama (tied and untied, grouped-query attention, Llama 3.1's scaled rotary
embeddings), GPT-2, BERT, ViT and ResNet models, in float32 as one file and in bfloat16
sharded with an index; and the real all-MiniLM-L6-v2 file. Every example's rules load
each, with nothing added, strictly, through `convert.convert` and through
`load_safetensors`, to transformers' outputs; and the export of each model, saved with
`save_safetensors`, is a folder `from_pretrained` loads with no missing or unexpected
names."""

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from _minilm import minilm_folder
from _torch import assert_close

import taktiny as tt
from examples import bert, gpt2, llama, resnet, vit
from taktiny import convert, nn
from taktiny.io import load_safetensors, open_safetensors, save_safetensors

transformers.utils.logging.disable_progress_bar()  # (their bars would fill the test log)
RNG = np.random.default_rng(0)
IDS = RNG.integers(0, 99, (2, 9))
VALID = np.arange(9) < np.array([[9], [6]])  # the second sequence padded
PIXELS = RNG.standard_normal((2, 3, 32, 32), dtype=np.float32)  # NCHW, as transformers


@dataclass(frozen=True)
class Kind:
    """One model kind: transformers' class and config, the example's model and rules, and
    how each side is called on the inputs (transformers' outputs as a dict of arrays)."""

    theirs: Any  # a transformers model class
    config: Callable[[], Any]
    ours: Callable[[Any], Any]
    rules: list[Any]
    inputs: tuple[np.ndarray, ...]
    call_ours: Callable[..., Any]
    call_theirs: Callable[..., dict[str, torch.Tensor]]


def _lm(model, ids):
    return {"logits": model(torch.from_numpy(ids), use_cache=False).logits}


def _bert(model, ids, valid):
    out = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(valid).long())
    return {"hidden": out.last_hidden_state, "pooled": out.pooler_output}


def _vit(model, pixels):
    out = model(torch.from_numpy(pixels))
    return {"hidden": out.last_hidden_state, "pooled": out.pooler_output}


def _resnet(model, pixels):
    out = model(torch.from_numpy(pixels))
    return {
        "hidden": out.last_hidden_state.permute(0, 2, 3, 1),
        "pooled": out.pooler_output.flatten(1),
    }


KINDS = {
    "llama-tied": Kind(
        transformers.LlamaForCausalLM, lambda: llama.llama_config(tied=True),
        lambda c: llama.Llama(c, rngs=nn.Rngs(0)), llama.TIED_RULES, (IDS,),
        lambda m, ids: {"logits": m(ids)}, _lm,
    ),
    "llama-untied": Kind(
        transformers.LlamaForCausalLM, lambda: llama.llama_config(tied=False),
        lambda c: llama.Llama(c, rngs=nn.Rngs(0)), llama.UNTIED_RULES, (IDS,),
        lambda m, ids: {"logits": m(ids)}, _lm,
    ),
    "gpt2": Kind(
        transformers.GPT2LMHeadModel,
        lambda: transformers.GPT2Config(vocab_size=99, n_positions=16, n_embd=32, n_layer=2,
                                        n_head=4, bos_token_id=0, eos_token_id=0),
        lambda c: gpt2.GPT2(c, rngs=nn.Rngs(0)), gpt2.RULES, (IDS,),
        lambda m, ids: {"logits": m(ids)}, _lm,
    ),
    "bert": Kind(
        transformers.BertModel,
        lambda: transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=37,
                                        max_position_embeddings=16),
        lambda c: bert.Bert(c, rngs=nn.Rngs(0)), bert.RULES, (IDS, VALID),
        lambda m, ids, valid: dict(zip(["hidden", "pooled"], m(ids, jnp.zeros_like(ids), valid), strict=True)),
        _bert,
    ),
    "vit": Kind(
        transformers.ViTModel,
        lambda: transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=48),
        lambda c: vit.ViT(c, rngs=nn.Rngs(0)), vit.RULES, (PIXELS,),
        lambda m, pixels: dict(zip(["hidden", "pooled"], m(pixels.transpose(0, 2, 3, 1)), strict=True)),
        _vit,
    ),
    "resnet": Kind(
        transformers.ResNetModel,
        lambda: transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                          depths=[1, 1], layer_type="basic"),
        lambda c: resnet.ResNet(c, rngs=nn.Rngs(0)), resnet.RULES, (PIXELS,),
        lambda m, pixels: dict(zip(["hidden", "pooled"], m(pixels.transpose(0, 2, 3, 1)), strict=True)),
        _resnet,
    ),
}  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def reference(kind: str) -> Any:
    """transformers' model of `kind`, in eval mode, every parameter and running statistic
    moved off its init (a zero bias or a unit norm would hide a mistake)."""
    torch.manual_seed(0)
    model = KINDS[kind].theirs(KINDS[kind].config()).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # (a tied embedding appears once)
            parameter.add_(torch.randn_like(parameter) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.normal_(0.0, 0.5)
            elif name.endswith("running_var"):
                buffer.uniform_(1.0, 4.0)
    return model


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Callable[[str, str, bool], Path]:
    """The folder save_pretrained wrote for (kind, dtype, sharded), made once a session."""

    @functools.cache
    def folder(kind: str, dtype: str, sharded: bool) -> Path:
        path = tmp_path_factory.mktemp(f"{kind}-{dtype}-{'sharded' if sharded else 'one'}")
        model = reference(kind).to(DTYPES[dtype])
        model.save_pretrained(path, max_shard_size="8KB" if sharded else "5GB")
        return path

    return folder


@functools.cache
def forward(kind: str) -> Callable[..., Any]:
    """The jitted forward of `kind` (one per kind: every variant compiles once)."""
    return jax.jit(KINDS[kind].call_ours)


def assert_same_outputs(kind: str, ours: Any, theirs: Any, tolerance: float = 1e-4) -> None:
    """Our model's outputs against a transformers model's, at full float32 precision."""
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        mine = forward(kind)(ours, *KINDS[kind].inputs)
        expected = KINDS[kind].call_theirs(theirs.float().eval(), *KINDS[kind].inputs)
    assert mine.keys() == expected.keys()
    for name, value in expected.items():
        assert_close(mine[name], value.detach().numpy(), tolerance)


# each kind in both dtypes and both layouts, in two folders (the four would double the time)
@pytest.mark.parametrize(
    ("dtype", "sharded"), [("float32", False), ("bfloat16", True)], ids=["float32", "bf16-sharded"]
)
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_example_loads_what_save_pretrained_writes(corpus, kind, dtype, sharded):
    folder = corpus(kind, dtype, sharded)
    assert (folder / "model.safetensors.index.json").exists() == sharded
    spec = KINDS[kind]
    abstract = jax.eval_shape(lambda: spec.ours(spec.config()))
    streamed = load_safetensors(abstract, folder, rules=spec.rules)  # strict by default
    checkpoint = open_safetensors(folder)
    report = convert.check(spec.rules, checkpoint, target=abstract)
    assert report.allowed == ()
    converted = abstract.load_flat_state_dict(
        convert.convert(spec.rules, checkpoint, target=abstract), strict=True
    )
    for name, leaf in tt.flat_state_dict(streamed).items():  # both ways load the same bits
        assert leaf.dtype == jnp.float32, name
        np.testing.assert_array_equal(leaf, tt.flat_state_dict(converted)[name], err_msg=name)
    theirs = spec.theirs.from_pretrained(folder, dtype=torch.float32)
    assert_same_outputs(kind, streamed, theirs)


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_export_saved_with_save_safetensors_is_what_from_pretrained_loads(
    corpus, tmp_path, kind
):
    spec = KINDS[kind]
    abstract = jax.eval_shape(lambda: spec.ours(spec.config()))
    model = load_safetensors(abstract, corpus(kind, "float32", False), rules=spec.rules)
    save_safetensors(tmp_path / "model.safetensors", convert.export(spec.rules, model))
    spec.config().save_pretrained(tmp_path)
    fresh, info = spec.theirs.from_pretrained(tmp_path, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected, misfit
    assert_same_outputs(kind, model, fresh)
    # a tied model's lm_head.weight is left out, as save_pretrained leaves it out
    assert ("lm_head.weight" in open_safetensors(tmp_path)) == (kind == "llama-untied")


def test_the_real_minilm_checkpoint_loads_with_the_bert_example_rules():
    folder = minilm_folder()
    config = transformers.BertConfig.from_pretrained(folder)
    abstract = jax.eval_shape(lambda: bert.Bert(config, rngs=nn.Rngs(0)))
    checkpoint = open_safetensors(folder / "model.safetensors")
    assert checkpoint["embeddings.position_ids"].dtype == np.int64  # a buffer, not a weight
    report = convert.check(bert.RULES, checkpoint, target=abstract)
    assert report.ignored == ("embeddings.position_ids",)
    model = load_safetensors(abstract, folder / "model.safetensors", rules=bert.RULES)
    theirs = transformers.BertModel.from_pretrained(folder).eval()
    ids = RNG.integers(0, config.vocab_size, (2, 9))
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        hidden, pooled = model(jnp.asarray(ids), jnp.zeros_like(ids), jnp.asarray(VALID))
        out = theirs(torch.from_numpy(ids), attention_mask=torch.from_numpy(VALID).long())
    assert_close(hidden, out.last_hidden_state.numpy(), 1e-4)
    assert_close(pooled, out.pooler_output.numpy(), 1e-4)
    names = json.loads((folder / "config.json").read_text())["architectures"]
    assert names == ["BertModel"]
