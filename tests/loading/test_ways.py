"""Each way a load reads a step holds what the budget counts for it, and the plan reports
the same: a checkpoint read in one way alone needs (beside its scratch buffer) the bytes
that way holds, which ``plan_load`` names in its refusal and as its ``held_bytes``, and
which the load itself refuses one byte less of and loads within."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantized_files import fp8_folder
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import convert as cv
from taktiny import nn
from taktiny.io import load_safetensors, open_safetensors, plan_load, save_safetensors

MiB = 2**20


def _on_eight(shape, spec):
    mesh = jax.make_mesh((8,), ("x",))
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def _linear():
    return nn.Sequential(nn.Linear(1024, 256, use_bias=False, rngs=nn.Rngs(0)))


class _Stacked(nn.Module):
    def __init__(self, *, rngs):
        self.layers = nn.Stack(
            lambda rngs: nn.Linear(512, 1024, use_bias=False, rngs=rngs), 1, rngs=rngs
        )


TURNED = [cv.Rule("w", "w", cv.transpose())]
# way: (the shapes saved, the target, the rules, the plan's ways, the bytes held)
CASES = {
    "whole, adopted on one CPU device": (
        {"w": (256, 1024)},
        lambda: {"w": jax.ShapeDtypeStruct((256, 1024), jnp.float32)},
        None,
        ["direct"],
        0,
    ),
    "whole, staged for eight devices": (
        {"w": (256, 1024)},
        lambda: {"w": _on_eight((256, 1024), P())},
        None,
        ["direct"],
        MiB,
    ),
    "in blocks, 4 MiB of rows at a time": (
        {"w": (4096, 1024)},
        lambda: {"w": _on_eight((4096, 1024), P("x"))},
        None,
        ["blocks"],
        4 * MiB,
    ),
    "transposed, a piece at a time": (
        {"w": (1024, 4096)},
        lambda: {"w": jax.ShapeDtypeStruct((4096, 1024), jnp.float32)},
        TURNED,
        ["transposed"],
        4 * MiB,
    ),
    "batched with its neighbours: staging and their buffer": (
        {f"b{k}": (64,) for k in range(3)},
        lambda: {f"b{k}": _on_eight((64,), P()) for k in range(3)},
        None,
        ["direct"] * 3,
        2 * 3 * 256,
    ),
    "through a scratch buffer, and the transpose before its cast": (
        {"w": (1024, 4096)},
        lambda: {"w": jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)},
        [cv.Rule("w", "w", cv.chain(cv.transpose(), cv.cast(jnp.bfloat16)))],
        ["scratch"],
        16 * MiB + 16 * MiB,
    ),
    "quantized from the scratch buffer": (
        {"layers.0.kernel": (1024, 256)},
        lambda: tt.quantize(jax.eval_shape(_linear)),
        None,
        ["quantized"],
        MiB,
    ),
    "into a slice of a stack, transposed a piece at a time": (
        {"layers.0.weight": (1024, 512)},
        lambda: jax.eval_shape(lambda: _Stacked(rngs=nn.Rngs(0))),
        [cv.Rule("layers.{i}.weight", "layers.{i}.kernel", cv.transpose())],
        ["transposed"],
        2 * MiB,
    ),
    "FP8 blocks, laid out into the scratch buffer": (
        "fp8",
        lambda: tt.quantize(jax.eval_shape(_linear)),
        "fp8",
        ["quantized"],
        256 * 1024 + 64,  # (float8 weights, and their scales at a multiple of 64 bytes)
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_bytes_a_way_holds_are_what_the_plan_and_the_load_count(tmp_path, case):
    shapes, make, rules, ways, held = CASES[case]
    rng = np.random.default_rng(0)
    if shapes == "fp8":
        path = tmp_path / "fp8"
        fp8_folder(
            {"layers.0.weight": rng.standard_normal((256, 1024), np.float32)},
            path,
            quantized=lambda name: True,
            shards=1,
        )
        rules = cv.linear("layers.0", "layers.0", bias=False)
        rules = cv.quantized_rules(rules, open_safetensors(path))
    else:
        path = tmp_path / "w.safetensors"
        save_safetensors(path, {n: rng.standard_normal(s, np.float32) for n, s in shapes.items()})
    plan = plan_load(make(), path, rules=rules)
    assert [s.way for s in plan.steps] == ways
    assert plan.ok and plan.held_bytes == held
    refused = plan_load(make(), path, rules=rules, max_host_bytes=1)
    if held == 0:
        assert refused.ok
        return
    assert f"needs {held:,} bytes" in refused.problems[0]
    with pytest.raises(ValueError, match=f"needs {held:,} bytes"):
        load_safetensors(make(), path, rules=rules, max_host_bytes=held - 1)
    free = load_safetensors(make(), path, rules=rules)
    within = load_safetensors(make(), path, rules=rules, max_host_bytes=held)
    for a, b in zip(jax.tree.leaves(free), jax.tree.leaves(within), strict=True):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _staged_everywhere(monkeypatch, platform):
    """The loads below read through the staging ring: on a TPU or a GPU (the `platform`'s
    first device is the default, where the targets go) as they are; on the CPU, its devices
    taken as devices that copy host memory. A CPU device adopts an aligned buffer instead of
    copying it, so each value it adopts from the ring must be copied before the buffer is
    reused: a load that forgot it would hand out arrays that the next reads overwrite."""
    import taktiny.loading._ways as ways_module

    if platform == "cpu":
        monkeypatch.setattr(ways_module, "_staging", lambda sharding: True)
    return ways_module


def test_a_load_onto_devices_that_copy_reads_through_a_reused_staging_ring(
    tmp_path, monkeypatch, platform
):
    ways_module = _staged_everywhere(monkeypatch, platform)
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal((64, 40 + i)).astype(np.float32) for i in range(10)}
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in state.items()}
    plan = plan_load(target, path)
    assert [s.way for s in plan.steps] == ["staged"] * 10
    largest = -(-state["w9"].nbytes // 64) * 64
    assert plan.scratch_bytes == ways_module.RING * largest  # four buffers, for ten tensors
    mapped = []
    real = ways_module.Scratch.read

    def read(self, tensors, verify, perm=None):
        mapped.append(id(self))
        return real(self, tensors, verify, perm)

    monkeypatch.setattr(ways_module.Scratch, "read", read)
    loaded = load_safetensors(target, path)
    assert len(mapped) == 10 and len(set(mapped)) <= ways_module.RING  # reused in turns
    for name, value in state.items():  # each its own array, none overwritten by a later read
        assert loaded[name].devices() == {jax.devices(platform)[0]}
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)


def test_a_staging_ring_shrinks_within_a_budget(tmp_path, monkeypatch, platform):
    _staged_everywhere(monkeypatch, platform)
    state = {f"w{i}": np.full((256, 256), i, np.float32) for i in range(6)}  # 256 KiB each
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in state.items()}
    each = state["w0"].nbytes
    assert plan_load(target, path).scratch_bytes == 4 * each
    assert plan_load(target, path, max_host_bytes=2 * each).scratch_bytes == 2 * each
    loaded = load_safetensors(target, path, max_host_bytes=each)  # one buffer, in turns
    assert [float(loaded[n][0, 0]) for n in state] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert plan_load(target, path, max_host_bytes=each).error is None
    refused = plan_load(target, path, max_host_bytes=each - 1).error
    assert "a staging buffer of 262,144 bytes to copy it onto its devices" in str(refused)


def test_a_transposed_tensor_onto_devices_that_copy_is_permuted_into_the_staging_ring(
    tmp_path, monkeypatch, platform
):
    _staged_everywhere(monkeypatch, platform)
    rng = np.random.default_rng(1)
    state = {f"w{i}": rng.standard_normal((64, 40 + i)).astype(np.float32) for i in range(6)}
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    target = {n: jax.ShapeDtypeStruct(v.T.shape, v.dtype) for n, v in state.items()}
    rules = [cv.Rule("{name}", "{name}", cv.transpose())]
    plan = plan_load(target, path, rules=rules)
    assert [s.way for s in plan.steps] == ["staged"] * 6
    loaded = load_safetensors(target, path, rules=rules)
    for name, value in state.items():  # permuted as read, none overwritten by a later read
        np.testing.assert_array_equal(np.asarray(loaded[name]), value.T)
