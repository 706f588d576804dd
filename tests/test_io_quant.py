"""Quantized models in safetensors files: saved as their parts (4-bit values packed two per
byte, the layout in the header) and loaded back bitwise; float checkpoints quantized
tensor by tensor as they stream into a quantized model; every inconsistency named."""

import json
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
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
    log = []
    read, read_into = Tensor.read, Tensor.read_into

    def logged(self, index=None, *, verify=True):
        log.append(self.name)
        return read(self, index, verify=verify)

    def logged_into(self, memory, *, verify=True):
        log.append(self.name)
        return read_into(self, memory, verify=verify)

    def logged_piecewise(self, send, memory=None):  # the loader's reads of whole tensors
        log.append(self.name)
        return piecewise(self, send, memory)

    piecewise = Tensor._piecewise
    monkeypatch.setattr(Tensor, "_piecewise", logged_piecewise)

    monkeypatch.setattr(Tensor, "read", logged)
    monkeypatch.setattr(Tensor, "read_into", logged_into)
    return log


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


def test_open_presents_packed_tensors_as_what_they_are(tmp_path):
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
    for rows, cols in [(slice(1, 3), slice(3, 5)), (slice(0, 64), slice(1, 4)), (slice(5, 6), slice(0, 1))]:  # fmt: skip
        block = tensor.read([rows, cols])
        assert np.array_equal(block, full[rows, cols]) and not block.flags.writeable


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint4, jnp.float4_e2m1fn])
def test_a_bare_4_bit_array_is_packed_too(tmp_path, dtype):
    rng = np.random.default_rng(0)
    arrays = {
        f"{n}": jnp.asarray(rng.integers(0, 16, shape, np.uint8).view(np.dtype(dtype)))
        for n, shape in enumerate([(7,), (3, 4), (), (2, 0), (2, 3, 1)])
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
    partly = tt.quantize(abstract_net(), bits=bits, group_size=group, filter="hidden")
    loaded = load_safetensors(partly, path)
    assert_bitwise(loaded, tt.quantize(model, bits=bits, group_size=group, filter="hidden"))


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
    import taktiny.io._place as load_module

    model = net()
    path = tmp_path / "f.safetensors"
    save_safetensors(path, model)
    buffers = []
    real = load_module._Scratch.__init__

    def counted(self):
        buffers.append(self)
        real(self)

    monkeypatch.setattr(load_module._Scratch, "__init__", counted)
    load_safetensors(tt.quantize(abstract_net()), path)
    assert len(buffers) == 1  # one read buffer, reused; the plain load reads ahead into two
    buffers.clear()
    rules = [cv.Rule("{layer}.{p}", "{layer}.{p}", cv.cast(jnp.float32))]
    load_safetensors(abstract_net(), path, rules=rules)
    assert len(buffers) == 2


def test_rules_can_make_the_float_array_of_a_quantized_parameter(tmp_path):
    rng = np.random.default_rng(0)
    torch_names = {
        "fc1.weight": rng.normal(size=(64, 32)).astype(np.float32),
        "fc1.bias": rng.normal(size=(64,)).astype(np.float32),
        "fc2.weight": rng.normal(size=(5, 64)).astype(np.float32),
        "fc2.bias": rng.normal(size=(5,)).astype(np.float32),
        "emb.weight": rng.normal(size=(10, 32)).astype(np.float32),
    }
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
    with pytest.raises(
        cv.ConversionError, match=r"\[shape\] 'hidden\.kernel': .*float32\[32, 64\]"
    ):
        load_safetensors(target, path, rules=wrong)
    again = cv.Rule("fc1.again", ["hidden.kernel.value", "hidden.kernel.scale"],
                    cv.chain(cv.transpose(), cv.quantize(bits=4, group_size=16)))  # fmt: skip
    twice = [*rules[:-1], again]
    with pytest.raises(cv.ConversionError, match=r"\[duplicate\] 'hidden\.kernel': made both"):
        load_safetensors(target, path, rules=twice)
    lacking = [rules[0], *rules[2:]]
    with pytest.raises(cv.ConversionError, match=r"\[missing\] 'head\.kernel\.value': no rule"):
        load_safetensors(target, path, rules=[*lacking, cv.Ignore("fc2.weight")])


def test_a_quantized_checkpoint_dequantizes_into_a_float_model_by_rule(tmp_path):
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
    loaded = load_safetensors(abstract_net(), path, rules=rules)
    assert_bitwise(loaded, tt.dequantize(model))


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
    problems = {p.key: p for p in caught.value.problems}
    assert sorted(problems) == ["head.kernel", "hidden.kernel"]
    message = str(caught.value)
    assert (
        "'hidden.kernel': shape mismatch: the model quantizes 'hidden.kernel' (int4 (groups of "
        "16 along axis 0)) from a float array of shape (32, 64), got (32, 63)." in message
    )
    assert "holds int32[64, 5] under its name, which is not a float array to quantize" in message
    assert problems["head.kernel"].kind == "dtype" and problems["hidden.kernel"].kind == "shape"
    assert not reads


def test_a_float_array_and_its_quantized_parts_together_are_refused(tmp_path):
    parts = flat_numpy(tt.quantize(net()))
    path = tmp_path / "both.safetensors"
    save_safetensors(path, {**parts, "hidden.kernel": np.zeros((32, 64), np.float32)})
    with pytest.raises(tt.StateDictError, match=r"'hidden\.kernel': the checkpoint holds both"):
        load_safetensors(tt.quantize(abstract_net()), path)


def test_a_checkpoint_quantized_otherwise_is_refused_by_name(tmp_path, reads):
    path = tmp_path / "int8.safetensors"
    save_safetensors(path, tt.quantize(net()))
    with pytest.raises(tt.StateDictError) as caught:
        load_safetensors(tt.quantize(abstract_net(), bits=4, group_size=16), path)
    message = str(caught.value)
    assert (
        "'hidden.kernel': the model quantizes 'hidden.kernel' as int4 (groups of 16 along axis "
        "0), the checkpoint holds it as int8 (one scale per channel along axis 0). Quantize the "
        "model as the checkpoint was (tt.quantize(float_model, bits=8))" in message
    )
    assert {p.kind for p in caught.value.problems} == {"dtype"}
    # without the layout record, by the values' dtype
    save_safetensors(path, flat_numpy(tt.quantize(net())))
    assert open_safetensors(path).quantized == {}
    with pytest.raises(tt.StateDictError, match=r"holds it as int8 values\. Quantize the model"):
        load_safetensors(tt.quantize(abstract_net(), bits=4), path)
    # the same bits, another group size
    save_safetensors(path, tt.quantize(net(), bits=4, group_size=16))
    with pytest.raises(tt.StateDictError, match=r"as int4 \(one scale per channel along axis 0\), the checkpoint holds it as int4 \(groups of 16"):  # fmt: skip
        load_safetensors(tt.quantize(abstract_net(), bits=4), path)
    assert not reads


def test_a_quantized_checkpoint_into_a_float_model_says_how_to_convert(tmp_path):
    path = tmp_path / "q.safetensors"
    save_safetensors(path, tt.quantize(net(), bits=4, group_size=16))
    with pytest.raises(tt.StateDictError) as caught:
        load_safetensors(abstract_net(), path)
    assert {p.key: p.kind for p in caught.value.problems} == {
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
        r"metadata 'taktiny_packed'.*does not list it"
    )
    with pytest.raises(SafetensorsError, match=message):
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
        head = {**entries, "__metadata__": {**metadata, "taktiny_quantized": json.dumps(layouts)}}
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
