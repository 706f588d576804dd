"""Invariant 7: loading works the same inside ``jax.jit``, and gradients flow through a load."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from .budget import examples
from .checks import (
    assert_same_leaf,
    dtype_of,
    flatten_by_path,
    kind_of,
    named_leaves,
    nest,
    same_values,
)
from .selections import flat_selections, replacements
from .strategies import models

# JIT arguments must be arrays, on devices compatible with the model's (or uncommitted). Wider
# ints only go into 32-bit ints: narrowing into int8 or uint8 needs a range check that a load
# refuses to skip inside jit (a StateDictError says so), and JAX turns 64-bit arguments into
# 32-bit ones.
ARRAY_FORMS = ("jax, same placement", "jax, default device", "numpy")
WIDER_FORMS = (*ARRAY_FORMS, "numpy, wider dtype")


@settings(max_examples=examples(40))
@given(data=st.data())
def test_loading_inside_jit_equals_loading_outside(platform, data):
    """``jax.jit(lambda m, s: m.load_state_dict(s))(m, s)`` equals ``m.load_state_dict(s)``
    leaf for leaf (tree structure, dtypes, bits; the shardings of jit's outputs are the
    compiler's choice), nested or flat, for a partial state of new values given as JAX or
    NumPy arrays (JIT arguments must be arrays).

    Seen to catch (`property_tests/mutants.py`): a load that skips the cast to the leaf's
    dtype for traced values (``no_cast_in_jit``: a float32 value then stays float32 in a
    bfloat16 leaf inside jit only).
    """
    devices = jax.devices(platform)
    model = data.draw(models(devices), label="case").model
    flat = model.flat_state_dict()
    names = data.draw(flat_selections(flat), label="names")
    state = {}
    for name in names:
        dtype = np.dtype(dtype_of(flat[name]))
        narrow = dtype.kind in "iu" and dtype.itemsize < 4
        forms = ARRAY_FORMS if narrow else WIDER_FORMS
        value, _ = data.draw(replacements(flat[name], devices, forms=forms), label=name)
        state[name] = value
    nested = data.draw(st.booleans(), label="nested")
    load = type(model).load_state_dict if nested else type(model).load_flat_state_dict
    state = nest(state) if nested else state
    outside = load(model, state)
    inside = jax.jit(load)(model, state)
    assert jax.tree.structure(inside) == jax.tree.structure(outside)
    for (where, x), (_, y) in zip(named_leaves(inside), named_leaves(outside), strict=True):
        assert_same_leaf(x, y, where, sharding=False)


def loss(model):
    """A function of every floating leaf, weighted by its position among all leaves (so leaves
    can't swap). Python floats count too: a load turns them into arrays."""
    total = jnp.zeros((), jnp.float32)
    for i, x in enumerate(jax.tree.leaves(model)):
        if kind_of(dtype_of(x)) == "floating":
            total = total + (i + 1) * jnp.sum(jnp.square(jnp.asarray(x).astype(jnp.float32)))
    return total


@settings(max_examples=examples(30))
@given(data=st.data())
def test_gradients_through_a_load_equal_those_of_the_model(platform, data):
    """The gradient of ``loss(m.load_state_dict(state))`` with respect to the state, at
    ``state = m.state_dict()`` (nested or flat), equals the gradient of ``loss(m)`` with
    respect to ``m``, read as a state: same names, dtypes and values, eagerly and under jit.

    Seen to catch (`property_tests/mutants.py`): a load that wraps its leaves in
    ``jax.lax.stop_gradient`` (``stop_gradient``); a load that puts the leaves back in the
    string order of their names (``permuted``).
    """
    case = data.draw(models(jax.devices(platform)), label="case")
    model = case.model
    nested = data.draw(st.booleans(), label="nested")
    state = model.state_dict() if nested else model.flat_state_dict()
    params, rest = eqx.partition(state, eqx.is_inexact_array)

    def through_load(params):
        loaded_state = eqx.combine(params, rest)
        if nested:
            return loss(model.load_state_dict(loaded_state))
        return loss(model.load_flat_state_dict(loaded_state))

    model_params, model_rest = eqx.partition(model, eqx.is_inexact_array)
    with case.placement.ambient():  # gradients of explicitly sharded arrays need the mesh
        want = jax.grad(lambda p: loss(eqx.combine(p, model_rest)))(model_params)
        eager, jitted = jax.grad(through_load)(params), jax.jit(jax.grad(through_load))(params)
    want = want.flat_state_dict()
    for grads in (eager, jitted):
        got = flatten_by_path(grads) if nested else grads  # JAX returns dicts in sorted order
        got = {name: g for name, g in got.items() if g is not None}
        assert sorted(got) == sorted(want)
        for name, g in got.items():
            assert same_values(g, want[name]), f"{name}: {g} != {want[name]}"
