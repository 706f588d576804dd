"""`tt.schema`: each leaf of a tree's state by its flat name, with its shape, dtype,
sharding and quantization, and a fingerprint that another process computes alike; JSON
in and out, hostile JSON refused by name; the changes between two schemas; the schema
save_safetensors records and open_safetensors reads back."""

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taktiny as tt
from taktiny import nn
from taktiny.io import SafetensorsError, open_safetensors, save_safetensors


class Block(nn.Module):
    def __init__(self, *, rngs):
        self.up = nn.Linear(8, 16, rngs=rngs)
        self.norm = nn.LayerNorm(16, rngs=rngs)
        self.down = nn.Linear(16, 8, use_bias=False, param_dtype=jnp.bfloat16, rngs=rngs)


def mesh_of():
    return jax.make_mesh((2, 4), ("data", "model"))


def entry(shape, dtype, sharding=None, quantization=None):
    return {"shape": shape, "dtype": dtype, "sharding": sharding, "quantization": quantization}


def test_a_schema_names_every_leaf_with_its_shape_and_dtype_as_the_flat_state_does():
    model = Block(rngs=nn.Rngs(0))
    schema = tt.schema(model)
    assert list(schema) == list(tt.flat_state_dict(model))
    assert dict(schema) == {
        "up.kernel": entry([8, 16], "float32"),
        "up.bias": entry([16], "float32"),
        "norm.scale": entry([16], "float32"),
        "norm.bias": entry([16], "float32"),
        "down.kernel": entry([16, 8], "bfloat16"),
    }
    abstract = jax.eval_shape(lambda: Block(rngs=nn.Rngs(0)))
    assert tt.schema(abstract) == schema
    assert tt.schema(abstract).fingerprint == schema.fingerprint
    assert repr(schema) == f"Schema(5 leaves, fingerprint {schema.fingerprint})"


def test_a_quantized_array_is_one_entry_with_its_layout_and_the_dtype_it_stands_for():
    model = tt.quantize(nn.Linear(64, 8, rngs=nn.Rngs(0)), bits=4, group_size=32)
    schema = tt.schema(model)
    assert dict(schema) == {
        "kernel": entry([64, 8], "float32", quantization={"bits": 4, "axis": 0, "group_size": 32}),
        "bias": entry([8], "float32"),
    }
    (change,) = tt.schema(nn.Linear(64, 8, rngs=nn.Rngs(0))).changes(schema)
    assert str(change) == "requantized kernel: none -> int4 (groups of 32 along axis 0)"


def test_a_sharded_tree_records_each_spec_per_axis_and_the_mesh_sizes():
    mesh = mesh_of()
    rules = {"up.kernel": (None, "model"), "down.kernel": (("data", "model"),), "*.bias": ()}
    model = tt.shard(Block(rngs=nn.Rngs(0)), rules, mesh)
    schema = tt.schema(model)
    sizes = {"data": 2, "model": 4}
    assert schema["up.kernel"]["sharding"] == {"spec": [None, "model"], "mesh": sizes}
    assert schema["down.kernel"]["sharding"] == {"spec": [["data", "model"], None], "mesh": sizes}
    assert schema["up.bias"]["sharding"] == {"spec": [None], "mesh": sizes}  # replicated
    assert schema["norm.scale"]["sharding"] == {"spec": [None], "mesh": sizes}
    abstract = tt.shard(jax.eval_shape(lambda: Block(rngs=nn.Rngs(0))), rules, mesh)
    assert tt.schema(abstract) == schema  # what a sharded restore target describes
    other = tt.shard(Block(rngs=nn.Rngs(0)), {**rules, "up.kernel": ("model", None)}, mesh)
    assert [str(c) for c in schema.changes(tt.schema(other))] == [
        "resharded   up.kernel: P(None, 'model') on {data: 2, model: 4} -> "
        "P('model', None) on {data: 2, model: 4}"
    ]
    flat = tt.schema(Block(rngs=nn.Rngs(0)))
    assert str(flat.changes(schema)[0]) == (
        "resharded   up.kernel: none -> P(None, 'model') on {data: 2, model: 4}"
    )


def test_changes_name_every_kind_of_difference():
    before = tt.Schema(
        {
            "gone": entry([2], "float32"),
            "w": entry([4, 8], "float32"),
            "b": entry([8], "float32", {"spec": [None], "mesh": {"x": 8}}),
            "q": entry([8, 8], "float32", quantization={"bits": 8, "axis": 0, "group_size": None}),
        }
    )
    after = tt.Schema(
        {
            "w": entry([8, 8], "bfloat16"),
            "b": entry([8], "float32", {"spec": ["x"], "mesh": {"x": 8}}),
            "q": entry([8, 8], "float32", quantization={"bits": 4, "axis": 0, "group_size": 4}),
            "new": entry([3, 3], "int8", {"devices": 2}),
        }
    )
    assert [(c.kind, c.name) for c in before.changes(after)] == [
        ("missing", "gone"),
        ("added", "new"),
        ("reshaped", "w"),
        ("recast", "w"),
        ("resharded", "b"),
        ("requantized", "q"),
    ]
    assert [str(c) for c in before.changes(after)] == [
        "missing     gone: float32[2]",
        "added       new: int8[3, 3], 2 devices",
        "reshaped    w: [4, 8] -> [8, 8]",
        "recast      w: float32 -> bfloat16",
        "resharded   b: P(None) on {x: 8} -> P('x') on {x: 8}",
        "requantized q: int8 (one scale per channel along axis 0) -> int4 (groups of 4 along "
        "axis 0)",
    ]
    assert before.changes(before) == [] and after.changes(after) == []
    assert before != after and before == tt.Schema(dict(before))


@pytest.mark.parametrize(
    "change",
    [
        lambda e: {**e, "w": entry([4, 9], "float32")},
        lambda e: {**e, "w": entry([4, 8], "float16")},
        lambda e: {**e, "w": entry([4, 8], "float32", {"spec": [None, "x"], "mesh": {"x": 2}})},
        lambda e: {**e, "w": entry([4, 8], "float32", {"spec": [None, "x"], "mesh": {"x": 4}})},
        lambda e: {**e, "w": entry([4, 8], "float32", {"devices": 2})},
        lambda e: {
            **e,
            "w": entry([4, 8], "float32", None, {"bits": 8, "axis": 0, "group_size": None}),
        },
        lambda e: {"v": e["w"], "b": e["b"]},  # renamed
        lambda e: {"w": e["w"]},  # removed
    ],
)
def test_the_fingerprint_changes_with_any_name_shape_dtype_sharding_or_quantization(change):
    entries = {"w": entry([4, 8], "float32"), "b": entry([8], "float32")}
    schema = tt.Schema(entries)
    assert tt.Schema(dict(reversed(entries.items()))).fingerprint == schema.fingerprint
    assert len(schema.fingerprint) == 32 and int(schema.fingerprint, 16) >= 0
    assert tt.Schema(change(entries)).fingerprint != schema.fingerprint


def test_the_fingerprint_is_the_same_in_another_process():
    mesh = mesh_of()
    model = tt.shard(Block(rngs=nn.Rngs(0)), {"*.kernel": (None, "model")}, mesh)
    program = (
        "import jax; jax.config.update('jax_num_cpu_devices', 8)\n"
        "import taktiny as tt\n"
        "from tests.state.test_schema import Block, mesh_of\n"
        "from taktiny import nn\n"
        "model = tt.shard(jax.eval_shape(lambda: Block(rngs=nn.Rngs(0))), "
        "{'*.kernel': (None, 'model')}, mesh_of())\n"
        "print(tt.schema(model).fingerprint)\n"
    )
    from _child import cpu_environment  # (here: the child imports this module, without tests/)

    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=300,
        env=cpu_environment(),
    )  # fmt: skip
    assert done.stdout.strip() == tt.schema(model).fingerprint


def test_json_round_trips_and_what_is_edited_or_malformed_is_refused():
    schema = tt.schema(tt.quantize(Block(rngs=nn.Rngs(0)), bits=8))
    text = schema.to_json()
    assert "\n" not in text and tt.Schema.from_json(text) == schema
    value = json.loads(text)
    assert value["format"] == "taktiny-schema/1" and value["fingerprint"] == schema.fingerprint
    value["tensors"]["up.bias"]["shape"] = [17]
    with pytest.raises(
        ValueError,
        match=r"fingerprint '[0-9a-f]{32}' is not its entries' \([0-9a-f]{32}\): it was changed after it was written",
    ):
        tt.Schema.from_json(json.dumps(value))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", r"a schema must be JSON: Expecting property name"),
        (
            "[1]",
            r"a schema is a JSON object with 'format', 'fingerprint' and 'tensors' \(and "
            r"optionally 'version' and 'versions'\), got \[1\]",
        ),
        (
            '{"format": "x", "fingerprint": "", "tensors": {}}',
            r"format is 'x'; this Taktiny reads 'taktiny-schema/1'",
        ),
        (
            '{"format": "taktiny-schema/1", "fingerprint": "", "tensors": []}',
            r"'tensors' must map names to entries, got \[\]",
        ),
    ],
)
def test_from_json_refuses_what_is_not_a_schema(text, message):
    with pytest.raises(ValueError, match=message):
        tt.Schema.from_json(text)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            {"shape": [2]},
            r"an entry has exactly the keys \['shape', 'dtype', 'sharding', 'quantization'\]",
        ),
        (entry([-1], "float32"), r"'shape' is a list of sizes \(ints >= 0\)"),
        (entry([True], "float32"), r"'shape' is a list of sizes"),
        (entry([2], 4), r"'dtype' is a dtype's name"),
        (entry([2], "float32", {"spec": ["y"], "mesh": {"x": 2}}), r"'sharding' is None, \{'spec'"),
        (entry([2], "float32", {"spec": [None, None], "mesh": {"x": 2}}), r"'sharding' is None"),
        (entry([2, 2], "float32", {"spec": ["x", "x"], "mesh": {"x": 2}}), r"'sharding' is None"),
        (entry([2], "float32", {"spec": ["x"], "mesh": {"x": 0}}), r"'sharding' is None"),
        (entry([2], "float32", {"devices": 1}), r"'sharding' is None"),
        (entry([2], "float32", [None]), r"'sharding' is None"),
        (
            entry([2], "float32", None, {"bits": 3, "axis": 0, "group_size": None}),
            r"'quantization' is None or \{'bits': 4 or 8",
        ),
        (
            entry([2], "float32", None, {"bits": 4, "axis": 0, "group_size": 0}),
            r"'quantization' is None",
        ),
        (entry([2], "float32", None, {"bits": 4, "axis": 0}), r"'quantization' is None"),
    ],
)
def test_a_malformed_entry_is_refused_naming_it_and_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=rf"schema entry 'w': {message}.*; got "):
        tt.Schema({"w": value})


def test_save_safetensors_records_the_schema_and_open_safetensors_reads_it(tmp_path):
    model = tt.quantize(Block(rngs=nn.Rngs(0)), bits=4, group_size=8)
    path = tmp_path / "model.safetensors"
    files = save_safetensors(path, model, max_shard_size=100)
    assert len(files) > 2  # an index and its shards: each shard records the schema
    assert open_safetensors(path).schema == tt.schema(model)
    for file in files:
        if file.suffix == ".safetensors":
            data = file.read_bytes()
            header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
            assert header["__metadata__"]["taktiny_schema"] == tt.schema(model).to_json()
    flat = {"a.b": np.ones((2, 3), np.float32)}  # a flat dict keeps its own names
    save_safetensors(tmp_path / "flat.safetensors", flat)
    assert dict(open_safetensors(tmp_path / "flat.safetensors").schema) == {
        "a.b": entry([2, 3], "float32")
    }
    with pytest.raises(ValueError, match=r"metadata key 'taktiny_schema' is Taktiny's own"):
        save_safetensors(tmp_path / "m.safetensors", flat, metadata={"taktiny_schema": "{}"})


def test_a_file_without_a_schema_has_none_and_a_malformed_one_is_named(tmp_path):
    import safetensors.numpy

    path = tmp_path / "other.safetensors"
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, path, {"format": "pt"})
    assert open_safetensors(path).schema is None
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, path, {"taktiny_schema": "[]"})
    checkpoint = open_safetensors(path)  # the tensors still open and read
    assert np.array_equal(checkpoint["w"], np.ones(2, np.float32))
    with pytest.raises(
        SafetensorsError,
        match=rf"^{path}: the header metadata 'taktiny_schema' is not a schema Taktiny wrote: "
        r"a schema is a JSON object .*\. Save the checkpoint again, or ignore its schema\.$",
    ):
        checkpoint.schema  # noqa: B018


MODELS = """
from taktiny import nn


class Net(nn.Module):
    def __init__(self, width, *, rngs):
        self.up = nn.Linear(4, width, rngs=rngs)
        self.down = nn.Linear(width, 4, use_bias=False, rngs=rngs)


def small():
    return Net(8, rngs=nn.Rngs(0))


def wide():
    return Net(16, rngs=nn.Rngs(0))


def broken():
    raise RuntimeError("no weights here")
"""


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("my_models", None)


def run_cli(capsys, *argv):
    from taktiny._cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_taktiny_diff_compares_models_schema_files_and_checkpoints(models, capsys):
    code, out, _ = run_cli(capsys, "diff", "my_models:small", "my_models:wide")
    assert code == 1
    assert out.splitlines() == [
        "reshaped    up.kernel: [4, 8] -> [4, 16]",
        "reshaped    up.bias: [8] -> [16]",
        "reshaped    down.kernel: [8, 4] -> [16, 4]",
        "3 changes from my_models:small to my_models:wide: 3 reshaped",
    ]
    import my_models

    save_safetensors(models / "small.safetensors", my_models.small())
    (models / "wide.json").write_text(tt.schema(my_models.wide()).to_json())
    fingerprint = tt.schema(my_models.small()).fingerprint
    code, out, _ = run_cli(capsys, "diff", "small.safetensors", "my_models:small")
    assert (code, out) == (0, f"the schemas agree: 3 names, fingerprint {fingerprint}\n")
    code, out, _ = run_cli(capsys, "diff", "wide.json", "small.safetensors", "--filter", "up.*")
    assert (
        code == 1
        and out.splitlines()[-1] == "2 changes from wide.json to small.safetensors: 2 reshaped"
    )
    # a file another program wrote: its schema is made from its tensors
    import safetensors.numpy

    other = {"up.kernel": np.zeros((4, 8), np.float32), "extra": np.zeros(2, np.int8)}
    safetensors.numpy.save_file(other, models / "other.safetensors")
    code, out, _ = run_cli(capsys, "diff", "my_models:small", "other.safetensors")
    assert code == 1 and out.splitlines() == [
        "missing     up.bias: float32[8]",
        "missing     down.kernel: float32[8, 4]",
        "added       extra: int8[2]",
        "3 changes from my_models:small to other.safetensors: 2 missing, 1 added",
    ]


@pytest.mark.parametrize(
    ("side", "message"),
    [
        (
            "no_such_module:small",
            r"no_such_module:small: cannot import 'no_such_module': ModuleNotFoundError",
        ),
        (
            "my_models:absent",
            r"my_models:absent: 'my_models' has no function 'absent'; name a function of no arguments",
        ),
        (
            "my_models:broken",
            r"my_models:broken: calling broken\(\) failed: RuntimeError: no weights here",
        ),
        ("bad.json", r"bad\.json: the schema's fingerprint '0' is not its entries'"),
    ],
)
def test_taktiny_diff_names_a_side_it_cannot_read(models, capsys, side, message):
    empty = tt.Schema({})
    (models / "bad.json").write_text(empty.to_json().replace(empty.fingerprint, "0"))
    code, out, err = run_cli(capsys, "diff", side, "my_models:small")
    assert (code, out) == (2, "")
    assert re.match(rf"taktiny: {message}", err), err


def test_a_prng_key_array_is_described_by_jax_s_name_of_its_dtype():
    schema = tt.schema({"key": jax.random.key(0), "keys": jax.random.split(jax.random.key(1), 3)})
    assert dict(schema) == {"key": entry([], "key<fry>"), "keys": entry([3], "key<fry>")}


VERSIONED = """
from taktiny import nn
from _versions import Net, NetV1, NetV2


def net():
    return Net(rngs=nn.Rngs(0))


def net_v2():
    return NetV2(rngs=nn.Rngs(0))


def old():
    return NetV1(rngs=nn.Rngs(0))
"""


def test_taktiny_diff_migrates_a_saved_schema_to_the_model_s_versions(models, capsys):
    """A checkpoint of older versions that loads cleanly into a model shows no change: its
    schema is migrated as the load would migrate it, and the report says by what."""
    (models / "versioned.py").write_text(VERSIONED)
    from _versions import Net, NetV1, NetV2

    old = NetV1(rngs=nn.Rngs(1))
    save_safetensors(models / "v1.safetensors", old)
    (models / "v1.json").write_text(tt.schema(old).to_json())
    inner = "Inner's migrations from state version 1 to 2 at 'blocks.0', 'blocks.1', 'blocks.2'"
    net = tt.schema(Net(rngs=nn.Rngs(0)))
    for a, b in [("v1.safetensors", "versioned:net"), ("versioned:net", "v1.json")]:
        saved = a if a.startswith("v1") else b
        code, out, _ = run_cli(capsys, "diff", a, b)
        assert (code, out.splitlines()) == (
            0,
            [
                f"migrated {saved} to versioned:net's state versions: {inner}",
                f"the schemas agree: 14 names, fingerprint {net.fingerprint}",
            ],
        )
    code, out, _ = run_cli(capsys, "diff", "v1.safetensors", "versioned:net_v2")
    assert code == 0 and out.splitlines() == [
        f"migrated v1.safetensors to versioned:net_v2's state versions: {inner}; "
        "NetV2's migrations from state version 1 to 2",
        f"the schemas agree: 15 names, fingerprint {tt.schema(NetV2(rngs=nn.Rngs(0))).fingerprint}",
    ]
    # with a filter: names compared after the migrations, which are still said
    code, out, _ = run_cli(
        capsys, "diff", "v1.safetensors", "versioned:net", "--filter", "blocks.0.**"
    )
    block = tt.Schema({n: e for n, e in net.items() if n.startswith("blocks.0.")})
    assert (code, out.splitlines()) == (
        0,
        [
            f"migrated v1.safetensors to versioned:net's state versions: {inner}",
            f"the schemas agree: 4 names, fingerprint {block.fingerprint}",
        ],
    )
    # a checkpoint of newer versions than the model's is refused, naming both and the module
    save_safetensors(models / "v2.safetensors", Net(rngs=nn.Rngs(1)))
    code, out, err = run_cli(capsys, "diff", "v2.safetensors", "versioned:old")
    assert (code, out) == (2, "")
    assert err == (
        "taktiny: v2.safetensors into versioned:old: taktiny.migrate(NetV1): the state of "
        "'blocks.0' was saved at state version 2; InnerV1 is at version 1: load it with the "
        "newer code that saved it (migrations only go forward).\n"
    )
    # a file another program wrote has no versions: compared as it is
    import safetensors.numpy

    safetensors.numpy.save_file(
        {n: np.asarray(v) for n, v in tt.flat_state_dict(old).items()}, models / "other.safetensors"
    )
    code, out, _ = run_cli(capsys, "diff", "other.safetensors", "versioned:net")
    assert code == 1 and not out.startswith("migrated")
    assert (
        out.splitlines()[-1]
        == "21 changes from other.safetensors to versioned:net: 9 missing, 12 added"
    )
    sys.modules.pop("versioned", None)
