"""LoRA adapters to and from the `peft` package, on the Llama of examples/llama.py: an
``adapter_model.safetensors`` that PEFT writes loads through conversion rules onto the
adapted Taktiny model (logits equal to PEFT's), and Taktiny's adapters exported into a
folder that ``PeftModel.from_pretrained`` loads (logits equal again)."""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import taktiny as tt
from taktiny import convert, nn
from taktiny.io import load_safetensors, save_safetensors

pytestmark = [
    pytest.mark.program,  # builds and runs transformers models: too slow for every mutant
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

# PEFT's module name -> Taktiny's layer; PEFT's file prefixes the model's names with
# "base_model.model." and stores lora_A.weight [rank, in] and lora_B.weight [out, rank],
# the transposes of lora_a [in, rank] and lora_b [rank, out]
TARGETS = {
    "q_proj": "attention.query",
    "v_proj": "attention.value",
    "o_proj": "attention.out",
    "down_proj": "mlp.down",
}
HF = {"q_proj": "self_attn.", "v_proj": "self_attn.", "o_proj": "self_attn.", "down_proj": "mlp."}


def peft_rules():
    rules = []
    for module, ours in TARGETS.items():
        theirs = f"base_model.model.model.layers.{{i}}.{HF[module]}{module}"
        rules += [
            convert.Rule(f"{theirs}.lora_A.weight", f"layers.{{i}}.{ours}.lora_a", convert.transpose()),
            convert.Rule(f"{theirs}.lora_B.weight", f"layers.{{i}}.{ours}.lora_b", convert.transpose()),
        ]  # fmt: skip
    return rules


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(the transformers reference, the Taktiny model loaded from it, the config)."""
    import torch
    from llama import TIED_RULES, Llama, hugging_face, llama_config

    config = llama_config(tied=True)
    torch.manual_seed(0)
    reference = hugging_face(config)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    folder = tmp_path_factory.mktemp("llama")
    reference.save_pretrained(folder)
    abstract = jax.eval_shape(lambda: Llama(config, rngs=nn.Rngs(0)))
    return reference, load_safetensors(abstract, folder, rules=TIED_RULES), config


def logits(model, ids):
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(lambda m, i: m(i))(model, ids))


def test_a_peft_adapter_loads_onto_the_adapted_model_and_gives_peft_logits(llama, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model

    reference, model, config = llama
    lora_config = LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), lora_dropout=0.0)
    peft_model = get_peft_model(reference, lora_config).eval()
    torch.manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero: make the test see it
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.1)
    peft_model.save_pretrained(tmp_path)

    adapted = tt.lora(model, 4, where=[f"layers.*.{t}" for t in TARGETS.values()],
                      alpha=8, rngs=nn.Rngs(0))  # fmt: skip
    adapted = load_safetensors(
        adapted, tmp_path / "adapter_model.safetensors", rules=peft_rules(), strict=False
    )
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 9))
    with torch.no_grad():
        theirs = peft_model(torch.from_numpy(ids), use_cache=False).logits.numpy()
    ours = logits(adapted, jax.numpy.asarray(ids))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    assert np.abs(ours - logits(model, jax.numpy.asarray(ids))).max() > 1e-2  # adapters count
    peft_model.unload()  # the reference back without its adapter layers, for the next test


def test_taktiny_adapters_export_into_a_folder_peft_loads(llama, tmp_path):
    import torch
    from peft import LoraConfig, PeftModel

    reference, model, config = llama
    rank, alpha = 2, 6
    targets = [f"layers.*.{t}" for t in TARGETS.values()]
    adapted = tt.lora(model, rank, where=targets, alpha=alpha, rngs=nn.Rngs(0))
    rng = np.random.default_rng(3)
    flat = {k: v for k, v in tt.flat_state_dict(adapted).items() if ".lora_" in k}
    adapted = adapted.load_flat_state_dict(
        {k: rng.normal(size=v.shape).astype(np.float32) * 0.1 for k, v in flat.items()}
    )
    adapters = {k: v for k, v in tt.flat_state_dict(adapted).items() if ".lora_" in k}
    save_safetensors(tmp_path / "adapter_model.safetensors", convert.export(peft_rules(), adapters))
    lora_config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(TARGETS))
    lora_config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == rank

    loaded = PeftModel.from_pretrained(reference, tmp_path).eval()
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 9))
    with torch.no_grad():
        theirs = loaded(torch.from_numpy(ids), use_cache=False).logits.numpy()
    np.testing.assert_allclose(
        logits(adapted, jax.numpy.asarray(ids)), theirs, rtol=1e-4, atol=1e-4
    )
    assert np.abs(theirs - logits(model, jax.numpy.asarray(ids))).max() > 1e-2
    loaded.unload()
