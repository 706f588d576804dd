"""Invariant 9: loading onto a module whose arrays live elsewhere reshards, values unchanged;
and the sharding API: ``tt.shard`` and ``tt.sharding_plan`` by ordered rules, host values loading
onto sharded leaves, and ``tt.eval_shape`` of an optimizer's init on an abstract sharded model.

(Every other property already runs on sharded modules: models are drawn mostly on a mesh of
shape (8,), (2, 4) or (4, 2), with a random PartitionSpec per array, and those properties check
that each leaf keeps its sharding; a partial load keeps every leaf it is not given as the very
object it was, so with its placement: `test_partial`.)
"""

import contextlib

import jax
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

import taktiny as tt

from .arrays import arrays, mesh_placements, partition_specs, shapes
from .budget import examples
from .checks import assert_same_leaf, dtype_of, identities, named_leaves, nest
from .rules import as_spec, first_rules, fits, placing_rules, rule_lists
from .strategies import Scaled, models, replaced, revalued


@settings(max_examples=examples(100))
@given(data=st.data())
def test_loading_onto_another_placement_reshards_with_equal_values(platform, data):
    """Loading ``m``'s state (nested or flat, strict) into a module ``t`` of the same structure
    whose arrays hold other values on another mesh, PartitionSpec or device gives ``m``'s
    values bit for bit, each on the sharding of the ``t`` leaf it replaces, with or without
    ``jax.set_mesh`` of ``t``'s mesh around the load; neither module changes.

    Seen to catch (`property_tests/mutants.py`): a load that keeps a value's own sharding when
    its shape and dtype match the leaf's (``keep_value_sharding``); a load that places every
    leaf on the default device (``drop_sharding``); a load that skips the elements of lists and
    tuples (``lists_ignored``). It also found a real defect: loading a zero-size array from a
    mesh of another device order gave a broken leaf (a JAX 0.10 bug, worked around in load).
    """
    devices = jax.devices(platform)
    model = data.draw(models(devices), label="case").model
    target, placement = data.draw(replaced(data.draw(revalued(model)), devices), label="target")
    nested = data.draw(st.booleans(), label="nested")
    ambient = data.draw(st.booleans(), label="under jax.set_mesh")
    before, target_before = identities(model), identities(target)
    with placement.ambient() if ambient else contextlib.nullcontext():
        if nested:
            loaded = target.load_state_dict(model.state_dict(), strict=True)
        else:
            loaded = target.load_flat_state_dict(model.flat_state_dict(), strict=True)
    want, placed = model.flat_state_dict(), target.flat_state_dict()
    for name, value in loaded.flat_state_dict().items():
        assert_same_leaf(value, want[name], name, sharding=False)
        if isinstance(placed[name], jax.Array):
            # placed alike (P("x") is P("x", None)): a value already so placed is kept
            alike = value.sharding.is_equivalent_to(placed[name].sharding, value.ndim)
            assert alike, f"{name}: {value.sharding}"
    assert identities(model) == before and identities(target) == target_before


def parameters(model):
    """Each leaf of a custom parameter (`Scaled`) by its flat name: the parameter's name, the
    leaf's shape and the parameter's (a value without a shape: ``()``)."""
    out = {}

    def walk(node, prefix):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, name + ".")
            elif isinstance(value, Scaled):
                for part in ("value", "scale"):
                    out[f"{name}.{part}"] = (name, np.shape(getattr(value, part)), ())

    walk(model.state_dict(), "")
    return out


def assert_whole_shards(x, where):
    """Every shard of `x` has the shape its sharding gives it: JAX 0.10 can make a misshapen
    one (a zero-size array moved between meshes of other device orders) that only reading it
    back reveals, and `checks.host` does not read zero-size arrays back."""
    shapes = {shard.data.shape for shard in x.addressable_shards}
    assert shapes == {x.sharding.shard_shape(x.shape)}, f"{where}: shards of shapes {shapes}"


@settings(max_examples=examples(80))
@given(data=st.data())
def test_shard_places_each_leaf_by_its_first_matching_rule(platform, data):
    """``tt.shard(tree, rules, mesh)``, for random ordered rules made from the module's names
    (``*``, ``?``, ``**``, exact names, patterns matching nothing; given as a list or a dict,
    each spec a PartitionSpec or a tuple) on a random mesh, of a module or of its abstract
    form (``jax.eval_shape``), gives every leaf exactly ``NamedSharding(mesh, spec)`` of the
    first rule matching its flat name, replicated when none does, with its values bit for
    bit (a ``ShapeDtypeStruct`` of its shape and dtype for an abstract leaf) and whole shards;
    ``tt.sharding_plan`` gives the same specs, and as ``unmatched`` exactly the names no rule
    matches, as a brute-force match by parts (`property_tests.rules`) finds them. A spec that
    cannot place some leaf it is the first match of, a rule that is no name's first match
    (always), or, with ``strict=True``, an unmatched name raises one ValueError naming
    exactly those leaves and rules. The input is never changed.

    Seen to catch (`property_tests/mutants.py`): a plan that takes the last matching rule
    instead of the first (``last_rule_wins``).
    """
    devices = jax.devices(platform)
    model = data.draw(models(devices), label="case").model
    mesh = data.draw(mesh_placements(devices), label="mesh").mesh
    flat = model.flat_state_dict()
    if data.draw(st.booleans(), label="a rule for every name"):
        rules = data.draw(placing_rules(flat, mesh, every=True), label="rules")
    else:
        rules = data.draw(rule_lists(flat, mesh), label="rules")
    if len({pattern for pattern, _ in rules}) == len(rules) and data.draw(st.booleans()):
        rules = dict(rules)
    pairs = list(rules.items()) if isinstance(rules, dict) else rules
    abstract = data.draw(st.booleans(), label="abstract")
    strict = data.draw(st.booleans(), label="strict")
    tree = jax.eval_shape(lambda: model) if abstract else model
    specs, unmatched, unused = first_rules(pairs, list(flat), parameters(model))
    bad = [name for name, spec in specs.items() if not fits(spec, np.shape(flat[name]), mesh)]
    before, tree_before = identities(model), identities(tree)

    if bad or unused or (strict and unmatched):
        with pytest.raises(tt.SelectionError) as info:
            tt.shard(tree, rules, mesh, strict=strict)
        problems = info.value.problems  # (all of them: the message shows the first 20)
        named = {p.name for p in problems if p.kind == "sharding"}
        assert named == set(bad), problems
        listed = [p.name for p in problems if p.kind == "missing"]
        assert listed == (unmatched if strict else [])
        said = [p.name for p in problems if p.kind == "unmatched"]
        assert said == unused, problems
        assert all(str(p) == f"{p.name!r}: {p.hint}" for p in problems)
        assert identities(model) == before and identities(tree) == tree_before
        return

    plan = tt.sharding_plan(tree, rules, mesh, strict=strict)
    assert plan.specs == specs and list(plan.specs) == list(flat)
    assert plan.unmatched == tuple(unmatched)
    placed = tt.shard(tree, rules, mesh, strict=strict)
    assert type(placed) is type(tree)
    assert jax.tree.structure(placed) == jax.tree.structure(tree)
    assert jax.tree.structure(plan.shardings) == jax.tree.structure(tree)
    for (name, x), sharding in zip(
        placed.flat_state_dict().items(), jax.tree.leaves(plan.shardings), strict=True
    ):
        want = NamedSharding(mesh, specs[name])
        assert x.sharding == want == sharding, f"{name}: {x.sharding}, wanted {want}"
        if abstract:
            assert isinstance(x, jax.ShapeDtypeStruct), f"{name}: {type(x).__name__}"
            assert (x.shape, x.dtype) == (np.shape(flat[name]), dtype_of(flat[name])), name
        else:
            assert isinstance(x, jax.Array), f"{name}: {type(x).__name__}"
            assert_same_leaf(x, flat[name], name, sharding=False)
            assert_whole_shards(x, name)
    assert identities(model) == before and identities(tree) == tree_before


@settings(max_examples=examples(30))
@given(data=st.data())
def test_shard_moves_arrays_between_meshes_of_any_device_order(platform, data):
    """``tt.shard`` of arrays placed on one mesh onto another (each mesh of any shape and
    device order, Explicit or Auto axes; every other array zero-size beside axes a mesh can
    split, which the models of the other properties draw too rarely to meet this case) gives
    each array its rule's sharding, its values bit for bit, and whole shards.

    Written for a real bug, which it catches: a zero-size array on a mesh of another device
    order came out of ``tt.shard`` in misshapen shards, so that reading it back raised (its
    ``jax.device_put`` meets the JAX 0.10 bug that loads work around by placing a zero-size
    value afresh from the host).
    """
    devices = jax.devices(platform)
    source = data.draw(mesh_placements(devices), label="from").mesh
    target = data.draw(mesh_placements(devices), label="to").mesh
    tree = {}
    for name in "abcd"[: data.draw(st.integers(1, 4), label="arrays")]:
        if data.draw(st.booleans(), label=f"{name} zero-size"):  # beside axes a mesh can split
            shape = data.draw(st.lists(st.sampled_from((2, 4, 8)), min_size=1, max_size=2))
            shape.insert(data.draw(st.integers(0, len(shape))), 0)
        else:
            shape = list(data.draw(shapes(allow_empty=False), label=f"{name} shape"))
        spec = data.draw(partition_specs(source, tuple(shape)), label=f"{name} spec")
        host = data.draw(arrays(None, shape=tuple(shape)), label=name)
        tree[name] = jax.device_put(host, NamedSharding(source, spec))
    rules = data.draw(placing_rules(tree, target, every=True), label="rules")
    before = identities(tree)
    placed = tt.shard(tree, rules, target)
    for pattern, spec in rules:
        x = placed[pattern]
        assert x.sharding == NamedSharding(target, as_spec(spec)), f"{pattern}: {x.sharding}"
        assert_same_leaf(x, tree[pattern], pattern, sharding=False)
        assert_whole_shards(x, pattern)
    assert identities(tree) == before


@settings(max_examples=examples(50))
@given(data=st.data())
def test_host_values_load_onto_the_shardings_of_the_leaves_they_replace(platform, data):
    """Loading NumPy arrays (host data with no placement of its own, as a NumPy or
    safetensors file gives it; nested or flat, strict) into a module whose arrays are sharded
    (as drawn, or placed by ``tt.shard`` with random rules on another mesh) or into its
    abstract form placed by ``tt.shard``, with or without ``jax.set_mesh`` of the mesh around
    the load, gives each leaf the host values bit for bit, as a ``jax.Array`` with the dtype
    and the sharding of the leaf it replaces, in whole shards; the module is not changed.

    Seen to catch (`property_tests/mutants.py`): a load that places every leaf on the default
    device (``drop_sharding``).
    """
    devices = jax.devices(platform)
    case = data.draw(models(devices), label="case")
    model, placement = case.model, case.placement
    how = data.draw(st.sampled_from(("as drawn", "tt.shard", "abstract")), label="target")
    if how != "as drawn":
        placement = data.draw(mesh_placements(devices), label="mesh")
        rules = data.draw(placing_rules(model.flat_state_dict(), placement.mesh), label="rules")
        base = jax.eval_shape(lambda: model) if how == "abstract" else model
        model = tt.shard(base, rules, placement.mesh)
    flat = model.flat_state_dict()
    host = {
        name: data.draw(arrays(None, shape=np.shape(x), dtype=dtype_of(x)), label=name)
        for name, x in flat.items()
    }
    nested = data.draw(st.booleans(), label="nested")
    ambient = data.draw(st.booleans(), label="under jax.set_mesh")
    before = identities(model)
    with placement.ambient() if ambient else contextlib.nullcontext():
        if nested:
            loaded = model.load_state_dict(nest(host), strict=True)
        else:
            loaded = model.load_flat_state_dict(host, strict=True)
    for name, x in loaded.flat_state_dict().items():
        assert isinstance(x, jax.Array), f"{name}: loaded as {type(x).__name__}"
        assert_same_leaf(x, host[name], name, sharding=False)
        old = flat[name]
        if isinstance(old, jax.Array | jax.ShapeDtypeStruct):
            assert x.sharding == old.sharding, f"{name}: {x.sharding} != {old.sharding}"
        assert_whole_shards(x, name)
    assert identities(model) == before


@settings(max_examples=examples(40))
@given(data=st.data())
def test_optimizer_state_of_an_abstract_sharded_model_is_sharded_like_its_parameters(
    platform, data
):
    """``tt.eval_shape(optimizer.init, abstract)``, for a module's abstract form placed by
    ``tt.shard`` with random rules on a mesh of ``Explicit`` or ``Auto`` axes (where plain
    ``jax.eval_shape`` drops shardings), gives ``optax.adam``'s two moments and ``optax.sgd``'s
    momentum the module's structure with each leaf of its parameter's shape and sharding, and
    every other leaf (the step count) replicated on the mesh: an Orbax target that restores
    every moment where its parameter lives.

    Seen to catch (`property_tests/mutants.py`): a ``tt.eval_shape`` that does not find the
    arguments' mesh, so that every result lands on the default device
    (``eval_shape_ignores_mesh``).
    """
    devices = jax.devices(platform)
    model = data.draw(models(devices, min_leaves=1), label="case").model
    mesh = data.draw(mesh_placements(devices), label="mesh").mesh
    rules = data.draw(placing_rules(model.flat_state_dict(), mesh), label="rules")
    abstract = tt.shard(jax.eval_shape(lambda: model), rules, mesh)
    name = data.draw(st.sampled_from(("adam", "sgd with momentum")), label="optimizer")
    optimizer = optax.adam(1e-3) if name == "adam" else optax.sgd(0.1, momentum=0.9)
    state = tt.eval_shape(optimizer.init, abstract)

    kind = type(abstract)
    found = jax.tree.leaves(state, is_leaf=lambda x: type(x) is kind)
    moments = [x for x in found if type(x) is kind]
    assert len(moments) == (2 if name == "adam" else 1)
    params = named_leaves(abstract)
    for moment in moments:
        assert jax.tree.structure(moment) == jax.tree.structure(abstract)
        for (where, x), (_, p) in zip(named_leaves(moment), params, strict=True):
            assert isinstance(x, jax.ShapeDtypeStruct), f"{where}: {type(x).__name__}"
            assert x.shape == p.shape, f"{where}: {x.shape} != {p.shape}"
            assert same_placement(x.sharding, p.sharding, x.shape), f"{where}: {x.sharding}"
    others = [x for x in found if type(x) is not kind]
    assert others or name != "adam"  # adam's step count
    for x in others:
        replicated = NamedSharding(mesh, PartitionSpec())
        assert same_placement(x.sharding, replicated, x.shape), f"{x}: {x.sharding}"


def same_placement(sharding, want, shape):
    """Whether `sharding` is a NamedSharding on `want`'s mesh placing an array of `shape` as
    `want` does. (``tt.eval_shape`` gives the spec as JAX types hold it, one entry per axis:
    ``P('x', None)`` where the parameter has ``P('x')``, which ``==`` tells apart.)"""
    return (
        isinstance(sharding, NamedSharding)
        and sharding.mesh == want.mesh
        and sharding.is_equivalent_to(want, len(shape))
    )
