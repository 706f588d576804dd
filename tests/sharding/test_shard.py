"""Sharding by name (`tt.shard`, `tt.sharding_plan`), abstract trees that keep their shardings
(`tt.eval_shape`), and the state of sharded models: read as they are, loaded onto the
leaves' shardings, outside and inside `jax.jit`."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import nn

AXES = [AxisType.Auto, AxisType.Explicit]


def mesh_of(shape=(2, 4), axis_type=AxisType.Explicit, names=("data", "model")):
    return jax.make_mesh(
        shape, names, axis_types=(axis_type,) * len(shape), devices=jax.devices("cpu")
    )


class Block(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.up = nn.Linear(8, 16, rngs=rngs)
        self.down = nn.Linear(16, 8, rngs=rngs)


class Net(nn.Module):
    def __init__(self, *, rngs: nn.Rngs, sharded: bool = False):
        kw = {"embedding_sharding": (None, "model")} if sharded else {}
        self.embed = nn.Embed(32, 8, rngs=rngs, **kw)
        self.encoder = [Block(rngs=rngs) for _ in range(2)]
        self.norm = nn.LayerNorm(8, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.encoder:
            x = x + block.down(jax.nn.relu(block.up(x)))
        return self.norm(x)


RULES = [
    ("encoder.*.up.kernel", (None, "model")),
    ("encoder.*.up.bias", ("model",)),
    ("encoder.*.down.kernel", PartitionSpec("model", None)),
    ("embed.embedding", (None, "model")),
]


def same(a, b, ndim):
    """Whether two shardings place an array of `ndim` axes alike (P("x") is P("x", None))."""
    return a.is_equivalent_to(b, ndim)


def specs(tree):
    return {name: leaf.sharding.spec for name, leaf in tt.flat_state_dict(tree).items()}


@pytest.mark.parametrize("axis_type", AXES)
def test_shard_places_every_leaf_by_the_first_matching_rule(axis_type):
    mesh = mesh_of(axis_type=axis_type)
    model = Net(rngs=nn.Rngs(0))
    before = {k: np.asarray(v) for k, v in model.flat_state_dict().items()}
    rules = [("encoder.0.up.kernel", ("model", None)), *RULES]  # the first rule wins
    sharded = tt.shard(model, rules, mesh)
    got = specs(sharded)
    assert got["encoder.0.up.kernel"] == PartitionSpec("model", None)
    assert got["encoder.1.up.kernel"] == PartitionSpec(None, "model")
    assert got["encoder.1.up.bias"] == PartitionSpec("model")
    assert got["encoder.0.down.kernel"] == PartitionSpec("model", None)
    assert got["embed.embedding"] == PartitionSpec(None, "model")
    for name in ("encoder.0.down.bias", "norm.scale", "norm.bias"):  # replicated
        assert got[name] == PartitionSpec(), name
    for name, leaf in sharded.flat_state_dict().items():
        assert leaf.sharding.mesh == mesh, name
        assert np.asarray(leaf).tobytes() == before[name].tobytes(), name
    for name, leaf in model.flat_state_dict().items():  # the model given is unchanged
        assert leaf.sharding == SingleDeviceSharding(jax.devices()[0]), name
    # the sharded model computes what the model does
    ids = jnp.arange(6).reshape(2, 3)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda m, i: m(i))(sharded, ids)
    np.testing.assert_allclose(out, model(ids), rtol=1e-5, atol=1e-6)


def test_shard_takes_the_mesh_of_set_mesh_and_needs_one():
    mesh = mesh_of()
    with jax.set_mesh(mesh):
        sharded = tt.shard(Block(rngs=nn.Rngs(0)), {"up.kernel": (None, "model")})
    assert sharded.up.kernel.sharding == NamedSharding(mesh, PartitionSpec(None, "model"))
    with pytest.raises(ValueError, match=r"taktiny.sharding_plan needs a mesh: pass mesh="):
        tt.shard(Block(rngs=nn.Rngs(0)), {"up.kernel": (None, "model")})
    with pytest.warns(DeprecationWarning, match="with mesh"), mesh:  # (JAX 0.10 still takes it)
        sharded = tt.shard({"w": np.ones((4, 8), np.float32)}, {"w": (None, "model")})
    assert sharded["w"].sharding == NamedSharding(mesh, PartitionSpec(None, "model"))


def test_rules_that_are_no_pairs_are_refused_naming_the_entry(without_type_checks):
    mesh = mesh_of()
    with pytest.raises(TypeError, match=r"^taktiny\.sharding_plan takes its rules as a dict "
                       r"\{pattern: value\} or a list of \(pattern, value\) pairs, got the "
                       r"entry 'up'\.$"):  # fmt: skip
        tt.shard(Block(rngs=nn.Rngs(0)), [("down.*", ()), "up"], mesh)


def test_shard_of_an_abstract_model_gives_a_sharded_restore_target():
    mesh = mesh_of()
    abstract = jax.eval_shape(lambda: Block(rngs=nn.Rngs(0)))
    target = tt.shard(abstract, {"*.kernel": (None, "model")}, mesh)
    leaf = target.up.kernel
    assert isinstance(leaf, jax.ShapeDtypeStruct) and leaf.shape == (8, 16)
    assert leaf.sharding == NamedSharding(mesh, PartitionSpec(None, "model"))
    assert target.up.bias.sharding == NamedSharding(mesh, PartitionSpec())


def test_sharding_plan_reports_unmatched_names():
    mesh = mesh_of()
    model = Net(rngs=nn.Rngs(0))
    plan = tt.sharding_plan(model, RULES, mesh)
    assert plan.unmatched == (
        "encoder.0.down.bias",
        "encoder.1.down.bias",
        "norm.scale",
        "norm.bias",
    )
    assert list(plan.specs) == list(model.flat_state_dict())
    assert plan.specs["encoder.1.down.kernel"] == PartitionSpec("model", None)
    assert repr(plan).startswith("ShardingPlan(11 leaves, 4 unmatched)\n")
    assert "\n  encoder.0.up.kernel: P(None, 'model')\n" in repr(plan)
    with pytest.raises(tt.SelectionError) as info:
        tt.sharding_plan(model, RULES, mesh, strict=True)
    fix = (
        "no rule matches it; add a rule for it (a last rule '**' matches everything), or pass "
        "strict=False to replicate it."
    )
    assert str(info.value).splitlines() == [
        "taktiny.sharding_plan(strict=True) on Net: 4 problems:",
        *(f"  - {name!r}: {fix}" for name in plan.unmatched),
    ]
    assert [(p.kind, p.name) for p in info.value.problems] == [
        ("missing", name) for name in plan.unmatched
    ]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("place", [tt.shard, tt.sharding_plan])
def test_a_rule_that_matches_no_leaf_is_an_error_naming_the_closest(place, strict):
    """A typo in a rule never leaves its leaves silently replicated: by default too, the
    rule is named with the name it was probably meant for; with strict, unmatched leaves
    are listed as well."""
    mesh = mesh_of()
    model = Net(rngs=nn.Rngs(0))
    rules = [*RULES, ("encoder.*.dwon.bias", ("model",)), ("head.kernel", (None, "model")),
             ("encoder.*.up", ())]  # fmt: skip
    unmatched = "  - 'encoder.0.down.bias': no rule matches it; add a rule for it"
    lines = [
        "'encoder.*.dwon.bias': matches no name; did you mean 'encoder.*.down.bias'?",
        "'head.kernel': matches no name; did you mean 'encoder.1.up.kernel'?",
        "'encoder.*.up': matches no name; it matches the group 'encoder.0.up', not a "
        "parameter: 'encoder.*.up.**' matches everything in it.",
    ]
    with pytest.raises(tt.SelectionError, match=r"on Net: (3|7) problems:\n") as info:
        place(model, rules, mesh, strict=strict)
    problems = str(info.value).splitlines()[1:]
    assert problems[:3] == [f"  - {line}" for line in lines]
    assert len(problems) == 3 + 4 * strict  # with strict, the 4 leaves no rule matches
    assert problems[3:4] == ([problems[3]] if strict else [])
    assert all(line.startswith(unmatched) for line in problems[3:4])
    assert tt.shard(model, RULES, mesh).norm.scale.sharding.spec == P()  # without the typos


def test_the_plan_shards_a_jitted_step_in_and_out():
    mesh = mesh_of(axis_type=AxisType.Auto)
    model = Net(rngs=nn.Rngs(0))
    plan = tt.sharding_plan(model, RULES, mesh)
    step = jax.jit(
        lambda m: jax.tree.map(lambda x: x * 2, m),
        in_shardings=(plan.shardings,),
        out_shardings=plan.shardings,
    )
    out = step(tt.shard(model, RULES, mesh))
    assert specs(out) == plan.specs


def test_bad_specs_are_one_error_naming_every_leaf_shape_spec_and_mesh():
    mesh = mesh_of()
    model = Block(rngs=nn.Rngs(0))
    rules = [
        ("up.kernel", (None, "modle")),  # no such axis
        ("up.bias", ("data", "model")),  # more entries than axes
        ("down.kernel", ("model", "model")),  # one mesh axis twice
        ("down.bias", ("model",)),  # 8 over 4: fine
    ]
    with pytest.raises(ValueError) as info:
        tt.shard(model, rules, mesh)
    message = str(info.value)
    assert "3 problems:" in message
    assert (
        "  - 'up.kernel': shape (8, 16) by P(None, 'modle') on the mesh "
        "{'data': 2, 'model': 4}: the mesh has no axis 'modle' (its axes: 'data', 'model').\n"
    ) in message
    assert "'up.bias': shape (16,) by P('data', 'model')" in message
    problem = info.value.problems[0]
    assert (problem.kind, problem.name, problem.expected, problem.got) == (
        "sharding",
        "up.kernel",
        P(None, "modle"),
        (8, 16),
    )
    assert "the spec has 2 entries, the array 1 axes" in message
    assert "the mesh axis 'model' splits two axes" in message
    with pytest.raises(ValueError, match=r"entry 0 \(3\) is not a mesh axis name"):
        tt.shard(model, {"down.kernel": (3,)}, mesh)
    odd = nn.Linear(8, 6, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match=r"'kernel': shape \(8, 6\) by P\(None, "
                       r"'model'\) on the mesh \{'data': 2, 'model': 4\}: axis 1 of size 6 "
                       r"does not divide into 4 parts"):  # fmt: skip
        tt.shard(odd, {"kernel": (None, "model")}, mesh)
    with pytest.raises(ValueError, match=r"^taktiny\.sharding_plan\(strict=True\) on Block: 1 "
                       r"problem:\n  - 'up\.\[k': the pattern 'up\.\[k' has a '\[' without its "
                       r"'\]'\.$"):  # fmt: skip
        tt.shard(model, {"up.[k": ()}, mesh, strict=True)
    with pytest.raises(ValueError, match=r"  - 'up.kernel': its spec: a sharding is a PartitionSpec "
                       r"or a tuple of mesh axis names .* got 'model'; for example \('model',\)"):  # fmt: skip
        tt.shard(model, {"up.kernel": "model"}, mesh)
    assert model.up.kernel.sharding == SingleDeviceSharding(jax.devices()[0])


def test_a_mesh_of_no_devices_is_a_problem_naming_its_axis():
    """A mesh built of devices that do not exist (``jax.devices()[8:]`` on a host of one
    accelerator) has an axis of size 0: told by name, not a ZeroDivisionError."""
    empty = Mesh(np.empty((0, 2), dtype=object), ("data", "model"))
    with pytest.raises(ValueError, match=r"'kernel': shape \(8, 6\) by P\('data',\) on the mesh "
                       r"\{'data': 0, 'model': 2\}: the mesh axis 'data' holds no devices; build "
                       r"it of devices that exist"):  # fmt: skip
        tt.shard(nn.Linear(8, 6, rngs=nn.Rngs(0)), {"kernel": ("data",)}, empty)


@pytest.mark.parametrize("axis_type", AXES)
def test_eval_shape_keeps_the_shardings_of_a_model_built_under_a_mesh(axis_type):
    mesh = mesh_of(axis_type=axis_type)
    with jax.set_mesh(mesh):
        abstract = tt.eval_shape(lambda: Net(rngs=nn.Rngs(0), sharded=True))
        concrete = Net(rngs=nn.Rngs(0), sharded=True)
    for name, leaf in abstract.flat_state_dict().items():
        assert isinstance(leaf, jax.ShapeDtypeStruct), name
        assert same(leaf.sharding, concrete.flat_state_dict()[name].sharding, leaf.ndim), name
        assert leaf.sharding.mesh == mesh  # the mesh given, with its own axis types
    assert abstract.embed.embedding.sharding.spec == PartitionSpec(None, "model")


@pytest.mark.parametrize("axis_type", AXES)
def test_eval_shape_of_optimizer_init_gives_moments_the_parameters_shardings(axis_type):
    mesh = mesh_of(axis_type=axis_type)
    abstract = tt.shard(jax.eval_shape(lambda: Net(rngs=nn.Rngs(0))), RULES, mesh)
    # jax.eval_shape drops them on Auto axes (flax#5110): that is the gap filled here
    if axis_type == AxisType.Auto:
        dropped = jax.eval_shape(optax.adam(1e-3).init, abstract)
        assert dropped[0].mu.embed.embedding.sharding is None
    state = tt.eval_shape(optax.adam(1e-3).init, abstract)
    flat = tt.flat_state_dict(state)
    params = abstract.flat_state_dict()
    for name, param in params.items():
        for moment in ("mu", "nu"):
            got = flat[f"0.{moment}.{name}"].sharding
            assert same(got, param.sharding, param.ndim), (moment, name)
    assert flat["0.count"].sharding == NamedSharding(mesh, PartitionSpec())
    assert all(isinstance(s, jax.ShapeDtypeStruct) for s in flat.values())


def test_eval_shape_without_a_mesh_places_on_the_default_device_and_refuses_two_meshes():
    out = tt.eval_shape(lambda: Block(rngs=nn.Rngs(0)))
    for name, leaf in out.flat_state_dict().items():
        assert leaf.sharding == SingleDeviceSharding(jax.devices()[0]), name
    a = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh_of(), PartitionSpec()))
    other = mesh_of((4, 2))
    b = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(other, PartitionSpec()))
    with pytest.raises(ValueError, match=r"the arguments are on 2 different meshes"):
        tt.eval_shape(lambda x, y: x + y, a, b)
    # leaves without a sharding (host arrays, Python numbers) are no mesh of their own
    out = tt.eval_shape(lambda x, h, n: x * h * n, a, np.ones(8, np.float32), 2.0)
    assert same(out.sharding, a.sharding, 1) and out.sharding.mesh == a.sharding.mesh
    # an argument with a shape but no dtype is no array: JAX's error names it, as without a mesh
    shaped = type("Shaped", (), {"shape": (8,)})()
    with pytest.raises(TypeError, match=r"as an abstract array.*of type <class '.*Shaped'>"):
        tt.eval_shape(lambda x, s: x, a, shaped)


def test_eval_shape_under_set_mesh_takes_arguments_on_it_and_refuses_others():
    mesh, other = mesh_of(), mesh_of((4, 2))
    on = lambda m, spec: jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(m, spec))
    with jax.set_mesh(mesh):
        out = tt.eval_shape(lambda x: x * 2, on(mesh, P("model")))
        assert same(out.sharding, NamedSharding(mesh, P("model")), 2)
        assert out.sharding.mesh == mesh
        with pytest.raises(ValueError, match=r"^taktiny\.eval_shape: the arguments are on 2 "
                           r"different meshes \(\{'data': 2, 'model': 4\}; \{'data': 4, "
                           r"'model': 2\}\); place them on one first\.$"):  # fmt: skip
            tt.eval_shape(lambda x: x * 2, on(other, P("model")))


def test_the_state_of_a_sharded_model_is_its_own_arrays():
    model = tt.shard(Net(rngs=nn.Rngs(0)), RULES, mesh_of())
    flat = model.flat_state_dict()
    assert flat["encoder.0.up.kernel"] is model.encoder[0].up.kernel
    assert model.state_dict()["encoder"]["1"]["down"]["kernel"] is model.encoder[1].down.kernel


def test_host_data_lands_on_each_leafs_sharding_in_one_transfer(monkeypatch):
    model = tt.shard(Net(rngs=nn.Rngs(0)), RULES, mesh_of())
    host = {k: np.asarray(v) + 1 for k, v in model.flat_state_dict().items()}
    model.load_flat_state_dict(host)  # a first load in the process also probes JAX's array type
    calls = []
    put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(1) or put(*a, **k))
    loaded = model.load_flat_state_dict(host, strict=True)
    assert len(calls) == 1
    for name, leaf in loaded.flat_state_dict().items():
        assert leaf.sharding == model.flat_state_dict()[name].sharding, name
        assert np.asarray(leaf).tobytes() == host[name].tobytes(), name


@pytest.mark.parametrize("axis_type", AXES)
def test_a_value_on_devices_outside_the_models_mesh_is_refused(axis_type):
    cpu = jax.devices("cpu")
    mesh = jax.make_mesh((4,), ("model",), axis_types=(axis_type,), devices=cpu[:4])
    model = tt.shard(Block(rngs=nn.Rngs(0)), {"up.kernel": (None, "model")}, mesh)
    elsewhere = jax.device_put(np.ones((8, 16), np.float32), cpu[6])
    other = jax.device_put(np.ones(8, np.float32), cpu[7])
    # the same split on a mesh of the same shape over other devices (the same abstract mesh)
    twin = jax.make_mesh((4,), ("model",), axis_types=(axis_type,), devices=cpu[4:])
    split = jax.device_put(np.ones((16, 8), np.float32), NamedSharding(twin, P()))
    with pytest.raises(tt.StateDictError) as info:
        model.load_state_dict(
            {"up": {"kernel": elsewhere}, "down": {"bias": other, "kernel": split}}
        )
    problems = info.value.problems
    assert [(p.name, p.kind) for p in problems] == [
        ("up.kernel", "sharding"),
        ("down.bias", "sharding"),
        ("down.kernel", "sharding"),
    ]
    assert (problems[0].expected, problems[0].got) == ("devices [0, 1, 2, 3]", "devices [6]")
    assert str(problems[0]) == (
        "'up.kernel': the value of shape (8, 16) sits on devices [6], outside the leaf's mesh "
        "{'model': 4} (devices [0, 1, 2, 3], spec P(None, 'model')). Load host "
        "data (NumPy) or arrays on the model's mesh: jax.device_put(value, leaf.sharding) first."
    )
    # on the mesh, or from the host, it loads
    inside = jax.device_put(np.ones((8, 16), np.float32), cpu[2])
    loaded = model.load_state_dict({"up": {"kernel": inside}})
    assert loaded.up.kernel.sharding == model.up.kernel.sharding


@pytest.mark.parametrize("axis_type", AXES)
def test_a_load_inside_jit_keeps_the_shardings_of_a_closed_over_model(axis_type):
    mesh = mesh_of(axis_type=axis_type)
    model = tt.shard(Block(rngs=nn.Rngs(0)), {"*.kernel": (None, "model")}, mesh)
    replicated = jax.device_put(
        {"up": {"kernel": np.ones((8, 16), np.float32)}}, NamedSharding(mesh, PartitionSpec())
    )
    with jax.set_mesh(mesh):
        out = jax.jit(lambda s: model.load_state_dict(s))(replicated)
    assert out.up.kernel.sharding.spec == PartitionSpec(None, "model")
    assert np.array_equal(out.up.kernel, np.ones((8, 16)))


@pytest.mark.parametrize("passed", [False, True], ids=["closed_over", "argument"])
def test_a_load_inside_jit_reshards_a_value_from_the_leafs_own_mesh_without_set_mesh(passed):
    """On Explicit axes, with no jax.set_mesh around the jit, a value already on the leaf's
    mesh is still resharded to the leaf's split (JAX allows that from the same mesh)."""
    mesh = mesh_of()
    model = tt.shard(Block(rngs=nn.Rngs(0)), {"*.kernel": (None, "model")}, mesh)
    replicated = jax.device_put(
        {"up": {"kernel": np.ones((8, 16), np.float32)}}, NamedSharding(mesh, PartitionSpec())
    )
    if passed:
        out = jax.jit(lambda m, s: m.load_state_dict(s))(model, replicated)
    else:
        out = jax.jit(lambda s: model.load_state_dict(s))(replicated)
    assert out.up.kernel.sharding.spec == PartitionSpec(None, "model")
    assert np.array_equal(out.up.kernel, np.ones((8, 16)))


def test_a_load_inside_jit_keeps_the_shardings_of_a_model_argument_on_explicit_axes():
    mesh = mesh_of()
    model = tt.shard(Block(rngs=nn.Rngs(0)), {"*.kernel": (None, "model")}, mesh)
    replicated = jax.device_put(
        {"up": {"kernel": np.ones((8, 16), np.float32)}}, NamedSharding(mesh, PartitionSpec())
    )
    with jax.set_mesh(mesh):
        out = jax.jit(lambda m, s: m.load_state_dict(s))(model, replicated)
    assert out.up.kernel.sharding.spec == PartitionSpec(None, "model")
    # on Auto axes a traced model has no sharding in its type: out_shardings places it
    auto = mesh_of(axis_type=AxisType.Auto)
    model = tt.shard(Block(rngs=nn.Rngs(0)), {"*.kernel": (None, "model")}, auto)
    plan = tt.sharding_plan(model, {"*.kernel": (None, "model")}, auto)
    replicated = jax.device_put(replicated, NamedSharding(auto, PartitionSpec()))
    load = jax.jit(lambda m, s: m.load_state_dict(s), out_shardings=plan.shardings)
    assert load(model, replicated).up.kernel.sharding.spec == PartitionSpec(None, "model")


def test_eval_shape_falls_back_to_the_compilers_shardings_where_explicit_axes_refuse():
    def operands(mesh):
        return (
            jax.ShapeDtypeStruct(
                (8, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))
            ),
            jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P("model"))),
        )

    # a contraction over the split axis: ambiguous on Explicit axes, fine on Auto ones
    explicit = mesh_of()
    with pytest.raises(Exception, match=r"Contracting dimensions are sharded"):
        with jax.set_mesh(explicit):
            jax.eval_shape(jnp.matmul, *operands(explicit))
    mesh = mesh_of(axis_type=AxisType.Auto)
    a, b = operands(mesh)
    out = tt.eval_shape(lambda x, y: {"product": x @ y, "kept": x * 2}, a, b)
    assert out["product"].shape == (8, 4) and out["product"].sharding.mesh == mesh
    assert same(out["kept"].sharding, a.sharding, 2)
    # compiled under the mesh (a bare PartitionSpec constraint finds it), keywords passed on
    placed = lambda x, *, y: jax.lax.with_sharding_constraint(x @ y, P("data"))
    out = tt.eval_shape(placed, a, y=b)
    assert same(out.sharding, NamedSharding(mesh, P("data")), 2) and out.sharding.mesh == mesh


def test_the_guides_recipe_builds_under_with_mesh_and_restores_with_orbax(tmp_path):
    """The guide: build under ``with mesh:`` (deprecated in JAX 0.10, still accepted), restore
    with ``target=model.state_dict()``, load: every leaf sharded as annotated, values equal."""
    import orbax.checkpoint as ocp

    saved = Net(rngs=nn.Rngs(0))
    path = (tmp_path / "ckpt").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, saved.state_dict())
    mesh = mesh_of()
    with pytest.warns(DeprecationWarning, match="with mesh"), mesh:
        model = Net(rngs=nn.Rngs(1), sharded=True)
        with ocp.StandardCheckpointer() as checkpointer:
            state = checkpointer.restore(path, target=model.state_dict())
        model = model.load_state_dict(state)
    embedding = model.embed.embedding
    assert embedding.sharding == NamedSharding(mesh, P(None, "model"))
    assert [s.data.shape for s in embedding.addressable_shards] == [(32, 2)] * 8
    for name, value in model.flat_state_dict().items():
        assert np.asarray(value).tobytes() == np.asarray(saved.flat_state_dict()[name]).tobytes()


def test_under_with_mesh_a_layer_built_inside_a_trace_is_sharded_as_annotated():
    """``with mesh:`` (deprecated, still accepted): building under ``jax.jit`` or
    ``tt.eval_shape`` finds its mesh as building eagerly does (JAX refuses ``jax.set_mesh``
    inside a trace, and a traced value does not tell its sharding)."""
    mesh = mesh_of(axis_type=AxisType.Auto)  # (Explicit axes need jax.set_mesh under jit)
    build = lambda: nn.Linear(8, 16, kernel_sharding=(None, "model"), rngs=nn.Rngs(0))
    with pytest.warns(DeprecationWarning, match="with mesh"), mesh:
        eager = build()
        traced = jax.jit(build)()
        abstract = tt.eval_shape(build)
    want = NamedSharding(mesh, P(None, "model"))
    assert eager.kernel.sharding == want and traced.kernel.sharding == want
    assert abstract.kernel.sharding == want and same(
        abstract.bias.sharding, NamedSharding(mesh, P()), 1
    )
    assert np.array_equal(traced.kernel, eager.kernel)


def test_eval_shape_without_a_mesh_follows_the_default_device():
    device = jax.devices("cpu")[3]
    with jax.default_device(device):
        out = tt.eval_shape(lambda: jnp.zeros(3))
        assert out.sharding == SingleDeviceSharding(jnp.zeros(3).devices().pop())
    assert out.sharding == SingleDeviceSharding(device)
    with jax.default_device("cpu"):  # a platform: its first device, as JAX places arrays
        out = tt.eval_shape(lambda: jnp.zeros(3))
        assert out.sharding == SingleDeviceSharding(jnp.zeros(3).devices().pop())
    assert out.sharding == SingleDeviceSharding(jax.devices("cpu")[0])
    keyword = tt.eval_shape(lambda x, *, to: x.astype(to.dtype), np.ones(3), to=np.ones(1, np.int8))
    assert (keyword.shape, keyword.dtype) == ((3,), np.int8)  # keyword arguments reach fn


def test_eval_shape_keeps_weak_types_as_jax_eval_shape_does():
    """A Python scalar's weak type survives (it decides how the result promotes), with and
    without a mesh; a strong type stays strong."""
    make = lambda: (jnp.asarray(1.0), jnp.ones(2))
    assert [s.weak_type for s in jax.eval_shape(make)] == [True, False]
    assert [s.weak_type for s in tt.eval_shape(make)] == [True, False]
    with jax.set_mesh(mesh_of()):
        assert [s.weak_type for s in tt.eval_shape(make)] == [True, False]


def test_a_rule_shadowed_by_an_earlier_one_is_reported_as_such():
    model = Block(rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match=r"  - '\*\.kernel': matches no name; the names it "
                       r"would match \('up.kernel' and 1 more\) go to the earlier rule '\*\*'; "
                       r"put the more specific rule first\.$"):  # fmt: skip
        tt.sharding_plan(model, [("**", ()), ("*.kernel", ("model",))], mesh_of(), strict=True)
    with pytest.raises(ValueError, match=r"  - 'up.kernel': matches no name; the names it "
                       r"would match \('up.kernel'\) go to the earlier rule 'up.\*'"):  # fmt: skip
        tt.by_name([("up.*", 1), ("up.kernel", 2)], default=0)(model)
    with pytest.raises(ValueError, match=r"  - 'up.kernel': matches no name; an earlier "
                       r"rule has the same pattern; remove one of them\."):  # fmt: skip
        tt.shard(model, [("up.kernel", ()), ("up.kernel", ("model",))], mesh_of(), strict=True)


def test_zero_size_leaves_move_between_meshes_of_any_device_order():
    cpu = jax.devices("cpu")
    reversed_mesh = jax.sharding.Mesh(np.array(cpu[::-1]), ("x",))
    empty = jax.device_put(np.zeros((0, 4), np.float32), NamedSharding(reversed_mesh, P()))
    mesh = mesh_of()
    moved = tt.shard({"w": empty}, {"w": (None, "model")}, mesh)["w"]
    assert [s.data.shape for s in moved.addressable_shards] == [(0, 1)] * 8
    assert np.asarray(moved).shape == (0, 4)


def test_a_value_placed_alike_under_another_spec_is_kept_not_copied():
    mesh = mesh_of()
    model = tt.shard(Block(rngs=nn.Rngs(0)), {"up.kernel": ("data",)}, mesh)
    assert model.up.kernel.sharding.spec == P("data")
    alike = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("data", None)))
    loaded = model.load_state_dict({"up": {"kernel": alike}})
    assert loaded.up.kernel is alike  # the same placement: nothing moved


def test_a_load_inside_jit_with_problems_reports_them_before_any_resharding():
    mesh = mesh_of()
    model = tt.shard(Block(rngs=nn.Rngs(0)), {"*.kernel": (None, "model")}, mesh)
    elsewhere = jax.device_put(np.ones((8, 16), np.float32), jax.devices("cpu")[0])
    with pytest.raises(tt.StateDictError, match=r"'down.kernel': shape mismatch"):
        jax.jit(lambda m, a: m.load_state_dict({"up": {"kernel": a}, "down": {"kernel": a}}))(
            model, elsewhere
        )


def test_a_rule_naming_a_quantized_weight_places_its_value_and_its_scale():
    """`*.kernel` names a QArray whole: its value takes the spec and its scale follows on
    the axes they share (the output axis), not on the grouped input axis; a rule for a part
    itself, or an earlier catch-all, still comes first; the rule counts as used."""
    mesh = mesh_of()
    model = tt.quantize(Net(rngs=nn.Rngs(0)), bits=4, group_size=4)
    rules = [("encoder.*.up.kernel", (None, "model")), ("encoder.1.down.kernel.scale", ()),
             ("encoder.*.down.kernel", ("model", None)), ("embed.embedding", ("model", None))]  # fmt: skip
    plan = tt.sharding_plan(model, rules, mesh)  # every rule matches: no error
    assert "encoder.0.up.kernel.value" not in plan.unmatched
    # a second rule of the same pattern is never a leaf's first: an error, as any unused rule
    with pytest.raises(ValueError, match=r"1 problem:\n  - 'encoder\.\*\.up\.kernel': "
                       r"matches no name"):  # fmt: skip
        tt.sharding_plan(model, [*rules, ("encoder.*.up.kernel", ())], mesh)
    got = specs(tt.shard(model, rules, mesh))
    assert got["encoder.0.up.kernel.value"] == P(None, "model")
    assert got["encoder.0.up.kernel.scale"] == P(None, "model")  # [8 / 4, 16]: the outputs
    assert got["encoder.0.down.kernel.value"] == P("model", None)
    assert got["encoder.0.down.kernel.scale"] == P(None, None)  # [16 / 4, 8]: grouped rows
    assert got["encoder.1.down.kernel.scale"] == P()  # its own rule came first
    assert got["embed.embedding.value"] == got["embed.embedding.scale"] == P("model", None)
    first = [("**.value", ()), ("encoder.*.up.kernel", (None, "model"))]
    assert tt.sharding_plan(model, first, mesh).specs["encoder.0.up.kernel.value"] == P()
    with pytest.raises(ValueError, match=r"'encoder\.0\.up\.kernel\.value': shape \(8, 16\) by "
                       r"P\(None, None, 'model'\)"):  # fmt: skip
        tt.shard(model, [("encoder.*.up.kernel", (None, None, "model"))], mesh)


def test_a_rule_for_a_part_after_a_rule_naming_its_parameter_whole_is_unused():
    """An earlier rule that names a QArray whole takes its parts, so a later rule for a part
    is no leaf's first: an error that says why, not a rule silently ignored (found by the
    thorough property profile: the part stayed replicated where the user asked for a split)."""
    mesh = mesh_of()
    model = tt.quantize(nn.Linear(16, 8, rngs=nn.Rngs(0)), bits=8)
    with pytest.raises(tt.SelectionError, match=r"1 problem:\n  - 'kernel\.value': matches no "
                       r"name; the names it would match \('kernel\.value'\) go to the earlier "
                       r"rule '\*', which names their parameter 'kernel' whole; put the more "
                       r"specific rule first\.$"):  # fmt: skip
        tt.sharding_plan(model, [("*", ()), ("kernel.value", (None, "model"))], mesh)
    plan = tt.sharding_plan(model, [("kernel.value", (None, "model")), ("*", ())], mesh)
    assert plan.specs == {"kernel.value": P(None, "model"), "kernel.scale": P(None, None),
                          "bias": P()}  # fmt: skip


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowRank:
    """A custom parameter of shape [rows, columns] stored as factors and a 1-D row scale."""

    left: jax.Array  # [rows, rank]
    right: jax.Array  # [rank, columns]
    rows: jax.Array  # [rows]

    @property
    def shape(self):
        return (self.left.shape[0], self.right.shape[1])


def test_a_rule_naming_a_custom_parameter_splits_only_the_leaves_axes_of_its_size():
    """Each leaf of the parameter takes the spec's entries on its axes of the parameter's
    size; a leaf of another rank is replicated, even where its axis has that size."""
    tree = {"w": LowRank(jnp.ones((8, 2)), jnp.ones((2, 16)), jnp.ones(8)), "b": jnp.ones(16)}
    plan = tt.sharding_plan(tree, {"w": ("data", "model"), "b": ("model",)}, mesh_of())
    assert plan.specs == {
        "b": P("model"),
        "w.left": P("data", None),
        "w.right": P(None, "model"),
        "w.rows": P(),
    }
    plan = tt.sharding_plan(tree, {"w": ("data",)}, mesh_of())  # the spec's last entries: None
    assert [plan.specs[f"w.{n}"] for n in ("left", "right", "rows")] == [P("data", None), P(None, None), P()]  # fmt: skip


def test_rules_read_from_json_take_lists_as_tuples_of_mesh_axes():
    """A plan kept in JSON gives lists where a spec has tuples: the outer list is the spec,
    an inner list the mesh axes that split one axis together."""
    rules = json.loads('{"up.kernel": [null, ["data", "model"]], "down.kernel": ["model"]}')
    sharded = tt.shard(Block(rngs=nn.Rngs(0)), rules, mesh_of())
    assert sharded.up.kernel.sharding.spec == P(None, ("data", "model"))
    assert [s.data.shape for s in sharded.up.kernel.addressable_shards] == [(8, 2)] * 8
    assert sharded.down.kernel.sharding.spec == P("model")


def test_every_problem_of_a_spec_is_reported_not_only_the_first():
    """After an entry that names no mesh axis, or an axis the mesh lacks, the later entries
    are still checked; a split over several mesh axes names them all."""
    mesh = mesh_of()
    model = Block(rngs=nn.Rngs(0))  # up.kernel [8, 16], down.kernel [16, 8]
    with pytest.raises(ValueError) as info:
        tt.sharding_plan(model, {"up.kernel": (3, "modle"), "down.kernel": ("modle", "mdoel")},
                         mesh)  # fmt: skip
    problems = str(info.value).splitlines()[1:]
    where = "on the mesh {'data': 2, 'model': 4}: "
    axes = "(its axes: 'data', 'model')"
    assert problems == [
        f"  - 'up.kernel': shape (8, 16) by P(3, 'modle') {where}entry 0 (3) is not a mesh "
        "axis name.",
        f"  - 'up.kernel': shape (8, 16) by P(3, 'modle') {where}the mesh has no axis 'modle' "
        f"{axes}.",
        f"  - 'down.kernel': shape (16, 8) by P('modle', 'mdoel') {where}the mesh has no axis "
        f"'modle' {axes}.",
        f"  - 'down.kernel': shape (16, 8) by P('modle', 'mdoel') {where}the mesh has no axis "
        f"'mdoel' {axes}.",
    ]


@pytest.mark.parametrize("axis_type", AXES)
def test_eval_shape_on_a_mesh_passes_keyword_arguments_on(axis_type):
    mesh = mesh_of(axis_type=axis_type)
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
    out = tt.eval_shape(lambda *, x, scale: x * scale, x=x, scale=np.float32(2))
    assert (out.shape, out.dtype) == ((8, 16), jnp.float32)
    assert same(out.sharding, x.sharding, 2) and out.sharding.mesh == mesh


def test_eval_shape_under_a_default_platform_places_on_that_platforms_first_device(monkeypatch):
    """``jax.default_device("cpu")`` on a machine whose default backend is an accelerator:
    the results go to the CPU, the platform named, not to the default backend's first
    device. (Here JAX has the CPU backend only: jax.local_devices is made to answer for an
    accelerator as the default backend, whose first device stands in for the accelerator's.)"""
    local = jax.local_devices
    accelerator = jax.devices("cpu")[5]

    def local_devices(process_index=None, backend=None, host_id=None):
        return local(process_index, backend, host_id) if backend else [accelerator]

    monkeypatch.setattr(jax, "local_devices", local_devices)
    with jax.default_device("cpu"):
        out = tt.eval_shape(lambda: jnp.zeros(3))
    assert out.sharding == SingleDeviceSharding(jax.devices("cpu")[0])
    assert tt.eval_shape(lambda: jnp.zeros(3)).sharding == SingleDeviceSharding(accelerator)


def test_eval_shape_keeps_a_mesh_the_function_makes_itself_devices_and_all():
    """A factory that shards onto a mesh of its own: ``jax.eval_shape`` keeps only the
    mesh's axis sizes (an AbstractMesh, no devices to load onto); ``tt.eval_shape`` gives
    each leaf the sharding the concrete model has, the mesh's device order included, and
    leaves a result no one placed on the default device."""
    devices = np.array(jax.devices("cpu")[::-1]).reshape(2, 4)  # not jax.devices()'s order
    rules = {"encoder.*.up.kernel": (None, "model"), "embed.embedding": ("data", None)}

    def make():
        mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        return {"net": tt.shard(Net(rngs=nn.Rngs(0)), rules, mesh), "step": jnp.zeros(())}

    forgotten = jax.eval_shape(make)["net"].embed.embedding.sharding.mesh
    assert isinstance(forgotten, jax.sharding.AbstractMesh)
    concrete, abstract = make(), tt.eval_shape(make)
    for made, kept in zip(jax.tree.leaves(concrete), jax.tree.leaves(abstract), strict=True):
        assert isinstance(kept, jax.ShapeDtypeStruct) and kept.shape == made.shape
        assert same(kept.sharding, made.sharding, made.ndim)
        assert kept.sharding.devices_indices_map(kept.shape) == made.sharding.devices_indices_map(
            made.shape
        )
    assert abstract["net"].encoder[1].up.kernel.sharding.spec == P(None, "model")
    assert abstract["step"].sharding == SingleDeviceSharding(jax.devices()[0])


def test_eval_shape_of_a_model_it_closes_over_keeps_that_model_s_mesh():
    """``tt.eval_shape(lambda: model)`` of a model already on a mesh with Explicit axes
    (a scalar among its leaves, which lowering the function outside that mesh refuses):
    each leaf keeps the concrete sharding the model's own leaf has."""
    devices = np.array(jax.devices("cpu")[::-1])  # not jax.devices()'s order
    mesh = jax.sharding.Mesh(devices, ("x",), axis_types=(AxisType.Explicit,))
    model = {
        "net": tt.shard(Net(rngs=nn.Rngs(0)), {"encoder.*.up.kernel": (None, "x")}, mesh),
        "scale": jax.device_put(jnp.ones(()), NamedSharding(mesh, P())),
    }
    abstract = tt.eval_shape(lambda: model)
    for made, kept in zip(jax.tree.leaves(model), jax.tree.leaves(abstract), strict=True):
        assert isinstance(kept, jax.ShapeDtypeStruct) and kept.shape == made.shape
        assert same(kept.sharding, made.sharding, made.ndim)
        assert kept.sharding.mesh == mesh


ODD = [0x7F92, 0xFF81, 0x0003, 0x8001, 0x4052, 0x7FC0, 0x3F80, 0xC000]  # payloads, subnormals


@pytest.mark.parametrize("axis_type", AXES)
@pytest.mark.parametrize("move", ["shard", "load_state_dict"])
def test_a_reshard_keeps_every_bit_of_bfloat16(move, axis_type):
    """A bfloat16 array moved from one mesh to another keeps its NaNs' payloads and its
    subnormals: the reshard's program on the CPU would make each NaN canonical (0x7fc0),
    so such floats move as their bits."""
    bits = np.array(ODD, np.uint16)
    here = mesh_of(axis_type=axis_type)
    there = jax.make_mesh((8,), ("x",), axis_types=(axis_type,), devices=jax.devices("cpu")[::-1])
    source = jax.device_put(bits.view(jnp.bfloat16), NamedSharding(here, P("data")))
    if move == "shard":
        out = tt.shard({"w": source}, {"w": P()}, there)["w"]
    else:
        model = {"w": jax.device_put(jnp.zeros(8, jnp.bfloat16), NamedSharding(there, P()))}
        out = tt.load_state_dict(model, {"w": source})["w"]
    assert out.sharding == NamedSharding(there, P())
    assert np.asarray(out).view(np.uint16).tolist() == ODD
