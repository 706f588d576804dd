"""MaxPool, AvgPool and GlobalAvgPool against torch.nn.MaxPool{1,2,3}d, AvgPool{1,2,3}d and
AdaptiveAvgPool{1,2,3}d(1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import assert_close, channels_last, numpy
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from taktiny import nn

# (kernel_size, strides, padding, ceil_mode, spatial size)
CASES = [
    ((3,), None, 0, False, (9,)),
    ((2,), 1, 1, False, (7,)),
    ((3,), 2, 1, True, (6,)),  # the last window starts in the input and ends past the padding
    ((3,), 3, 0, True, (2,)),  # a window larger than the input, kept by ceil_mode
    ((4,), 3, 2, True, (5,)),  # a last window from the input across all the end padding
    ((2,), 3, 1, True, (5,)),  # a window that would start in the end padding is dropped
    ((2, 2), None, 0, False, (6, 7)),  # an odd width: the last column is left out
    ((3, 3), 2, 1, False, (7, 8)),
    ((3, 2), (1, 2), (1, 0), False, (5, 5)),
    ((3, 1), (2, 1), (1, 0), False, (7, 4)),  # a window of 1 on the second axis
    ((3, 3), 2, 1, True, (6, 5)),
    ((2, 3, 2), (1, 2, 2), (1, 1, 0), False, (4, 5, 3)),
    ((2, 2, 2), None, 0, True, (3, 5, 4)),
]


def torch_input(size, seed=0):
    """[2, 3, *size] (torch's layout), spread out so that no window has ties."""
    return torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("kernel_size, strides, padding, ceil_mode, size", CASES)
def test_max_pool_matches_torch(kernel_size, strides, padding, ceil_mode, size):
    n = len(kernel_size)
    reference = getattr(torch.nn, f"MaxPool{n}d")(
        kernel_size, stride=strides, padding=padding, ceil_mode=ceil_mode
    )
    x = torch_input(size)
    pool = nn.MaxPool(kernel_size, strides, padding, ceil_mode=ceil_mode)
    assert_close(pool(jnp.asarray(channels_last(x))), channels_last(reference(x)), 0.0)


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("kernel_size, strides, padding, ceil_mode, size", CASES)
def test_avg_pool_matches_torch(kernel_size, strides, padding, ceil_mode, size, count_include_pad):
    n = len(kernel_size)
    reference = getattr(torch.nn, f"AvgPool{n}d")(
        kernel_size, stride=strides, padding=padding, ceil_mode=ceil_mode,
        count_include_pad=count_include_pad,
    )  # fmt: skip
    x = torch_input(size)
    pool = nn.AvgPool(
        kernel_size, strides, padding, ceil_mode=ceil_mode, count_include_pad=count_include_pad
    )
    assert_close(pool(jnp.asarray(channels_last(x))), channels_last(reference(x)))


@pytest.mark.parametrize("kind", ["Max", "Avg"])
@pytest.mark.parametrize("kernel_size, strides, padding, ceil_mode, size", CASES[2:4] + CASES[9:10])
def test_pool_gradients_match_torch(kind, kernel_size, strides, padding, ceil_mode, size):
    n = len(kernel_size)
    reference = getattr(torch.nn, f"{kind}Pool{n}d")(
        kernel_size, stride=strides, padding=padding, ceil_mode=ceil_mode
    )
    x = torch_input(size).requires_grad_()
    weights = torch.randn(reference(x).shape, generator=torch.Generator().manual_seed(1))
    (reference(x) * weights).sum().backward()
    pool = getattr(nn, f"{kind}Pool")(kernel_size, strides, padding, ceil_mode=ceil_mode)
    w = jnp.asarray(channels_last(weights))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(pool(x) * w)))(jnp.asarray(channels_last(x)))
    assert x.grad is not None
    assert_close(grad, channels_last(x.grad))


@pytest.mark.parametrize("kind", ["Max", "Avg"])
def test_int_arguments_with_dims_equal_tuples(kind):
    layer = getattr(nn, f"{kind}Pool")
    x = jnp.asarray(channels_last(torch_input((7, 8))))
    pool = layer(3, 2, 1, dims=2)
    assert (pool.kernel_size, pool.strides, pool.padding) == ((3, 3), (2, 2), (1, 1))
    np.testing.assert_array_equal(pool(x), layer((3, 3), (2, 2), (1, 1))(x))
    # a tuple anywhere sets the number of axes; the other ints fill it
    assert layer(2, padding=(1, 0)).kernel_size == (2, 2)
    assert layer(2, (1, 2, 1)).padding == (0, 0, 0)
    assert layer((2, 3)).strides == (2, 3)  # strides default to the window, as in torch


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("keepdims", [False, True])
def test_global_avg_pool_matches_torch_adaptive_avg_pool(n, keepdims):
    x = torch_input((5, 4, 3)[:n]) + 2
    expected = getattr(torch.nn, f"AdaptiveAvgPool{n}d")(1)(x)
    expected = channels_last(expected) if keepdims else numpy(expected.flatten(1))
    ours = nn.GlobalAvgPool(keepdims=keepdims)(jnp.asarray(channels_last(x)))
    assert_close(ours, expected)


def test_pools_keep_any_batch_axes():
    x = jnp.asarray(channels_last(torch_input((6, 7))))  # [2, 6, 7, 3]
    for pool in (nn.MaxPool((3, 2), 2, 1), nn.AvgPool((3, 2), 2, 1, count_include_pad=False)):
        expected = pool(x)
        np.testing.assert_array_equal(pool(x[0]), expected[0])  # no batch axis
        stacked = jnp.stack([x, x[::-1]])  # [2, 2, 6, 7, 3]
        np.testing.assert_array_equal(pool(stacked), jnp.stack([expected, expected[::-1]]))


def test_low_precision_inputs_keep_their_dtype_and_are_summed_in_float32():
    # 512 ones: a bfloat16 running sum stops at 256 (256 + 1 rounds back to 256)
    ones = jnp.ones((2, 512, 3), jnp.bfloat16)
    assert nn.AvgPool((512,))(ones).dtype == jnp.bfloat16
    np.testing.assert_array_equal(nn.AvgPool((512,))(ones), np.ones((2, 1, 3)))
    np.testing.assert_array_equal(nn.GlobalAvgPool()(ones), np.ones((2, 3)))
    x = jnp.asarray(channels_last(torch_input((6, 7))), jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    y = nn.MaxPool((2, 7))(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(y, x64[:, :6].reshape(2, 3, 2, 1, 7, 3).max((2, 4)))
    y = nn.GlobalAvgPool()(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float64), x64.mean((1, 2)), rtol=2**-8, atol=1e-3)
    assert nn.AvgPool((2, 2))(x.astype(jnp.float16)).dtype == jnp.float16


@pytest.mark.parametrize(
    "pool",
    [nn.MaxPool((3, 3), 2, 1), nn.AvgPool((3, 3), 2, 1, ceil_mode=True), nn.GlobalAvgPool()],
    ids=["MaxPool", "AvgPool", "GlobalAvgPool"],
)
def test_pools_have_no_state_jit_and_run_in_a_named_scope(pool):
    assert pool.flat_state_dict() == {} and jax.tree.leaves(pool) == []
    x = jnp.asarray(channels_last(torch_input((6, 5))))
    np.testing.assert_allclose(jax.jit(lambda p, x: p(x))(pool, x), pool(x), atol=1e-6)
    name = type(pool).__name__
    jaxpr = jax.make_jaxpr(lambda p, x: p(x))(pool, x).jaxpr
    stacks = {str(eqn.source_info.name_stack) for eqn in jaxpr.eqns}
    assert stacks and all(stack.startswith(name) for stack in stacks), stacks


def test_reprs_show_the_configuration():
    assert repr(nn.MaxPool(2, dims=2)) == (
        "MaxPool(kernel_size=(2, 2), strides=(2, 2), padding=(0, 0), ceil_mode=False)"
    )
    pool = nn.AvgPool((3,))  # PyTorch's defaults
    assert (pool.strides, pool.padding, pool.ceil_mode, pool.count_include_pad) == (
        (3,), (0,), False, True
    )  # fmt: skip
    assert "count_include_pad=False" in repr(nn.AvgPool((3,), 1, 1, count_include_pad=False))
    assert repr(nn.GlobalAvgPool(keepdims=True)) == "GlobalAvgPool(keepdims=True)"


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_pools_under_a_mesh_equal_the_unsharded_result(axis_type):
    """Split on the batch and a spatial axis: the windows cross the spatial split."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    x = channels_last(torch_input((8, 6)))
    pools = [nn.MaxPool((3, 3), 2, 1), nn.AvgPool((3, 3), 2, 1, ceil_mode=True),
             nn.GlobalAvgPool()]  # fmt: skip
    with jax.set_mesh(mesh):
        split = jax.device_put(x, P("data", "model"))
        outs = [jax.jit(lambda p, x: p(x))(pool, split) for pool in pools]
    for pool, out in zip(pools, outs, strict=True):
        assert_close(out, pool(jnp.asarray(x)), 1e-6)
        if axis_type == AxisType.Explicit:  # split as the batch, the spatial axes gathered
            assert out.sharding.spec == P("data", *(None,) * (out.ndim - 1))


BAD_ARGUMENTS = [
    (lambda: nn.MaxPool(2),
     r"MaxPool cannot tell the number of spatial axes from kernel_size=2: pass a tuple, one "
     r"size per spatial axis \(\(2, 2\) for 2D\), or dims= \(dims=2\)\."),
    (lambda: nn.AvgPool((2, 2), strides=(1, 1, 1)),
     r"AvgPool's arguments disagree on the number of spatial axes \(kernel_size=\(2, 2\), "
     r"strides=\(1, 1, 1\)\); give each tuple one entry per spatial axis, and dims that number"),
    (lambda: nn.MaxPool(2, padding=(1,), dims=2),
     r"MaxPool's arguments disagree .* \(dims=2, padding=\(1,\)\)"),
    (lambda: nn.MaxPool(2, dims=0), r"MaxPool's dims is the number of spatial axes, got 0\."),
    (lambda: nn.MaxPool(()), r"MaxPool's kernel_size is empty; give one entry per spatial axis"),
    (lambda: nn.MaxPool((3, 0)),
     r"MaxPool's kernel_size must be a positive int or 2 positive ints \(one per spatial "
     r"axis\), got \(3, 0\)\."),
    (lambda: nn.AvgPool((3,), strides=0), r"AvgPool's strides must be a positive int or 1 "),
    (lambda: nn.AvgPool((3,), padding=-1),
     r"AvgPool's padding must be a non-negative int or 1 non-negative ints"),
    (lambda: nn.MaxPool(3, padding=2, dims=1),
     r"MaxPool's padding \(2,\) must be at most half of kernel_size \(3,\) on every axis \(as "
     r"PyTorch requires\), or a window could hold padding only; pass padding=1 or less, or a "
     r"larger kernel_size\."),
    (lambda: nn.AvgPool((4, 3), padding=(2, 2)), r"AvgPool's padding \(2, 2\) .* padding=\(2, 1\)"),
]  # fmt: skip


@pytest.mark.parametrize("make, message", BAD_ARGUMENTS)
def test_bad_arguments_are_refused_with_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_window_larger_than_the_padded_input_is_refused():
    with pytest.raises(
        ValueError,
        match=r"MaxPool's window \(3, 3\) is larger than its padded input \(2, 7\) \(the "
        r"input's spatial axes \(2, 5\) with padding \(0, 1\) on both sides\)\. Pass a larger "
        r"input, a smaller kernel_size or more padding\.",
    ):
        nn.MaxPool((3, 3), padding=(0, 1))(jnp.ones((4, 2, 5, 3)))
    with pytest.raises(ValueError, match=r"AvgPool's window \(4,\) is larger than its padded "):
        nn.AvgPool((4,), 1, ceil_mode=True)(jnp.ones((2, 2, 3)))  # ceil_mode cannot save it
    assert nn.AvgPool((4,), 1, 1)(jnp.ones((2, 2, 3))).shape == (2, 1, 3)  # with padding it fits


def test_inputs_with_too_few_axes_are_refused(without_type_checks):
    with pytest.raises(
        ValueError,
        match=r"AvgPool has a 2D window \(2, 2\), so it expects inputs \[\*batch, 2 spatial "
        r"axes, features\] \(channels last\), got an input of shape \(4, 3\)\. Add the missing "
        r"axes, e\.g\. x\[\.\.\., None\] for one feature\.",
    ):
        nn.AvgPool((2, 2))(jnp.ones((4, 3)))
    with pytest.raises(ValueError, match=r"MaxPool has a 1D window \(2,\), .* shape \(\)"):
        nn.MaxPool((2,))(jnp.ones(()))
    with pytest.raises(
        ValueError,
        match=r"GlobalAvgPool expects inputs \[batch, \*spatial, features\] with at least one "
        r"spatial axis, got an input of shape \(4, 3\)\. Add a spatial axis \(x\[:, None\]\) "
        r"or leave the pooling out\.",
    ):
        nn.GlobalAvgPool()(jnp.ones((4, 3)))


def test_sizes_that_are_not_ints_are_refused(without_type_checks):
    with pytest.raises(
        ValueError,
        match=r"^MaxPool's kernel_size must be a positive int or 1 positive ints \(one per "
        r"spatial axis\), got \(2\.5,\)\.$",
    ):
        nn.MaxPool((2.5,))  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8])
def test_max_pool_of_integers_pads_with_their_lowest_value(dtype, without_type_checks):
    """Integer inputs (no -inf) are padded with the dtype's minimum: negative values next
    to the padding are still the maxima of their windows. (The signature says Float, so
    the test-time type checks are off.)"""
    x = np.random.default_rng(0).integers(-100, -1, size=(2, 7, 3))
    pool = nn.MaxPool((3,), 2, 1)
    y = pool(jnp.asarray(x, dtype))
    assert y.dtype == dtype
    expected = pool(jnp.asarray(x, jnp.float32))
    np.testing.assert_array_equal(y, np.asarray(expected).astype(np.int64))


def test_pools_gather_only_the_split_spatial_axes():
    """On Explicit axes, a split last spatial axis is gathered before the windows are taken,
    and the features stay split as they came."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    x = np.random.default_rng(0).normal(size=(2, 6, 8, 4)).astype(np.float32)
    pools = [nn.MaxPool((3, 3), 2, 1), nn.AvgPool((3, 3), 2, 1, ceil_mode=True)]
    with jax.set_mesh(mesh):
        split = jax.device_put(x, P(None, None, "data", "model"))
        outs = [jax.jit(lambda p, x: p(x))(pool, split) for pool in pools]
    for pool, out in zip(pools, outs, strict=True):
        assert out.sharding.spec == P(None, None, None, "model")
        assert_close(out, pool(jnp.asarray(x)), 1e-6)


def test_with_x64_a_float32_average_stays_in_float32():
    x = channels_last(torch_input((7,)))
    pool = nn.AvgPool((3,), 2, 1, ceil_mode=True)
    expected = pool(jnp.asarray(x))
    with jax.enable_x64(True):
        y = pool(jnp.asarray(x))
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, expected)  # the same float32 arithmetic
