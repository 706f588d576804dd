"""taktiny.models.Decoder against transformers, family by family: a small random model of
each saved by transformers loads with `from_pretrained` (a list of layers, or scanned),
its logits within 1e-5 of transformers' at float32 (highest matmul precision), decoding
with caches gives the same logits, and `save_pretrained` writes a folder transformers
loads with nothing missing or unexpected, to the same logits."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from taktiny import models

COMMON = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}  # fmt: skip
FAMILIES = {  # name: (config class, model class, what the variant sets)
    "llama2-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3}),
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


SCANNED = ("mistral-window", "qwen3")  # the families scanned in `make test`


def reference(name):
    config_class, model_class, variant = FAMILIES[name]
    config = getattr(transformers, config_class)(**COMMON, **variant)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():  # every parameter moved off its init (norms are ones)
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


# scanned: for two families in `make test` (the property over configs scans others), for
# every family in `make property`
@pytest.mark.parametrize(
    ("name", "scanned"),
    [
        pytest.param(n, s, marks=[pytest.mark.thorough] if s and n not in SCANNED else [])
        for n in FAMILIES
        for s in (False, True)
    ],
)
def test_a_family_loads_decodes_and_exports_as_transformers(tmp_path, name, scanned):
    theirs = reference(name)
    theirs.save_pretrained(tmp_path / "hf")
    ours = models.from_pretrained(tmp_path / "hf", scanned=scanned)
    assert (
        ours.config.model_type
        == json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"]
    )
    ids = np.random.default_rng(1).integers(0, 96, (2, 11))
    expected = logits_of(theirs, ids)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(ours(jnp.asarray(ids)))
        # the prompt's first 6 tokens at once, then one at a time through the caches
        caches = ours.init_caches(2, 11)
        first, caches = ours(jnp.asarray(ids[:, :6]), caches=caches)
        steps = [first]
        for t in range(6, 11):
            step, caches = ours(jnp.asarray(ids[:, t : t + 1]), caches=caches)
            steps.append(step)
        decoded = np.asarray(jnp.concatenate(steps, axis=1))
    assert np.abs(got - expected).max() <= 1e-5
    assert np.abs(decoded - expected).max() <= 1e-5
    written = models.save_pretrained(ours, tmp_path / "ours")
    assert {p.name for p in written} == {"model.safetensors", "config.json"}
    model_class = getattr(transformers, FAMILIES[name][1])
    back, info = model_class.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    back.set_attn_implementation("eager")
    np.testing.assert_array_equal(logits_of(back.eval(), ids), expected)


def test_a_window_changes_the_logits_past_it():
    """The sliding window is applied (the test above would pass without it only if no
    query saw more than 4 keys): without it, Mistral's logits past position 3 differ."""
    theirs = reference("mistral-window")
    config = models.DecoderConfig.from_hf(theirs.config.to_dict())
    windowless = models.Decoder(
        config.__class__(**{**config.__dict__, "sliding_window": None}), rngs=models_rngs()
    )
    windowed = models.Decoder(config, rngs=models_rngs())
    windowless = windowless.load_state_dict(windowed.state_dict())
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 96, (1, 9)))
    a, b = np.asarray(windowed(ids)), np.asarray(windowless(ids))
    np.testing.assert_allclose(a[:, :4], b[:, :4], rtol=1e-6, atol=1e-6)
    assert np.abs(a[:, 4:] - b[:, 4:]).min() > 0


def models_rngs():
    from taktiny import nn

    return nn.Rngs(0)


def test_a_config_of_another_family_is_refused_naming_the_families():
    with pytest.raises(
        ValueError,
        match=r"model_type 'gpt2'; it builds 'llama', 'mistral', 'qwen2', 'qwen3' \(the Llama family\), and taktiny.models.Encoder builds 'bert'",
    ):
        models.DecoderConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"the llama config.json has no 'vocab_size'"):
        models.DecoderConfig.from_hf(
            {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2}
        )


def test_a_folder_without_a_config_is_refused_saying_what_it_holds(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(
        ValueError, match=r"has no config\.json \(it holds \['model\.safetensors'\]\)"
    ):
        models.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has no config\.json \(no such folder\)"):
        models.from_pretrained(tmp_path / "missing")


@pytest.mark.parametrize(
    ("name", "scanned"), [("llama3.1", False), ("mistral-window", True), ("qwen3", False)]
)
def test_greedy_generate_gives_the_tokens_of_transformers_generate(tmp_path, name, scanned):
    theirs = reference(name)
    theirs.save_pretrained(tmp_path)
    ours = models.from_pretrained(tmp_path, scanned=scanned)
    prompt = np.random.default_rng(3).integers(0, 96, (2, 5))
    with jax.default_matmul_precision("highest"):
        tokens = ours.generate(jnp.asarray(prompt), 12)
    expected = theirs.generate(
        torch.from_numpy(prompt),
        attention_mask=torch.ones(prompt.shape, dtype=torch.long),
        max_new_tokens=12,
        do_sample=False,
    )[:, 5:].numpy()
    assert tokens.shape == (2, 12) and tokens.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(tokens), expected)
    assert len(set(expected.ravel().tolist())) > 2  # (not one token repeated)


@pytest.mark.parametrize(("name", "scanned"), [("llama3.1", False), ("qwen2", True)])
def test_a_left_padded_batch_decodes_as_transformers_and_as_each_prompt_alone(
    tmp_path, name, scanned
):
    theirs = reference(name)
    theirs.save_pretrained(tmp_path)
    ours = models.from_pretrained(tmp_path, scanned=scanned)
    rng = np.random.default_rng(5)
    prompt = rng.integers(1, 96, (3, 7))
    valid = np.ones(prompt.shape, bool)
    valid[0, :3] = valid[2, :1] = False  # prompts of 4, 7 and 6 tokens, padded on the left
    prompt[~valid] = 0
    with jax.default_matmul_precision("highest"):
        tokens = np.asarray(ours.generate(jnp.asarray(prompt), 10, valid=jnp.asarray(valid)))
        for row in range(3):  # each prompt alone, unpadded, decodes the same tokens
            alone = ours.generate(jnp.asarray(prompt[row : row + 1, valid[row]]), 10)
            np.testing.assert_array_equal(tokens[row : row + 1], alone)
    expected = theirs.generate(
        torch.from_numpy(prompt),
        attention_mask=torch.from_numpy(valid.astype(np.int64)),
        max_new_tokens=10,
        do_sample=False,
    )[:, 7:].numpy()
    np.testing.assert_array_equal(tokens, expected)


def test_sampling_draws_by_the_key_and_a_tiny_temperature_is_greedy():
    model = models.Decoder(reference("qwen2").config.to_dict(), rngs=models_rngs())
    prompt = jnp.asarray(np.random.default_rng(4).integers(0, 96, (3, 4)))
    key = jax.random.key(0)
    drawn = model.generate(prompt, 16, temperature=1.5, key=key)
    assert drawn.shape == (3, 16) and int(drawn.min()) >= 0 and int(drawn.max()) < 96
    np.testing.assert_array_equal(drawn, model.generate(prompt, 16, temperature=1.5, key=key))
    other = model.generate(prompt, 16, temperature=1.5, key=jax.random.key(1))
    assert not np.array_equal(drawn, other)
    greedy = model.generate(prompt, 16)
    assert not np.array_equal(drawn, greedy)
    np.testing.assert_array_equal(model.generate(prompt, 16, temperature=1e-6, key=key), greedy)
    np.testing.assert_array_equal(model.generate(prompt, 1), greedy[:, :1])


def test_generate_refuses_what_it_cannot_do_naming_the_fix():
    model = models.Decoder(reference("qwen2").config.to_dict(), rngs=models_rngs())
    prompt = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"max_new_tokens must be at least 1, got 0"):
        model.generate(prompt, 0)
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or above, got -1.0"):
        model.generate(prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match=r"at temperature 0.7: pass key=jax.random.key\(seed\)"):
        model.generate(prompt, 2, temperature=0.7)
