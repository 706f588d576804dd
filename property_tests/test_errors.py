"""Invariant 6: strict loads fail exactly when a leaf is missing; unknown keys and bad values
always fail, all listed in one StateDictError; a failed load changes nothing."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import taktiny as tt

from .budget import examples
from .checks import assert_same_model, identities, nest
from .selections import (
    FORMS,
    bad_values,
    flat_problem_kind,
    flat_renamings,
    flat_selections,
    nested_renamings,
    replacements,
    walk_nested,
)
from .strategies import Scaled, models

JIT_FORMS = ("jax, same placement", "jax, default device", "numpy")  # jit takes arrays


def _at(nested, name):
    """What the nested state holds at the flat `name` (None where it holds nothing)."""
    for key in name.split("."):
        if not isinstance(nested, dict) or key not in nested:
            return None
        nested = nested[key]
    return nested


def load(model, state, *, nested, strict):
    if nested:
        return model.load_state_dict(state, strict=strict)
    return model.load_flat_state_dict(state, strict=strict)


@settings(max_examples=examples(100))
@given(data=st.data())
def test_strict_load_fails_exactly_when_a_leaf_is_missing(platform, data):
    """With ``strict=True`` a load of some of a module's leaves (nested or flat) fails exactly
    when one is not supplied, and the error lists exactly the names not supplied, in module
    order, and nothing else; a load of all of them succeeds. The module is unchanged.

    Seen to catch (`property_tests/mutants.py`): an error that lists only its first problem
    (``first_problem_only``); nested loads that ignore ``strict`` (``strict_ignored_nested``).
    """
    model = data.draw(models(jax.devices(platform)), label="case").model
    flat = model.flat_state_dict()
    nested = data.draw(st.booleans(), label="nested")
    names = data.draw(flat_selections(flat), label="names")
    state = {name: flat[name] for name in names}
    state = nest(state) if nested else state
    missing = tuple(name for name in flat if name not in names)
    before = identities(model)
    if missing:
        with pytest.raises(tt.StateDictError, match=r"missing: strict=True requires every") as info:
            load(model, state, nested=nested, strict=True)
        assert info.value.missing_keys == missing
        assert [p.kind for p in info.value.problems] == ["missing"] * len(missing)
    else:
        assert_same_model(load(model, state, nested=nested, strict=True), model)
    assert identities(model) == before


@settings(max_examples=examples(120))
@given(data=st.data())
def test_unknown_keys_always_fail_and_are_all_listed(platform, data):
    """A state with one to three keys the module has not got (typos, prefixes, suffixes, parent
    names, changed indices, keys with ".", int keys, empty keys), beside valid ones, fails with
    one StateDictError that lists every such key by its flat name, in order, with the right kind
    (unknown, or structure for a flat name of a group or of something inside one array), plus,
    under strict, exactly the missing names. The module and the state are unchanged.

    Seen to catch (`property_tests/mutants.py`): a load that drops keys it does not know, as
    PyTorch's ``strict=False`` does (``unknown_ignored``); an error that lists only its first
    problem (``first_problem_only``); nested loads that ignore ``strict``
    (``strict_ignored_nested``). It also found a real
    bug: a non-string key where the module has ``"0"`` was reported as a group given a dict
    (and left out of ``unexpected_keys``), or as "did you mean" the very name given.
    """
    model = data.draw(models(jax.devices(platform)), label="case").model
    flat = model.flat_state_dict()
    names = list(flat)
    nested = data.draw(st.booleans(), label="nested")
    strict = data.draw(st.booleans(), label="strict")
    state = {name: flat[name] for name in data.draw(flat_selections(flat), label="names")}
    count = data.draw(st.integers(1, 3), label="unknown keys")
    if nested:
        state = nest(state)
        for _ in range(count):
            state = data.draw(nested_renamings(state, model.state_dict()), label="renamed")
        supplied, expected = walk_nested(state, names)
    else:
        for _ in range(count):
            state[data.draw(flat_renamings(names), label="unknown")] = np.zeros(2, np.float32)
        supplied = [name for name in state if name in flat]
        expected = [(name, flat_problem_kind(name, names)) for name in state if name not in flat]
        # a custom parameter named whole, by an array of another structure, is given in
        # another representation (a structure problem): its leaves are not also missing
        whole = [name for name in state if isinstance(_at(model.state_dict(), name), Scaled)]
        supplied += [n for n in names if any(n.startswith(f"{name}.") for name in whole)]
    before, given_state = identities(model), identities(state)
    with pytest.raises(tt.StateDictError, match=r"problems?; nothing was loaded") as info:
        load(model, state, nested=nested, strict=strict)
    error = info.value
    assert [(p.name, p.kind) for p in error.problems if p.kind != "missing"] == expected
    assert error.unexpected_keys == tuple(n for n, kind in expected if kind != "structure")
    missing = tuple(name for name in names if name not in supplied) if strict else ()
    assert error.missing_keys == missing
    assert all(f"{name!r}: " in str(error) for name, _ in expected)
    assert identities(model) == before and identities(state) == given_state


@settings(max_examples=examples(120))
@given(data=st.data())
def test_bad_values_are_all_listed_and_nothing_is_loaded(platform, data):
    """A state (nested or flat) in which some values are bad (wrong shape, a dtype of another
    kind, an int out of the leaf's range, a string, None, an object, an abstract array, a dict
    where an array belongs) beside good ones fails with one StateDictError listing exactly the
    bad names with the right kind of problem; the module and the state are unchanged. Inside
    ``jax.jit`` (arrays only) the same problems are found.

    Seen to catch (`property_tests/mutants.py`): a load that writes the good values into the
    module before raising (``half_applied``); an error that lists only its first problem
    (``first_problem_only``); a cast between ints without the range check
    (``no_range_check``); a shape check that lets 2-D values through (``no_shape_check``).
    """
    devices = jax.devices(platform)
    model = data.draw(models(devices, min_leaves=1), label="case").model
    flat = model.flat_state_dict()
    nested = data.draw(st.booleans(), label="nested")
    traced = data.draw(st.booleans(), label="inside jax.jit")
    names = data.draw(flat_selections(flat), label="names") or list(flat)
    bad = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True), label="bad")
    values = {name: data.draw(bad_values(flat[name], traced), label=name) for name in bad}
    forms = JIT_FORMS if traced else FORMS
    state = {  # new good values, so that a load that applies them before raising shows
        name: values[name][0]
        if name in values
        else data.draw(replacements(flat[name], devices, forms=forms))[0]
        for name in names
    }
    state = nest(state) if nested else state
    before, given_state = identities(model), identities(state)
    loader = lambda m, s: load(m, s, nested=nested, strict=False)
    with pytest.raises(tt.StateDictError, match=r"problems?; nothing was loaded") as info:
        (jax.jit(loader) if traced else loader)(model, state)
    got = {p.name: p.kind for p in info.value.problems}
    assert len(got) == len(info.value.problems)
    assert got == {name: kind for name, (_, kind) in values.items()}
    assert identities(model) == before and identities(state) == given_state
