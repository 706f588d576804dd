"""Sequential with functions, keys handed on to the layers that take them, slicing, reprs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taktiny import nn


def test_functions_become_lambdas_with_readable_reprs():
    seq = nn.Sequential(
        nn.Linear(2, 3, rngs=nn.Rngs(0)),
        jax.nn.relu,
        functools.partial(jax.nn.gelu, approximate=False),
    )
    assert repr(seq) == (
        "Sequential(\n  layers=(\n    Linear(kernel=f32[2,3], bias=f32[3]),\n    Lambda(relu),\n"
        "    Lambda(partial(gelu, approximate=False))\n  )\n)"
    )
    assert list(seq.flat_state_dict()) == ["layers.0.kernel", "layers.0.bias"]
    np.testing.assert_array_equal(
        seq(jnp.ones(2)), jax.nn.gelu(jax.nn.relu(seq[0](jnp.ones(2))), approximate=False)
    )


def test_a_key_is_split_among_the_layers_that_take_one():
    seq = nn.Sequential(nn.Dropout(0.5), jnp.negative, nn.Dropout(0.5))
    x, key = jnp.ones((64,)), jax.random.key(0)
    first, _, third = jax.random.split(key, 3)
    expected = seq[2](-seq[0](x, key=first), key=third)
    np.testing.assert_array_equal(seq(x, key=key), expected)
    np.testing.assert_array_equal(jax.jit(lambda s, x, k: s(x, key=k))(seq, x, key), expected)
    np.testing.assert_array_equal(seq(x), -x)  # no key: no dropout


def test_attention_in_a_sequential_gets_a_key_too():
    mha = nn.MultiHeadAttention(2, 4, dropout_rate=0.5, rngs=nn.Rngs(0))
    seq = nn.Sequential(mha, jax.nn.relu)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)), jnp.float32)
    key = jax.random.key(1)
    np.testing.assert_array_equal(
        seq(x, key=key), jax.nn.relu(mha(x, key=jax.random.split(key, 2)[0]))
    )
    np.testing.assert_array_equal(seq(x), jax.nn.relu(mha(x)))


def test_slicing_indexing_and_iteration():
    layers = [nn.Linear(2, 2, rngs=nn.Rngs(i)) for i in range(3)]
    seq = nn.Sequential(*layers)
    assert len(seq) == 3 and seq[1] is layers[1] and list(seq) == layers
    tail = seq[1:]
    assert isinstance(tail, nn.Sequential) and tail.layers == tuple(layers[1:])
    assert list(tail.flat_state_dict()) == [
        f"layers.{i}.{p}" for i in (0, 1) for p in ("kernel", "bias")
    ]
    with pytest.raises(IndexError, match="out of range"):
        seq[3]
