"""taktiny.io.plan_load: a load planned from the headers alone. Each test compares the
plan with the real load it predicts: the bytes its arrays hold per device, the bytes
os.preadv reads, the error it raises (the same problems, in order), and the way each tensor
goes (a scratch buffer, a transposition, a quantization); and checks that planning reads
no tensor byte."""

import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _reads import log_preads
from _versions import BlockV1, BlockV2, BlockV3, Net, NetV1, NetV2
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import convert as cv
from taktiny import nn
from taktiny._cli import main
from taktiny.io import Tensor, load_safetensors, plan_load, save_safetensors

SHAPES = {  # name -> (shape, dtype)
    "wide": ((64, 2048), np.float32),
    "tall": ((512, 256), np.float32),
    "cube": ((8, 16, 64), ml_dtypes.bfloat16),
    "bias": ((64,), np.float32),
}
SPECS = {  # plan -> (mesh shape, axes, spec per tensor; the others replicated)
    "one device": None,
    "outer": ((8,), ("x",), {"wide": P("x"), "tall": P("x"), "bias": P("x")}),
    "inner": ((8,), ("x",), {"wide": P(None, "x"), "tall": P(None, "x")}),
    "2-D": ((2, 4), ("a", "b"), {"wide": P("a", "b"), "cube": P(None, "a", "b")}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    rng = np.random.default_rng(0)
    values = {n: rng.standard_normal(s, np.float32).astype(d) for n, (s, d) in SHAPES.items()}
    path = tmp_path_factory.mktemp("plan") / "t.safetensors"
    save_safetensors(path, values)
    return values, path


@pytest.fixture
def preads(monkeypatch):
    """(path, offset, bytes) of each os.preadv call."""
    return log_preads(monkeypatch)


def read(log):
    """The tensor bytes the logged reads read: a file's header (read through the same call
    before its tensors) is left out."""
    starts = {}
    for path, _, _ in log:
        if path not in starts:
            with open(path, "rb") as f:
                starts[path] = 8 + int.from_bytes(f.read(8), "little")
    return sum(n for path, at, n in log if at >= starts[path])


def target(plan, dtypes=None):
    spec = SPECS[plan]
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        if spec is None:
            where = SingleDeviceSharding(jax.devices()[0])
        else:
            where = NamedSharding(jax.make_mesh(spec[0], spec[1]), spec[2].get(name, P()))
        out[name] = jax.ShapeDtypeStruct(shape, (dtypes or {}).get(name, dtype), sharding=where)
    return out


def held(loaded):
    """The bytes each device holds of the loaded arrays."""
    out = {}
    for leaf in jax.tree.leaves(loaded):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def planned(model, path, monkeypatch, **kwargs):
    """plan_load with every read of tensor bytes refused (a file's header, which comes
    before them, may be read)."""
    with monkeypatch.context() as m:

        def refuse(*args, **kw):
            raise AssertionError("the plan read tensor bytes")

        def headers_only(fd, buffers, offset, *flags):
            with open(f"/proc/self/fd/{fd}", "rb") as f:
                data = 8 + int.from_bytes(f.read(8), "little")  # where its tensors start
            if offset + sum(memoryview(b).nbytes for b in buffers) > data:
                refuse()
            return preadv(fd, buffers, offset, *flags)

        for name in ("read", "read_into", "read_blocks", "read_transposed", "verify"):
            m.setattr(Tensor, name, refuse)
        preadv = os.preadv
        m.setattr(os, "preadv", headers_only)
        return plan_load(model, path, **kwargs)


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
@pytest.mark.parametrize("plan", list(SPECS))
def test_bytes_per_device_and_read_are_the_load_s(saved, preads, monkeypatch, plan, verify):
    _, path = saved
    model = target(plan)
    got = planned(model, path, monkeypatch, verify=verify)
    assert got.ok and got.problems == ()
    preads.clear()
    loaded = load_safetensors(model, path, verify=verify)
    assert dict(got.device_bytes) == held(loaded)
    assert dict(got.read_bytes) == {0: read(preads)}
    ways = {s.sources[0]: s.way for s in got.steps}
    if plan == "one device":
        assert set(ways.values()) == {"direct"}
        assert got.scratch_bytes == 0
    else:
        assert ways["wide"] == "blocks"
    assert got.peak_host_bytes == got.scratch_bytes + sum(held(loaded).values())


def test_a_cast_goes_through_a_scratch_buffer_of_the_largest_tensors(saved, preads, monkeypatch):
    _, path = saved
    model = target("one device", {n: jnp.bfloat16 for n in ("wide", "tall", "bias")})
    got = planned(model, path, monkeypatch)
    casts = {s.sources[0]: s.casts for s in got.steps}
    assert casts["wide"] == (("wide", "float32", "bfloat16"),)
    assert casts["cube"] == ()
    assert {s.sources[0]: s.way for s in got.steps}["wide"] == "scratch"
    # two buffers, taking turns in file order: each as large as the largest tensor it holds
    order = [s for s in got.steps if s.way == "scratch"]
    sizes = [max((s.nbytes for s in order[k::2]), default=0) for k in (0, 1)]
    assert got.scratch_bytes == sum(-(-n // 64) * 64 for n in sizes)
    preads.clear()
    loaded = load_safetensors(model, path)
    assert dict(got.read_bytes) == {0: read(preads)}
    assert dict(got.device_bytes) == held(loaded)


def test_a_transposing_rule_reads_into_place(tmp_path, preads, monkeypatch):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 128), np.float32)
    path = tmp_path / "t.safetensors"
    save_safetensors(path, {"w": w.T.copy(), "b": np.ones(64, np.float32)})
    rules = [cv.Rule("{p}", "{p}", cv.transpose())]
    model = {
        "w": jax.ShapeDtypeStruct((64, 128), jnp.float32),
        "b": jax.ShapeDtypeStruct((64,), jnp.float32),
    }
    got = planned(model, path, monkeypatch, rules=rules)
    assert [(s.sources, s.way, s.transform) for s in got.steps] == [
        (("w",), "transposed", "transpose(perm=None)"),
        (("b",), "transposed", "transpose(perm=None)"),
    ] or {s.way for s in got.steps} == {"transposed"}
    preads.clear()
    loaded = load_safetensors(model, path, rules=rules)
    assert dict(got.read_bytes) == {0: read(preads)}
    assert dict(got.device_bytes) == held(loaded)
    assert "transpose" in str(got)


def test_a_quantizing_load_goes_through_one_scratch_buffer(tmp_path, preads, monkeypatch):
    from taktiny import nn

    def make():
        return [nn.Linear(256, 512, rngs=nn.Rngs(0)), nn.Linear(512, 128, rngs=nn.Rngs(1))]

    path = tmp_path / "float.safetensors"
    save_safetensors(path, make())
    model = tt.quantize(jax.eval_shape(make))
    got = planned(model, path, monkeypatch)
    ways = {s.sources[0]: s for s in got.steps}
    assert ways["0.kernel"].way == "quantized"
    assert ways["0.kernel"].targets == ("0.kernel.value", "0.kernel.scale")
    assert ways["0.kernel"].casts == (("0.kernel", "float32", "int8 (quantized)"),)
    assert ways["0.bias"].way == "direct"
    assert got.scratch_bytes == 256 * 512 * 4  # one buffer, of the largest float kernel
    preads.clear()
    loaded = load_safetensors(model, path)
    assert dict(got.read_bytes) == {0: read(preads)}
    assert dict(got.device_bytes) == held(loaded)


def test_problems_are_those_the_load_raises(saved, monkeypatch):
    _, path = saved
    model = target("one device")
    model["tall"] = jax.ShapeDtypeStruct((512, 255), jnp.float32)  # a shape mismatch
    model["bias"] = jax.ShapeDtypeStruct((64,), jnp.int32)  # a dtype that cannot cast
    model["extra"] = jax.ShapeDtypeStruct((3,), jnp.float32)  # missing from the file
    got = planned(model, path, monkeypatch)
    with pytest.raises(
        tt.StateDictError, match=r"3 problems; nothing was loaded|'extra'"
    ) as raised:
        load_safetensors(model, path)
    assert not got.ok
    assert got.problems == raised.value.problems
    assert sorted(p.kind for p in got.problems) == ["dtype", "missing", "shape"]
    assert type(got.error) is tt.StateDictError and str(got.error) == str(raised.value)
    # the tensors that load are still planned
    assert {s.sources[0] for s in got.steps} == {"wide", "cube"}
    assert "the load would raise StateDictError" in str(got)


def test_problems_of_rules_are_the_conversion_error(saved, monkeypatch):
    _, path = saved
    model = target("one device")
    rules = [cv.Rule("wide", "wide"), cv.Rule("tall", "tall", cv.transpose())]
    got = planned(model, path, monkeypatch, rules=rules)
    with pytest.raises(cv.ConversionError, match="shape") as raised:
        load_safetensors(model, path, rules=rules)
    assert got.problems == raised.value.problems
    assert {p.kind for p in got.problems} >= {"unused", "shape"}


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
@pytest.mark.parametrize("plan", ["outer", "inner", "2-D"])
def test_bytes_read_of_another_process_s_blocks_are_read_blocks_s(saved, preads, plan, verify):
    """What a plan counts for another process (its devices' blocks, from the sharding's
    device map) is what read_blocks of those blocks reads: here the blocks of devices 4-7,
    as a second process of 4 devices would hold them."""
    from taktiny.io import open_safetensors

    _, path = saved
    checkpoint = open_safetensors(path)
    for name, leaf in target(plan).items():
        tensor = checkpoint[name]
        blocks = []
        for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
            block = tuple(s.indices(n)[:2] for s, n in zip(index, leaf.shape, strict=True))
            if device.id >= 4 and block not in blocks:
                blocks.append(block)
        preads.clear()
        tensor.read_blocks(blocks, verify=verify)
        assert tensor.bytes_read(blocks, verify=verify) == read(preads), (name, blocks)


def test_the_plan_command(saved, tmp_path, monkeypatch, capsys):
    _, path = saved
    (tmp_path / "plan_models.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "import ml_dtypes\n"
        "def good():\n"
        "    return {'wide': jnp.zeros((64, 2048)), 'tall': jnp.zeros((512, 256)),\n"
        "            'cube': jnp.zeros((8, 16, 64), jnp.bfloat16), 'bias': jnp.zeros(64)}\n"
        "def bad():\n"
        "    return {**good(), 'bias': jnp.zeros(65)}\n"
        "RULES = []\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(path), "--model", "plan_models:good"]) == 0
    out = capsys.readouterr().out
    assert "the load would succeed" in out and "process 0: reads" in out
    assert main(["plan", str(path), "--model", "plan_models:bad"]) == 1
    out = capsys.readouterr().out
    assert "'bias': shape mismatch" in out
    assert (
        main(["plan", str(path), "--model", "plan_models:good", "--rules", "plan_models:RULES"])
        == 1
    )
    assert "no rule consumes or ignores this source name" in capsys.readouterr().out
    assert main(["plan", str(path), "--model", "plan_models:nothing"]) == 2
    assert "has no function 'nothing'" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "absent.safetensors"), "--model", "plan_models:good"]) == 2
    assert "does not exist" in capsys.readouterr().err


# Plans of loads that migrate (tests/_versions.py's models), into concrete, abstract and
# sharded models: each compared with the load it plans.


@pytest.fixture(scope="module")
def versioned(tmp_path_factory):
    """A checkpoint of each version: {name: path}."""
    folder = tmp_path_factory.mktemp("versions")
    saved = {"block_v1": BlockV1, "block_v2": BlockV2, "block_v3": BlockV3}
    saved |= {"net_v1": NetV1, "net": Net}
    paths = {}
    for name, cls in saved.items():
        paths[name] = folder / f"{name}.safetensors"
        save_safetensors(paths[name], cls(rngs=nn.Rngs(1)))
    return paths


def _sharded(make, rules):
    """A function making the model `make` makes, sharded by `rules` on a mesh of its own."""
    return lambda: tt.shard(make(), rules, jax.make_mesh((2, 4), ("data", "model")))


def _block():
    return BlockV3(rngs=nn.Rngs(2))


def _net():
    return Net(rngs=nn.Rngs(2))


BLOCK_RULES = {"qkv.kernel": (None, "model"), "ffn.kernel": ("model", None)}
NET_RULES = {"blocks.*.ffn.kernel": (None, "model"), "blocks.*.q_t": ("data", "model")}
VERSIONED = {  # id -> (checkpoint, the model, load's arguments, (error type, steps))
    "migrated": ("block_v1", _block, {}, (None, 3)),
    "migrated from v2": ("block_v2", _block, {}, (None, 3)),
    "migrated, quantized": ("block_v1", lambda: tt.quantize(_block()), {}, (None, 3)),
    "migrated, not strict": ("block_v2", _block, {"strict": False}, (None, 3)),
    "migrated, abstract": (
        "block_v2",
        lambda: jax.eval_shape(_block),
        {},
        (cv.ConversionError, 3),
    ),
    "migrated, sharded": ("block_v1", _sharded(_block, BLOCK_RULES), {}, (None, 3)),
    "migrated, sharded abstract": (
        "block_v1",
        lambda: tt.eval_shape(_sharded(_block, BLOCK_RULES)),
        {},
        (cv.ConversionError, 3),
    ),
    "same version": ("block_v3", _block, {}, (None, 4)),
    "newer": ("block_v3", lambda: BlockV2(rngs=nn.Rngs(2)), {}, (ValueError, 0)),
    "rules for an older one": (
        "block_v1",
        _block,
        {"rules": [cv.Rule("{p}", "{p}")]},
        (ValueError, 0),
    ),
    "nested": ("net_v1", _net, {}, (None, 11)),
    "nested and top": ("net_v1", lambda: NetV2(rngs=nn.Rngs(2)), {}, (None, 11)),
    "nested, abstract": (
        "net_v1",
        lambda: jax.eval_shape(_net),
        {},
        (cv.ConversionError, 11),
    ),
    "nested, sharded": ("net_v1", _sharded(_net, NET_RULES), {}, (None, 11)),
    "nested, sharded abstract": (
        "net_v1",
        lambda: tt.eval_shape(_sharded(_net, NET_RULES)),
        {},
        (cv.ConversionError, 11),
    ),
    "nested, newer": ("net", lambda: NetV1(rngs=nn.Rngs(2)), {}, (ValueError, 0)),
}


@pytest.mark.parametrize("case", list(VERSIONED))
def test_a_plan_of_a_migrating_load_is_the_load_s(versioned, preads, monkeypatch, case):
    """The plan's steps, bytes per device and read, the leaves it keeps and the error it
    holds are those of the load it plans, whether the load succeeds or raises."""
    name, make, kwargs, (expected, count) = VERSIONED[case]
    path, model = versioned[name], make()
    got = planned(model, path, monkeypatch, **kwargs)
    assert len(got.steps) == count
    preads.clear()
    try:
        loaded = load_safetensors(model, path, **kwargs)
    except ValueError as error:
        assert type(error) is expected and type(got.error) is expected
        assert str(got.error) == str(error)
        assert got.problems == getattr(error, "problems", (str(error),))
        return
    assert expected is None and got.ok
    assert dict(got.device_bytes) == held(loaded)
    assert dict(got.read_bytes) == {0: read(preads)}
    before, after = tt.flat_state_dict(model), tt.flat_state_dict(loaded)
    made = {t for s in got.steps for t in s.targets}
    assert made.isdisjoint(got.kept) and made | set(got.kept) == set(after)
    for leaf in got.kept:  # the leaves a migration adds keep the model's values
        np.testing.assert_array_equal(np.asarray(after[leaf]), np.asarray(before[leaf]))
    assert (got.migrations is None) == (case == "same version")


def test_a_model_on_an_abstract_mesh_is_refused_naming_the_file_and_the_model(versioned):
    """``jax.eval_shape`` of a function that shards keeps a mesh without devices: the load
    and its plan refuse it alike, before anything, and say what to use instead;
    ``tt.eval_shape`` of the same function keeps the mesh, and plans."""
    make = _sharded(_block, BLOCK_RULES)
    message = (
        r"taktiny.io.load_safetensors\(BlockV3\): loading .*block_v3.safetensors: 4 leaves of "
        r"the model \('qkv.kernel', 'ffn.kernel', 'ffn.bias', ...\) are sharded on an "
        r"abstract mesh \({'data': 2, 'model': 4}\), which names no devices to place them on "
        r"\(jax.eval_shape keeps only a mesh's axis sizes\): make the abstract model with "
        r"taktiny.eval_shape, which keeps the mesh"
    )
    for call in (load_safetensors, plan_load):
        with pytest.raises(ValueError, match=message):
            call(jax.eval_shape(make), versioned["block_v3"])
    got = plan_load(tt.eval_shape(make), versioned["block_v3"])
    assert got.ok and len(got.device_bytes) == 8


def test_the_plan_command_plans_migrated_and_sharded_models(
    versioned, tmp_path, monkeypatch, capsys
):
    """``taktiny plan`` makes the model abstractly but plans the load into the concrete model
    its factory makes: the leaves a migration adds are kept, and a sharded model is planned
    with its shardings."""
    (tmp_path / "versioned_models.py").write_text(
        "import jax\n"
        "import taktiny as tt\n"
        "from taktiny import nn\n"
        "from _versions import BlockV2, BlockV3, Net\n"
        "def block():\n"
        "    return BlockV3(rngs=nn.Rngs(0))\n"
        "def old_block():\n"
        "    return BlockV2(rngs=nn.Rngs(0))\n"
        "def sharded():\n"
        "    mesh = jax.make_mesh((2, 4), ('data', 'model'))\n"
        "    rules = {'blocks.*.ffn.kernel': (None, 'model'), 'blocks.*.q_t': ('data', 'model')}\n"
        "    return tt.shard(Net(rngs=nn.Rngs(0)), rules, mesh)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "versioned_models", raising=False)
    assert main(["plan", str(versioned["block_v1"]), "--model", "versioned_models:block"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "kept from the model (added by a migration): gate.kernel" in out
    assert "migrated: BlockV3's migrations from state version 1 to 3" in out
    assert "3 steps, 1,056 bytes" in out and out[-1] == "the load would succeed"
    assert main(["plan", str(versioned["net_v1"]), "--model", "versioned_models:sharded"]) == 0
    out = capsys.readouterr().out.splitlines()
    import versioned_models

    loaded = load_safetensors(versioned_models.sharded(), versioned["net_v1"])
    held_bytes = [
        f"device {d}: holds {n:,} bytes"
        for d, n in sorted(held(loaded).items(), key=lambda i: i[0].id)
    ]
    assert [line for line in out if line.startswith("device ")] == held_bytes
    assert len(held_bytes) == 8 and out[-1] == "the load would succeed"
    assert main(["plan", str(versioned["block_v3"]), "--model", "versioned_models:old_block"]) == 1
    out = capsys.readouterr().out
    assert "the load would raise ValueError:" in out
    assert "saved at state version 3; BlockV2 is at version 2" in out
    monkeypatch.delitem(sys.modules, "versioned_models")
