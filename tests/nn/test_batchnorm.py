"""BatchNorm against torch.nn.BatchNorm{1,2,3}d: inference, train steps, running statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from _torch import assert_close, build, channels_last, numpy, randomize_

from taktiny import nn
from taktiny.nn._training import record

NAMES = {"weight": "scale", "bias": "bias", "running_mean": "mean", "running_var": "var"}


def convert(reference):
    """Drops num_batches_tracked, which only matters for torch's momentum=None."""
    state = reference.state_dict()
    assert set(state) == {*NAMES, "num_batches_tracked"}
    return {NAMES[name]: numpy(value) for name, value in state.items() if name in NAMES}


# the torch layer and an input [N, C, *spatial] for it
CASES = [
    (torch.nn.BatchNorm1d, (8, 5)),
    (torch.nn.BatchNorm1d, (4, 5, 7)),
    (torch.nn.BatchNorm2d, (3, 5, 4, 6)),
    (torch.nn.BatchNorm3d, (2, 5, 3, 4, 2)),
]


@pytest.mark.parametrize("torch_type, shape", CASES)
def test_inference_uses_the_running_statistics_as_torch_eval(torch_type, shape):
    reference = randomize_(torch_type(5, eps=1e-3))
    bn = build(lambda: nn.BatchNorm(5, epsilon=1e-3), convert(reference))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 2 + 1
    assert_close(bn(jnp.asarray(channels_last(x))), channels_last(reference(x)))


@pytest.mark.parametrize("torch_type, shape", CASES)
def test_train_steps_match_torch_train_mode(torch_type, shape):
    """Three steps, each normalising with batch statistics and updating the running ones;
    a torch momentum of 0.1 is 0.9 here."""
    reference = randomize_(torch_type(5, momentum=0.1)).train()
    bn = build(lambda: nn.BatchNorm(5, momentum=0.9), convert(reference))
    step = jax.jit(lambda bn, x: bn(x, train=True))
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(shape, generator=generator) * 3 - 1
        y, bn = step(bn, jnp.asarray(channels_last(x)))
        assert_close(y, channels_last(reference(x)))
        assert_close(bn.mean, numpy(reference.running_mean))
        assert_close(bn.var, numpy(reference.running_var))  # updated with the unbiased variance


def test_train_returns_a_new_module_and_leaves_the_old_one_alone():
    bn = nn.BatchNorm(3)
    x = jnp.arange(12.0).reshape(4, 3)
    y, new = bn(x, train=True)
    assert isinstance(new, nn.BatchNorm) and new is not bn
    np.testing.assert_array_equal(bn.mean, np.zeros(3))
    np.testing.assert_allclose(new.mean, 0.01 * np.asarray(x.mean(0)), rtol=1e-6)
    np.testing.assert_allclose(new.var, 0.99 + 0.01 * np.asarray(x.var(0, ddof=1)), rtol=1e-6)
    assert new.scale is bn.scale and new.momentum == bn.momentum
    np.testing.assert_allclose(y.mean(0), np.zeros(3), atol=1e-6)
    assert list(new.flat_state_dict()) == ["scale", "bias", "mean", "var"]


def test_a_jitted_train_step_with_optax_learns_and_tracks_statistics(optax_promotion):
    """The documented pattern: the new statistics come out of the loss as auxiliary data."""
    model = nn.Sequential(nn.Linear(4, 8, rngs=nn.Rngs(0)), nn.BatchNorm(8, momentum=0.5))
    optimizer = optax.sgd(0.1)
    x = jax.random.normal(jax.random.key(1), (32, 4)) * 3 + 2
    target = jnp.ones((32, 8))

    @jax.jit
    def train_step(model, opt_state):
        def loss_fn(model):
            h = model.layers[0](x)
            y, bn = model.layers[1](h, train=True)
            return jnp.mean((y - target) ** 2), model.replace(layers=(model.layers[0], bn))

        (loss, model_with_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(model)
        np_zero = jnp.zeros(8)
        # training mode does not read the running statistics: their gradients are zero
        zero_grads = jnp.array_equal(grads.layers[1].mean, np_zero) & jnp.array_equal(
            grads.layers[1].var, np_zero
        )
        updates, opt_state = optimizer.update(grads, opt_state, model_with_stats)
        return optax.apply_updates(model_with_stats, updates), opt_state, loss, zero_grads

    opt_state = optimizer.init(model)
    losses = []
    for _ in range(30):
        model, opt_state, loss, zero_grads = train_step(model, opt_state)
        assert bool(zero_grads)
        losses.append(float(loss))
    assert losses[-1] < losses[0] / 2
    h = model.layers[0](x)
    np.testing.assert_allclose(model.layers[1].mean, h.mean(0), atol=1e-3)  # tracked
    assert not np.allclose(model.layers[1].scale, 1.0)  # and the affine part learned


def test_parameters_and_dtype():
    bn = nn.BatchNorm(3, param_dtype=jnp.bfloat16)
    assert {v.dtype for v in bn.flat_state_dict().values()} == {jnp.dtype(jnp.bfloat16)}
    assert bn(jnp.ones((2, 3))).dtype == jnp.bfloat16
    y, new = bn(jnp.ones((2, 3)) * jnp.arange(3.0), train=True)
    assert y.dtype == new.mean.dtype == new.var.dtype == jnp.bfloat16
    fresh = nn.BatchNorm(3)
    for name, value in (("scale", 1), ("bias", 0), ("mean", 0), ("var", 1)):
        np.testing.assert_array_equal(getattr(fresh, name), np.full(3, value))


def test_rejects_the_wrong_feature_size():
    with pytest.raises(
        ValueError,
        match=r"BatchNorm expects inputs whose last axis has 3 features \(its scale is \(3,\)\), "
        r"got an input of shape \(4, 5\).*num_features=5",
    ):
        nn.BatchNorm(3)(jnp.ones((4, 5)), train=True)


def test_training_needs_more_than_one_value_per_feature():
    with pytest.raises(
        ValueError,
        match=r"BatchNorm in training needs more than one value per feature.*got an input of "
        r"shape \(1, 3\).*train=False",
    ):
        nn.BatchNorm(3)(jnp.ones((1, 3)), train=True)
    assert nn.BatchNorm(3)(jnp.ones((1, 3))).shape == (1, 3)  # inference is fine


def test_momentum_must_be_in_unit_interval_and_mentions_torch():
    with pytest.raises(
        ValueError,
        match=r"BatchNorm's momentum .* in \[0, 1\]; got 1\.5 \(a PyTorch momentum m is 1 - m here\)",
    ):
        nn.BatchNorm(3, momentum=1.5)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), jnp.float32)
    for momentum in (0.0, 1.0):  # the ends: keep only the batch's statistics, or only the old
        _, new = nn.BatchNorm(3, momentum=momentum)(x, train=True)
        expected = np.asarray(x).mean(0) if momentum == 0.0 else np.zeros(3)
        np.testing.assert_allclose(new.mean, expected, rtol=1e-6, atol=1e-7)


class _Twice(nn.Module):
    """Calls its BatchNorm twice: once as train_forward tracks it, once with train=True."""

    def __init__(self):
        self.bn = nn.BatchNorm(3, momentum=0.5)

    def __call__(self, x):
        self.bn(x)
        return self.bn(x * 3.0, train=True)[1]


def test_train_true_updates_from_the_layer_it_is_called_on_even_under_train_forward():
    """An explicit train=True returns the layer it was called on, moved once: updates that
    train_forward collected for the same layer do not leak into it."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), jnp.float32)
    model = _Twice()
    explicit, tracked = nn.train_forward(model, x)
    np.testing.assert_allclose(explicit.mean, 0.5 * np.asarray(x * 3.0).mean(0), rtol=1e-6)
    np.testing.assert_allclose(tracked.bn.mean, 0.5 * np.asarray(x).mean(0), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("train", [False, True])
def test_batch_norm_stays_in_float32_when_x64_is_on(dtype, train):
    """With ``jax_enable_x64``, a float32 or bfloat16 BatchNorm still computes (and keeps its
    running statistics) in float32, not in JAX's default float dtype (float64 then); the
    values are those of a float64 NumPy oracle to bfloat16's rounding."""
    values = np.linspace(0.5, 1.5, 4)
    x64 = np.random.default_rng(0).normal(size=(6, 4)) * 2 + 1
    with jax.enable_x64(True):
        state = {name: values.astype(dtype) for name in ("scale", "bias", "mean", "var")}
        bn = nn.BatchNorm(4, param_dtype=dtype).load_flat_state_dict(state, strict=True)
        x = jnp.asarray(x64, jnp.float32)
        jaxpr = jax.make_jaxpr(lambda bn, x: bn(x, train=train))(bn, x).jaxpr
        assert [e for e in jaxpr.eqns if any(v.aval.dtype == np.float64 for v in e.outvars)] == []
        out = bn(x, train=train)
    v, x64 = values.astype(dtype).astype(np.float64), np.asarray(x, np.float64)
    if not train:
        expected = (x64 - v) / np.sqrt(v + 1e-5) * v + v
    else:
        out, new = out
        mean, var = x64.mean(0), x64.var(0)
        expected = (x64 - mean) / np.sqrt(var + 1e-5) * v + v
        assert new.mean.dtype == new.var.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(new.mean, np.float64), 0.99 * v + 0.01 * mean, rtol=2**-7
        )
        np.testing.assert_allclose(
            np.asarray(new.var, np.float64), 0.99 * v + 0.01 * var * 6 / 5, rtol=2**-7
        )
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2**-7, atol=1e-2)


class OtherNorm(nn.BatchNorm):
    """A second kind of BatchNorm, to tell the kinds of stray layers apart."""


def test_train_forward_hands_keywords_on_and_names_every_kind_of_stray_layer():
    """``train_forward(model, *args, **kwargs)`` calls ``model(*args, **kwargs)`` (a dropout
    key reaches the dropout); layers that ran but are not in the model are refused, each
    kind named once; ``record`` outside ``train_forward`` is an error."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)
    model, key = nn.Sequential(nn.BatchNorm(4), nn.Dropout(0.5)), jax.random.key(0)
    out, new = nn.train_forward(model, x, key=key)
    y, bn = model[0](x, train=True)
    np.testing.assert_array_equal(out, model[1](y, key=jax.random.split(key, 2)[1]))
    np.testing.assert_array_equal(new[0].mean, bn.mean)

    class Strays(nn.Module):
        def __call__(self, x):
            return OtherNorm(4)(nn.BatchNorm(4)(nn.BatchNorm(4)(x)))  # made during the call

    with pytest.raises(ValueError) as raised:
        nn.train_forward(Strays(), x)
    assert str(raised.value) == (
        "train_forward: 3 layer(s) (BatchNorm, OtherNorm) ran in training mode but are not "
        "part of the Strays given, so their new statistics have nowhere to go. Store every "
        "layer the model calls in one of its fields."
    )
    with pytest.raises(RuntimeError) as raised:
        record(model[0], bn)
    assert str(raised.value) == ("record() is only called by layers running under train_forward().")
