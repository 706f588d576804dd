"""Invariants 3 and 4: a module's own state loads back to an equal module, and the nested and
flat forms of a state describe the same leaves in the same order."""

import jax
from hypothesis import given, settings
from hypothesis import strategies as st

from .budget import examples
from .checks import assert_same_model, flatten_by_path, identities
from .strategies import models


@settings(max_examples=examples(150))
@given(data=st.data())
def test_own_state_loads_back_to_an_equal_module(platform, data):
    """``m.load_state_dict(m.state_dict())`` and ``m.load_flat_state_dict(m.flat_state_dict())``
    equal ``m`` leaf for leaf (same bits, dtypes and shardings, same tree structure), strict or
    not, and ``m`` is unchanged.

    Seen to catch (`property_tests/mutants.py`): a load that places every leaf on the default
    device (``drop_sharding``); a load that puts the leaves back in the string order of their
    names (``permuted``). It also found a real bug: loading into a Python scalar forced into
    the data with ``field(static=False)`` raised AttributeError.
    """
    model = data.draw(models(jax.devices(platform)), label="case").model
    strict = data.draw(st.booleans(), label="strict")
    before = identities(model)
    assert_same_model(model.load_state_dict(model.state_dict(), strict=strict), model)
    assert_same_model(model.load_flat_state_dict(model.flat_state_dict(), strict=strict), model)
    assert identities(model) == before


def _key_name(key):
    """A key path entry as the flat form names it (independent of taktiny's own walk)."""
    for attr in ("name", "idx", "key"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise AssertionError(f"unexpected key {key!r}")


@settings(max_examples=examples(150))
@given(data=st.data())
def test_nested_and_flat_states_describe_the_same_leaves(platform, data):
    """Flattening ``state_dict()`` by path gives exactly ``flat_state_dict()``: the same names
    in the same order, holding the same objects, which are the module's own leaves in flatten
    order, named by attribute, position and dict key; no group in the nested form is empty.

    Seen to catch (`property_tests/mutants.py`): a flat form sorted as strings ("layers.10"
    before "layers.2", ``flat_sorted``); a nested form rebuilt by ``jax.tree.map``, whose dicts
    come back in sorted key order (``nested_sorted``); a nested form of NumPy copies instead of
    the module's own arrays (``state_copies``).
    """
    model = data.draw(models(jax.devices(platform)), label="case").model
    nested, flat = model.state_dict(), model.flat_state_dict()
    by_path = flatten_by_path(nested)
    assert list(by_path) == list(flat)
    assert all(by_path[name] is value for name, value in flat.items())
    path_leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    assert list(flat) == [".".join(_key_name(k) for k in path) for path, _ in path_leaves]
    assert [id(x) for x in flat.values()] == [id(x) for _, x in path_leaves]

    def no_empty_groups(group):
        return all(not isinstance(v, dict) or (v and no_empty_groups(v)) for v in group.values())

    assert no_empty_groups(nested)
