"""Migrations between state versions of a model (`tt.migrate`, `convert.Init`, and
`load_safetensors` of an older checkpoint): three versions of one small attention block,
saved at versions 1 and 2 and loaded into version 3 through safetensors, a state dict and
an Orbax restore, each checked against NumPy."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from _versions import TO_2, TO_3, BlockV1, BlockV2, BlockV3, Inner, Net, NetV1, NetV2
from hypothesis import given, settings
from hypothesis import strategies as st

import taktiny as tt
from taktiny import convert, nn
from taktiny.io import open_safetensors, save_safetensors


def _numpy(model: Any) -> dict[str, np.ndarray]:
    return {n: np.asarray(v) for n, v in tt.flat_state_dict(model).items()}


def _expected(old: Any, fresh: Any) -> dict[str, np.ndarray]:
    """What a load of `old` (version 1 or 2) into `fresh` (version 3) must hold, by NumPy."""
    saved, kept = _numpy(old), _numpy(fresh)
    if "q.kernel" in saved:
        saved = {
            "qkv.kernel": np.concatenate([saved[f"{p}.kernel"] for p in "qkv"], axis=1),
            "ffn.kernel": saved["mlp.kernel"],
            "ffn.bias": saved["mlp.bias"],
        }
    return {**saved, "gate.kernel": kept["gate.kernel"]}


def _check(loaded: Any, expected: dict[str, np.ndarray]) -> None:
    got = _numpy(loaded)
    assert list(got) == ["qkv.kernel", "ffn.kernel", "ffn.bias", "gate.kernel"]
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.fixture(params=[BlockV1, BlockV2], ids=["from_v1", "from_v2"])
def old(request: pytest.FixtureRequest) -> Any:
    return request.param(rngs=nn.Rngs(1))


def test_schema_records_the_declared_version() -> None:
    v1, v3 = BlockV1(rngs=nn.Rngs(0)), BlockV3(rngs=nn.Rngs(0))
    assert tt.schema(v1).version is None
    assert tt.schema(v3).version == 3
    # an undeclared version leaves the fingerprint as the entries alone give it
    assert tt.schema(v1).fingerprint == tt.Schema(dict(tt.schema(v1))).fingerprint
    versioned = tt.schema(v3)
    assert versioned.fingerprint != tt.Schema(dict(versioned)).fingerprint
    assert versioned != tt.Schema(dict(versioned))
    back = tt.Schema.from_json(versioned.to_json())
    assert back == versioned and back.version == 3
    assert '"version"' not in tt.schema(v1).to_json()
    assert tt.Schema.from_json(tt.schema(v1).to_json()).version is None


def test_a_bad_version_is_refused() -> None:
    with pytest.raises(ValueError, match="a schema's version is an int >= 1 or None, got 0"):
        tt.Schema({}, version=0)
    text = tt.schema(BlockV3(rngs=nn.Rngs(0))).to_json().replace('"version":3', '"version":"3"')
    with pytest.raises(ValueError, match="a schema's version is an int >= 1 or None, got '3'"):
        tt.Schema.from_json(text)

    class Wrong(nn.Module):
        state_version: ClassVar[Any] = "2"

        def __init__(self) -> None:
            self.w = np.zeros(2)

    with pytest.raises(ValueError, match=r"Wrong.state_version must be an int >= 1, got '2'"):
        tt.schema(Wrong())


def test_load_safetensors_migrates_an_older_checkpoint(tmp_path: Path, old: Any) -> None:
    path = tmp_path / "old.safetensors"
    save_safetensors(path, old)
    stored = open_safetensors(path).schema
    assert stored is not None and stored.version == tt.schema(old).version
    fresh = BlockV3(rngs=nn.Rngs(2))
    loaded = tt.io.load_safetensors(fresh, path)
    _check(loaded, _expected(old, fresh))


def test_plan_load_plans_the_migrated_load(tmp_path: Path, old: Any) -> None:
    path = tmp_path / "old.safetensors"
    save_safetensors(path, old)
    planned = tt.io.plan_load(BlockV3(rngs=nn.Rngs(2)), path)
    assert planned.error is None
    made = {t: (s.sources, s.transform) for s in planned.steps for t in s.targets}
    assert set(made) == {"qkv.kernel", "ffn.kernel", "ffn.bias"}  # the gate keeps its value
    if isinstance(old, BlockV1):
        assert made["qkv.kernel"][0] == ("q.kernel", "k.kernel", "v.kernel")
        assert "concatenate(axis=1)" in made["qkv.kernel"][1]
        assert made["ffn.bias"][0] == ("mlp.bias",)
    assert planned.kept == ("gate.kernel",)
    start = 1 if isinstance(old, BlockV1) else 2
    assert planned.migrations == f"BlockV3's migrations from state version {start} to 3"
    assert "kept from the model (added by a migration): gate.kernel" in str(planned)
    save_safetensors(tmp_path / "v3.safetensors", BlockV3(rngs=nn.Rngs(1)))
    newer = tt.io.plan_load(BlockV2(rngs=nn.Rngs(0)), tmp_path / "v3.safetensors")
    assert type(newer.error) is ValueError and newer.steps == ()
    assert "saved at state version 3; BlockV2 is at version 2" in str(newer.error)


def test_load_state_dict_after_migrate(old: Any) -> None:
    fresh = BlockV3(rngs=nn.Rngs(2))
    flat = tt.migrate(fresh, tt.flat_state_dict(old), version=tt.schema(old).version)
    loaded = tt.load_flat_state_dict(fresh, flat, strict=True)
    _check(loaded, _expected(old, fresh))


def test_orbax_restore_then_migrate(tmp_path: Path, old: Any) -> None:
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "step", old)
    checkpointer.wait_until_finished()
    (tmp_path / "step.schema.json").write_text(tt.schema(old).to_json())

    saved = tt.Schema.from_json((tmp_path / "step.schema.json").read_text())
    raw = tt.flat_state_dict(checkpointer.restore(tmp_path / "step"))
    fresh = BlockV3(rngs=nn.Rngs(2))
    loaded = tt.load_flat_state_dict(
        fresh, tt.migrate(fresh, raw, version=saved.version), strict=True
    )
    _check(loaded, _expected(old, fresh))


def test_the_current_version_loads_as_it_is(tmp_path: Path) -> None:
    model = BlockV3(rngs=nn.Rngs(1))
    flat = tt.flat_state_dict(model)
    assert tt.migrate(BlockV3(rngs=nn.Rngs(2)), flat, version=3) == flat
    save_safetensors(tmp_path / "v3.safetensors", model)
    loaded = tt.io.load_safetensors(BlockV3(rngs=nn.Rngs(2)), tmp_path / "v3.safetensors")
    _check(loaded, _numpy(model))


def test_a_newer_checkpoint_is_refused(tmp_path: Path) -> None:
    save_safetensors(tmp_path / "v3.safetensors", BlockV3(rngs=nn.Rngs(1)))
    newer = "saved at state version 3; BlockV2 is at version 2: load it with the newer code"
    with pytest.raises(ValueError, match=newer):
        tt.io.load_safetensors(BlockV2(rngs=nn.Rngs(0)), tmp_path / "v3.safetensors")
    with pytest.raises(ValueError, match=newer):
        tt.migrate(BlockV2(rngs=nn.Rngs(0)), {}, version=3)
    with pytest.raises(ValueError, match=r"a state version is an int >= 1 .* got 0"):
        tt.migrate(BlockV2(rngs=nn.Rngs(0)), {}, version=0)


def test_rules_with_an_older_checkpoint_are_refused(tmp_path: Path) -> None:
    save_safetensors(tmp_path / "v1.safetensors", BlockV1(rngs=nn.Rngs(1)))
    with pytest.raises(
        ValueError,
        match=r"saved at older state versions, which BlockV3's migrations from state version 1 to 3 convert; rules= converts",
    ):
        tt.io.load_safetensors(
            BlockV3(rngs=nn.Rngs(0)), tmp_path / "v1.safetensors", rules=[convert.Rule("x", "y")]
        )


def test_an_abstract_model_cannot_keep_an_added_parameter(tmp_path: Path) -> None:
    """The load refuses, naming the leaf and the fix; the plan names the same problem and
    still plans the other steps; a value given for the leaf first is kept."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    old = BlockV2(rngs=nn.Rngs(1))
    save_safetensors(tmp_path / "v2.safetensors", old)
    abstract = jax.eval_shape(lambda: BlockV3(rngs=nn.Rngs(0)))
    message = (
        r"(?s)load_safetensors\(BlockV3\): after BlockV3's migrations from state version 2 to "
        r"3: 1 problem.*'gate.kernel': an Init adds it, so it keeps the model's "
        r"own value, but the model is abstract \(jax.eval_shape\) and has none: load into a "
        r"concrete model \(made by its class\), or give this leaf of the abstract model a "
        r"value first \(equinox.tree_at\)\.$"
    )
    with pytest.raises(convert.ConversionError, match=message) as raised:
        tt.io.load_safetensors(abstract, tmp_path / "v2.safetensors")
    planned = tt.io.plan_load(abstract, tmp_path / "v2.safetensors")
    assert planned.problems == raised.value.problems and str(planned.error) == str(raised.value)
    assert sorted(t for s in planned.steps for t in s.targets) == [
        "ffn.bias",
        "ffn.kernel",
        "qkv.kernel",
    ]
    assert planned.kept == ()
    with pytest.raises(convert.ConversionError, match=r"'gate.kernel': an Init adds it"):
        tt.migrate(abstract, tt.flat_state_dict(old), version=2)
    gate = np.arange(64, dtype=np.float32).reshape(8, 8)
    given = eqx.tree_at(lambda m: m.gate.kernel, abstract, jnp.asarray(gate))
    loaded = tt.io.load_safetensors(given, tmp_path / "v2.safetensors")
    np.testing.assert_array_equal(np.asarray(loaded.gate.kernel), gate)
    np.testing.assert_array_equal(np.asarray(loaded.ffn.bias), np.asarray(old.ffn.bias))
    assert tt.io.plan_load(given, tmp_path / "v2.safetensors").kept == ("gate.kernel",)


def _versioned(migrations: Sequence[Sequence[Any]], version: int = 3) -> type:
    class Block(nn.Module):
        state_version: ClassVar[int] = version
        state_migrations: ClassVar[Sequence[Sequence[Any]]] = migrations

        def __init__(self, *, rngs: nn.Rngs):
            self.qkv = nn.Linear(8, 24, use_bias=False, rngs=rngs)
            self.ffn = nn.Linear(8, 8, rngs=rngs)
            self.gate = nn.Linear(8, 8, use_bias=False, rngs=rngs)

    return Block


def test_a_declaration_without_a_migration_per_version_is_refused() -> None:
    block = _versioned([TO_2])(rngs=nn.Rngs(0))
    with pytest.raises(TypeError, match=r"Block is at state version 3, so it lists 2 migrations"):
        tt.migrate(block, {}, version=1)
    with pytest.raises(TypeError, match=r"state_migrations\[1\] .* holds Tie"):
        tt.migrate(_versioned([TO_2, [convert.Tie("a", "b")]])(rngs=nn.Rngs(0)), {}, version=1)


def test_a_migration_that_does_not_cover_is_refused(tmp_path: Path) -> None:
    save_safetensors(tmp_path / "v1.safetensors", BlockV1(rngs=nn.Rngs(1)))
    flat = tt.flat_state_dict(BlockV1(rngs=nn.Rngs(1)))
    typo = [convert.Rule("mpl.{p}", "ffn.{p}"), *TO_2[1:]]  # matches nothing: mlp stays
    block = _versioned([typo, TO_3])(rngs=nn.Rngs(0))
    unmatched = r"(?s)state_migrations\[0\] \(version 1 -> 2\).*  - 'mpl.\{p\}': Rule\("
    with pytest.raises(convert.ConversionError, match=unmatched):
        tt.migrate(block, flat, version=1)
    with pytest.raises(convert.ConversionError, match=unmatched):
        tt.io.load_safetensors(block, tmp_path / "v1.safetensors")
    # without the fused projection the model's qkv is missing and q, k, v are unknown
    unfused = _versioned([TO_2[:1], TO_3])(rngs=nn.Rngs(0))
    with pytest.raises(
        convert.ConversionError,
        match=r"(?s)'q.kernel': a state of version 1 still.*  - 'qkv",
    ):
        tt.migrate(unfused, flat, version=1)
    forgotten = _versioned([TO_2, []])(rngs=nn.Rngs(0))  # the gate is not declared added
    forgot = r"(?s)after Block's migrations from state version 1 to 3.*'gate.kernel': no migration"
    with pytest.raises(convert.ConversionError, match=forgot):
        tt.io.load_safetensors(forgotten, tmp_path / "v1.safetensors")
    misnamed = _versioned([TO_2, [convert.Init("gates.kernel")]])(rngs=nn.Rngs(0))
    with pytest.raises(convert.ConversionError, match=r"'gates.kernel': an Init adds it, but"):
        tt.migrate(misnamed, flat, version=1)


def test_migrations_compose_transforms_and_renames_of_added_names() -> None:
    """v1 -> v2 fuses q/k/v, v2 -> v3 transposes the fused kernel and renames what
    migration 1 added: the chain runs as one conversion per saved group."""

    class Transposed(nn.Module):
        state_version: ClassVar[int] = 3
        state_migrations: ClassVar[Sequence[Sequence[Any]]] = (
            [*TO_2, convert.Init("extra.kernel")],
            [
                convert.Rule("qkv.kernel", "qkv_t", convert.transpose((1, 0))),
                convert.Rule("extra.kernel", "gate.kernel"),
            ],
        )

        def __init__(self, *, rngs: nn.Rngs):
            self.qkv_t = np.zeros((24, 8), np.float32)
            self.ffn = nn.Linear(8, 8, rngs=rngs)
            self.gate = nn.Linear(8, 8, use_bias=False, rngs=rngs)

    old, fresh = BlockV1(rngs=nn.Rngs(1)), Transposed(rngs=nn.Rngs(2))
    flat = tt.migrate(fresh, tt.flat_state_dict(old), version=None)
    expected = _expected(old, BlockV3(rngs=nn.Rngs(2)))
    np.testing.assert_array_equal(np.asarray(flat["qkv_t"]), expected["qkv.kernel"].T)
    np.testing.assert_array_equal(np.asarray(flat["ffn.bias"]), expected["ffn.bias"])
    np.testing.assert_array_equal(np.asarray(flat["gate.kernel"]), _numpy(fresh)["gate.kernel"])

    class Transformed(nn.Module):  # an added name has no value for a later transform
        state_version: ClassVar[int] = 3
        state_migrations: ClassVar[Sequence[Sequence[Any]]] = (
            [*TO_2, convert.Init("gate.kernel")],
            [convert.Rule("gate.kernel", "gate.kernel", convert.transpose((1, 0)))],
        )

    with pytest.raises(convert.ConversionError, match=r"'gate.kernel': .* added it \(Init\)"):
        tt.migrate(Transformed(), tt.flat_state_dict(old), version=1)


class _Fused(nn.Module):
    """Version 2 of a model whose version 1 held "q", "k" and "v" kernels of any widths:
    one fused, transposed kernel, and an added bias."""

    state_version: ClassVar[int] = 2
    state_migrations: ClassVar[Sequence[Sequence[Any]]] = (
        [
            convert.Rule(
                ["q.kernel", "k.kernel", "v.kernel"],
                "qkv",
                convert.chain(convert.concatenate(axis=1), convert.transpose((1, 0))),
            ),
            convert.Ignore("step"),
            convert.Init("bias"),
        ],
    )

    def __init__(self, width: int, seed: int):
        self.qkv = np.zeros((width, 3), np.float32)
        self.bias = np.random.default_rng(seed).normal(size=width).astype(np.float32)


@given(widths=st.lists(st.integers(1, 5), min_size=3, max_size=3), seed=st.integers(0, 99))
@settings(max_examples=25, deadline=None)
def test_migrate_matches_numpy_for_any_widths(widths: list[int], seed: int) -> None:
    """Oracle: the migrated state equals NumPy's concatenation then transpose of the saved
    kernels, the dropped name is gone and the added one keeps the model's value."""
    values = np.random.default_rng(seed)
    saved = {
        f"{p}.kernel": values.normal(size=(3, w)).astype(np.float32)
        for p, w in zip("qkv", widths, strict=True)
    }
    saved["step"] = np.array(7)
    model = _Fused(sum(widths), seed)
    flat = tt.migrate(model, saved, version=1)
    expected = np.concatenate([saved["q.kernel"], saved["k.kernel"], saved["v.kernel"]], axis=1).T
    assert list(flat) == ["qkv", "bias"]
    np.testing.assert_array_equal(np.asarray(flat["qkv"]), expected)
    np.testing.assert_array_equal(np.asarray(flat["bias"]), model.bias)


def test_a_migrated_rename_or_transpose_reads_as_the_rule_would(tmp_path: Path) -> None:
    """A migration that renames or transposes a saved array alone keeps the load's fast
    ways: read straight into the leaf, or permuted piece by piece."""

    class Turned(nn.Module):
        state_version: ClassVar[int] = 2
        state_migrations: ClassVar[Sequence[Sequence[Any]]] = (
            [
                convert.Rule("mlp.kernel", "out.kernel", convert.transpose((1, 0))),
                convert.Rule("mlp.bias", "out.bias"),
                convert.Ignore("q.kernel", "k.kernel", "v.kernel"),
            ],
        )

        def __init__(self) -> None:
            self.out = {"kernel": np.zeros((8, 8), np.float32), "bias": np.zeros(8, np.float32)}

    old = BlockV1(rngs=nn.Rngs(1))
    save_safetensors(tmp_path / "v1.safetensors", old)
    ways = {s.targets: s.way for s in tt.io.plan_load(Turned(), tmp_path / "v1.safetensors").steps}
    assert ways == {("out.kernel",): "transposed", ("out.bias",): "direct"}
    loaded = tt.io.load_safetensors(Turned(), tmp_path / "v1.safetensors")
    np.testing.assert_array_equal(np.asarray(loaded.out["kernel"]), np.asarray(old.mlp.kernel).T)
    np.testing.assert_array_equal(np.asarray(loaded.out["bias"]), np.asarray(old.mlp.bias))


# Nested versions: `Inner` (version 2) in a list of blocks of `Net` (no version of its own)
# and of `NetV2` (version 2 itself), from a checkpoint of `NetV1` (every class at 1).


def _nested_expected(old: Any, fresh: Any) -> dict[str, np.ndarray]:
    """NumPy's migration of `old` (a NetV1) into `fresh` (a Net or NetV2): each block's MLP
    renamed, its query kernel transposed, its gate (and NetV2's norm) the fresh model's."""
    saved, kept = _numpy(old), _numpy(fresh)
    out = {}
    for i in range(len(old.blocks)):
        block = f"blocks.{i}"
        out[f"{block}.ffn.kernel"] = saved[f"{block}.mlp.kernel"]
        out[f"{block}.ffn.bias"] = saved[f"{block}.mlp.bias"]
        out[f"{block}.q_t"] = saved[f"{block}.q.kernel"].T
        out[f"{block}.gate.kernel"] = kept[f"{block}.gate.kernel"]
    head = "out" if "out.kernel" in kept else "head"
    out[f"{head}.kernel"], out[f"{head}.bias"] = saved["head.kernel"], saved["head.bias"]
    if "norm" in kept:
        out["norm"] = kept["norm"]
    return out


def _check_all(loaded: Any, expected: dict[str, np.ndarray]) -> None:
    got = _numpy(loaded)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


INNER = "Inner's migrations from state version 1 to 2 at 'blocks.0', 'blocks.1', 'blocks.2'"


@pytest.mark.parametrize("cls", [Net, NetV2])
def test_nested_versions_are_recorded_by_path(cls: type) -> None:
    schema = tt.schema(cls(rngs=nn.Rngs(0)))
    assert dict(schema.versions) == {"blocks.0": 2, "blocks.1": 2, "blocks.2": 2}
    assert schema.version == (2 if cls is NetV2 else None)
    back = tt.Schema.from_json(schema.to_json())
    assert back == schema and dict(back.versions) == dict(schema.versions)
    assert tt.Schema(dict(schema), version=schema.version) != schema
    assert tt.Schema(dict(schema), version=schema.version).fingerprint != schema.fingerprint
    # a model without nested versions keeps the fingerprint of its entries (and version)
    old = tt.schema(NetV1(rngs=nn.Rngs(0)))
    assert dict(old.versions) == {} and old.fingerprint == tt.Schema(dict(old)).fingerprint
    assert '"versions"' not in old.to_json()
    with pytest.raises(ValueError, match=r"a schema's versions are by module path .* got ''"):
        tt.Schema({}, versions={"": 2})
    with pytest.raises(ValueError, match=r"a schema's version is an int >= 1 or None, got 0"):
        tt.Schema({}, versions={"blocks.0": 0})


@pytest.mark.parametrize("cls", [Net, NetV2], ids=["nested", "nested_and_top"])
def test_a_nested_module_s_migrations_load_an_older_checkpoint(tmp_path: Path, cls: type) -> None:
    old = NetV1(rngs=nn.Rngs(1))
    path = tmp_path / "v1.safetensors"
    save_safetensors(path, old)
    fresh = cls(rngs=nn.Rngs(2))
    expected = _nested_expected(old, fresh)
    _check_all(tt.io.load_safetensors(fresh, path), expected)
    saved = open_safetensors(path).schema
    assert saved is not None
    flat = tt.migrate(
        fresh, tt.flat_state_dict(old), version=saved.version, versions=saved.versions
    )
    _check_all(tt.load_flat_state_dict(fresh, flat, strict=True), expected)
    planned = tt.io.plan_load(fresh, path)
    assert planned.ok
    gates = tuple(f"blocks.{i}.gate.kernel" for i in range(3))
    assert planned.kept == (*gates, "norm") if cls is NetV2 else gates
    top = "; NetV2's migrations from state version 1 to 2" if cls is NetV2 else ""
    assert planned.migrations == INNER + top
    steps = {s.targets: s for s in planned.steps}
    assert steps[("blocks.1.q_t",)].sources == ("blocks.1.q.kernel",)
    assert steps[("blocks.1.q_t",)].way == "transposed"
    head = "out" if cls is NetV2 else "head"
    assert steps[(f"{head}.kernel",)].sources == ("head.kernel",)
    # the model's own versions load as they are
    save_safetensors(tmp_path / "v2.safetensors", fresh)
    again = tt.io.plan_load(fresh, tmp_path / "v2.safetensors")
    assert again.ok and again.migrations is None and again.kept == ()
    assert (
        tt.migrate(
            fresh, flat, version=tt.schema(fresh).version, versions=tt.schema(fresh).versions
        )
        == flat
    )


def test_nested_and_newer_versions_are_refused_with_the_module_s_path(tmp_path: Path) -> None:
    save_safetensors(tmp_path / "v2.safetensors", Net(rngs=nn.Rngs(1)))
    newer = (
        "taktiny.io.load_safetensors(NetV1): the state of 'blocks.0' was saved at state "
        "version 2; InnerV1 is at version 1: load it with the newer code that saved it "
        "(migrations only go forward)."
    )
    with pytest.raises(ValueError, match=re.escape(newer)):
        tt.io.load_safetensors(NetV1(rngs=nn.Rngs(0)), tmp_path / "v2.safetensors")
    planned = tt.io.plan_load(NetV1(rngs=nn.Rngs(0)), tmp_path / "v2.safetensors")
    assert str(planned.error) == newer and planned.steps == ()
    with pytest.raises(
        ValueError,
        match=r"taktiny.migrate\(Net\): the state of 'blocks.1' was saved at state version 3; "
        r"Inner is at version 2",
    ):
        tt.migrate(Net(rngs=nn.Rngs(0)), {}, version=None, versions={"blocks.1": 3})
    flat = tt.flat_state_dict(NetV1(rngs=nn.Rngs(1)))
    with pytest.raises(
        TypeError,
        match=r"taktiny.migrate\(Net\): modules inside the model declare state versions of "
        r"their own \('blocks.0', 'blocks.1', 'blocks.2'\): pass versions= too",
    ):
        tt.migrate(Net(rngs=nn.Rngs(0)), flat, version=None)


def test_a_nested_migration_s_problems_name_the_module_s_path(tmp_path: Path) -> None:
    old = NetV1(rngs=nn.Rngs(1))
    save_safetensors(tmp_path / "v1.safetensors", old)
    rules = Inner.state_migrations[0]

    def net(migration: list[Any]) -> Any:
        class Block(Inner):
            state_migrations: ClassVar[Sequence[Sequence[Any]]] = (migration,)

        class Model(nn.Module):
            def __init__(self) -> None:
                self.blocks = [Block(rngs=nn.Rngs(0)) for _ in range(3)]
                self.head = nn.Linear(8, 4, rngs=nn.Rngs(0))

        return Model()

    typo = net([convert.Rule("mpl.{p}", "ffn.{p}"), *rules[1:]])
    unmatched = (
        r"(?s)Block.state_migrations\[0\] \(version 1 -> 2\) at 'blocks.0'.*"
        r"  - 'blocks.0.mpl.\{p\}': Rule\("
    )
    with pytest.raises(convert.ConversionError, match=unmatched):
        tt.io.load_safetensors(typo, tmp_path / "v1.safetensors")
    with pytest.raises(convert.ConversionError, match=unmatched):
        tt.migrate(typo, tt.flat_state_dict(old), version=None, versions={})
    forgot = net(list(rules[:2]))  # the gate is not declared added
    missing = (
        r"(?s)after Block's migrations from state version 1 to 2 at 'blocks.0', 'blocks.1', "
        r"'blocks.2': 3 problems.*'blocks.0.gate.kernel': no migration makes it "
        r"from the saved state"
    )
    with pytest.raises(convert.ConversionError, match=missing) as raised:
        tt.io.load_safetensors(forgot, tmp_path / "v1.safetensors")
    assert tt.io.plan_load(forgot, tmp_path / "v1.safetensors").problems == raised.value.problems


def test_inner_modules_migrate_before_the_modules_that_hold_them(tmp_path: Path) -> None:
    """An outer class's migration names its parts' leaves as their classes make them now
    (``q_t``, which Inner's migration makes from ``q.kernel``): Inner's run first, then
    the outer one's, composed into one conversion per saved tensor."""

    class Flipped(nn.Module):  # version 2 stores each block's q_t transposed back
        state_version: ClassVar[int] = 2
        state_migrations: ClassVar[Sequence[Sequence[Any]]] = (
            [convert.Rule("blocks.{i}.q_t", "blocks.{i}.q_t", convert.transpose((1, 0)))],
        )

        def __init__(self, *, rngs: nn.Rngs):
            self.blocks = [Inner(rngs=rngs) for _ in range(3)]
            self.head = nn.Linear(8, 4, rngs=rngs)

    old = NetV1(rngs=nn.Rngs(1))
    save_safetensors(tmp_path / "v1.safetensors", old)
    fresh = Flipped(rngs=nn.Rngs(2))
    expected = _nested_expected(old, fresh)
    expected |= {f"blocks.{i}.q_t": _numpy(old)[f"blocks.{i}.q.kernel"] for i in range(3)}
    _check_all(tt.io.load_safetensors(fresh, tmp_path / "v1.safetensors"), expected)
    flat = tt.migrate(fresh, tt.flat_state_dict(old), version=None, versions={})
    _check_all(tt.load_flat_state_dict(fresh, flat, strict=True), expected)


class NestedV1(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.encoder = {"blocks": [nn.Linear(2, 3, rngs=rngs)], "out": nn.Linear(3, 1, rngs=rngs)}


class NestedV2(nn.Module):  # version 2: "encoder" renamed "backbone", at every depth below it
    state_version: ClassVar[int] = 2
    state_migrations: ClassVar[Sequence[Sequence[Any]]] = (
        [convert.Rule("encoder.**", "backbone.**")],
    )

    def __init__(self, *, rngs: nn.Rngs):
        self.backbone = {"blocks": [nn.Linear(2, 3, rngs=rngs)], "out": nn.Linear(3, 1, rngs=rngs)}


def test_a_migration_renames_a_nested_prefix_with_one_double_star_rule(tmp_path):
    old = NestedV1(rngs=nn.Rngs(0))
    save_safetensors(tmp_path / "v1.safetensors", old)
    new = NestedV2(rngs=nn.Rngs(1))
    flat = tt.migrate(new, tt.flat_state_dict(old), version=1)
    expected = {f"backbone.{n[len('encoder.') :]}": v for n, v in tt.flat_state_dict(old).items()}
    assert sorted(flat) == sorted(expected)
    loaded = tt.io.load_safetensors(new, tmp_path / "v1.safetensors", progress=False)
    for name, value in tt.flat_state_dict(loaded).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
