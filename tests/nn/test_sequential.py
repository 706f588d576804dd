"""Sequential with functions, keys handed on to the layers that take them, slicing, reprs."""

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import assert_close, build, channels_last, numpy, randomize_

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


# --- train=: handed on to the layers that take it -----------------------------------------


def _torch_stack():
    """torch's Sequential(Conv2d, BatchNorm2d, ReLU) with random weights and statistics, and
    ours with the same state (a torch momentum of 0.1 is 0.9 here)."""
    reference = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4, momentum=0.1), torch.nn.ReLU()
    )
    randomize_(reference)
    conv, bn = reference[0], reference[1]
    state = {
        "layers.0.kernel": numpy(conv.weight.permute(2, 3, 1, 0)),
        "layers.0.bias": numpy(conv.bias),
        "layers.1.scale": numpy(bn.weight),
        "layers.1.bias": numpy(bn.bias),
        "layers.1.mean": numpy(bn.running_mean),
        "layers.1.var": numpy(bn.running_var),
    }
    ours = build(
        lambda: nn.Sequential(
            nn.Conv(3, 4, 3, dims=2, padding=1, precision="highest", rngs=nn.Rngs(0)),
            nn.BatchNorm(4, momentum=0.9),
            jax.nn.relu,
        ),
        state,
    )
    return reference, ours


def test_train_steps_of_a_sequential_match_torch_train_mode():
    """``seq(x, train=True)`` returns ``(y, new_seq)``: the BatchNorm inside trained on the
    batch's statistics and moved its running statistics, three steps as torch does."""
    reference, seq = _torch_stack()
    reference.train()
    step = jax.jit(lambda seq, x: seq(x, train=True))
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 3, 6, 5, generator=generator) * 2 + 1
        y, new = step(seq, jnp.asarray(channels_last(x)))
        assert_close(y, channels_last(reference(x)))
        assert isinstance(new, nn.Sequential) and new[0] is not seq[0]
        assert_close(new[1].mean, numpy(reference[1].running_mean))
        assert_close(new[1].var, numpy(reference[1].running_var))
        np.testing.assert_array_equal(new[0].kernel, seq[0].kernel)  # the rest unchanged
        seq = new
    reference.eval()  # and then evaluation with the statistics both have tracked
    x = torch.randn(2, 3, 6, 5, generator=generator)
    assert_close(seq(jnp.asarray(channels_last(x)), train=False), channels_last(reference(x)))
    assert_close(seq(jnp.asarray(channels_last(x))), channels_last(reference(x)))


def test_train_false_makes_batch_norm_infer_even_under_train_forward():
    reference, seq = _torch_stack()
    x = torch.randn(4, 3, 6, 5, generator=torch.Generator().manual_seed(1))
    ours = jnp.asarray(channels_last(x))
    y, new = nn.train_forward(seq, ours, train=False)  # train=False wins over the context
    assert_close(y, channels_last(reference.eval()(x)))
    assert new is seq
    y, new = nn.train_forward(seq, ours)  # without train=, the context trains it
    assert_close(y, channels_last(reference.train()(x)))
    assert_close(new[1].mean, numpy(reference[1].running_mean))


def test_train_true_reaches_nested_sequentials_and_goes_with_the_key():
    """A Sequential inside a Sequential takes train= too and hands back its new layers; the
    key is split as without train=."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)) * 2 + 3, jnp.float32)
    inner = nn.Sequential(nn.Dropout(0.5), nn.BatchNorm(4))
    seq = nn.Sequential(jnp.negative, inner)
    key = jax.random.key(0)
    y, new = seq(x, key=key, train=True)
    dropped = inner[0](-x, key=jax.random.split(jax.random.split(key, 2)[1], 2)[0])
    expected, bn = inner[1](dropped, train=True)
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    assert isinstance(new[1], nn.Sequential)
    np.testing.assert_array_equal(new[1][1].mean, bn.mean)
    assert jax.tree.structure(new) == jax.tree.structure(seq)


def test_train_true_without_stateful_layers_returns_the_sequential_itself():
    seq = nn.Sequential(nn.Linear(2, 3, rngs=nn.Rngs(0)), jax.nn.relu)
    y, new = seq(jnp.ones((1, 2)), train=True)
    assert new.layers == seq.layers
    np.testing.assert_array_equal(y, seq(jnp.ones((1, 2))))
    np.testing.assert_array_equal(seq(jnp.ones((1, 2)), train=False), y)


class TrainEcho(nn.Module):
    """A layer of one's own that takes train= and returns it."""

    def __call__(self, x, *, train=None):
        return train


def test_train_is_given_only_when_set_and_a_layer_that_returns_no_pair_is_refused():
    assert nn.Sequential(TrainEcho())(jnp.ones(2)) is None  # its own default
    assert nn.Sequential(TrainEcho())(jnp.ones(2), train=False) is False
    with pytest.raises(TypeError) as raised:
        nn.Sequential(jnp.negative, TrainEcho())(jnp.ones(2), train=True)
    assert str(raised.value) == (
        "Sequential(train=True) calls layers.1 (TrainEcho) with train=True and expects the "
        "pair (y, new_layer) back, as BatchNorm returns; got bool. Return (y, self) from a "
        "layer with no state to update, or call the Sequential without train= "
        "(nn.train_forward collects updates instead)."
    )


class TrainTwice(nn.Module):
    """A layer of one's own that returns a pair, but not (y, new_layer)."""

    def __call__(self, x, *, train=None):
        return x, x


def test_a_layer_that_returns_a_tuple_but_no_new_layer_is_refused_by_its_length():
    with pytest.raises(TypeError) as raised:
        nn.Sequential(TrainTwice())(jnp.ones(2), train=True)
    assert str(raised.value) == (
        "Sequential(train=True) calls layers.0 (TrainTwice) with train=True and expects the "
        "pair (y, new_layer) back, as BatchNorm returns; got a tuple of 2. Return (y, self) "
        "from a layer with no state to update, or call the Sequential without train= "
        "(nn.train_forward collects updates instead)."
    )
