"""`taktiny.models.from_pretrained` and `save_pretrained` with what a user asks of one call:
a folder in a bucket (FP8 blocks too), quantized on the way in, placed on a mesh, within a
host-memory budget, an encoder's folders, and the refusals naming what the folder holds."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import io, models

SMALL = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
BERT = dict(
    vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=37, max_position_embeddings=64,
)  # fmt: skip


AUTO = AxisType.Auto  # (explicit axes would ask the attention's reshapes for out_sharding)


def randomized(model):
    torch.manual_seed(0)
    model.eval().set_attn_implementation("eager")
    with torch.no_grad():  # every parameter moved off its init (norms are ones)
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A small random Llama saved by transformers: its folder."""
    folder = tmp_path_factory.mktemp("llama")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    randomized(model).save_pretrained(folder)
    return folder


def same(a, b):
    """Whether two models hold the same state, bit for bit (a stack read per layer)."""
    left, right = tt.flat_state_dict(a, unstacked=True), tt.flat_state_dict(b, unstacked=True)
    return list(left) == list(right) and all(
        left[k].dtype == right[k].dtype and np.array_equal(left[k], right[k]) for k in left
    )


def upload(folder, url):
    for file in sorted(Path(folder).iterdir()):
        io.put_object(io.locate(f"{url}/{file.name}"), file.read_bytes())


@pytest.mark.program
def test_a_folder_in_a_bucket_loads_and_saves_back_there(llama, s3):
    local = models.from_pretrained(llama)
    upload(llama, f"{s3}/llama")
    scanned = models.from_pretrained(f"{s3}/llama", scanned=True)
    assert isinstance(scanned.layers, tt.nn.Stack)
    assert same(scanned, local)
    written = models.save_pretrained(scanned, f"{s3}/again")
    assert sorted(str(w).rsplit("/", 1)[1] for w in written) == ["config.json", "model.safetensors"]
    assert same(models.from_pretrained(f"{s3}/again"), local)


@pytest.mark.program
def test_an_fp8_folder_in_a_bucket_loads_as_it_does_from_disk(tmp_path, s3):
    from examples import llama as example

    reference = randomized(transformers.LlamaForCausalLM(example.llama_config(tied=False)))
    example.fp8_checkpoint(reference, str(tmp_path))
    upload(tmp_path, f"{s3}/fp8")
    local = models.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert same(models.from_pretrained(f"{s3}/fp8", dtype=jnp.bfloat16), local)
    # FP8 dequantized by blocks, then quantized again on the way in: as quantizing after
    int8 = models.from_pretrained(tmp_path, dtype=jnp.bfloat16, quantize="int8")
    assert same(int8, tt.quantize(local, bits=8, where="layers.**"))


@pytest.mark.parametrize(
    ("scanned", "bits", "group_size"), [(False, "int8", None), (True, "int4", 16)]
)
def test_quantize_gives_what_quantizing_the_float_model_gives(llama, scanned, bits, group_size):
    loaded = models.from_pretrained(llama, scanned=scanned, quantize=bits, group_size=group_size)
    float_model = models.from_pretrained(llama, scanned=scanned)
    expected = tt.quantize(
        float_model, bits=int(bits[3:]), group_size=group_size, where="layers.**"
    )
    assert same(loaded, expected)
    assert isinstance(loaded.embed, tt.nn.Embed)  # the embeddings and the head stay float
    assert isinstance(loaded.lm_head, tt.nn.Linear)


def test_a_quantized_model_saves_as_compressed_tensors_and_loads_back_bit_for_bit(llama, tmp_path):
    int4 = models.from_pretrained(llama, scanned=True, quantize="int4", group_size=16)
    models.save_pretrained(int4, tmp_path / "int4")
    config = json.loads((tmp_path / "int4" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    back = models.from_pretrained(tmp_path / "int4", quantize="int4", group_size=16)
    assert same(back, int4)
    assert same(models.from_pretrained(tmp_path / "int4"), tt.dequantize(int4))
    # transformers decompresses it to the same weights: the same logits
    served = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "int4").eval()
    served.set_attn_implementation("eager")
    ids = np.random.default_rng(0).integers(0, 96, (2, 7))
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        expected = served(torch.from_numpy(ids)).logits.numpy()
        np.testing.assert_allclose(int4(jnp.asarray(ids)), expected, atol=1e-5, rtol=0)
    models.save_pretrained(tt.dequantize(int4), tmp_path / "float")
    assert "quantization_config" not in json.loads((tmp_path / "float" / "config.json").read_text())


@pytest.mark.parametrize("scanned", [False, True])
def test_a_mesh_places_the_layers_as_megatron_splits_them(llama, scanned):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
    placed = models.from_pretrained(llama, scanned=scanned, mesh=mesh)
    layer = placed.layers.block if scanned else placed.layers[0]
    lead = (None,) if scanned else ()
    assert layer.attention.query.kernel.sharding.spec == P(*lead, None, "model")
    assert layer.attention.out.kernel.sharding.spec == P(*lead, "model", None)
    assert layer.mlp.down.kernel.sharding.spec == P(*lead, "model", None)
    assert set(layer.mlp_norm.scale.sharding.spec) <= {None}  # the rest replicated
    assert len(layer.mlp.up.kernel.sharding.device_set) == 8
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 7)))
    with jax.default_matmul_precision("highest"):
        expected = models.from_pretrained(llama, scanned=scanned)(ids)
        np.testing.assert_allclose(placed(ids), expected, atol=1e-6)


def test_sharding_rules_place_what_they_name(llama):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    placed = models.from_pretrained(llama, sharding={"embed.embedding": (None, "data")}, mesh=mesh)
    assert placed.embed.embedding.sharding.spec == P(None, "data")
    assert set(placed.layers[0].mlp.up.kernel.sharding.spec) <= {None}


def test_a_mesh_without_a_model_axis_needs_rules(llama):
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(ValueError, match=r"the mesh has the axes \('data',\); the default split"):
        models.from_pretrained(llama, mesh=mesh)


def test_the_host_budget_reaches_the_load(llama):
    with pytest.raises(ValueError, match=r"max_host_bytes=1,024 \(.*\) is too small"):
        models.from_pretrained(llama, max_host_bytes=1024)


def test_the_encoders_folders_load_heads_dropped_and_save_as_a_bert_model(tmp_path):
    config = transformers.BertConfig(**BERT)
    randomized(transformers.BertForMaskedLM(config)).save_pretrained(tmp_path / "mlm")
    masked = models.from_pretrained(tmp_path / "mlm", scanned=True)
    assert isinstance(masked, models.Encoder)
    assert masked.pooler is None  # BertForMaskedLM's files hold none
    reference = randomized(transformers.BertModel(config))
    reference.save_pretrained(tmp_path / "bert")
    ours = models.from_pretrained(tmp_path / "bert")
    assert ours.pooler is not None
    models.save_pretrained(ours, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "bert"
    back, info = transformers.BertModel.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    theirs = reference.state_dict()
    for name, value in back.state_dict().items():
        assert torch.equal(value, theirs[name]), name


def test_what_it_does_not_build_is_refused_naming_the_families(tmp_path, llama):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(
        ValueError,
        match=r"model_type 'gpt2'; it builds 'llama', 'mistral', 'qwen2', 'qwen3', 'bert'",
    ):
        models.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"quantize='int2'; give 'int8', 'int4' or None"):
        models.from_pretrained(llama, quantize="int2")
    with pytest.raises(ValueError, match=r"group_size=16 is quantize's; give quantize="):
        models.from_pretrained(llama, group_size=16)
    with pytest.raises(ValueError, match=r"has no config\.json \(no such folder\)"):
        models.from_pretrained(tmp_path / "missing")


def test_a_decoders_rules_take_no_prefix():
    config = models.DecoderConfig.from_hf({"model_type": "llama", **SMALL})
    with pytest.raises(ValueError, match=r"prefix= and pooler= are an encoder's"):
        models.rules(config, prefix="model.")
