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
    assert nn.LayerNorm(4, dtype=jnp.bfloat16)(x.astype(jnp.float32)).dtype == jnp.bfloat16
    assert nn.RMSNorm(4, dtype=jnp.bfloat16)(x.astype(jnp.float32)).dtype == jnp.bfloat16
    bare = nn.LayerNorm(4, use_scale=False, use_bias=False)
    assert bare(x).dtype == jnp.bfloat16  # no parameters: the input's dtype
    assert jax.jit(bare.__call__)(jnp.ones((3, 7))).shape == (3, 7)  # and any size


@pytest.mark.parametrize(
    "layer, name", [(nn.LayerNorm(6), "LayerNorm"), (nn.RMSNorm(6), "RMSNorm")]
)
def test_norms_reject_the_wrong_feature_size(layer, name):
    with pytest.raises(
        ValueError,
        match=rf"{name} expects inputs whose last axis has 6 features \(its scale is \(6,\)\), "
        r"got an input of shape \(2, 4\).*num_features=4",
    ):
        layer(jnp.ones((2, 4)))


def test_layer_norm_with_only_a_bias_names_the_bias():
    with pytest.raises(ValueError, match=r"LayerNorm .* 6 features \(its bias is \(6,\)\)"):
        nn.LayerNorm(6, use_scale=False)(jnp.ones((2, 4)))
