"""GroupNorm against torch.nn.GroupNorm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import assert_close, build, channels_last, numpy, randomize_
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from taktiny import nn


def torch_input(*shape, seed=0):
    """torch's [batch, channels, *spatial], offset and spread so that centring matters."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3 + 2


def convert(reference):
    return {"scale": numpy(reference.weight), "bias": numpy(reference.bias)}


# (num_groups, torch's input shape [batch, channels, *spatial])
CASES = [
    (2, (3, 6)),  # no spatial axes: statistics over each group's channels only
    (1, (2, 6, 7)),  # one group: each example over all its values
    (3, (2, 6, 7)),
    (6, (2, 6, 5)),  # a group per channel: instance normalisation
    (2, (2, 4, 5, 3)),
    (4, (2, 8, 3, 4, 2)),
]


@pytest.mark.parametrize("num_groups, shape", CASES)
@pytest.mark.parametrize("epsilon", [1e-5, 1e-2])
def test_group_norm_matches_torch(num_groups, shape, epsilon):
    channels = shape[1]
    reference = randomize_(torch.nn.GroupNorm(num_groups, channels, eps=epsilon))
    norm = build(lambda: nn.GroupNorm(num_groups, channels, epsilon=epsilon), convert(reference))
    x = torch_input(*shape)
    assert_close(norm(jnp.asarray(channels_last(x))), channels_last(reference(x)))


def test_group_norm_without_affine_parameters_matches_torch():
    reference = torch.nn.GroupNorm(2, 6, affine=False)
    norm = nn.GroupNorm(2, 6, use_scale=False, use_bias=False)
    assert norm.flat_state_dict() == {}
    x = torch_input(2, 6, 4, 3)
    assert_close(norm(jnp.asarray(channels_last(x))), channels_last(reference(x)))
    # a scale alone: torch's output without its bias
    reference = torch.nn.GroupNorm(3, 6)
    randomize_(reference)
    norm = build(lambda: nn.GroupNorm(3, 6, use_bias=False), {"scale": numpy(reference.weight)})
    assert list(norm.flat_state_dict()) == ["scale"]
    expected = channels_last(reference(x) - reference.bias[:, None, None])
    assert_close(norm(jnp.asarray(channels_last(x))), expected)
    # a bias alone: torch's output with a scale of ones
    with torch.no_grad():
        reference.weight.fill_(1.0)
    norm = build(lambda: nn.GroupNorm(3, 6, use_scale=False), {"bias": numpy(reference.bias)})
    assert list(norm.flat_state_dict()) == ["bias"]
    assert_close(norm(jnp.asarray(channels_last(x))), channels_last(reference(x)))


def test_group_norm_gradients_match_torch():
    reference = torch.nn.GroupNorm(2, 4, eps=1e-5)
    randomize_(reference)
    x = torch_input(2, 4, 5).requires_grad_()
    weights = torch_input(2, 4, 5, seed=1)
    (reference(x) * weights).sum().backward()
    norm = build(lambda: nn.GroupNorm(2, 4), convert(reference))
    w = jnp.asarray(channels_last(weights))
    loss = lambda norm, x: jnp.sum(norm(x) * w)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(norm, jnp.asarray(channels_last(x)))
    assert x.grad is not None and reference.weight.grad is not None
    assert reference.bias.grad is not None
    assert_close(grads[1], channels_last(x.grad), 1e-4)
    assert_close(grads[0].scale, numpy(reference.weight.grad), 1e-4)
    assert_close(grads[0].bias, numpy(reference.bias.grad), 1e-4)


def test_init_is_ones_and_zeros_and_the_groups_are_normalised():
    norm = nn.GroupNorm(2, 4)
    np.testing.assert_array_equal(norm.scale, np.ones(4))
    np.testing.assert_array_equal(norm.bias, np.zeros(4))
    assert repr(norm) == "GroupNorm(scale=f32[4], bias=f32[4], num_groups=2, epsilon=1e-05)"
    y = norm(jnp.asarray(channels_last(torch_input(3, 4, 6))))  # [3, 6, 4]
    groups = np.asarray(y).reshape(3, 6, 2, 2)  # channels 0-1 and 2-3
    np.testing.assert_allclose(groups.mean((1, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(groups.var((1, 3)), 1, atol=1e-3)


def test_dtypes_follow_the_dtype_convention():
    x = jnp.asarray(channels_last(torch_input(2, 4, 6)))
    assert nn.GroupNorm(2, 4)(x.astype(jnp.bfloat16)).dtype == jnp.float32  # the parameters'
    low = nn.GroupNorm(2, 4, param_dtype=jnp.bfloat16)
    assert {p.dtype for p in jax.tree.leaves(low)} == {jnp.dtype(jnp.bfloat16)}
    assert low(x).dtype == jnp.bfloat16
    mixed = nn.GroupNorm(2, 4, dtype=jnp.bfloat16)  # float32 parameters, bfloat16 output
    assert mixed.scale is not None and mixed.scale.dtype == jnp.float32
    assert mixed(x).dtype == jnp.bfloat16
    bare = nn.GroupNorm(2, 4, use_scale=False, use_bias=False)
    assert bare(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16  # no parameters: the input's
    assert bare(x).dtype == jnp.float32
    bare = nn.GroupNorm(2, 4, use_scale=False, use_bias=False, dtype=jnp.bfloat16)
    assert bare(x).dtype == jnp.bfloat16


def test_low_precision_group_norm_computes_its_statistics_in_float32():
    # a mean of 50 taken in bfloat16 is off by about 0.1, and every output with it
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 32, 32, 8)) + 50, jnp.bfloat16)
    x64 = np.asarray(x, np.float64).reshape(4, 32, 32, 2, 4)
    mean, var = x64.mean((1, 2, 4), keepdims=True), x64.var((1, 2, 4), keepdims=True)
    expected = ((x64 - mean) / np.sqrt(var + 1e-5)).reshape(4, 32, 32, 8)
    y = nn.GroupNorm(2, 8, param_dtype=jnp.bfloat16)(x)
    assert y.dtype == jnp.bfloat16
    y = np.asarray(y, np.float64)
    assert np.all(np.abs(y - expected) <= np.abs(expected) * 2**-8 + 1e-3), np.abs(
        y - expected
    ).max()


def test_group_norm_jits_and_runs_in_a_named_scope():
    norm = nn.GroupNorm(2, 4)
    x = jnp.asarray(channels_last(torch_input(2, 4, 6)))
    np.testing.assert_allclose(jax.jit(lambda n, x: n(x))(norm, x), norm(x), atol=1e-6)
    jaxpr = jax.make_jaxpr(lambda n, x: n(x))(norm, x).jaxpr
    stacks = {str(eqn.source_info.name_stack) for eqn in jaxpr.eqns}
    assert stacks and all(stack == "GroupNorm" for stack in stacks), stacks


def test_a_numpy_scalar_epsilon_is_configuration_not_a_parameter(without_type_checks):
    norm = nn.GroupNorm(2, 4, epsilon=np.float32(1e-3))
    assert list(norm.flat_state_dict()) == ["scale", "bias"]
    assert type(norm.epsilon) is float and norm.epsilon == np.float32(1e-3)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize(
    "num_groups, x_spec",
    [(4, P("data", None, None, "model")), (2, P("data", None, None, "model")),
     (2, P("data", "model"))],
)  # fmt: skip
def test_group_norm_under_a_mesh_equals_the_unsharded_result(axis_type, num_groups, x_spec):
    """Channels split over 4 devices with 4 groups (whole groups per device) or 2 (the groups
    gathered), or a spatial axis split: the output is split as the input on Explicit axes."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    reference = randomize_(torch.nn.GroupNorm(num_groups, 8))
    x = channels_last(torch_input(2, 8, 4, 3))
    expected = build(lambda: nn.GroupNorm(num_groups, 8), convert(reference))(jnp.asarray(x))
    with jax.set_mesh(mesh):
        norm = nn.GroupNorm(num_groups, 8, scale_sharding=("model",), bias_sharding=(None,))
        assert norm.scale is not None and norm.scale.sharding.spec == P("model")
        split_bias = nn.GroupNorm(num_groups, 8, bias_sharding=("model",)).bias
        assert split_bias is not None and split_bias.sharding.spec == P("model")
        norm = norm.load_flat_state_dict(convert(reference))
        y = jax.jit(lambda n, x: n(x))(norm, jax.device_put(x, x_spec))
    assert_close(y, expected, 1e-6)
    if axis_type == AxisType.Explicit:
        assert y.sharding.spec == P(*x_spec, *(None,) * (4 - len(x_spec)))


def test_num_groups_must_divide_num_features():
    with pytest.raises(
        ValueError,
        match=r"GroupNorm's num_groups \(4\) must divide num_features \(6\) into groups of "
        r"equal size; pass one of \[1, 2, 3, 6\] as num_groups, or change num_features\.",
    ):
        nn.GroupNorm(4, 6)
    with pytest.raises(ValueError, match=r"GroupNorm's num_groups \(0\) must divide"):
        nn.GroupNorm(0, 6)
    with pytest.raises(
        ValueError, match=r"num_features \(0\) into groups of equal size; pass one of \[\] as"
    ):
        nn.GroupNorm(0, 0)  # no features: no number of groups to suggest


def test_group_norm_rejects_the_wrong_inputs(without_type_checks):
    with pytest.raises(
        ValueError,
        match=r"GroupNorm expects inputs whose last axis has 6 features \(its scale is \(6,\)\), "
        r"got an input of shape \(2, 5, 4\)\. .*num_features=4",
    ):
        nn.GroupNorm(2, 6)(jnp.ones((2, 5, 4)))
    with pytest.raises(ValueError, match=r"GroupNorm .* 6 features \(its bias is \(6,\)\)"):
        nn.GroupNorm(2, 6, use_scale=False)(jnp.ones((2, 4)))
    with pytest.raises(
        ValueError,
        match=r"GroupNorm expects inputs \[batch, \*spatial, num_features\] \(channels last, "
        r"the first axis the batch\), got an input of shape \(6,\)\. Add a batch axis: x\[None\]",
    ):
        nn.GroupNorm(2, 6)(jnp.ones((6,)))
    bare = nn.GroupNorm(2, 6, use_scale=False, use_bias=False)
    assert bare(jnp.ones((2, 3, 4))).shape == (2, 3, 4)  # any multiple of num_groups
    with pytest.raises(
        ValueError,
        match=r"GroupNorm's num_groups \(2\) must divide the input's features, got an input "
        r"of shape \(2, 3, 5\)\. Pass inputs whose last axis is a multiple of 2, or build the "
        r"layer with another num_groups\.",
    ):
        bare(jnp.ones((2, 3, 5)))


def test_sharding_errors_name_the_parameter(without_type_checks):
    for name in ("scale", "bias"):
        with pytest.raises(TypeError, match=rf"^GroupNorm\.{name}: a sharding is a PartitionSpec "):
            nn.GroupNorm(2, 4, **{f"{name}_sharding": "model"})  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize(
    "num_groups, channels, split",
    [(4, "model", "model"), (8, ("data", "model"), ("data", "model")), (2, "model", None)],
)
def test_whole_groups_are_normalised_where_their_channels_are(num_groups, channels, split):
    """On Explicit axes the grouped view [batch, *spatial, groups, per_group] keeps the
    channels' split when the devices hold whole groups (4 or 8 groups of 8 channels split 4
    or 8 ways), and is gathered otherwise (2 groups on 4 devices)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    x = channels_last(torch_input(2, 8, 4, 3))
    norm = nn.GroupNorm(num_groups, 8)
    with jax.set_mesh(mesh):
        split_x = jax.device_put(x, P(None, None, None, channels))
        jaxpr = jax.make_jaxpr(lambda n, x: n(x))(norm, split_x).jaxpr
        y = jax.jit(lambda n, x: n(x))(norm, split_x)
    grouped = next(e.outvars[0].aval for e in jaxpr.eqns if e.primitive.name == "reshape")
    assert grouped.shape == (2, 4, 3, num_groups, 8 // num_groups)
    assert grouped.sharding.spec == P(None, None, None, split, None)
    assert y.sharding.spec == P(None, None, None, channels)
    assert_close(y, norm(jnp.asarray(x)), 1e-6)


def test_with_x64_a_float32_group_norm_stays_in_float32():
    x = channels_last(torch_input(2, 4, 6))
    expected = nn.GroupNorm(2, 4)(jnp.asarray(x))
    with jax.enable_x64(True):
        y = nn.GroupNorm(2, 4)(jnp.asarray(x))
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, expected)  # the same float32 arithmetic
