"""FP8 block-scaled checkpoints in (`convert.quantized_rules`, `convert.dequantize_blocks`):
the NumPy oracle of the dequantization, bit for bit, ragged edge blocks included; products
rounded to float32, then into bfloat16, as PyTorch rounds them; a sharded
Hugging Face Llama folder loaded into bfloat16 and float32 models (checked against PyTorch
DCP's `QuantizedHuggingFaceStorageReader` too) and requantized on the stream into int8 and
int4 models; and every checkpoint or config it cannot read refused by name."""

import functools
import json
import math
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from _quantized_files import (
    FP8_CONFIG,
    dequantized,
    fp8_blocks,
    fp8_folder,
)
from _quantized_files import (
    llama_reference as reference,
)

import taktiny as tt
from taktiny import convert, nn
from taktiny.io import load_safetensors, open_safetensors, save_safetensors

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import llama  # (the example's model and rules)

BLOCKS = [
    ((256, 384), (128, 128)),  # whole blocks
    ((200, 300), (128, 128)),  # ragged on both axes: 72 rows, 44 columns left over
    ((64, 176), (128, 128)),  # one block smaller than the weight's row count
    ((3, 50, 70), (16, 32)),  # a leading axis (experts), non-square blocks
]


@pytest.mark.parametrize("shape, block", BLOCKS)
def test_dequantize_blocks_is_the_numpy_oracle_bit_for_bit(shape, block, platform):
    # (on each platform: the products are float32's, rounded once into bfloat16)
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 3
    weight, scale = fp8_blocks(w, block)
    assert scale.shape[-2:] == (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    (ours,) = convert.dequantize_blocks(block)((weight, scale))
    oracle = dequantized(weight, scale, block)
    assert ours.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ours), oracle)
    # every block has its own scale: the weights come back within float8's rounding
    assert np.abs(np.asarray(ours) - w).max() <= np.abs(w).max() * 2**-3
    (half,) = convert.dequantize_blocks(block, dtype=jnp.bfloat16)((weight, scale))
    np.testing.assert_array_equal(
        np.asarray(half).view(np.uint16), oracle.astype(ml_dtypes.bfloat16).view(np.uint16)
    )
    perm = (
        *range(len(shape) - 2),
        len(shape) - 1,
        len(shape) - 2,
    )  # a Linear's weight, as a kernel
    (kernel,) = convert.dequantize_blocks(block, layout=convert.transpose(perm))((weight, scale))
    np.testing.assert_array_equal(np.asarray(kernel), np.swapaxes(oracle, -1, -2))


REQUANTIZED = [  # (shape, block, bits, axis from the end, group size): a kernel's layout
    (shape, block, bits, back, group)
    for shape, block in BLOCKS
    for bits, back, group in [
        (8, 2, None),  # the input axis, per channel
        (4, 2, 8),  # groups within a block
        (4, 2, 25),  # groups straddling blocks (where 25 divides the axis)
        (8, 1, None),  # per channel along the other blocked axis
        (4, 1, 10),
    ]
    if group is None or shape[back - 3] % group == 0  # (the kernel's axes: swapped)
]


def requantized(shape, block, bits, back, group, dtype, stored=False):
    """A kernel's FP8 blocks requantized as a load places them (the weights laid out as a
    kernel, as read into a buffer; with `stored`, as the file holds them, as copied from
    its mapped pages), with what `tt.QArray.quantize` makes of the dequantized kernel."""
    w = np.random.default_rng(1).standard_normal(shape).astype(np.float32) * 3
    w[..., 5, :] = 0  # a zero row: some channels' largest magnitude is in another block
    weight, scale = fp8_blocks(w, block)
    scale[..., 0, :] *= -1  # the format does not forbid negative scales: |w * scale| counts
    perm = (*range(len(shape) - 2), len(shape) - 1, len(shape) - 2)
    blocks = convert.dequantize_blocks(block, layout=convert.transpose(perm))
    kernel = np.transpose(dequantized(weight, scale, block), perm).astype(dtype)
    expected = tt.QArray.quantize(kernel, bits=bits, axis=len(shape) - back, group_size=group)
    laid_out = jnp.asarray(np.ascontiguousarray(np.transpose(weight, perm)))

    def place(value, scale):
        return blocks.placed(value, scale, dtype, expected, laid_out=not stored)

    value = jnp.asarray(weight) if stored else laid_out
    return place, (value, jnp.asarray(scale)), expected, blocks


LEAF_DTYPES = [  # float32 and float16 over every layout under `make property`; below, two
    jnp.bfloat16,
    pytest.param(jnp.float32, marks=pytest.mark.thorough),
    pytest.param(jnp.float16, marks=pytest.mark.thorough),
]


@pytest.mark.parametrize("stored", [False, True], ids=["laid out", "as stored"])
@pytest.mark.parametrize("dtype", LEAF_DTYPES)
@pytest.mark.parametrize("shape, block, bits, back, group", REQUANTIZED)
def test_fp8_blocks_requantize_as_quantize_of_the_dequantized_weights_bit_for_bit(
    shape, block, bits, back, group, dtype, stored, platform
):
    # (on each platform, against tt.quantize on the same one)
    place, args, expected, _ = requantized(shape, block, bits, back, group, dtype, stored)
    for ours, theirs in zip(place(*args), (expected.value, expected.scale), strict=True):
        assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype)
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("stored", [False, True], ids=["laid out", "as stored"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("shape, bits, group", [((256, 384), 8, None), ((200, 320), 4, 32)])
def test_requantizing_fp8_blocks_holds_no_product_for_bfloat16_or_float32(
    shape, bits, group, dtype, stored
):
    """The program that places FP8 blocks into a quantized leaf gives `tt.quantize` of
    the dequantized weights (every dtype; a float16 leaf through the cast), and for a
    bfloat16 or float32 leaf it holds at most the float8 bytes' magnitudes, a byte a
    weight (one pass for the scales over the bytes, one for the values), as the compiled
    program's memory shows and `held_bytes` says; the float32 product would take four."""
    place, args, expected, blocks = requantized(shape, (128, 128), bits, 2, group, dtype, stored)
    for ours, theirs in zip(place(*args), (expected.value, expected.scale), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    held = blocks.held_bytes(args[0], dtype, expected)
    temporaries = jax.jit(place).lower(*args).compile().memory_analysis().temp_size_in_bytes
    size = math.prod(shape)
    if dtype == jnp.float16:  # rounding into float16 is a cast: the product is held
        assert held == size * 4 <= temporaries
    else:
        assert held == 0 and temporaries < 2 * size
    assert blocks.held_bytes(args[0], dtype) == 0  # (a float leaf: fused)


@pytest.mark.parametrize("shape, bits, group", [((256, 384), 8, None), ((2, 256, 384), 4, 64)])
def test_fp8_blocks_as_stored_are_permuted_for_the_values_pass_alone(shape, bits, group):
    """Requantizing FP8 blocks as the file holds them (a load copying them from its mapped
    pages), the scales' pass reads the stored bytes and only the values' pass reads them
    permuted, so XLA can permute them inside that pass: read by both, the permuted bytes
    were written out whole first (on a TPU v5e, 0.2 ms of the 0.43 ms a 4096 x 4096 step
    took into int8, against 0.20 ms into bfloat16: bench/FINDINGS.md section 14)."""
    place, args, expected, _ = requantized(shape, (128, 128), bits, 2, group, jnp.bfloat16, True)
    for ours, theirs in zip(place(*args), (expected.value, expected.scale), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    (program,) = [e for e in jax.make_jaxpr(place)(*args).eqns if "jaxpr" in e.params]
    inner = program.params["jaxpr"].jaxpr
    moved = [e.outvars[0] for e in inner.eqns if e.primitive.name == "transpose"
             and e.invars[0].aval.shape == shape]  # fmt: skip
    assert len(moved) == 1  # (the bytes, permuted once)
    readers = []
    for e in inner.eqns:  # (the bytes read back as float8: the same values)
        if any(v is m for v in e.invars for m in moved):
            if e.primitive.name == "bitcast_convert_type":
                moved.append(e.outvars[0])
            else:
                readers.append(e.primitive.name)
    assert readers == ["convert_element_type"]  # (into float32, for the product)


@pytest.mark.parametrize("fp8", [ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz])
def test_other_float8_dtypes_requantize_bit_for_bit_those_without_ordered_bytes_unfused(fp8):
    """float8_e5m2's bytes order as its magnitudes, as float8_e4m3fn's do: the same two
    passes. The "fnuz" dtypes keep their NaN in the sign bit, so their largest byte is
    not their largest magnitude: they take the program that holds the product, and
    `held_bytes` says so."""
    rng = np.random.default_rng(2)
    weight = (rng.standard_normal((200, 300)) * 2).astype(fp8)
    weight[7, 11] = np.nan  # a NaN weight: its channel quantizes as the float load's does
    scale = rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32)
    blocks = convert.dequantize_blocks(layout=convert.transpose())
    kernel = dequantized(weight, scale, (128, 128)).T.astype(jnp.bfloat16)
    expected = tt.QArray.quantize(kernel, bits=8, axis=0)
    laid_out = jnp.asarray(np.ascontiguousarray(weight.T))
    got = blocks.placed(laid_out, jnp.asarray(scale), jnp.bfloat16, expected)
    for ours, theirs in zip(got, (expected.value, expected.scale), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    ordered = fp8 == ml_dtypes.float8_e5m2
    assert blocks.held_bytes(laid_out, jnp.bfloat16, expected) == (
        0 if ordered else 4 * weight.size
    )


def test_dequantize_blocks_refuses_scales_of_other_blocks():
    weight, scale = fp8_blocks(np.ones((200, 300), np.float32), (128, 128))
    with pytest.raises(
        ValueError,
        match=r"blocks of 128x128 take one float scale per block, a scale of shape \[2, 3\]; got float32\[2, 2\]",
    ):
        convert.dequantize_blocks()((weight, scale[:, :2]))
    with pytest.raises(ValueError, match=r"block-scaled weights are float8, got float32"):
        convert.dequantize_blocks()((np.ones((200, 300), np.float32), scale))
    with pytest.raises(ValueError, match=r"takes two arrays, the weights and their scales, got 1"):
        convert.dequantize_blocks()((weight,))
    with pytest.raises(ValueError, match=r"block_size must be positive sizes, got \(0, 128\)"):
        convert.dequantize_blocks((0, 128))
    with pytest.raises(
        ValueError,
        match=r"layout is identity\(\) or a transpose, got split\(axis=0\); chain other transforms after this one",
    ):
        convert.dequantize_blocks(layout=convert.split(0))


# float8_e4m3fn bytes and float32 scale bits whose products, rounded to float32 and then to
# bfloat16, differ from the exact product rounded once to bfloat16 (the first 8 of the 26 in
# 4 million random pairs: the float32 rounding lands on a bfloat16 tie)
DOUBLE_ROUNDED = [(55, 992407279), (27, 998101365), (25, 1007827172), (180, 1008052907),
                  (181, 998123363), (58, 986657587), (178, 992398541), (186, 1007393178)]  # fmt: skip


def rounded_once(exact, bits):
    """`exact` (float64) rounded once, to nearest even, to `bits` significant bits (8:
    bfloat16's), for normal numbers."""
    fraction, exponent = np.frexp(exact)
    return np.round(np.ldexp(fraction, bits)) * np.exp2(exponent - bits)


def test_fp8_products_round_in_float32_then_into_the_leafs_dtype_as_pytorch_rounds_them(
    tmp_path,
):
    """A float8 value (4 significant bits) times a float32 scale (24) can need 28 bits: the
    load rounds the product to float32, then casts it to the leaf's dtype, rounding again
    into bfloat16. That is PyTorch's (and DCP's) ``(w.float() * scale).to(dtype)``, bit for
    bit, on entries where it differs from rounding the exact product once; an int8 model
    quantizes that. Planted: the product taken in the leaf's dtype (the scale rounded into
    bfloat16 first: the bfloat16 load fails)."""
    w = np.array([b for b, _ in DOUBLE_ROUNDED], np.uint8).view(ml_dtypes.float8_e4m3fn)
    scale = np.array([b for _, b in DOUBLE_ROUNDED], np.uint32).view(np.float32)
    w, scale = w.reshape(2, 4), scale.reshape(2, 4)  # (a 1x1 block per entry)
    save_safetensors(
        tmp_path / "model.safetensors", {"proj.weight": w, "proj.weight_scale_inv": scale}
    )
    fp8_config = {**FP8_CONFIG, "weight_block_size": [1, 1]}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": fp8_config}))
    rules = convert.linear("proj", "layers.0", bias=False)
    rules = convert.quantized_rules(rules, open_safetensors(tmp_path))
    product = torch.from_numpy(w.view(np.uint8)).view(torch.float8_e4m3fn).float()
    product = product * torch.from_numpy(scale)  # PyTorch's float32 product
    exact = w.astype(np.float64) * scale.astype(np.float64)  # (float64 holds 28 bits)
    assert (product.double().numpy() != exact).all()  # each rounded in float32
    loaded = {}
    for dtype, torch_dtype in [(jnp.float32, torch.float32), (jnp.bfloat16, torch.bfloat16)]:
        target = jax.eval_shape(functools.partial(projection, dtype))
        model = load_safetensors(target, tmp_path, rules=rules)
        loaded[dtype] = np.asarray(model.layers[0].kernel).T
        want = product.to(torch_dtype).float().numpy()  # (to float32: exact)
        np.testing.assert_array_equal(loaded[dtype].astype(np.float32), want)
        requantized = load_safetensors(tt.quantize(target), tmp_path, rules=rules)
        quantized = tt.quantize(model)
        for a, b in zip(jax.tree.leaves(requantized), jax.tree.leaves(quantized), strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)  # (quantized from that)
    once = rounded_once(exact, 8).astype(np.float32)  # (8 significant bits: exact)
    assert (once != loaded[jnp.bfloat16].astype(np.float32)).all()


def projection(dtype):
    return nn.Sequential(nn.Linear(4, 2, use_bias=False, param_dtype=dtype, rngs=nn.Rngs(0)))


def is_linear(name):  # the decoder layers' projections, as transformers' FP8 models hold them
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """The example's untied Llama in FP8 blocks: its folder, what it holds, its config."""
    config = llama.llama_config(tied=False)
    model = reference(config)
    floats = {n: p.detach().numpy() for n, p in model.state_dict().items()}
    folder = tmp_path_factory.mktemp("fp8")
    written = fp8_folder(floats, folder, quantized=is_linear, config=config.to_dict())
    return folder, written, config


def abstract(config, dtype=jnp.float32):
    model = jax.eval_shape(lambda: llama.Llama(config, rngs=nn.Rngs(0)))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), model)


def test_an_fp8_llama_loads_into_bfloat16_as_numpy_and_dcp_dequantize_it(fp8):
    folder, written, config = fp8
    checkpoint = open_safetensors(folder)  # the index of two shards
    rules = convert.quantized_rules(llama.UNTIED_RULES, checkpoint)  # its config.json
    model = load_safetensors(abstract(config, jnp.bfloat16), checkpoint, rules=rules)
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    state = {
        n: torch.empty(a.shape, dtype=torch.bfloat16)
        for n, a in written.items()
        if not n.endswith("_scale_inv")
    }
    with warnings.catch_warnings():  # DCP warns that it reads in this one process
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        load(state, storage_reader=QuantizedHuggingFaceStorageReader(str(folder), target_dtype=torch.bfloat16), no_dist=True)  # fmt: skip
    bits = lambda a: np.asarray(a).view(np.uint16)
    for i in range(config.num_hidden_layers):
        for ours, theirs in [
            ("attention.query", "self_attn.q_proj"),
            ("mlp.down", "mlp.down_proj"),
        ]:
            kernel = bits(functools.reduce(getattr, ours.split("."), model.layers[i]).kernel.T)
            name = f"model.layers.{i}.{theirs}.weight"
            oracle = dequantized(written[name], written[name + "_scale_inv"], (128, 128))
            np.testing.assert_array_equal(kernel, oracle.astype(ml_dtypes.bfloat16).view(np.uint16))
            np.testing.assert_array_equal(
                kernel, state[name].view(torch.int16).numpy().view(np.uint16)
            )
    # what is not quantized loads as it is
    np.testing.assert_array_equal(
        bits(model.embed.embedding),
        state["model.embed_tokens.weight"].view(torch.int16).numpy().view(np.uint16),
    )


def test_an_fp8_llama_requantizes_on_the_stream_into_int8_and_int4_models(fp8):
    folder, _, config = fp8
    rules = convert.quantized_rules(llama.UNTIED_RULES, open_safetensors(folder))
    floats = load_safetensors(abstract(config), folder, rules=rules)
    for bits, group in [(8, None), (4, 16)]:
        target = tt.quantize(abstract(config), bits=bits, group_size=group)
        loaded = load_safetensors(target, folder, rules=rules)
        expected = tt.quantize(floats, bits=bits, group_size=group)  # the float model's rounding
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(expected), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert loaded.layers[1].mlp.up.kernel.bits == bits


def test_the_fp8_llama_computes_as_transformers_with_the_dequantized_weights(fp8):
    folder, written, config = fp8
    rules = convert.quantized_rules(llama.UNTIED_RULES, open_safetensors(folder))
    ours = load_safetensors(abstract(config), folder, rules=rules)
    theirs = reference(config, seed=1)  # every weight replaced: the NumPy oracle's, or as stored
    weights = {
        n: dequantized(a, written[n + "_scale_inv"], (128, 128))
        if n + "_scale_inv" in written
        else a
        for n, a in written.items()
        if not n.endswith("_scale_inv")
    }
    theirs.load_state_dict({n: torch.from_numpy(a) for n, a in weights.items()})
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 9))
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        want = theirs(torch.from_numpy(ids), use_cache=False).logits.numpy()
        got = np.asarray(jax.jit(lambda m, x: m(x))(ours, ids))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_plain_rules_refuse_an_fp8_checkpoint_naming_its_scales(fp8):
    folder, _, config = fp8
    with pytest.raises(
        convert.ConversionError,
        match=r"'model\.layers\.0\.mlp\.down_proj\.weight_scale_inv': no rule consumes",
    ):
        load_safetensors(abstract(config), folder, rules=llama.UNTIED_RULES)


def test_scales_that_do_not_fit_their_weights_blocks_are_refused_by_name(fp8, tmp_path):
    folder, written, config = fp8
    bad = dict(written)
    name = "model.layers.1.self_attn.o_proj.weight"
    bad[name + "_scale_inv"] = np.ones((2, 2), np.float32)  # o_proj is [64, 64]: one block
    from safetensors.numpy import save_file

    save_file({n: np.ascontiguousarray(a) for n, a in bad.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    rules = convert.quantized_rules(llama.UNTIED_RULES, open_safetensors(tmp_path))
    with pytest.raises(
        convert.ConversionError,
        match=r"model\.layers\.1\.self_attn\.o_proj\.weight.*weights of shape \[64, 64\] in blocks of 128x128 take one float scale per block, a scale of shape \[1, 1\]; got float32\[2, 2\]",
    ) as info:
        load_safetensors(abstract(config), tmp_path, rules=rules)
    assert [(p.kind, p.name) for p in info.value.problems] == [
        ("transform", name),  # the scale, named by its weight and its rule
        ("missing", "layers.1.attention.out.kernel"),  # the leaf it would have made
    ]
    # a block size other than the checkpoint's is refused the same way
    other = convert.quantized_rules(
        llama.UNTIED_RULES,
        open_safetensors(folder),
        config={"quantization_config": {**FP8_CONFIG, "weight_block_size": [32, 32]}},
    )
    with pytest.raises(
        convert.ConversionError,
        match=r"in blocks of 32x32 take one float scale per block, a scale of shape \[2, 2\]; got float32\[1, 1\]",
    ):
        load_safetensors(abstract(config), folder, rules=other)


def test_configs_it_cannot_read_are_refused_saying_what_it_reads(fp8, tmp_path):
    folder, written, _ = fp8
    checkpoint = open_safetensors(folder)
    rules = llama.UNTIED_RULES
    for quantization, message in [
        (
            {**FP8_CONFIG, "weight_block_size": None},
            r"weight_block_size is two positive ints \(\[128, 128\]\), got None; Taktiny reads block-scaled FP8 only",
        ),
        (
            {**FP8_CONFIG, "activation_scheme": "static"},
            r"activation_scheme 'static'; Taktiny reads e4m3 weights with dynamic",
        ),
        (
            {"quant_method": "gptq", "bits": 4},
            r"quant_method 'gptq'; Taktiny reads \['fp8', 'compressed-tensors'\]",
        ),
        (
            {"bits": 4},
            r"the config has no quantization_config \(with a quant_method\): the checkpoint is not quantized",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            convert.quantized_rules(rules, checkpoint, config={"quantization_config": quantization})
    with pytest.raises(
        ValueError,
        match=r"pass config=, the checkpoint's config.json \(its path or dict\): only a local checkpoint's is found beside it",
    ):
        convert.quantized_rules(rules, dict(written))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"cannot read the checkpoint's config '.*config.json'"):
        convert.quantized_rules(rules, dict(written), config=tmp_path / "config.json")
    json_path = tmp_path / "config.json"
    json_path.write_text(json.dumps({"quantization_config": FP8_CONFIG}))
    assert len(convert.quantized_rules(rules, dict(written), config=json_path)) == len(rules)


def test_a_rule_reading_scaled_and_unscaled_weights_or_many_at_once_is_refused(fp8):
    folder, _, _ = fp8
    checkpoint = open_safetensors(folder)
    mixed = [convert.Rule("model.**.weight", "**.kernel", convert.transpose())]
    with pytest.raises(
        ValueError,
        match=r"reads FP8 weights with block scales \('model\.layers\.0\..*'\) and weights without \('model\.embed_tokens\.weight'\); split it",
    ):
        convert.quantized_rules(mixed, checkpoint)
    stacked = [convert.Rule("model.layers.{i}.mlp.up_proj.weight", "up", convert.stack())]
    with pytest.raises(
        ValueError,
        match=r"only a rule that reads one '<module>\.weight' template \(no regex, no gathering\) can read them",
    ):
        convert.quantized_rules(stacked, checkpoint)


@pytest.mark.thorough  # (the stack's path: tests/loading/test_into_stack.py; FP8 steps as any other)
def test_a_scanned_model_reads_each_layers_fp8_weights_into_its_slice(fp8):
    folder, _, config = fp8
    rules = convert.quantized_rules(llama.UNTIED_RULES, open_safetensors(folder))
    flat = load_safetensors(abstract(config), folder, rules=rules)
    scanned = jax.eval_shape(lambda: llama.Llama(config, rngs=nn.Rngs(0), scanned=True))
    for target, expected in [(scanned, flat), (tt.quantize(scanned), tt.quantize(flat))]:
        loaded = load_safetensors(target, folder, rules=rules)
        for i in range(config.num_hidden_layers):
            want = jax.tree.leaves(expected.layers[i].mlp)
            got = jax.tree.leaves(loaded.layers[i].mlp)  # (a Stack's layer: its slices)
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_blocks_load_into_a_bfloat16_int8_model_and_onto_a_mesh_as_they_would_unfused(fp8):
    folder, _, config = fp8
    rules = convert.quantized_rules(llama.UNTIED_RULES, open_safetensors(folder))
    halves = load_safetensors(abstract(config, jnp.bfloat16), folder, rules=rules)
    int8 = load_safetensors(tt.quantize(abstract(config, jnp.bfloat16)), folder, rules=rules)
    for a, b in zip(jax.tree.leaves(int8), jax.tree.leaves(tt.quantize(halves)), strict=True):
        assert a.dtype == b.dtype  # (bfloat16 scales)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu")[:4])
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = jax.tree.map(  # every matrix split by columns across 4 devices
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split if x.ndim == 2 else whole),
        abstract(config, jnp.bfloat16),
    )
    placed = load_safetensors(target, folder, rules=rules)
    gate = placed.layers[1].mlp.gate.kernel  # [64, 176]: 44 columns a device
    assert gate.sharding == split
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(halves), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_quantizing_fp8_load_reads_through_one_scratch_buffer(tmp_path):
    """Into a float model FP8 steps take turns in two scratch buffers (the next weight is
    read while one is placed); a quantizing load reads them through one, as it reads
    float tensors, and its program holds nothing more: the plan says so, and the load
    gives `tt.quantize` of the float load."""
    from taktiny.io import plan_load

    rng = np.random.default_rng(0)
    floats = {f"l{k}.weight": rng.standard_normal((96, 200)).astype(np.float32) for k in range(4)}
    fp8_folder(floats, tmp_path, quantized=lambda name: True, shards=1)
    rules = convert.quantized_rules(
        [convert.Rule("{n}.weight", "{n}.kernel", convert.transpose())], open_safetensors(tmp_path)
    )
    model = jax.eval_shape(
        lambda: {
            f"l{k}": nn.Linear(200, 96, use_bias=False, param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))
            for k in range(4)
        }
    )
    weight = math.prod(floats["l0.weight"].shape)  # bytes: one a weight
    scales = 1 * 2 * 4  # float32, one per 128x128 block
    floating = plan_load(model, tmp_path, rules=rules)
    quantizing = plan_load(tt.quantize(model), tmp_path, rules=rules)
    assert floating.error is None and quantizing.error is None
    assert weight + scales <= quantizing.scratch_bytes < weight + 4096  # (aligned)
    assert floating.scratch_bytes == 2 * quantizing.scratch_bytes
    loaded = load_safetensors(tt.quantize(model), tmp_path, rules=rules)
    expected = tt.quantize(load_safetensors(model, tmp_path, rules=rules))
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
