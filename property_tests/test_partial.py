"""Invariant 5: a partial load changes exactly the supplied leaves, and nothing else."""

import contextlib
import dataclasses

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from .budget import examples
from .checks import dtype_of, flatten_by_path, identities, same_values
from .selections import flat_selections, nested_selections, replacements
from .strategies import models


def with_values(selection, values, prefix=""):
    """`selection` (a nested state) with each leaf replaced by ``values[flat name]``; a custom
    parameter kept whole gets its parts by their flat names (as arrays: in a custom value a
    Python list would be a node of the tree, not a value)."""

    def part(key, path):
        value = values[f"{prefix}{key}.{jax.tree_util.keystr(path, simple=True, separator='.')}"]
        return np.asarray(value) if isinstance(value, list) else value

    def new(key, value):
        if isinstance(value, dict):
            return with_values(value, values, f"{prefix}{key}.")
        if dataclasses.is_dataclass(value):
            return jax.tree_util.tree_map_with_path(lambda path, _: part(key, path), value)
        return values[f"{prefix}{key}"]

    return {key: new(key, value) for key, value in selection.items()}


@settings(max_examples=examples(150))
@given(data=st.data())
def test_partial_load_changes_exactly_the_supplied_leaves(platform, data):
    """Loading new values for some leaves (a nested or flat selection: whole groups, single
    leaves, empty groups; values as JAX arrays on any device, NumPy arrays, wider dtypes or
    Python lists) returns a module in which exactly those leaves hold the new values, with the
    old leaves' dtypes and shardings, and every other leaf is the very object it was, with or
    without ``jax.set_mesh`` of the module's mesh around the load. Neither the module nor the
    state given is changed.

    Seen to catch (`property_tests/mutants.py`): a load that skips the elements of lists and
    tuples (``lists_ignored``); a load that places every leaf on the default device
    (``drop_sharding``); a load that keeps a value's own sharding when its shape and dtype match
    the leaf's (``keep_value_sharding``).
    """
    devices = jax.devices(platform)
    case = data.draw(models(devices), label="case")
    model = case.model
    flat = model.flat_state_dict()
    nested = data.draw(st.booleans(), label="nested")
    if nested:
        selection = data.draw(nested_selections(model.state_dict()), label="selection")
        names = list(flatten_by_path(selection))
    else:
        names = data.draw(flat_selections(flat), label="names")
    new = {name: data.draw(replacements(flat[name], devices), label=name) for name in names}
    values = {name: value for name, (value, _) in new.items()}
    state = with_values(selection, values) if nested else values
    ambient = data.draw(st.booleans(), label="under jax.set_mesh")
    before, given_state = identities(model), identities(state)

    with case.placement.ambient() if ambient else contextlib.nullcontext():
        loaded = model.load_state_dict(state) if nested else model.load_flat_state_dict(state)

    assert identities(model) == before and identities(state) == given_state
    assert jax.tree.structure(loaded) == jax.tree.structure(model)
    result = loaded.flat_state_dict()
    assert list(result) == list(flat)
    for name, old in flat.items():
        got = result[name]
        if name not in new:
            assert got is old, f"{name}: not supplied, but replaced"
            continue
        assert isinstance(got, jax.Array), f"{name}: loaded as {type(got).__name__}"
        assert dtype_of(got) == dtype_of(old), f"{name}: {got.dtype} != {dtype_of(old)}"
        assert same_values(got, new[name][1]), f"{name}: {got} != {new[name][1]}"
        if isinstance(old, jax.Array):
            assert got.sharding == old.sharding, f"{name}: {got.sharding} != {old.sharding}"
