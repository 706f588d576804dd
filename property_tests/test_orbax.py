"""Invariant 8: an Orbax checkpoint of a state restores bit for bit onto the target's shardings.

Orbax cannot save zero-size arrays, nor an empty state: the models here have arrays of at
least one element, and at least one array.
"""

import tempfile
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from hypothesis import given, settings
from hypothesis import strategies as st

import taktiny as tt

from .arrays import mesh_placements
from .budget import examples
from .checks import assert_same_leaf, flatten_by_path
from .rules import placing_rules
from .strategies import models, replaced, revalued


def save_and_restore(state, target, directory):
    """`state` saved with StandardCheckpointer and restored with ``target=target``."""
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp).absolute() / "checkpoint"  # Orbax: absolute, and must not exist
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path, state)
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path, target=target)


@settings(max_examples=examples(40))
@given(data=st.data())
def test_orbax_round_trip_is_bitwise_onto_the_targets_shardings(platform, data, tmp_path_factory):
    """Saving ``m.state_dict()`` (or the flat state) with StandardCheckpointer and restoring it
    with ``target=t.state_dict()``, for a module ``t`` of the same structure with other values,
    on the same placement or another one (another mesh, spec or device), gives ``m``'s leaves
    bit for bit, each with the sharding of ``t``'s leaf; ``t.load_state_dict`` of that (strict)
    gives ``m``'s values on ``t``'s shardings.

    Seen to catch (`property_tests/mutants.py`): a load that places every leaf on the default
    device (``drop_sharding``); a load that skips the elements of lists and tuples
    (``lists_ignored``: the strict load of the restored state then fails).
    """
    devices = jax.devices(platform)
    case = data.draw(models(devices, allow_empty=False, min_leaves=1), label="case")
    model = case.model
    target = data.draw(revalued(model), label="target")
    if data.draw(st.booleans(), label="another placement"):
        target, _ = data.draw(replaced(target, devices), label="target")
    nested = data.draw(st.booleans(), label="nested")
    if nested:
        state, target_state = model.state_dict(), target.state_dict()
    else:
        state, target_state = model.flat_state_dict(), target.flat_state_dict()
    restored = save_and_restore(state, target_state, tmp_path_factory.getbasetemp())

    flat_restored = flatten_by_path(restored) if nested else restored
    want, placed = model.flat_state_dict(), target.flat_state_dict()
    assert sorted(flat_restored) == sorted(want)  # Orbax returns dicts in sorted key order
    for name, value in flat_restored.items():
        assert_same_leaf(value, want[name], name, sharding=False)
        if isinstance(placed[name], jax.Array):
            assert value.sharding == placed[name].sharding, name
    load = target.load_state_dict if nested else target.load_flat_state_dict
    loaded = load(restored, strict=True).flat_state_dict()
    for name, value in loaded.items():
        assert_same_leaf(value, want[name], name, sharding=False)
        if isinstance(placed[name], jax.Array):
            assert value.sharding == placed[name].sharding, name


@settings(max_examples=examples(25))
@given(data=st.data())
def test_orbax_restores_onto_an_abstract_target_sharded_on_another_mesh(
    platform, data, tmp_path_factory
):
    """A module's state saved with StandardCheckpointer (nested or flat) and restored with
    the state of an abstract target, ``tt.shard(tt.eval_shape(lambda: m), rules, mesh)`` with
    random rules on a newly drawn mesh (another shape, device order or axis type than ``m``'s
    placement, mostly), gives ``m``'s leaves bit for bit, each with the sharding of the
    target's leaf; loading that into the abstract target (strict), or loading ``m``'s own
    state into it directly, gives ``m``'s values as arrays on those shardings.

    Seen to catch (`property_tests/mutants.py`): a load that places every leaf on the default
    device (``drop_sharding``).
    """
    devices = jax.devices(platform)
    model = data.draw(models(devices, allow_empty=False, min_leaves=1), label="case").model
    mesh = data.draw(mesh_placements(devices), label="target mesh").mesh
    flat = model.flat_state_dict()
    rules = data.draw(placing_rules(flat, mesh), label="rules")
    abstract = tt.shard(tt.eval_shape(lambda: model), rules, mesh)
    placed = abstract.flat_state_dict()
    via_orbax = data.draw(st.booleans(), label="through Orbax")
    nested = data.draw(st.booleans(), label="nested")
    state = model.state_dict() if nested else flat
    if via_orbax:
        target = abstract.state_dict() if nested else placed
        state = save_and_restore(state, target, tmp_path_factory.getbasetemp())
        restored = flatten_by_path(state) if nested else state
        assert sorted(restored) == sorted(flat)
        for name, value in restored.items():
            assert_same_leaf(value, flat[name], name, sharding=False)
            assert value.sharding == placed[name].sharding, f"{name}: {value.sharding}"
    load = abstract.load_state_dict if nested else abstract.load_flat_state_dict
    for name, value in load(state, strict=True).flat_state_dict().items():
        assert isinstance(value, jax.Array), f"{name}: {type(value).__name__}"
        assert_same_leaf(value, flat[name], name, sharding=False)
        assert value.sharding == placed[name].sharding, f"{name}: {value.sharding}"
