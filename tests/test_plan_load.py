"""taktiny.io.plan_load: a load planned from the headers alone. Each test compares the
plan with the real load it predicts: the bytes its arrays hold per device, the bytes
os.preadv reads, the error it raises (the same problems, in order), and the way each tensor
goes (a scratch buffer, a transposition, a quantization); and checks that planning reads
no tensor byte."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _reads import log_preads
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import convert as cv
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
    return sum(n for _, _, n in log)


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
    """plan_load with every read of tensor bytes refused."""
    with monkeypatch.context() as m:

        def refuse(*args, **kw):
            raise AssertionError("the plan read tensor bytes")

        for name in ("read", "read_into", "read_blocks", "read_transposed", "verify"):
            m.setattr(Tensor, name, refuse)
        m.setattr(os, "preadv", refuse)
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
    assert "[unused]" in capsys.readouterr().out
    assert main(["plan", str(path), "--model", "plan_models:nothing"]) == 2
    assert "has no function 'nothing'" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "absent.safetensors"), "--model", "plan_models:good"]) == 2
    assert "does not exist" in capsys.readouterr().err
