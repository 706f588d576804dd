"""The Pallas kernel for int4 kernels in groups of 128 on a TPU (`nn._grouped_product`):
its numbers against NumPy and XLA's product (interpreted here), when a layer takes it, that
a TPU's lowering of the layer holds it, and that anywhere else, and in the gradients, the
layer computes exactly as XLA's product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taktiny as tt
from taktiny import nn
from taktiny.nn import _grouped_product as grouped


def layer(k=2048, n=1024, bits=4, group_size=128, seed=0):
    dense = nn.Linear(k, n, use_bias=True, param_dtype=jnp.bfloat16, rngs=nn.Rngs(seed))
    dense = dense.replace(bias=jnp.linspace(-1, 1, n, dtype=jnp.bfloat16))
    return tt.quantize(dense, bits=bits, group_size=group_size)


def inputs(rows, k=2048, dtype=jnp.bfloat16):
    return jnp.asarray(np.random.default_rng(1).normal(size=(rows, k)), dtype)


@pytest.mark.parametrize("rows", [1, 19])  # (one tile of rows; two, padded)
def test_the_kernel_is_the_groups_product_taken_in_float32(rows):
    """Interpreted: within one bfloat16 rounding of the float64 product of the dequantized
    kernel (NumPy), and closer to it than XLA's product, which rounds the dequantized
    kernel into bfloat16 first."""
    kernel = layer(k=2048, n=1024).kernel
    x = inputs(rows)
    got = np.asarray(grouped.kernel(x, kernel.value, kernel.scale, interpret=True), np.float64)
    want = oracle(layer(k=2048, n=1024).replace(bias=jnp.zeros(1024)), x)
    assert got.shape == (rows, 1024)
    assert np.abs(got - want).max() <= 2**-8 * np.abs(want).max()
    xla = np.asarray(grouped._xla(x, kernel.value, kernel.scale, None), np.float64)
    assert np.abs(got - want).mean() < np.abs(xla - want).mean()


def oracle(model, x):
    """NumPy's float64 product of the dequantized kernel, and the bias."""
    kernel, k = model.kernel, model.kernel.value.shape[0]
    q = np.asarray(kernel.value, np.float64).reshape(k // 128, 128, -1)
    w = (q * np.asarray(kernel.scale, np.float64)[:, None, :]).reshape(k, -1)
    return np.asarray(x, np.float64) @ w + np.asarray(model.bias, np.float64)


def test_on_each_platform_the_layer_is_the_groups_product(platform):
    """On a TPU (one device: the kernel taken, compiled by Mosaic) and anywhere else (XLA's
    product), the layer's output is within a bfloat16 rounding of NumPy's product."""
    model, x = layer(), inputs(16)
    assert grouped.takes(x, model.kernel) == (platform == "tpu")
    got = np.asarray(jax.jit(lambda m, x: m(x))(model, x), np.float64)
    want = oracle(model, x)
    assert np.abs(got - want).max() <= 2**-7 * np.abs(want).max()


def test_a_layer_takes_it_only_where_it_was_measured(monkeypatch):
    """bfloat16 inputs of at most 256 rows, int4 in groups of 128, axes that tile, one TPU
    device: the shapes of bench/device_quantized.py on the chip. Anything else, or any
    other machine, keeps XLA's product."""
    int4, x = layer().kernel, inputs(16)
    assert not grouped.takes(x, int4)  # (a CPU here)
    monkeypatch.setattr(grouped, "_one_tpu", lambda: True)
    assert grouped.takes(x, int4) and grouped.takes(inputs(256), int4)
    assert grouped.takes(x.reshape(4, 4, 2048), int4)
    assert not grouped.takes(inputs(257), int4)
    assert not grouped.takes(inputs(16, dtype=jnp.float32), int4)
    assert not grouped.takes(x, layer(group_size=64).kernel)
    assert not grouped.takes(x, layer(bits=8, group_size=128).kernel)
    assert not grouped.takes(x, layer(bits=4, group_size=None).kernel)
    assert not grouped.takes(x[:, :1536], layer(k=1536).kernel)  # (not whole input tiles)
    assert not grouped.takes(x, layer(n=768).kernel)


def test_on_a_tpu_the_layer_lowers_to_the_kernel_and_elsewhere_to_xla(monkeypatch):
    """Taken, the layer's program holds both products; lowered for a TPU it is the Pallas
    kernel (Mosaic's custom call), for the CPU XLA's product: the outputs, the gradients
    (of the input and the scales) and a forward-mode derivative are bitwise those of the
    layer not taking it."""
    model, x = layer(), inputs(4)
    loss = lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2)
    grads = lambda: jax.jit(jax.grad(loss, argnums=(0, 1), allow_int=True))  # (traced anew)
    along = jnp.flip(x, axis=1)
    tangent = lambda: jax.jit(lambda m, x: jax.jvp(m, (x,), (along,))[1])
    want, want_grads = jax.jit(lambda m, x: m(x))(model, x), grads()(model, x)
    want_tangent = tangent()(model, x)
    monkeypatch.setattr(grouped, "_one_tpu", lambda: True)
    forward = jax.jit(lambda m, x: m(x))
    tpu = forward.trace(model, x).lower(lowering_platforms=("tpu",)).as_text()
    cpu = forward.trace(model, x).lower().as_text()
    assert "tpu_custom_call" in tpu and "tpu_custom_call" not in cpu
    got, got_grads = forward(model, x), grads()(model, x)
    assert got.dtype == jnp.bfloat16 and np.array_equal(np.asarray(got), np.asarray(want))
    (gm, gx), (wm, wx) = got_grads, want_grads
    assert np.array_equal(np.asarray(gx), np.asarray(wx))
    assert np.array_equal(np.asarray(gm.kernel.scale), np.asarray(wm.kernel.scale))
    assert np.array_equal(np.asarray(gm.bias), np.asarray(wm.bias))
    assert np.array_equal(np.asarray(tangent()(model, x)), np.asarray(want_tangent))
