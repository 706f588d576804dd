"""taktiny.models.Encoder against transformers' BERT: a small random BertModel saved by
transformers loads into a model built without initialising it (a list of layers, or
scanned), its hidden states and pooled output within 1e-5 of transformers' on a padded
batch at float32 (highest matmul precision), with the exact GELU and its tanh
approximation; BertForPreTraining's and BertForMaskedLM's files load through the
``bert.`` prefix; the export is a folder BertModel.from_pretrained loads with nothing
missing or unexpected, bit for bit; the real all-MiniLM-L6-v2 gives sentence-transformers'
embeddings through `mean_pool`; what it does not compute is refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from _minilm import minilm_folder

import taktiny as tt
from taktiny import convert, models, nn
from taktiny.io import load_safetensors, open_safetensors, save_safetensors

transformers.utils.logging.disable_progress_bar()  # (their bars would fill the test log)
COMMON = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=37, max_position_embeddings=16)  # fmt: skip
RNG = np.random.default_rng(0)
IDS = RNG.integers(0, 99, (2, 9))
TYPES = RNG.integers(0, 2, (2, 9))
VALID = np.arange(9) < np.array([[9], [6]])  # the second sequence padded


def reference(model_class="BertModel", **variant):
    """transformers' model, eager attention, every parameter moved off its init (a zero
    bias or a unit norm would hide a mistake)."""
    config = transformers.BertConfig(**COMMON, **variant)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def theirs(bert):
    """(hidden, pooled) of a BertModel on the padded batch; pooled None without a pooler."""
    with torch.no_grad():
        out = bert(torch.from_numpy(IDS), attention_mask=torch.from_numpy(VALID).long(),
                   token_type_ids=torch.from_numpy(TYPES))  # fmt: skip
    pooled = None if out.pooler_output is None else out.pooler_output.numpy()
    return out.last_hidden_state.numpy(), pooled


@jax.jit
def ours(model):
    with jax.default_matmul_precision("highest"):
        return model(jnp.asarray(IDS), jnp.asarray(TYPES), jnp.asarray(VALID))


def abstract(config, **kw):
    return jax.eval_shape(lambda: models.Encoder(config, **kw, rngs=nn.Rngs(0)))


@pytest.mark.parametrize("scanned", [False, True], ids=["list", "scanned"])
@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_a_bert_model_folder_loads_to_transformers_outputs(tmp_path, act, scanned):
    bert = reference(hidden_act=act)
    bert.save_pretrained(tmp_path)
    config = models.EncoderConfig.from_hf(tmp_path)
    assert config.hidden_act == act and config.max_position_embeddings == 16
    model = load_safetensors(
        abstract(config, scanned=scanned), tmp_path, rules=models.rules(config)
    )
    assert isinstance(model.layers, nn.Stack) == scanned
    hidden, pooled = ours(model)
    expected_hidden, expected_pooled = theirs(bert)
    assert hidden.shape == (2, 9, 32) and pooled.shape == (2, 32)
    assert np.abs(hidden - expected_hidden).max() <= 1e-5
    assert np.abs(pooled - expected_pooled).max() <= 1e-5


@pytest.mark.parametrize(("model_class", "pooler"), [("BertForPreTraining", True),
                                                     ("BertForMaskedLM", False)])  # fmt: skip
def test_the_files_of_bert_with_heads_load_through_the_prefix(tmp_path, model_class, pooler):
    """Their names start with ``bert.``; the heads' ``cls.*`` are dropped, and
    BertForMaskedLM's BERT has no pooler."""
    bert = reference(model_class)
    bert.save_pretrained(tmp_path)
    config = models.EncoderConfig.from_hf(tmp_path / "config.json")
    rules = models.rules(config, prefix="bert.", pooler=pooler)
    target = abstract(config, pooler=pooler)
    report = convert.check(rules, open_safetensors(tmp_path), target=target)
    assert report.ignored and all(name.startswith("cls.") for name in report.ignored)
    model = load_safetensors(target, tmp_path, rules=rules)
    hidden, pooled = ours(model)
    expected_hidden, expected_pooled = theirs(bert.bert)
    assert np.abs(hidden - expected_hidden).max() <= 1e-5
    if pooler:
        assert np.abs(pooled - expected_pooled).max() <= 1e-5
    else:
        assert pooled is None and expected_pooled is None
        assert not any("pooler" in rule.sources[0] for rule in rules)


def test_an_export_is_a_bert_model_folder_bit_for_bit(tmp_path):
    bert = reference()
    config = models.EncoderConfig.from_hf(bert.config.to_dict())
    rules = models.rules(config)
    state = {
        **bert.state_dict(),
        "embeddings.position_ids": torch.arange(16)[None],
    }  # (older files)
    assert convert.check(rules, state, target=abstract(config)).ignored == (
        "embeddings.position_ids",
    )
    model = abstract(config).load_flat_state_dict(
        convert.convert(rules, state, target=abstract(config)), strict=True
    )
    exported = convert.export(rules, model)
    scanned = abstract(config, scanned=True).load_state_dict(model.state_dict())
    assert tt.flat_state_dict(scanned, unstacked=True).keys() == tt.flat_state_dict(model).keys()
    for name, value in convert.export(rules, scanned).items():  # scanned: the same names, bits
        np.testing.assert_array_equal(value, exported[name], err_msg=name)
    save_safetensors(tmp_path / "model.safetensors", exported)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    assert models.EncoderConfig.from_hf(tmp_path) == config
    back, info = transformers.BertModel.from_pretrained(tmp_path, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected, misfit
    assert back.state_dict().keys() == bert.state_dict().keys()
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), bert.state_dict()[name].numpy(), err_msg=name)


def test_the_real_minilm_gives_sentence_transformers_embeddings():
    """all-MiniLM-L6-v2's sentence embeddings, as sentence-transformers computes them
    (modules.json: the BertModel, mean pooling, Normalize), written out in torch here
    rather than imported (its import alone takes 13 s)."""
    folder = minilm_folder()
    config = models.EncoderConfig.from_hf(folder)
    assert (config.hidden_size, config.num_hidden_layers, config.hidden_act) == (384, 6, "gelu")
    rules = models.rules(config)
    model = load_safetensors(
        abstract(config, scanned=True), folder / "model.safetensors", rules=rules
    )
    sentences = ["A man is eating food.", "A man is eating a piece of bread.",
                 "The girl is carrying a baby.", "A man is riding a horse on the beach."]  # fmt: skip
    tokens = transformers.AutoTokenizer.from_pretrained(folder)(sentences, padding=True,
                                                                return_tensors="np")  # fmt: skip
    ids, valid = tokens["input_ids"], tokens["attention_mask"]
    assert (valid == 0).any()  # padded
    with jax.default_matmul_precision("highest"):
        hidden, _ = model(jnp.asarray(ids), valid=jnp.asarray(valid))
        embeddings = np.asarray(models.mean_pool(hidden, jnp.asarray(valid)))
    bert = transformers.BertModel.from_pretrained(folder).eval()
    with torch.no_grad():
        token_embeddings = bert(torch.from_numpy(ids), attention_mask=torch.from_numpy(valid))[0]
        mask = torch.from_numpy(valid).unsqueeze(-1).expand(token_embeddings.size()).float()
        mean = (token_embeddings * mask).sum(1) / torch.clamp(mask.sum(1), min=1e-9)
        expected = torch.nn.functional.normalize(mean, p=2, dim=1).numpy()
    assert np.abs(embeddings - expected).max() <= 1e-5
    similar = embeddings @ embeddings.T
    assert similar[0, 1] > 0.6 > max(similar[0, 2], similar[0, 3])  # the meaning is there


def test_mean_pool_averages_the_valid_tokens_then_normalises():
    hidden = jnp.asarray(RNG.standard_normal((2, 9, 4)), jnp.float32)
    valid = jnp.asarray(VALID)
    mean = models.mean_pool(hidden, valid, normalize=False)
    np.testing.assert_allclose(mean[1], hidden[1, :6].mean(0), rtol=1e-6)
    np.testing.assert_allclose(mean[0], hidden[0].mean(0), rtol=1e-6)
    pooled = models.mean_pool(hidden.at[1, 6:].set(100.0), valid)  # the padding is not read
    np.testing.assert_allclose(pooled, mean / jnp.linalg.norm(mean, axis=-1, keepdims=True),
                               rtol=1e-6)  # fmt: skip
    np.testing.assert_allclose(
        models.mean_pool(hidden), models.mean_pool(hidden, jnp.ones((2, 9), int))
    )
    empty = models.mean_pool(hidden, jnp.zeros((2, 9), bool))  # nothing valid: zeros, not NaN
    np.testing.assert_array_equal(empty, np.zeros((2, 4)))


def test_dropout_runs_with_a_key_alike_in_both_variants():
    config = models.EncoderConfig.from_hf(reference().config.to_dict())
    model = models.Encoder(config, rngs=nn.Rngs(0))
    scanned = abstract(config, scanned=True).load_state_dict(model.state_dict())
    inputs = (jnp.asarray(IDS), jnp.asarray(TYPES), jnp.asarray(VALID))
    hidden = jax.jit(lambda model, key: model(*inputs, key=key)[0])
    plain, dropped = hidden(model, None), hidden(model, jax.random.key(0))
    assert np.abs(dropped - plain).mean() > 0.01
    np.testing.assert_allclose(hidden(scanned, jax.random.key(0)), dropped, atol=1e-5)
    np.testing.assert_allclose(hidden(scanned, None), plain, atol=1e-5)


def test_what_the_encoder_does_not_compute_is_refused_naming_it():
    bert = {**COMMON, "model_type": "bert"}
    with pytest.raises(ValueError, match=r"model_type 'gpt2'; it builds 'bert' \(the BERT family\), "
                       r"and taktiny.models.Decoder builds 'llama', 'mistral', 'qwen2', 'qwen3'"):  # fmt: skip
        models.EncoderConfig.from_hf({**bert, "model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"GELU MLPs \('gelu', 'gelu_new', 'gelu_pytorch_tanh'\); "
                       r"this bert config.json asks for hidden_act='relu'"):  # fmt: skip
        models.EncoderConfig.from_hf({**bert, "hidden_act": "relu"})
    with pytest.raises(ValueError, match=r"asks for position_embedding_type='relative_key'"):
        models.EncoderConfig.from_hf({**bert, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match=r"makes a decoder \(is_decoder=True, add_cross_attention"):
        models.EncoderConfig.from_hf({**bert, "is_decoder": True})
    with pytest.raises(ValueError, match=r"the bert config.json has no 'vocab_size'"):
        models.EncoderConfig.from_hf({k: v for k, v in bert.items() if k != "vocab_size"})
    config = models.EncoderConfig.from_hf(bert)
    with pytest.raises(
        ValueError, match=r"got 17 tokens a sequence; .* max_position_embeddings=16"
    ):
        models.Encoder(config, rngs=nn.Rngs(0))(jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match=r"prefix 'bert' is the start .*: pass 'bert\.'"):
        models.rules(config, prefix="bert")
