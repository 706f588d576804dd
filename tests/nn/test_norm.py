"""LayerNorm and RMSNorm against torch.nn.LayerNorm and torch.nn.RMSNorm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import assert_close, numpy, randomize_

from taktiny import nn

SHAPES = [(8,), (3, 8), (2, 5, 8), (2, 3, 4, 8)]


def convert_layer_norm(reference):
    names = {"weight": "scale", "bias": "bias"}
    return {names[name]: numpy(value) for name, value in reference.state_dict().items()}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("epsilon", [1e-5, 1e-12])
def test_layer_norm_matches_torch(shape, epsilon):
    reference = randomize_(torch.nn.LayerNorm(8, eps=epsilon))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3 + 1
    norm = nn.LayerNorm(8, epsilon=epsilon).load_flat_state_dict(
        convert_layer_norm(reference), strict=True
    )
    assert_close(norm(jnp.asarray(numpy(x))), numpy(reference(x)))


@pytest.mark.parametrize(
    "use_scale, use_bias, torch_kwargs",
    [(True, False, {"bias": False}), (False, False, {"elementwise_affine": False})],
)
def test_layer_norm_without_scale_or_bias_matches_torch(use_scale, use_bias, torch_kwargs):
    reference = randomize_(torch.nn.LayerNorm(8, eps=1e-5, **torch_kwargs))
    norm = nn.LayerNorm(8, epsilon=1e-5, use_scale=use_scale, use_bias=use_bias)
    norm = norm.load_flat_state_dict(convert_layer_norm(reference), strict=True)
    assert (norm.scale is None) != use_scale and (norm.bias is None) != use_bias
    expected_names = [n for n, used in (("scale", use_scale), ("bias", use_bias)) if used]
    assert list(norm.flat_state_dict()) == expected_names
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    assert_close(norm(jnp.asarray(numpy(x))), numpy(reference(x)))


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_torch(shape):
    reference = randomize_(torch.nn.RMSNorm(8, eps=1e-6))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    norm = nn.RMSNorm(8).load_flat_state_dict({"scale": numpy(reference.weight)}, strict=True)
    assert_close(norm(jnp.asarray(numpy(x))), numpy(reference(x)))


def test_init_is_ones_and_zeros():
    norm = nn.LayerNorm(4)
    np.testing.assert_array_equal(norm.scale, np.ones(4))
    np.testing.assert_array_equal(norm.bias, np.zeros(4))
    np.testing.assert_array_equal(nn.RMSNorm(4).scale, np.ones(4))
    y = norm(jnp.array([1.0, 2.0, 3.0, 4.0]))
    assert abs(float(y.mean())) < 1e-6 and abs(float(y.var()) - 1) < 1e-4


def test_norms_compute_in_their_parameters_dtype():
    x = jnp.ones((2, 4), jnp.bfloat16) * jnp.arange(4, dtype=jnp.bfloat16)
    assert nn.LayerNorm(4)(x).dtype == jnp.float32
    assert nn.RMSNorm(4)(x).dtype == jnp.float32
    assert nn.LayerNorm(4, param_dtype=jnp.bfloat16)(x.astype(jnp.float32)).dtype == jnp.bfloat16
    assert nn.RMSNorm(4, param_dtype=jnp.bfloat16)(x.astype(jnp.float32)).dtype == jnp.bfloat16
    bare = nn.LayerNorm(4, use_scale=False, use_bias=False)
    assert bare(x).dtype == jnp.bfloat16  # no parameters: the input's dtype
    bare = nn.LayerNorm(4, use_scale=False, use_bias=False, dtype=jnp.float32)
    assert bare(x).dtype == jnp.float32  # unless it is told one
    assert jax.jit(bare.__call__)(jnp.ones((3, 7))).shape == (3, 7)  # and any size


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_norms_reject_the_wrong_feature_size(name):
    layer = getattr(nn, name)(6)
    with pytest.raises(
        ValueError,
        match=rf"{name} expects inputs whose last axis has 6 features \(its scale is \(6,\)\), "
        r"got an input of shape \(2, 4\).*num_features=4",
    ):
        layer(jnp.ones((2, 4)))


def test_layer_norm_with_only_a_bias_names_the_bias():
    with pytest.raises(ValueError, match=r"LayerNorm .* 6 features \(its bias is \(6,\)\)"):
        nn.LayerNorm(6, use_scale=False)(jnp.ones((2, 4)))


def _close_to(y, expected):
    """`y` within bfloat16's rounding of the float64 `expected` (8 significant bits)."""
    y = np.asarray(y, np.float64)
    assert np.all(np.abs(y - expected) <= np.abs(expected) * 2**-8 + 1e-3), np.abs(
        y - expected
    ).max()


@pytest.mark.parametrize("stored", [jnp.bfloat16, jnp.float32])
def test_low_precision_norms_compute_their_statistics_in_float32(stored):
    # Once: a bfloat16 LayerNorm(4096) took the mean of a mean-50 input in bfloat16, and was
    # off by 0.03 everywhere, also where the output is near zero. Computing in bfloat16,
    # parameters stored in bfloat16 or float32, the statistics are float32.
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 4096)) + 50, jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    mean, var = x64.mean(-1, keepdims=True), x64.var(-1, keepdims=True)
    dtypes = {"dtype": jnp.bfloat16, "param_dtype": stored}
    layer = nn.LayerNorm(4096, **dtypes)(x)
    assert layer.dtype == jnp.bfloat16
    _close_to(layer, (x64 - mean) / np.sqrt(var + 1e-6))
    rms = nn.RMSNorm(4096, **dtypes)(x)
    assert rms.dtype == jnp.bfloat16
    _close_to(rms, x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + 1e-6))
    y, new = nn.BatchNorm(4096, **dtypes)(x, train=True)
    assert y.dtype == jnp.bfloat16 and new.mean.dtype == new.var.dtype == stored
    _close_to(y, (x64 - x64.mean(0)) / np.sqrt(x64.var(0) + 1e-5))
    np.testing.assert_allclose(np.asarray(new.mean, np.float64), 0.01 * x64.mean(0), rtol=2**-7)


@pytest.mark.parametrize("epsilon", [1e-5, 1e-2])
def test_epsilon_where_it_matters(epsilon):
    # a row of zeros (0 / sqrt(epsilon), not NaN) and values near 1e-3, where epsilon is a
    # large part of the variance: compared with torch at the same epsilon
    x = torch.tensor([[0.0] * 8, [1e-3, -2e-3, 3e-3, 0.0, 1e-3, -1e-3, 2e-3, 5e-4]])
    layer = torch.nn.LayerNorm(8, eps=epsilon, elementwise_affine=False)
    ours = nn.LayerNorm(8, epsilon=epsilon, use_scale=False, use_bias=False)
    assert_close(ours(jnp.asarray(numpy(x))), numpy(layer(x)))
    rms = torch.nn.RMSNorm(8, eps=epsilon, elementwise_affine=False)
    ours_rms = nn.RMSNorm(8, epsilon=epsilon)
    assert_close(ours_rms(jnp.asarray(numpy(x))), numpy(rms(x)))
    assert np.all(np.isfinite(ours_rms(jnp.zeros((2, 8)))))
    assert not np.any(ours_rms(jnp.zeros((2, 8))))


def _float64_results(fn, *args):
    """The primitives of `fn`'s jaxpr that produce a float64 value."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [e.primitive.name for e in jaxpr.eqns for v in e.outvars if v.aval.dtype == np.float64]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "make",
    [
        lambda dtype: nn.LayerNorm(8, epsilon=np.float64(1e-2), param_dtype=dtype),
        lambda dtype: nn.LayerNorm(8, epsilon=np.float64(1e-2), use_bias=False, param_dtype=dtype),
        lambda dtype: nn.LayerNorm(8, epsilon=np.float64(1e-2), use_scale=False, param_dtype=dtype),
        lambda dtype: nn.LayerNorm(8, epsilon=np.float64(1e-2), use_scale=False, use_bias=False),
        lambda dtype: nn.RMSNorm(8, epsilon=np.float64(1e-2), param_dtype=dtype),
    ],
    ids=["LayerNorm", "LayerNorm-scale-only", "LayerNorm-bias-only", "LayerNorm-bare", "RMSNorm"],
)
def test_norms_stay_in_float32_when_x64_is_on(make, dtype):
    """With ``jax_enable_x64``, a float32 or bfloat16 norm still computes in float32: neither
    JAX's default float dtype (float64 then) nor a NumPy float64 epsilon promotes it."""
    values = np.linspace(-1, 1, 8).astype(dtype)  # the scale, and the bias if any
    with jax.enable_x64(True):
        layer = make(dtype)
        names = [name for name in ("scale", "bias") if name in layer.flat_state_dict()]
        layer = layer.load_flat_state_dict(dict.fromkeys(names, values))
        x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8)) * 3 + 1, jnp.float32)
        assert _float64_results(layer, x) == []
        y = layer(x)
        assert y.dtype == (dtype if names else jnp.float32)  # bare: the input's dtype
    v, x = values.astype(np.float64), np.asarray(x, np.float64)
    if isinstance(layer, nn.RMSNorm):
        expected = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-2) * v
    else:
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        expected = (x - mean) / np.sqrt(var + 1e-2)
        expected = expected * (v if "scale" in names else 1) + (v if "bias" in names else 0)
    _close_to(y, expected)


def test_float64_norms_compute_in_float64():
    """With ``jax_enable_x64``, a float64 norm keeps float64 statistics: its output matches
    NumPy's float64 result far beyond float32's precision (inputs offset by 1e3)."""
    x = np.random.default_rng(0).normal(size=(6, 16)) + 1e3
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    with jax.enable_x64(True):
        layer = nn.LayerNorm(16, param_dtype=jnp.float64)(jnp.asarray(x))
        rms = nn.RMSNorm(16, param_dtype=jnp.float64)(jnp.asarray(x))
        batch, _ = nn.BatchNorm(16, param_dtype=jnp.float64)(jnp.asarray(x), train=True)
    assert layer.dtype == rms.dtype == batch.dtype == np.float64
    np.testing.assert_allclose(layer, (x - mean) / np.sqrt(var + 1e-6), rtol=0, atol=1e-10)
    expected_rms = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms, expected_rms, rtol=0, atol=1e-12)
    expected_batch = (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5)
    np.testing.assert_allclose(batch, expected_batch, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (lambda eps: nn.LayerNorm(4, epsilon=eps), ["scale", "bias"]),
        (lambda eps: nn.RMSNorm(4, epsilon=eps), ["scale"]),
        (lambda eps: nn.BatchNorm(4, epsilon=eps, momentum=np.float32(0.9)),
         ["scale", "bias", "mean", "var"]),
    ],
)  # fmt: skip
def test_a_numpy_scalar_epsilon_is_configuration_not_a_parameter(make, names, without_type_checks):
    # a NumPy scalar is an array to a module; stored as given, epsilon would join the state
    # and an optimizer would train it
    layer = make(np.float32(1e-3))
    assert list(layer.flat_state_dict()) == names
    assert type(layer.epsilon) is float and layer.epsilon == np.float32(1e-3)
