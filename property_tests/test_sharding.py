"""Invariant 9: loading onto a module whose arrays live elsewhere reshards, values unchanged.

(Every other property already runs on sharded modules: models are drawn mostly on a mesh of
shape (8,), (2, 4) or (4, 2), with a random PartitionSpec per array, and those properties check
that each leaf keeps its sharding.)
"""

import contextlib

import jax
from hypothesis import given, settings
from hypothesis import strategies as st

from .budget import examples
from .checks import assert_same_leaf, identities
from .strategies import models, replaced, revalued


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
            assert value.sharding == placed[name].sharding, f"{name}: {value.sharding}"
    assert identities(model) == before and identities(target) == target_before
