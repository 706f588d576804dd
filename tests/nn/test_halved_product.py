"""A quantized layer's float32 product on a TPU: at the default precision the chip takes
bfloat16 operands, so the weight is made into bfloat16 for it, never float32
(`halved_product`), forward and backward; checked against NumPy with the same roundings,
and on the chip against the float32 product itself, bit for bit."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import taktiny as tt
from taktiny import nn
from taktiny.nn import _quantized as quantized

CASES = {"int8": {"bits": 8}, "int4 in groups": {"bits": 4, "group_size": 32}}


def layer(case):
    return tt.quantize(nn.Linear(64, 48, rngs=nn.Rngs(0)), **CASES[case])


def inputs(rows=6):
    return jnp.asarray(np.random.default_rng(1).normal(size=(rows, 64)), jnp.float32)


def rounded(a):
    """`a` rounded to bfloat16 (to nearest even), back in float64."""
    return np.asarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16), np.float64)


def table(model):
    """The float32 table of the layer's kernel, [in, out]."""
    return np.asarray(tt.dequantize(model).kernel, np.float32)


@pytest.mark.parametrize("case", CASES)
def test_the_halved_product_is_the_bfloat16_operands_product(monkeypatch, case):
    """Forced (as on a TPU): the output is the product of the operands rounded to bfloat16
    (an int8 kernel's integers exact, its scales on the result; a grouped kernel's table
    made in float32 and rounded once), summed in float32; the input's gradient that of
    the chip's product with the float32 weight (the output's gradient and the weight
    scaled rounded to bfloat16), the scales' that of the same product."""
    monkeypatch.setattr(quantized, "_halved", lambda x, precision: x.dtype == jnp.float32)
    model, x = layer(case), inputs()
    c = jnp.asarray(np.random.default_rng(2).normal(size=(6, 48)), jnp.float32)
    loss = lambda m, x: jnp.sum(m(x) * c)
    got = jax.jit(lambda m, x: m(x))(model, x)
    (dm, dx) = jax.jit(jax.grad(loss, argnums=(0, 1), allow_int=True))(model, x)
    q = np.asarray(model.kernel.value, np.float64)
    scale = np.asarray(model.kernel.scale, np.float64)
    bias = np.asarray(model.bias, np.float64)
    g = rounded(c)  # the output's gradient, rounded as the product takes it
    if case == "int8":
        want = rounded(x) @ q * scale + bias
        want_dx = g @ rounded(q * scale).T  # (the weight scaled, then rounded, as the chip's)
        want_dscale = np.sum(np.asarray(c, np.float64) * (rounded(x) @ q), axis=0, keepdims=True)
    else:
        w = rounded(table(model))
        want = rounded(x) @ w + bias
        want_dx = g @ w.T
        dtable = rounded(rounded(x).T @ g)  # (the table's gradient held in bfloat16)
        want_dscale = (dtable * q).reshape(2, 32, 48).sum(axis=1)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(dm.kernel.scale, np.float64),
        want_dscale,
        rtol=2e-2,
        atol=2e-2 * np.abs(want_dscale).max(),
    )


def test_the_halved_path_is_taken_only_for_float32_at_the_default_precision_on_a_tpu(monkeypatch):
    x = inputs()
    assert not quantized._halved(x, None)  # (this machine's CPU)

    class Tpu:
        platform = "tpu"

    monkeypatch.setattr(quantized, "default_device", lambda: Tpu())
    assert quantized._halved(x, None) and quantized._halved(x, jax.lax.Precision.DEFAULT)
    assert not quantized._halved(x.astype(jnp.bfloat16), None)
    assert not quantized._halved(x, jax.lax.Precision.HIGHEST)
    with jax.default_matmul_precision("highest"):
        assert not quantized._halved(x, None)


@pytest.mark.parametrize("case", CASES)
def test_on_each_platform_the_layer_is_its_float32_product(platform, monkeypatch, case):
    """On a TPU the halved path is taken, and its output and the input's gradient are the
    float32 product's within a bfloat16 rounding (the chip's default precision takes
    bfloat16 operands on its matrix unit; XLA computes products this small exactly in
    float32, so they are not the same bits; at 2,048 x 4,096 x 4,096 the int8 layer's
    output was, FINDINGS 18). Elsewhere the float32 product is taken as it is, bit for bit."""
    device = jax.devices(platform)[0]
    model, x = jax.device_put((layer(case), inputs(16)), device)
    c = jnp.ones((16, 48), jnp.float32)
    with jax.default_device(device):
        assert quantized._halved(x, None) == (platform == "tpu")
        forward = lambda m, x: m(x)
        run = lambda: (
            jax.jit(forward)(model, x),
            jax.jit(jax.grad(lambda x: jnp.sum(model(x) * c)))(x),
        )
        halved = run()
        monkeypatch.setattr(quantized, "_halved", lambda x, precision: False)
        plain = run()
    for a, b in zip(halved, plain, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if platform == "tpu":
            assert np.abs(a - b).max() <= 2**-7 * np.abs(b).max()
        else:
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("case", CASES)
def test_a_frozen_weight_costs_the_backward_no_product_of_its_own(monkeypatch, case):
    """Differentiating the input alone (a frozen base, as in QLoRA), the backward takes one
    product, the input's; differentiating the model too, a grouped kernel's table takes a
    second one, for its scales (an int8 kernel's scales multiply the forward's product:
    none)."""
    monkeypatch.setattr(quantized, "_halved", lambda x, precision: x.dtype == jnp.float32)
    model, x = layer(case), inputs()
    loss = lambda m, x: jnp.sum(m(x))
    products = lambda f: jax.jit(f).lower(model, x).as_text().count("stablehlo.dot_general")
    assert products(jax.value_and_grad(loss, argnums=1)) == 2  # the forward, the input's gradient
    both = 2 if case == "int8" else 3
    assert products(jax.value_and_grad(loss, argnums=(0, 1), allow_int=True)) == both


@pytest.mark.parametrize("case", CASES)
def test_a_grouped_table_is_made_once_for_both_products(monkeypatch, case):
    """A grouped kernel's table is held, between the forward's product and the input
    gradient's, behind an optimization barrier: fused into each product, XLA on the TPU
    held the scales' broadcast in float32 instead, twice the table's bytes, and QLoRA's
    step on an int4 base ran at 1.18x LoRA's (bench/FINDINGS.md 18). An int8 kernel's
    integers need none: they enter both products as they are."""
    monkeypatch.setattr(quantized, "_halved", lambda x, precision: x.dtype == jnp.float32)
    model, x = layer(case), inputs()
    text = jax.jit(jax.grad(lambda x: jnp.sum(model(x)))).lower(x).as_text()
    assert text.count("stablehlo.optimization_barrier") == (0 if case == "int8" else 1)
