"""Quantized models in safetensors files: saved as their parts (4-bit values packed two per
byte, the layout in the header) and loaded back bitwise; float checkpoints quantized
tensor by tensor as they stream into a quantized model; every inconsistency named."""

import json
import re
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from _reads import log_reads
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import convert as cv
from taktiny import nn
from taktiny.io import (
    SafetensorsError,
    Tensor,
    load_safetensors,
    open_safetensors,
    save_safetensors,
)

LAYOUTS = {"int8": (8, None), "int4": (4, None), "int4-g16": (4, 16)}


class Net(nn.Module):
    """Quantizable layers with an odd last axis (5: a half-filled last byte) and a table
    quantized along its rows' features."""

    def __init__(self, *, rngs: nn.Rngs):
        self.embed = nn.Embed(10, 32, rngs=rngs)
        self.hidden = nn.Linear(32, 64, rngs=rngs)
        self.head = nn.Linear(64, 5, rngs=rngs)


def net(seed=0):
    return Net(rngs=nn.Rngs(seed))


def abstract_net():
    return jax.eval_shape(net)


def flat_numpy(tree):
    return {k: np.asarray(v) for k, v in tt.flat_state_dict(tree).items()}


def assert_bitwise(tree, expected):
    got, want = flat_numpy(tree), flat_numpy(expected)
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name


def header(path):
    """The header of a safetensors file: {name: entry}, and its metadata."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    entries = json.loads(data[8 : 8 + length])
    return entries, entries.pop("__metadata__")


@pytest.fixture
def reads(monkeypatch):
    """Every tensor read from disk, by name."""
    return log_reads(monkeypatch, lambda tensor, out: tensor.name)


# --- saving and loading quantized models ------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_quantized_model_saves_and_loads_back_bitwise(tmp_path, layout):
    bits, group = LAYOUTS[layout]
    model = tt.quantize(net(), bits=bits, group_size=group)
    path = tmp_path / "q.safetensors"
    save_safetensors(path, model)
    # into an abstract quantized model, and into a concrete one with other values
    loaded = load_safetensors(tt.quantize(abstract_net(), bits=bits, group_size=group), path)
    assert_bitwise(loaded, model)
    assert isinstance(loaded.hidden.kernel, tt.QArray) and loaded.hidden.kernel.bits == bits
    other = tt.quantize(net(1), bits=bits, group_size=group)
    assert_bitwise(load_safetensors(other, path), model)
    x = jnp.ones((2, 32))
    assert np.array_equal(loaded.hidden(x), model.hidden(x))


def test_the_header_records_the_layout_and_the_packing(tmp_path):
    model = tt.quantize(net(), bits=4, group_size=16)
    path = tmp_path / "q.safetensors"
    save_safetensors(path, model, metadata={"step": "3"})
    entries, metadata = header(path)
    assert json.loads(metadata["taktiny_quantized"]) == {
        "embed.embedding": {"bits": 4, "axis": 1, "group_size": 16, "shape": [10, 32]},
        "hidden.kernel": {"bits": 4, "axis": 0, "group_size": 16, "shape": [32, 64]},
        "head.kernel": {"bits": 4, "axis": 0, "group_size": 16, "shape": [64, 5]},
    }
    assert json.loads(metadata["taktiny_packed"]) == {
        "embed.embedding.value": {"dtype": "int4", "shape": [10, 32]},
        "hidden.kernel.value": {"dtype": "int4", "shape": [32, 64]},
        "head.kernel.value": {"dtype": "int4", "shape": [64, 5]},
    }
    assert metadata["step"] == "3"
    # packed two per byte; the odd last axis (5) takes 3 bytes; scales beside, as they are
    assert (entries["head.kernel.value"]["dtype"], entries["head.kernel.value"]["shape"]) == (
        "U8",
        [64, 3],
    )
    assert (entries["head.kernel.scale"]["dtype"], entries["head.kernel.scale"]["shape"]) == (
        "F32",
        [4, 5],
    )
    # low nibble first along the last axis, the odd one out padded with a zero nibble
    stored = safetensors.numpy.load_file(path)["head.kernel.value"]
    values = np.asarray(model.head.kernel.value).view(np.uint8) & 0x0F
    assert np.array_equal(stored & 0x0F, values[:, 0::2])
    assert np.array_equal(stored[:, :2] >> 4, values[:, 1::2])
    assert not (stored[:, 2] >> 4).any()
    # int8 is stored as it is, with no packing record
    save_safetensors(path, tt.quantize(net()))
    entries, metadata = header(path)
    assert entries["hidden.kernel.value"]["dtype"] == "I8" and "taktiny_packed" not in metadata
    assert json.loads(metadata["taktiny_quantized"])["hidden.kernel"]["bits"] == 8


def test_open_presents_packed_tensors_as_what_they_are(tmp_path, monkeypatch):
    model = tt.quantize(net(), bits=4)
    path = tmp_path / "q.safetensors"
    save_safetensors(path, model)
    checkpoint = open_safetensors(path)
    tensor = checkpoint["head.kernel.value"]
    assert (tensor.dtype, tensor.shape, tensor.nbytes, tensor.packed) == (
        np.dtype(ml_dtypes.int4),
        (64, 5),
        64 * 3,
        True,
    )
    assert repr(tensor) == "Tensor('head.kernel.value', int4[64, 5], packed, q.safetensors)"
    assert not checkpoint["head.kernel.scale"].packed
    assert checkpoint.quantized["head.kernel"] == {
        "bits": 4,
        "axis": 0,
        "group_size": None,
        "shape": [64, 5],
    }
    full = np.asarray(model.head.kernel.value)
    assert np.array_equal(np.asarray(tensor), full) and np.asarray(tensor).dtype == full.dtype
    # a block starting on an odd element, across rows, reads only its bytes and unpacks
    stored, read = [], Tensor.read

    def logged(self, index=None, *, verify=True):  # the packed bytes' reads: their shapes
        out = read(self, index, verify=verify)
        stored.append(out.shape)
        return out

    monkeypatch.setattr(Tensor, "read", logged)
    blocks = [(slice(1, 3), slice(3, 5)), (slice(0, 64), slice(1, 4)), (slice(5, 6), slice(0, 1))]
    for (rows, cols), nbytes in zip(blocks, [(2, 2), (64, 2), (1, 1)], strict=True):
        stored.clear()
        block = tensor.read([rows, cols])
        assert np.array_equal(block, full[rows, cols]) and not block.flags.writeable
        assert stored == [nbytes]  # the bytes holding the block's elements, no more


def test_the_packing_record_of_a_4_bit_tensor_of_64_axes_is_read(tmp_path):
    path = tmp_path / "deep.safetensors"
    save_safetensors(path, {"deep": jnp.zeros((1,) * 63 + (3,), jnp.int4)})
    tensor = open_safetensors(path)["deep"]
    assert tensor.packed and tensor.dtype == jnp.int4 and tensor.shape == (1,) * 63 + (3,)
    assert tensor.stored.shape == (1,) * 63 + (2,)


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint4, jnp.float4_e2m1fn])
def test_a_bare_4_bit_array_is_packed_too(tmp_path, dtype):
    rng = np.random.default_rng(0)
    arrays = {
        f"{n}": jnp.asarray(rng.integers(0, 16, shape, np.uint8).view(np.dtype(dtype)))
        for n, shape in enumerate([(7,), (3, 4), (), (2, 0), (2, 3, 1), (2, 131)])
    }
    path = tmp_path / "b.safetensors"
    save_safetensors(path, {**arrays, "f": jnp.ones(3)})
    checkpoint = open_safetensors(path)
    assert sorted(json.loads(checkpoint.metadata["taktiny_packed"])) == sorted(arrays)
    for name, array in arrays.items():
        got = np.asarray(checkpoint[name])
        assert got.dtype == array.dtype and got.shape == array.shape, name
        assert np.array_equal(got.view(np.uint8) & 15, np.asarray(array).view(np.uint8) & 15)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in arrays.items()}
    loaded = load_safetensors({**abstract, "f": jax.ShapeDtypeStruct((3,), jnp.float32)}, path)
    for name, array in arrays.items():
        assert np.asarray(loaded[name]).tobytes() == np.asarray(array).tobytes(), name


def test_a_sharded_quantized_model_loads_its_own_blocks(tmp_path, reads):
    model = tt.quantize(net(), bits=4, group_size=16)
    path = tmp_path / "q.safetensors"
    save_safetensors(path, model)
    mesh = jax.make_mesh((2, 4), ("rows", "cols"))
    rules = [
        ("hidden.kernel.value", P("rows", "cols")),  # scales [2, 64]: one group per row block
        ("hidden.kernel.scale", P("rows", "cols")),
        ("head.kernel.*", P("rows")),
    ]
    target = tt.shard(tt.quantize(abstract_net(), bits=4, group_size=16), rules, mesh)
    loaded = load_safetensors(target, path)
    assert_bitwise(loaded, model)
    value = loaded.hidden.kernel.value
    assert value.sharding == NamedSharding(mesh, P("rows", "cols"))
    assert loaded.hidden.kernel.scale.sharding == NamedSharding(mesh, P("rows", "cols"))
    expected = np.asarray(model.hidden.kernel.value)
    for shard in value.addressable_shards:
        assert shard.data.shape == (16, 16)
        assert np.array_equal(shard.data, expected[shard.index])
    assert reads.count("hidden.kernel.value") == 8  # each device's block, read alone


def test_a_quantized_model_in_shards_with_an_index(tmp_path):
    model = tt.quantize(net(), bits=4)
    files = save_safetensors(tmp_path / "q.safetensors", model, max_shard_size=600)
    assert len(files) > 3
    packed = {}
    for file in files[:-1]:
        _, metadata = header(file)
        assert json.loads(metadata["taktiny_quantized"]).keys() == {
            "embed.embedding",
            "hidden.kernel",
            "head.kernel",
        }  # every shard records every layout; each lists its own packed tensors
        for name in json.loads(metadata.get("taktiny_packed", "{}")):
            assert name not in packed
            packed[name] = file
    assert len(packed) == 3 and len(set(packed.values())) > 1
    assert_bitwise(load_safetensors(tt.quantize(abstract_net(), bits=4), tmp_path), model)
    opened = open_safetensors(tmp_path)  # the index: its layouts are the shards' records
    assert opened.quantized == json.loads(header(files[0])[1]["taktiny_quantized"])
    assert opened.quantized["hidden.kernel"]["bits"] == 4


def test_quantized_parts_alone_or_beside_a_lone_part_are_told_as_quantized(tmp_path):
    path = tmp_path / "k.safetensors"
    model = {
        "j": jax.ShapeDtypeStruct((1,), jnp.float32),
        "k": jax.ShapeDtypeStruct((4, 4), jnp.float32),
    }
    parts = {"k.value": np.ones((4, 4), np.int8), "k.scale": np.ones((1, 4), np.float32)}
    lone = {"j.value": np.ones(1, np.float32)}  # a part without its scale: no quantized 'j'
    for state in (parts, {**lone, **parts}):  # only the two parts; a lone part read first
        safetensors.numpy.save_file(state, str(path))
        with pytest.raises(tt.StateDictError) as caught:
            load_safetensors(model, path)
        problems = {p.name: (p.kind, p.got) for p in caught.value.problems}
        assert problems["k"] == ("structure", "quantized parts"), state.keys()
        assert problems["j"][0] == "missing" and "k.value" not in problems


def test_an_index_whose_shards_record_an_inconsistent_layout_is_refused_by_name(tmp_path):
    layout = {"q": {"bits": 8, "axis": 0, "group_size": None, "shape": [4, 4]}}
    safetensors.numpy.save_file(
        {"q.value": np.zeros((4, 4), np.float32)},  # 8-bit values must be int8
        str(tmp_path / "m-1.safetensors"),
        metadata={"taktiny_quantized": json.dumps(layout)},
    )
    safetensors.numpy.save_file(
        {"q.scale": np.ones((1, 4), np.float32)}, str(tmp_path / "m-2.safetensors")
    )
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(
        json.dumps({"weight_map": {"q.value": "m-1.safetensors", "q.scale": "m-2.safetensors"}})
    )
    with pytest.raises(SafetensorsError, match=rf"^{re.escape(str(index))}: the metadata "
                       r"'taktiny_quantized' records 'q' as quantized int8 .* but its 8-bit values "
                       r"q\.value must be int8, and the checkpoint holds float32\[4, 4\]"):  # fmt: skip
        open_safetensors(index)


# --- quantizing a float checkpoint as it streams in -------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_float_checkpoint_is_quantized_tensor_by_tensor(tmp_path, layout, reads):
    bits, group = LAYOUTS[layout]
    model = net()
    path = tmp_path / "f.safetensors"
    save_safetensors(path, model)
    target = tt.quantize(abstract_net(), bits=bits, group_size=group)
    loaded = load_safetensors(target, path)
    assert_bitwise(loaded, tt.quantize(model, bits=bits, group_size=group))
    assert sorted(reads) == sorted(tt.flat_state_dict(model))  # each float tensor read once
    # only some layers quantized: the others load as they are
    partly = tt.quantize(abstract_net(), bits=bits, group_size=group, where="hidden")
    loaded = load_safetensors(partly, path)
    assert_bitwise(loaded, tt.quantize(model, bits=bits, group_size=group, where="hidden"))


def test_quantizing_onto_a_mesh_places_value_and_scale_on_their_shardings(tmp_path):
    model = net()
    path = tmp_path / "f.safetensors"
    save_safetensors(path, model)
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    rules = [("hidden.kernel.*", P(None, ("x", "y"))), ("embed.embedding.*", P("x"))]
    target = tt.shard(tt.quantize(abstract_net(), bits=4, group_size=16), rules, mesh)
    loaded = load_safetensors(target, path)
    assert_bitwise(loaded, tt.quantize(model, bits=4, group_size=16))
    kernel = loaded.hidden.kernel
    assert kernel.value.sharding == NamedSharding(mesh, P(None, ("x", "y")))
    assert kernel.scale.sharding == NamedSharding(mesh, P(None, ("x", "y")))
    assert loaded.embed.embedding.scale.sharding == NamedSharding(mesh, P("x"))


def test_a_quantizing_load_keeps_one_float_tensor_at_a_time(tmp_path, monkeypatch):
    import taktiny.loading._place as load_module

    model = net()
    path = tmp_path / "f.safetensors"
    save_safetensors(path, model)
    buffers = []
    real = load_module.Scratch.__init__

    def counted(self, *args):
        buffers.append(self)
        real(self, *args)

    monkeypatch.setattr(load_module.Scratch, "__init__", counted)
    load_safetensors(tt.quantize(abstract_net()), path)
    assert len(buffers) == 1  # one read buffer, reused; the plain load reads ahead into two
    buffers.clear()
    rules = [cv.Rule("{layer}.{p}", "{layer}.{p}", cv.cast(jnp.float32))]
    load_safetensors(abstract_net(), path, rules=rules)
    assert len(buffers) == 2


def _torch_net(seed: int) -> dict[str, np.ndarray]:
    """The state dict of a PyTorch twin of `net`: fc1 (hidden), fc2 (head), emb (embed)."""
    rng = np.random.default_rng(seed)
    return {
        "fc1.weight": rng.normal(size=(64, 32)).astype(np.float32),
        "fc1.bias": rng.normal(size=(64,)).astype(np.float32),
        "fc2.weight": rng.normal(size=(5, 64)).astype(np.float32),
        "fc2.bias": rng.normal(size=(5,)).astype(np.float32),
        "emb.weight": rng.normal(size=(10, 32)).astype(np.float32),
    }


def test_rules_can_make_the_float_array_of_a_quantized_parameter(tmp_path):
    torch_names = _torch_net(0)
    torch_names["fc1.again"] = torch_names["fc1.weight"]
    path = tmp_path / "torch.safetensors"
    safetensors.numpy.save_file(torch_names, str(path))
    rules = [
        cv.Rule("fc1.weight", "hidden.kernel", cv.transpose()),
        cv.Rule("fc2.weight", "head.kernel", cv.transpose()),
        cv.Rule("fc1.bias", "hidden.bias"),
        cv.Rule("fc2.bias", "head.bias"),
        cv.Rule("emb.weight", "embed.embedding"),
        cv.Ignore("fc1.again"),
    ]
    float_model = abstract_net().load_flat_state_dict(
        dict(cv.convert(rules, torch_names, target=abstract_net()))
    )
    target = tt.quantize(abstract_net(), bits=4, group_size=16)
    loaded = load_safetensors(target, path, rules=rules)
    assert_bitwise(loaded, tt.quantize(float_model, bits=4, group_size=16))
    # or made into the parts by a quantize transform
    explicit = [
        cv.Rule(
            "fc1.weight",
            ["hidden.kernel.value", "hidden.kernel.scale"],
            cv.chain(cv.transpose(), cv.quantize(bits=4, group_size=16)),
        ),
        *rules[1:],
    ]
    assert_bitwise(load_safetensors(target, path, rules=explicit), loaded)
    # a shape the rule gets wrong is found from the headers, on the logical shape
    wrong = [cv.Rule("fc1.weight", "hidden.kernel"), *rules[1:]]
    with pytest.raises(cv.ConversionError, match=r"'hidden\.kernel': .*float32\[32, 64\]"):
        load_safetensors(target, path, rules=wrong)
    again = cv.Rule("fc1.again", ["hidden.kernel.value", "hidden.kernel.scale"],
                    cv.chain(cv.transpose(), cv.quantize(bits=4, group_size=16)))  # fmt: skip
    twice = [*rules[:-1], again]
    with pytest.raises(cv.ConversionError, match=r"'hidden\.kernel': made both"):
        load_safetensors(target, path, rules=twice)
    lacking = [rules[0], *rules[2:]]
    with pytest.raises(cv.ConversionError, match=r"'head\.kernel\.value': no rule"):
        load_safetensors(target, path, rules=[*lacking, cv.Ignore("fc2.weight")])


def test_rules_into_a_quantized_model_take_allow_and_ties_and_name_the_load(tmp_path):
    torch_names = {**_torch_net(1), "steps": np.array(3, np.int64)}
    torch_names["fc1.copy"] = torch_names["fc1.weight"]
    torch_names["fc2.copy"] = torch_names["fc2.weight"] + 1
    path = tmp_path / "torch.safetensors"
    safetensors.numpy.save_file(torch_names, str(path))
    fc1 = [
        cv.Rule("fc1.weight", "hidden.kernel", cv.transpose()),
        cv.Rule("fc1.bias", "hidden.bias"),
    ]
    fc2 = [cv.Rule("fc2.weight", "head.kernel", cv.transpose()), cv.Rule("fc2.bias", "head.bias")]
    rest = [cv.Rule("emb.weight", "embed.embedding"), cv.Tie("fc1.copy", same_as="fc1.weight")]
    rules = [*fc1, *fc2, *rest, cv.Ignore("fc2.copy")]
    target = tt.quantize(net(1), bits=4, group_size=16)  # concrete: a partial load keeps the rest
    where = r"^taktiny\.io\.load_safetensors\(Net\): "
    with pytest.raises(
        cv.ConversionError,
        match=where + r"1 problem; nothing was converted\.\n  - 'steps': no rule",
    ):
        load_safetensors(target, path, rules=rules)
    unused = {"unused": ["steps"]}
    loaded = load_safetensors(target, path, rules=rules, allow=unused)
    assert np.array_equal(loaded.head.bias, torch_names["fc2.bias"])
    assert not np.array_equal(loaded.hidden.kernel.value, target.hidden.kernel.value)
    with pytest.raises(
        cv.ConversionError,
        match=where + r"1 problem; nothing was converted\.\n  - 'fc2\.copy': is tied "
        r"to 'fc2\.weight', but their values differ\.$",
    ):
        load_safetensors(target, path, rules=[*rules[:-1], cv.Tie("fc2.copy", "fc2.weight")],
                         allow=unused)  # fmt: skip
    # what the rules leave out, allowed missing, keeps its value: a float leaf, a quantized one
    head = ["head.bias", "head.kernel.value", "head.kernel.scale"]
    partial = [*fc1, *rest, cv.Ignore("fc2.*")]
    loaded = load_safetensors(target, path, rules=partial, allow={**unused, "missing": head},
                              strict=False)  # fmt: skip
    assert_bitwise(loaded.head, target.head)
    assert np.array_equal(loaded.hidden.bias, torch_names["fc1.bias"])
    # every part of every quantized parameter left out is named
    lacking = [fc1[1], fc2[1], rest[0], cv.Ignore("fc1.*"), cv.Ignore("fc2.*"), cv.Ignore("steps")]
    with pytest.raises(
        cv.ConversionError, match=where + r"4 problems; nothing was converted\.\n"
    ) as caught:
        load_safetensors(target, path, rules=lacking)
    assert [(p.kind, p.name) for p in caught.value.problems] == [
        ("missing", "hidden.kernel.value"), ("missing", "hidden.kernel.scale"),
        ("missing", "head.kernel.value"), ("missing", "head.kernel.scale"),
    ]  # fmt: skip


class Halves(nn.Module):
    """Two float16 layers, which rules make from one fused tensor each."""

    def __init__(self, *, rngs: nn.Rngs):
        self.a = nn.Linear(8, 4, param_dtype=jnp.float16, rngs=rngs)
        self.b = nn.Linear(8, 4, param_dtype=jnp.float16, rngs=rngs)


def test_a_split_into_quantized_parameters_checks_and_quantizes_each_part(tmp_path):
    abstract = jax.eval_shape(lambda: Halves(rngs=nn.Rngs(0)))
    target = tt.quantize(abstract)
    fused = np.arange(64, dtype=np.float32).reshape(8, 8) / 8
    biases = np.arange(12, dtype=np.float32)
    path = tmp_path / "fused.safetensors"
    save_safetensors(path, {"fused": fused, "biases": biases})
    rules = [
        cv.Rule("fused", ["a.kernel", "b.kernel"], cv.split(axis=1)),
        cv.Rule("biases", ["a.bias", "b.bias", "extra"], cv.split()),
    ]
    loaded = load_safetensors(target, path, rules=rules, allow={"unknown": ["extra"]})
    floats = {"a.kernel": fused[:, :4], "b.kernel": fused[:, 4:], "a.bias": biases[:4],
              "b.bias": biases[4:8]}  # fmt: skip
    float_model = abstract.load_flat_state_dict(
        {k: v.astype(np.float16) for k, v in floats.items()}
    )
    assert_bitwise(loaded, tt.quantize(float_model))
    assert "extra" not in tt.flat_state_dict(loaded)
    # values float16 cannot hold, in both halves: each named, before anything is loaded
    fused[0, 0] = fused[0, 4] = 1e6
    save_safetensors(path, {"fused": fused, "biases": biases})
    inf = (
        "casting float32 to float16 would turn a value into inf: the largest is 1e+06, and "
        "float16 holds at most 6.55e+04. Scale or clip the value, or keep this parameter in a "
        "wider dtype."
    )
    with pytest.raises(tt.StateDictError) as caught:
        load_safetensors(target, path, rules=rules, allow={"unknown": ["extra"]})
    assert str(caught.value) == (
        f"taktiny.io.load_safetensors(Halves): 2 problems; nothing was loaded.\n"
        f"  - 'a.kernel': {inf}\n  - 'b.kernel': {inf}"
    )
    # and so are the float leaves' values
    fused[0, 0] = fused[0, 4] = 0
    biases[[0, 4]] = 1e6
    save_safetensors(path, {"fused": fused, "biases": biases})
    with pytest.raises(tt.StateDictError) as caught:
        load_safetensors(target, path, rules=rules, allow={"unknown": ["extra"]})
    assert str(caught.value) == (
        f"taktiny.io.load_safetensors(Halves): 2 problems; nothing was loaded.\n"
        f"  - 'a.bias': {inf}\n  - 'b.bias': {inf}"
    )


def test_a_quantized_checkpoint_dequantizes_into_a_float_model_by_rule(tmp_path, monkeypatch):
    import taktiny.io._read as read_module

    model = tt.quantize(net(), bits=4, group_size=16)
    path = tmp_path / "q.safetensors"
    save_safetensors(path, model)
    rules = [
        cv.Rule(["hidden.kernel.value", "hidden.kernel.scale"], "hidden.kernel",
                cv.dequantize(axis=0, group_size=16)),
        cv.Rule(["head.kernel.value", "head.kernel.scale"], "head.kernel",
                cv.dequantize(axis=0, group_size=16)),
        cv.Rule(["embed.embedding.value", "embed.embedding.scale"], "embed.embedding",
                cv.dequantize(axis=1, group_size=16)),
        cv.Rule("{layer}.bias", "{layer}.bias"),
    ]  # fmt: skip
    fresh, buffer = [], read_module._buffer

    def counted(shape, dtype):
        fresh.append(np.dtype(dtype))
        return buffer(shape, dtype)

    monkeypatch.setattr(read_module, "_buffer", counted)
    loaded = load_safetensors(abstract_net(), path, rules=rules)
    assert_bitwise(loaded, tt.dequantize(model))
    assert np.dtype(np.uint8) not in fresh  # the packed bytes are read into the scratch buffer


# --- problems -------------------------------------------------------------------------


def test_a_float_tensor_of_the_wrong_shape_or_kind_is_refused_before_any_read(tmp_path, reads):
    model = net()
    state = flat_numpy(model)
    state["hidden.kernel"] = np.zeros((32, 63), np.float32)
    state["head.kernel"] = np.zeros((64, 5), np.int32)
    path = tmp_path / "bad.safetensors"
    save_safetensors(path, state)
    with pytest.raises(tt.StateDictError, match="load_safetensors") as caught:
        load_safetensors(tt.quantize(abstract_net(), bits=4, group_size=16), path)
    problems = {p.name: p for p in caught.value.problems}
    assert sorted(problems) == ["head.kernel", "hidden.kernel"]
    message = str(caught.value)
    assert (
        "'hidden.kernel': shape mismatch: the model quantizes 'hidden.kernel' (int4 (groups of "
        "16 along axis 0)) from a float array of shape (32, 64), got (32, 63)." in message
    )
    assert "holds int32[64, 5] under its name, which is not a float array to quantize" in message
    assert problems["head.kernel"].kind == "dtype" and problems["hidden.kernel"].kind == "shape"
    head, hidden = problems["head.kernel"], problems["hidden.kernel"]
    assert (head.expected, head.got) == ("a float array", "int32")
    assert (hidden.expected, hidden.got) == ((32, 64), (32, 63))
    assert head.hint == (
        "the model quantizes 'head.kernel' as int4 (groups of 16 along axis 0), and the "
        "checkpoint holds int32[64, 5] under its name, which is not a float array to quantize. "
        "Give the float array, or the quantized parts head.kernel.value and head.kernel.scale."
    )
    assert not reads


def test_a_float_array_and_its_quantized_parts_together_are_refused(tmp_path):
    parts = flat_numpy(tt.quantize(net()))
    path = tmp_path / "both.safetensors"
    save_safetensors(path, {**parts, "hidden.kernel": np.zeros((32, 64), np.float32)})
    with pytest.raises(
        tt.StateDictError, match=r"'hidden\.kernel': the checkpoint holds both"
    ) as caught:
        load_safetensors(tt.quantize(abstract_net()), path)
    (problem,) = caught.value.problems
    assert (problem.kind, problem.name) == ("structure", "hidden.kernel")
    assert (problem.expected, problem.got) == ("a float array or its quantized parts", "both")
    assert problem.hint == (
        "the checkpoint holds both the float array 'hidden.kernel' and the quantized parts "
        "['hidden.kernel.value', 'hidden.kernel.scale'] of this quantized parameter; keep one "
        "of them."
    )


def refused(target, path):
    """The problem a load of `path` into `target` finds with 'hidden.kernel'."""
    with pytest.raises(tt.StateDictError) as caught:
        load_safetensors(target, path)
    problems = {p.name: p for p in caught.value.problems}
    assert sorted(problems) == ["embed.embedding", "head.kernel", "hidden.kernel"]
    problem = problems["hidden.kernel"]
    assert problem.hint in str(caught.value)
    return problem.kind, problem.expected, problem.got, problem.hint


def test_a_checkpoint_quantized_otherwise_is_refused_by_name(tmp_path, reads):
    path = tmp_path / "int8.safetensors"
    save_safetensors(path, tt.quantize(net()))
    fix = "or load a float checkpoint, which is quantized on load."
    int4_g16, int8 = "int4 (groups of 16 along axis 0)", "int8 (one scale per channel along axis 0)"
    assert refused(tt.quantize(abstract_net(), bits=4, group_size=16), path) == (
        "dtype", int4_g16, int8,
        f"the model quantizes 'hidden.kernel' as {int4_g16}, the checkpoint holds it as {int8}. "
        f"Quantize the model as the checkpoint was (tt.quantize(float_model, bits=8)), {fix}",
    )  # fmt: skip
    # without the layout record, by the values' dtype
    save_safetensors(path, flat_numpy(tt.quantize(net())))
    assert open_safetensors(path).quantized == {}
    int4 = "int4 (one scale per channel along axis 0)"
    assert refused(tt.quantize(abstract_net(), bits=4), path) == (
        "dtype", int4, "int8 values",
        f"the model quantizes 'hidden.kernel' as {int4}, the checkpoint holds it as int8 values. "
        f"Quantize the model as the checkpoint was (tt.quantize(float_model, bits=8)), {fix}",
    )  # fmt: skip
    assert not reads  # each refused from the headers alone
    assert_bitwise(load_safetensors(tt.quantize(abstract_net()), path), tt.quantize(net()))
    reads.clear()
    save_safetensors(path, flat_numpy(tt.quantize(net(), bits=4)))  # packed, unrecorded
    assert open_safetensors(path).quantized == {}
    assert refused(tt.quantize(abstract_net()), path) == (
        "dtype", int8, "int4 values",
        f"the model quantizes 'hidden.kernel' as {int8}, the checkpoint holds it as int4 values. "
        f"Quantize the model as the checkpoint was (tt.quantize(float_model, bits=4)), {fix}",
    )  # fmt: skip
    state = flat_numpy(tt.quantize(net()))
    state["hidden.kernel.value"] = state["hidden.kernel.value"].astype(np.int16)
    save_safetensors(path, state)
    with pytest.raises(tt.StateDictError) as caught:
        load_safetensors(tt.quantize(abstract_net()), path)
    ((kind, key, expected, got, hint),) = [
        (p.kind, p.name, p.expected, p.got, p.hint) for p in caught.value.problems
    ]
    assert (kind, key, expected, got) == ("dtype", "hidden.kernel", int8, "int16 values")
    assert hint == (
        f"the model quantizes 'hidden.kernel' as {int8}, the checkpoint holds it as int16 "
        f"values. Load a float checkpoint, which is quantized on load."
    )
    del state["hidden.kernel.scale"]  # a part refused is not also missing: one problem
    save_safetensors(path, state)
    with pytest.raises(tt.StateDictError) as caught:
        load_safetensors(tt.quantize(abstract_net()), path)
    assert [(p.kind, p.name) for p in caught.value.problems] == [("dtype", "hidden.kernel")]
    # the same bits, another group size
    save_safetensors(path, tt.quantize(net(), bits=4, group_size=16))
    assert refused(tt.quantize(abstract_net(), bits=4), path) == (
        "shape", int4, int4_g16,
        f"the model quantizes 'hidden.kernel' as {int4}, the checkpoint holds it as {int4_g16}. "
        f"Quantize the model as the checkpoint was (tt.quantize(float_model, bits=4, "
        f"group_size=16)), {fix}",
    )  # fmt: skip
    assert not reads


def test_a_quantized_checkpoint_into_a_float_model_says_how_to_convert(tmp_path):
    path = tmp_path / "q.safetensors"
    save_safetensors(path, tt.quantize(net(), bits=4, group_size=16))
    with pytest.raises(tt.StateDictError) as caught:
        load_safetensors(abstract_net(), path)
    assert {p.name: p.kind for p in caught.value.problems} == {
        "embed.embedding": "structure",
        "hidden.kernel": "structure",
        "head.kernel": "structure",
    }
    assert (
        "'hidden.kernel': the checkpoint holds it quantized as int4 (groups of 16 along axis 0), "
        "as hidden.kernel.value and hidden.kernel.scale; the model holds a float array "
        "float32[32, 64]. Load it into the quantized model, tt.quantize(model, bits=4, "
        "group_size=16) (then tt.dequantize it for floats), or pass rules that dequantize: "
        "convert.Rule(['hidden.kernel.value', 'hidden.kernel.scale'], 'hidden.kernel', "
        "convert.dequantize(axis=0, group_size=16))." in str(caught.value)
    )
    problem = next(p for p in caught.value.problems if p.name == "hidden.kernel")
    assert (problem.expected, problem.got) == ("a float array float32[32, 64]", "quantized parts")
    rule = (
        "convert.Rule(['hidden.kernel.value', 'hidden.kernel.scale'], 'hidden.kernel', "
        "convert.dequantize(axis={}))."
    )
    # one scale per channel; and without the layout record, only the parts' names
    for state, layout, bits, axis in [
        (tt.quantize(net()), " as int8 (one scale per channel along axis 0)", "8", "0"),
        (flat_numpy(tt.quantize(net())), "", "...", "..."),
    ]:
        save_safetensors(path, state)
        with pytest.raises(tt.StateDictError) as caught:
            load_safetensors(abstract_net(), path)
        hints = {p.name: p.hint for p in caught.value.problems}
        assert sorted(hints) == ["embed.embedding", "head.kernel", "hidden.kernel"]
        assert hints["hidden.kernel"] == (
            f"the checkpoint holds it quantized{layout}, as hidden.kernel.value and "
            f"hidden.kernel.scale; the model holds a float array float32[32, 64]. Load it into "
            f"the quantized model, tt.quantize(model, bits={bits}) (then tt.dequantize it for "
            f"floats), or pass rules that dequantize: " + rule.format(axis)
        )
    # one part alone, unrecorded, is no quantized parameter: an entry the float array lacks
    # and parts of no parameter of the model, and other entries, are unknown entries
    state = flat_numpy(tt.quantize(net()))
    del state["hidden.kernel.scale"]
    state.update({"a.extra": np.zeros(1, np.float32), "a.value": np.zeros(1, np.int8)})
    state["a.scale"] = np.ones(1, np.float32)
    save_safetensors(path, state)
    with pytest.raises(tt.StateDictError) as caught:
        load_safetensors(abstract_net(), path)
    kinds = {p.name: p.kind for p in caught.value.problems}
    assert kinds["hidden.kernel.value"] == "structure" and kinds["hidden.kernel"] == "missing"
    assert kinds["embed.embedding"] == kinds["head.kernel"] == "structure"  # each still told
    assert {kinds[n] for n in ("a.extra", "a.value", "a.scale")} == {"unknown"}
    assert "'hidden.kernel' is an array, so it has no entry 'value'" in str(caught.value)


def test_packed_bytes_without_their_record_are_refused_by_name(tmp_path, reads):
    model = tt.quantize(net(), bits=4)
    state = flat_numpy(model)
    state["hidden.kernel.value"] = np.zeros((32, 32), np.uint8)  # packed, but not listed
    path = tmp_path / "bare.safetensors"
    safetensors.numpy.save_file(
        {k: v for k, v in state.items() if v.dtype != ml_dtypes.int4}, str(path)
    )
    message = (
        r"'hidden\.kernel\.value' is stored as uint8\[32, 32\], where the model holds "
        r"int4\[32, 64\]: 4-bit tensors are stored packed two per byte, but the header "
        r"metadata 'taktiny_packed', which lists each packed tensor with its dtype and shape, "
        r"does not list it, so it cannot be unpacked\. Write the checkpoint with "
        r"taktiny\.io\.save_safetensors, which records it\.$"
    )
    with pytest.raises(SafetensorsError, match=rf"^{path}: {message}"):
        load_safetensors(tt.quantize(abstract_net(), bits=4), path, strict=False)
    # with its layout recorded, the file itself is found inconsistent when opened
    layout = {"hidden.kernel": {"bits": 4, "axis": 0, "group_size": None, "shape": [32, 64]}}
    safetensors.numpy.save_file(
        {k: state[k] for k in ("hidden.kernel.value", "hidden.kernel.scale")},
        str(path),
        metadata={"taktiny_quantized": json.dumps(layout)},
    )
    with pytest.raises(SafetensorsError, match=r"its 4-bit values hidden\.kernel\.value must be int4 \(stored packed two per byte, listed in the file's 'taktiny_packed'\), and the checkpoint holds uint8\[32, 32\]"):  # fmt: skip
        open_safetensors(path)
    assert not reads


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"hidden.kernel.value": {"dtype": "int4", "shape": [32, 66]}},
            r"lists 'hidden\.kernel\.value' as int4\[32, 66\] packed two per byte, which is "
            r"stored as uint8\[32, 33\], but the file holds uint8\[32, 32\]; the header is inconsistent",
        ),
        (
            {"hidden.kernel.value": {"dtype": "int4", "shape": [32, 64]}, "w": {"dtype": "int4", "shape": [2]}},
            r"lists 'w' as a packed int4\[2\], but the file holds no tensor of that name",
        ),
        (
            {"hidden.kernel.value": {"dtype": "int3", "shape": [32, 64]}},
            r"gives 'hidden\.kernel\.value' the record \{'dtype': 'int3', .*\}; a packed tensor's record is",
        ),
        ("not json", r"the metadata 'taktiny_packed' is not valid JSON"),
    ],
)  # fmt: skip
def test_inconsistent_packing_records_are_refused_when_opened(tmp_path, record, message):
    path = tmp_path / "p.safetensors"
    text = record if isinstance(record, str) else json.dumps(record)
    safetensors.numpy.save_file(
        {"hidden.kernel.value": np.zeros((32, 32), np.uint8)},
        str(path),
        metadata={"taktiny_packed": text},
    )
    with pytest.raises(SafetensorsError, match=message) as caught:
        open_safetensors(path)
    assert str(path) in str(caught.value)


def test_inconsistent_layout_records_are_refused_when_opened(tmp_path):
    model = tt.quantize(net(), bits=4, group_size=16)
    path = tmp_path / "q.safetensors"
    state = {k: v for k, v in tt.flat_state_dict(model).items() if k != "head.kernel.scale"}
    state["hidden.kernel.scale"] = jnp.ones((1, 64))
    save_safetensors(path, state)
    layouts = {
        "hidden.kernel": {"bits": 4, "axis": 0, "group_size": 16, "shape": [32, 64]},
        "head.kernel": {"bits": 4, "axis": 0, "group_size": 16, "shape": [64, 5]},
    }
    entries, metadata = header(path)
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])

    def rewrite(layouts):
        # (an older Taktiny's header, without its own digest: a sealed one would be refused
        # as damaged before its records are read)
        own = {k: v for k, v in metadata.items() if k != "taktiny_header_checksums"}
        head = {**entries, "__metadata__": {**own, "taktiny_quantized": json.dumps(layouts)}}
        text = json.dumps(head).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])

    rewrite({"head.kernel": layouts["head.kernel"]})
    with pytest.raises(SafetensorsError, match=r"records 'head\.kernel' as quantized int4 \(groups of 16 along axis 0\) of shape \[64, 5\], but its parts must be tensors, and the checkpoint has no head\.kernel\.scale"):  # fmt: skip
        open_safetensors(path)
    rewrite(layouts)
    with pytest.raises(SafetensorsError, match=r"its scales hidden\.kernel\.scale must be floats of shape \[2, 64\], and the checkpoint holds float32\[1, 64\]"):  # fmt: skip
        open_safetensors(path)
    rewrite({"hidden.kernel": {**layouts["hidden.kernel"], "group_size": 5}})
    with pytest.raises(SafetensorsError, match=r"gives 'hidden\.kernel' an impossible layout: group_size must divide axis 0"):  # fmt: skip
        open_safetensors(path)
