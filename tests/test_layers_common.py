"""What every layer shares: named scopes, the dtype rule, jit/grad, init draws, reprs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taktiny import nn
from taktiny.nn import _random


def rngs():
    return nn.Rngs(0)


# name -> (factory taking a dtype, input shape, call keyword arguments)
LAYERS = {
    "Linear": (lambda dtype: nn.Linear(4, 3, dtype=dtype, rngs=rngs()), (2, 4), {}),
    "LayerNorm": (lambda dtype: nn.LayerNorm(4, dtype=dtype), (2, 4), {}),
    "RMSNorm": (lambda dtype: nn.RMSNorm(4, dtype=dtype), (2, 4), {}),
    "Conv": (lambda dtype: nn.Conv(4, 3, (3,), dtype=dtype, rngs=rngs()), (2, 5, 4), {}),
    "ConvTranspose": (
        lambda dtype: nn.ConvTranspose(4, 3, (3,), strides=2, dtype=dtype, rngs=rngs()),
        (2, 5, 4),
        {},
    ),
    "BatchNorm": (lambda dtype: nn.BatchNorm(4, dtype=dtype), (2, 4), {}),
    "MultiHeadAttention": (
        lambda dtype: nn.MultiHeadAttention(2, 4, dtype=dtype, rngs=rngs()),
        (2, 5, 4),
        {"causal": True},
    ),
}


@pytest.mark.parametrize("name", LAYERS)
def test_layers_compute_in_their_parameters_dtype(name):
    factory, shape, kwargs = LAYERS[name]
    layer = factory(jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(layer)} == {jnp.dtype(jnp.bfloat16)}
    assert layer(jnp.ones(shape, jnp.float32), **kwargs).dtype == jnp.bfloat16
    layer = factory(jnp.float32)
    assert layer(jnp.ones(shape, jnp.bfloat16), **kwargs).dtype == jnp.float32


@pytest.mark.parametrize("name", [*LAYERS, "Embed", "Dropout", "Sequential"])
def test_every_call_runs_in_a_named_scope(name):
    if name == "Embed":
        layer, x, kwargs = nn.Embed(5, 4, rngs=rngs()), jnp.arange(3), {}
    elif name == "Dropout":
        layer, x, kwargs = nn.Dropout(0.5), jnp.ones((2, 4)), {"key": jax.random.key(0)}
    elif name == "Sequential":
        layer, x, kwargs = nn.Sequential(nn.LayerNorm(4), jax.nn.relu), jnp.ones((2, 4)), {}
    else:
        factory, shape, kwargs = LAYERS[name]
        layer, x = factory(jnp.float32), jnp.ones(shape)
    jaxpr = jax.make_jaxpr(lambda layer, x: layer(x, **kwargs))(layer, x).jaxpr
    stacks = {str(eqn.source_info.name_stack) for eqn in jaxpr.eqns}
    assert stacks and all(stack.startswith(name) for stack in stacks), stacks


def test_sequential_nests_its_layers_scopes_in_its_own():
    """Each layer of a Sequential, a wrapped function too, keeps its own scope inside it."""
    seq = nn.Sequential(nn.LayerNorm(4), jax.nn.relu)
    jaxpr = jax.make_jaxpr(lambda seq, x: seq(x))(seq, jnp.ones((2, 4))).jaxpr
    stacks = {str(e.source_info.name_stack) for e in jaxpr.eqns}
    assert stacks == {"Sequential/LayerNorm", "Sequential/Lambda"}


def test_attend_has_its_own_scope():
    embed = nn.Embed(5, 4, rngs=rngs())
    jaxpr = jax.make_jaxpr(embed.attend)(jnp.ones((2, 4))).jaxpr
    assert {str(e.source_info.name_stack) for e in jaxpr.eqns} == {"Embed.attend"}


@pytest.mark.parametrize("name", LAYERS)
def test_layers_jit_and_differentiate(name):
    factory, shape, kwargs = LAYERS[name]
    layer = factory(jnp.float32)
    x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
    eager = layer(x, **kwargs)
    jitted = jax.jit(lambda layer, x: layer(x, **kwargs))(layer, x)
    np.testing.assert_allclose(jitted, eager, atol=1e-6)
    grads = jax.grad(lambda layer: jnp.sum(layer(x, **kwargs) ** 2))(layer)
    assert type(grads) is type(layer)
    assert jax.tree.structure(grads) == jax.tree.structure(layer)


def test_flat_draws_equal_jax_initializers_on_the_full_shape():
    """A [window, in, out] kernel: fan_in is window * in, and the draws are JAX's own
    (to the rounding of the standard deviation)."""
    shape, key = (3, 2, 4), jax.random.key(3)
    np.testing.assert_allclose(
        _random.lecun_normal(key, shape, jnp.float32),
        jax.nn.initializers.lecun_normal()(key, shape, jnp.float32),
        rtol=1e-6,
    )
    np.testing.assert_array_equal(
        _random.normal(key, shape, jnp.bfloat16, stddev=2.0),
        jax.nn.initializers.normal(2.0)(key, shape, jnp.bfloat16),
    )
    np.testing.assert_array_equal(
        _random.keep_mask(key, 0.3, shape), jax.random.bernoulli(key, 0.7, shape)
    )
    assert math.prod(shape) == _random.keep_mask(key, 0.3, shape).size


def test_reprs_show_parameters_and_configuration():
    assert repr(nn.LayerNorm(4)) == "LayerNorm(scale=f32[4], bias=f32[4], epsilon=1e-06)"
    assert repr(nn.Embed(5, 4, rngs=rngs())) == "Embed(embedding=f32[5,4])"
    assert "strides=(2,)" in repr(nn.Conv(1, 2, (3,), strides=2, rngs=rngs()))


BAD_INPUTS = [  # (the layer, the input): made in the test, not at import
    (
        lambda: nn.Linear(4, 3, rngs=rngs()),
        lambda: jnp.ones((2, 5)),
        ValueError,
        "Linear expects inputs whose last axis has 4 features (its kernel is (4, 3)), got an "
        "input of shape (2, 5).",
    ),
    (
        lambda: nn.Linear(4, 3, rngs=rngs()),
        lambda: jnp.ones(()),
        ValueError,
        "Linear expects inputs whose last axis has 4 features (its kernel is (4, 3)), got an "
        "input of shape ().",
    ),
    (
        lambda: nn.Embed(5, 4, rngs=rngs()),
        lambda: jnp.ones((2, 3)),
        TypeError,
        "Embed expects integer ids, got an array of dtype float32 and shape (2, 3); cast it "
        "first: ids.astype(jnp.int32).",
    ),
    (
        lambda: nn.RMSNorm(4),
        lambda: jnp.ones(()),
        ValueError,
        "RMSNorm expects inputs whose last axis has 4 features (its scale is (4,)), got an "
        "input of shape (). Pass inputs with 4 features on the last axis, or build the layer "
        "for this input (a batch of vectors of 4).",
    ),
    (
        lambda: nn.LayerNorm(4),
        lambda: jnp.ones((3,)),
        ValueError,
        "LayerNorm expects inputs whose last axis has 4 features (its scale is (4,)), got an "
        "input of shape (3,). Pass inputs with 4 features on the last axis, or build the "
        "layer for this input (num_features=3).",
    ),
]


@pytest.mark.parametrize("layer, x, error, message", BAD_INPUTS)
def test_a_bad_input_is_rejected_with_the_layer_and_both_shapes(
    layer, x, error, message, without_type_checks
):
    """An input of the wrong size (or a scalar, or float ids) is an error naming the layer,
    what fixes its size and the input's shape; a scalar cannot be fitted by a constructor
    argument, so the hint asks for a batch of vectors instead."""
    layer = layer()
    with pytest.raises(error) as raised:  # the layer's own check, as users see it
        layer(x())
    assert str(raised.value) == message


@pytest.mark.parametrize("batch", [(), (3,), (3, 2), (2, 3, 5)])
def test_linear_maps_the_last_axis_of_any_batch_shape(batch):
    """Only the last axis must match ``in_features``; any leading axes are batch axes."""
    layer = nn.Linear(4, 3, rngs=rngs())
    layer = layer.load_flat_state_dict({"bias": np.arange(3.0, dtype=np.float32)})
    x = np.random.default_rng(0).normal(size=(*batch, 4))
    expected = x @ np.asarray(layer.kernel, np.float64) + np.arange(3.0)
    np.testing.assert_allclose(layer(jnp.asarray(x, jnp.float32)), expected, atol=1e-5)
