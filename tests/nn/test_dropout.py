"""Dropout: identity without a key, inverted dropout with one, as torch.nn.Dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import numpy

from taktiny import nn


def test_without_a_key_it_is_the_identity_as_torch_in_eval_mode():
    values = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    x = jnp.asarray(values)
    reference = torch.nn.Dropout(0.5).eval()
    np.testing.assert_array_equal(numpy(reference(torch.from_numpy(values))), x)
    assert nn.Dropout(0.5)(x) is x


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.8])
def test_with_a_key_it_drops_and_rescales_as_torch_in_train_mode(rate):
    x = np.random.default_rng(0).uniform(1, 2, size=(200, 100)).astype(np.float32)
    ours = np.asarray(nn.Dropout(rate)(jnp.asarray(x), key=jax.random.key(0)))
    torch.manual_seed(0)  # torch's mask comes from its global generator: seeded, not inherited
    theirs = numpy(torch.nn.Dropout(rate).train()(torch.from_numpy(x)))
    for y in (ours, theirs):  # both zero some elements and scale the rest by 1 / (1 - rate)
        kept = y != 0
        assert abs(1 - kept.mean() - rate) < 0.01
        np.testing.assert_allclose(y[kept], x[kept] / (1 - rate), rtol=1e-6)
    assert abs((ours == 0).mean() - (theirs == 0).mean()) < 0.015


def test_the_key_decides_the_mask():
    dropout = nn.Dropout(0.5)
    x = jnp.ones((64,))
    a, b = dropout(x, key=jax.random.key(1)), dropout(x, key=jax.random.key(1))
    c = jax.jit(lambda x, key: dropout(x, key=key))(x, jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert jax.grad(lambda x: dropout(x, key=jax.random.key(1)).sum())(x).shape == (64,)


def test_rates_zero_and_one_and_the_input_dtype():
    x = jnp.ones((3, 4), jnp.bfloat16)
    key = jax.random.key(0)
    assert nn.Dropout(0.0)(x, key=key) is x
    np.testing.assert_array_equal(nn.Dropout(1.0)(x, key=key), np.zeros((3, 4)))
    # rate 1 drops everything, and its gradient is zero, not 0 * (1 / 0) = NaN
    grad = jax.grad(lambda x: nn.Dropout(1.0)(x, key=key).sum())(jnp.ones((3, 4)))
    np.testing.assert_array_equal(grad, np.zeros((3, 4)))
    assert nn.Dropout(0.5)(x, key=key).dtype == jnp.bfloat16
    assert nn.Dropout(0.5).state_dict() == {}
    assert repr(nn.Dropout(0.25)) == "Dropout(rate=0.25)"


@pytest.mark.parametrize("rate", [-0.1, 1.5])
def test_rate_must_be_a_probability(rate):
    with pytest.raises(
        ValueError, match=rf"Dropout's rate is a probability in \[0, 1\], got {rate}"
    ):
        nn.Dropout(rate)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.8])
def test_dropout_is_the_reference_mask_and_rescale(rate):
    # the elements kept are those of jax.random.bernoulli(key, 1 - rate), scaled by
    # 1 / (1 - rate): the expected value of each output is its input
    x = jnp.asarray(np.random.default_rng(0).uniform(1, 2, size=(50, 40)).astype(np.float32))
    key = jax.random.key(3)
    keep = np.asarray(jax.random.bernoulli(key, 1.0 - rate, (x.size,))).reshape(x.shape)
    expected = np.where(keep, np.asarray(x) / np.float32(1 - rate), 0.0)
    np.testing.assert_allclose(nn.Dropout(rate)(x, key=key), expected, rtol=1e-6)
    means = [float(nn.Dropout(rate)(x, key=jax.random.key(i)).mean()) for i in range(20)]
    assert abs(np.mean(means) - float(x.mean())) < 0.02 * float(x.mean())
