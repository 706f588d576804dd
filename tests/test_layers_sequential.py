"""Sequential with functions, keys handed on to the layers that take them, slicing, reprs."""

import functools
import operator

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


class Scale:
    """A callable object: no ``__qualname__`` or ``__name__`` of its own, only a repr."""

    def __init__(self, factor):
        self.factor = factor

    def __call__(self, x):
        return x * self.factor

    def __repr__(self):
        return f"Scale({self.factor})"

    @staticmethod
    def halve(x):
        return x / 2


@pytest.mark.parametrize(
    "fn, name",
    [
        (Scale.halve, "Scale.halve"),  # the qualified name, not just "halve"
        (jnp.negative, "negative"),  # a jax ufunc has a __name__ but no __qualname__
        (Scale(2.0), "Scale(2.0)"),  # neither: the object's repr
        (functools.partial(operator.mul, 2.0), "partial(mul, 2.0)"),  # positional: repr'd
        (functools.partial(Scale.halve), "partial(Scale.halve)"),
        (functools.partial(Scale(3), x="a"), "partial(Scale(3), x='a')"),
    ],
)
def test_a_lambda_is_named_by_its_function(fn, name):
    """A Lambda's repr names its function: the qualified name, else ``__name__``, else the
    function object's repr; a partial shows its function and its arguments' reprs."""
    assert repr(nn.Lambda(fn)) == f"Lambda({name})"
    assert repr(nn.Sequential(fn)) == f"Sequential(layers=(Lambda({name}),))"


def test_a_key_is_split_among_the_layers_that_take_one():
    seq = nn.Sequential(nn.Dropout(0.5), jnp.negative, nn.Dropout(0.5))
    x, key = jnp.ones((64,)), jax.random.key(0)
    first, _, third = jax.random.split(key, 3)
    expected = seq[2](-seq[0](x, key=first), key=third)
    np.testing.assert_array_equal(seq(x, key=key), expected)
    np.testing.assert_array_equal(jax.jit(lambda s, x, k: s(x, key=k))(seq, x, key), expected)
    np.testing.assert_array_equal(seq(x), -x)  # no key: no dropout


class KeyEcho(nn.Module):
    """A layer of one's own that returns the key it was called with (its own default when
    it got none)."""

    def __call__(self, x, *, key="its own default"):
        return key


def test_without_a_key_no_layer_is_given_one():
    """``seq(x)`` calls a key-taking layer without ``key=`` (its default applies, not
    ``key=None``); ``seq(x, key=key)`` gives it its share of the split."""
    assert nn.Sequential(KeyEcho())(jnp.ones(2)) == "its own default"
    key = jax.random.key(4)
    echoed = nn.Sequential(jnp.negative, KeyEcho())(jnp.ones(2), key=key)
    np.testing.assert_array_equal(
        jax.random.key_data(echoed), jax.random.key_data(jax.random.split(key, 2)[1])
    )


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
