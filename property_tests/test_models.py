"""`taktiny.models` against transformers over drawn configs: a random model of the Llama
family (Llama, Mistral, Qwen2, Qwen3), of drawn widths, heads, key/value heads, head
size, depth, tied or untied head and RoPE scaling, saved by transformers, loads with
`from_pretrained` (a list of layers or scanned) to transformers' logits, exports with
`save_pretrained` to a folder transformers loads with nothing missing or unexpected and
the same tensors bit for bit, and loads back (scanned the other way) bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import taktiny as tt
from taktiny import models

from .budget import examples

CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8},
]  # fmt: skip


@st.composite
def configs(draw: st.DrawFn) -> tuple[str, dict]:
    """A family and the fields of its transformers config."""
    family = draw(st.sampled_from(sorted(CLASSES)))
    heads = draw(st.sampled_from([2, 4]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    head_dim = draw(st.sampled_from([8, 16]))
    hidden = draw(st.sampled_from([16, 32]))
    scaling = draw(st.sampled_from(SCALINGS))
    theta = draw(st.sampled_from([10000.0, 500000.0]))
    fields = dict(
        vocab_size=draw(st.sampled_from([40, 64])),
        hidden_size=hidden,
        intermediate_size=draw(st.sampled_from([24, 48])),
        num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=draw(st.booleans()),
        rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": theta},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    if family == "llama":
        fields["attention_bias"] = draw(st.booleans())
        fields["mlp_bias"] = draw(st.booleans())
    if family == "mistral":
        fields["sliding_window"] = draw(st.sampled_from([None, 3, 64]))
    return family, fields


def randomized(family: str, fields: dict, seed: int) -> torch.nn.Module:
    config_class, model_class = CLASSES[family]
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():  # every parameter moved off its init (norms are ones, biases 0)
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


@settings(max_examples=examples(5))
@given(drawn=configs(), scanned=st.booleans(), seed=st.integers(0, 2**16))
def test_a_drawn_config_loads_exports_and_loads_back_as_transformers_does(
    tmp_path_factory, drawn, scanned, seed
):
    family, fields = drawn
    folder = tmp_path_factory.mktemp("model")
    theirs = randomized(family, fields, seed)
    theirs.save_pretrained(folder / "hf")
    ours = models.from_pretrained(folder / "hf", scanned=scanned)
    ids = np.random.default_rng(seed).integers(0, fields["vocab_size"], (2, 7))
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        expected = theirs(torch.from_numpy(ids)).logits.numpy()
        np.testing.assert_allclose(ours(jnp.asarray(ids)), expected, atol=1e-5, rtol=0)

    models.save_pretrained(ours, folder / "out")
    model_class = type(theirs)
    back, info = model_class.from_pretrained(folder / "out", output_loading_info=True)
    assert not any(info.values()), info
    state, exported = theirs.state_dict(), back.state_dict()
    assert sorted(state) == sorted(exported)
    for name, value in exported.items():
        assert torch.equal(value, state[name]), name

    again = models.from_pretrained(folder / "out", scanned=not scanned)
    left = tt.flat_state_dict(ours, unstacked=True)
    right = tt.flat_state_dict(again, unstacked=True)
    assert list(left) == list(right)
    for name in left:
        assert np.array_equal(left[name], right[name]), name
