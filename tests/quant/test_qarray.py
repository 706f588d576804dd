"""tt.QArray: symmetric max-abs quantization against a NumPy oracle, the checks of its parts,
array-like properties and repr, PyTree behaviour, and the plain functions loaders use."""

import dataclasses
import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import nn
from taktiny.quant import _qarray as _quant


def weights(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def oracle(w, bits, axis, group_size, by_stored=True):
    """Symmetric max-abs quantization in NumPy: (value, scale), scale of the reduced shape
    in `w`'s dtype, as it is stored; computed in float32, the values rounded by the scale
    as stored, times its float32 reciprocal (`by_stored=False`: by max|w| / qmax before
    it is rounded to its dtype, the slip the half-precision tests below are made to tell
    apart)."""
    qmax, dtype = (127 if bits == 8 else 7), w.dtype
    w = np.moveaxis(w.astype(np.float32), axis, 0)
    size = w.shape[0] if group_size is None else group_size
    grouped = w.reshape(w.shape[0] // size, size, *w.shape[1:])
    exact = np.abs(grouped).max(axis=1, keepdims=True) / np.float32(qmax)
    scale = np.where(exact == 0, 1, exact).astype(dtype)
    by = scale.astype(np.float32) if by_stored else np.where(exact == 0, 1, exact)
    value = np.clip(np.round(grouped * (np.float32(1) / by)), -qmax, qmax).reshape(w.shape)
    return np.moveaxis(value, 0, axis), np.moveaxis(scale[:, 0], 0, axis)


LAYOUTS = [(8, 0, None), (4, 0, None), (8, 1, None), (4, 0, 16), (8, 0, 32), (4, 1, 8)]


@pytest.mark.parametrize("bits, axis, group_size", LAYOUTS)
def test_quantize_matches_the_numpy_oracle(bits, axis, group_size):
    w = weights(64, 48)
    q = tt.QArray.quantize(w, bits=bits, axis=axis, group_size=group_size)
    value, scale = oracle(w, bits, axis, group_size)
    assert q.value.dtype == (jnp.int8 if bits == 8 else jnp.int4)
    assert (q.bits, q.axis, q.group_size) == (bits, axis, group_size)
    np.testing.assert_array_equal(np.asarray(q.value).astype(np.int8), value)
    np.testing.assert_allclose(q.scale, scale, rtol=1e-6)
    # each entry is within half a step of its scale
    step = np.asarray(q.dequantize()) - w
    full = np.repeat(scale, 1 if group_size is None else group_size, axis=axis)
    assert np.all(np.abs(step) <= full / 2 * (1 + 1e-5))
    assert np.abs(q.value.astype(jnp.int8)).max() == (127 if bits == 8 else 7)


def test_an_all_zero_channel_gets_scale_one_and_dequantizes_to_zero():
    w = weights(16, 4)
    w[:, 2] = 0
    q = tt.QArray.quantize(w)
    assert float(q.scale[0, 2]) == 1.0 and np.all(np.isfinite(q.scale))
    np.testing.assert_array_equal(q.dequantize()[:, 2], np.zeros(16))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_coarse_float16_scale_is_clipped_into_range(bits):
    # scales of tiny float16 weights are subnormal: rounded down by up to a few percent,
    # the largest int8 entries would round past 127 (and wrap around) without the clip;
    # int4 (a qmax of 8 would wrap to -8) keeps its range here even without it
    w = weights(256, 64, dtype=np.float16) * np.float16(5e-5)
    q = tt.QArray.quantize(w, bits=bits)
    qmax = 127 if bits == 8 else 7
    value = np.asarray(q.value).astype(np.int8)
    assert value.min() >= -qmax and value.max() <= qmax
    assert q.scale.dtype == jnp.float16
    signs = np.sign(value) == np.sign(w)
    assert np.all(signs | (value == 0))  # no entry wrapped around to the other sign


def test_the_scale_keeps_the_weights_dtype_and_dequantize_takes_any():
    q = tt.QArray.quantize(jnp.asarray(weights(8, 4)).astype(jnp.bfloat16), bits=4)
    assert q.scale.dtype == jnp.bfloat16 and q.dtype == jnp.bfloat16
    assert q.dequantize().dtype == jnp.bfloat16
    assert q.dequantize(jnp.float32).dtype == jnp.float32


def test_array_properties_and_storage_bytes():
    q8 = tt.QArray.quantize(weights(512, 256))
    assert (q8.shape, q8.ndim, q8.size, q8.dtype) == ((512, 256), 2, 512 * 256, jnp.float32)
    assert q8.nbytes == 512 * 256 + 256 * 4
    q4 = tt.QArray.quantize(weights(512, 256), bits=4, group_size=64)
    assert q4.nbytes == 512 * 256 // 2 + 8 * 256 * 4
    odd = tt.QArray.quantize(weights(3, 3), bits=4)
    assert odd.nbytes == 5 + 3 * 4  # 9 values in 4.5 bytes, rounded up


def test_repr_reads_like_an_array():
    assert repr(tt.QArray.quantize(weights(512, 256))) == (
        "QArray(i8[512,256], scale=f32[1,256], axis=0)"
    )
    q = tt.QArray.quantize(weights(64, 8), bits=4, axis=1, group_size=4)
    assert repr(q) == "QArray(i4[64,8], scale=f32[64,2], axis=1, group_size=4)"
    abstract = jax.eval_shape(lambda: q)
    assert repr(abstract) == repr(q)
    # other leaves (of a tree map) as they are, even one with a shape but no dtype
    assert repr(jax.tree.map(lambda x: None, q)) == "QArray(None, scale=None, axis=1, group_size=4)"
    shaped = type("Shaped", (), {"shape": (2,), "__repr__": lambda self: "<shaped>"})()
    only_shape = dataclasses.replace(q, value=shaped)  # (not checked: not an array)
    assert repr(only_shape) == "QArray(<shaped>, scale=f32[64,2], axis=1, group_size=4)"
    # inside a tree, as equinox (and so a module's repr) prints it
    assert eqx.tree_pformat({"w": q}) == f"{{'w': {q!r}}}"
    model = tt.quantize(nn.Linear(4, 2, rngs=nn.Rngs(0)))
    assert "(kernel=QArray(i8[4,2], scale=f32[1,2], axis=0), bias=f32[2])" in repr(model)


@pytest.mark.parametrize("bits, axis, group_size", LAYOUTS)
def test_a_stacked_qarray_dequantizes_and_reads_layer_by_layer(bits, axis, group_size):
    """A stack's QArray (nn.Stack holds one QArray per layer as one, its parts with the
    leading layer axes and its axis counted within a layer) dequantizes each layer as the
    NumPy oracle does, one and two layer axes, and its repr shows the layers apart from
    a layer's shapes. Seen to fail with the layer axes not added to the axis
    (dequantize_array's reshape) and with the repr of the whole parts' shapes."""
    w = weights(4, 64, 48)
    stacked = jax.vmap(
        lambda x: tt.QArray.quantize(x, bits=bits, axis=axis, group_size=group_size)
    )(jnp.asarray(w))
    assert (stacked.axis, stacked.shape) == (axis, (4, 64, 48))
    each = [oracle(w[i], bits, axis, group_size) for i in range(4)]
    want = np.stack(
        [v * np.repeat(s, 1 if group_size is None else group_size, axis=axis) for v, s in each]
    )
    np.testing.assert_allclose(stacked.dequantize(), want, rtol=1e-6)
    twice = jax.tree.map(lambda x: x.reshape(2, 2, *x.shape[1:]), stacked)
    np.testing.assert_array_equal(
        twice.dequantize(), np.asarray(stacked.dequantize()).reshape(2, 2, 64, 48)
    )
    layer = "i8" if bits == 8 else "i4"
    scale = [*stacked.scale.shape[1:]]
    group = "" if group_size is None else f", group_size={group_size}"
    assert (
        repr(stacked)
        == f"QArray(4 layers of {layer}[64,48], scale=f32[{scale[0]},{scale[1]}], axis={axis}{group})"
    )
    assert repr(twice).startswith(f"QArray(2x2 layers of {layer}[64,48], scale=f32[")
    assert repr(jax.eval_shape(lambda: stacked)) == repr(stacked)
    model = tt.quantize(
        nn.Stack(lambda r: nn.Linear(36, 8, rngs=r), 3, rngs=nn.Rngs(0)), bits=4, group_size=9
    )
    assert "kernel=QArray(3 layers of i4[36,8], scale=f32[4,8], axis=0, group_size=9)" in repr(
        model
    )


def test_parts_are_named_children_and_the_layout_is_static():
    q = tt.QArray.quantize(weights(8, 4), bits=4, group_size=4)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(q)[0]]
    assert paths == [".value", ".scale"]
    other = tt.QArray.quantize(weights(8, 4), bits=4)
    assert jax.tree.structure(q) != jax.tree.structure(other)  # group_size is static
    doubled = jax.jit(lambda q: q.dequantize() * 2)(q)
    np.testing.assert_array_equal(doubled, q.dequantize() * 2)
    # tree maps with other leaves build the node without checking them
    assert jax.tree.map(lambda x: None, q).value is None
    assert jax.tree.map(lambda x: True, q).scale is True
    grads = jax.grad(lambda q: q.dequantize().sum(), allow_int=True)(q)
    assert grads.value.dtype == jax.dtypes.float0 and grads.scale.shape == (2, 4)
    copied = pickle.loads(pickle.dumps(q))
    np.testing.assert_array_equal(copied.scale, q.scale)
    assert jax.tree.structure(copied) == jax.tree.structure(q)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.bits = 8  # pyright: ignore[reportAttributeAccessIssue]


def test_abstract_arrays_quantize_and_dequantize_abstractly():
    q = tt.QArray.quantize(jax.ShapeDtypeStruct((64, 8), jnp.bfloat16), bits=4, group_size=16)
    assert isinstance(q.value, jax.ShapeDtypeStruct) and q.value.dtype == jnp.int4
    assert q.scale.shape == (4, 8) and q.scale.dtype == jnp.bfloat16
    out = q.dequantize(jnp.float32)
    assert isinstance(out, jax.ShapeDtypeStruct) and out.shape == (64, 8)


def INT8():  # made in the test: collecting the tests must not start JAX
    return jnp.zeros((8, 4), jnp.int8)


@pytest.mark.parametrize(
    "value, scale, meta, message",
    [
        (INT8, lambda: jnp.ones((2, 4)), {"bits": 8, "axis": 0},
         r"scale has shape \(2, 4\), expected \(1, 4\) for a value of shape \(8, 4\) quantized "
         r"along axis 0 \(one per channel\)"),
        (INT8, lambda: jnp.ones((1, 4)), {"bits": 8, "axis": 0, "group_size": 4},
         r"scale has shape \(1, 4\), expected \(2, 4\).*\(one per group of 4\)"),
        (INT8, lambda: jnp.ones((8, 1)), {"bits": 8, "axis": 0},  # the scale of the other axis
         r"scale has shape \(8, 1\), expected \(1, 4\)"),
        (INT8, lambda: jnp.ones((1, 4)), {"bits": 4, "axis": 0},
         r"a 4-bit QArray holds int4 values, got int8; quantize float weights with "
         r"QArray\.quantize\(w, bits=4, \.\.\.\)"),
        (lambda: jnp.ones((8, 4)), lambda: jnp.ones((1, 4)), {"bits": 8, "axis": 0},
         r"a 8-bit QArray holds int8 values, got float32"),
        (INT8, lambda: jnp.ones((1, 4), jnp.int32), {"bits": 8, "axis": 0},
         r"scale must be a float array, got int32"),
        (INT8, lambda: jnp.ones((1, 4)), {"bits": 3, "axis": 0}, r"bits must be 8 or 4, got 3"),
        (INT8, lambda: jnp.ones((1, 4)), {"bits": 8, "axis": 2},
         r"axis must be an axis of the array, 0 to 1, got 2 \(value of shape \(8, 4\)\)"),
        (INT8, lambda: jnp.ones((1, 4)), {"bits": 8, "axis": 0, "group_size": 3},
         r"group_size must divide axis 0 \(size 8\) into whole groups, got 3"),
    ],
)  # fmt: skip
def test_inconsistent_parts_are_refused(value, scale, meta, message):
    value, scale = value(), scale()
    tt.QArray(INT8(), jnp.ones((1, 4)), bits=8, axis=0)  # a consistent one first (it is cached)
    with pytest.raises(ValueError, match=r"^QArray: " + message):
        tt.QArray(value, scale, **meta)


def test_quantize_refuses_what_it_cannot_quantize():
    with pytest.raises(TypeError, match=r"cannot quantize the array: expected a float array"):
        tt.QArray.quantize(np.ones((4, 4), np.int32))
    with pytest.raises(
        ValueError,
        match=r"cannot quantize the array of shape \(10, 4\): group_size must divide axis 0 "
        r"\(size 10\) into whole groups, got 4; pick a divisor of 10, or None",
    ):
        tt.QArray.quantize(weights(10, 4), group_size=4)


def test_plain_functions_for_loaders_quantize_like_a_leaf_and_dequantize():
    like = tt.QArray.quantize(jnp.asarray(weights(32, 8)).astype(jnp.bfloat16), bits=4,
                              group_size=8)  # fmt: skip
    w = weights(32, 8, seed=1)
    q = _quant.quantize_like(w, like)
    assert jax.tree.structure(q) == jax.tree.structure(like)
    assert q.scale.dtype == jnp.bfloat16 and q.value.dtype == jnp.int4
    value, scale = _quant.quantize_array(w, bits=4, axis=0, group_size=8, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(q.value, np.int8), np.asarray(value, np.int8))
    full = _quant.dequantize_array(value, scale, axis=0, group_size=8, dtype=jnp.float32)
    np.testing.assert_array_equal(full, q.dequantize(jnp.float32))
    with pytest.raises(
        ValueError, match=r"cannot quantize w like QArray\(i4\[32,8\].*its shape is \(8, 32\)"
    ):
        _quant.quantize_like(w.T, like, name="w")
    with pytest.raises(ValueError, match=r"^cannot quantize the array like QArray\(i4\[32,8\]"):
        _quant.quantize_like(w.T, like)  # named by default
    with pytest.raises(TypeError, match=r"^cannot quantize w: expected a float array, got int32"):
        _quant.quantize_like(w.astype(np.int32), like, name="w")  # the name reaches the checks


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_split_arrays_give_parts_split_alike(axis_type):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    w = weights(64, 32)
    for spec, scale_spec in [
        (P(None, "model"), P(None, "model")),
        (P("model", "data"), P(None, "data")),
    ]:
        split = jax.device_put(w, NamedSharding(mesh, spec))
        q = tt.QArray.quantize(split, bits=4, group_size=16)
        assert q.value.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
        assert q.scale.sharding.is_equivalent_to(NamedSharding(mesh, scale_spec), 2)
        expected = tt.QArray.quantize(w, bits=4, group_size=16)
        np.testing.assert_array_equal(
            np.asarray(q.value, np.int8), np.asarray(expected.value, np.int8)
        )
        np.testing.assert_array_equal(q.scale, expected.scale)
    rows = jax.device_put(w, NamedSharding(mesh, P("model")))
    with pytest.raises(
        ValueError,
        match=r"the array of shape \(64, 32\) is split 4 ways along axis 0 .* does not divide its "
        r"2 groups of 32: a group would straddle two devices",
    ):
        tt.QArray.quantize(rows, group_size=32)


def test_parts_layout_reads_bits_axis_and_group_size_from_the_parts_shapes():
    value = lambda *shape, dtype=jnp.int8: jax.ShapeDtypeStruct(shape, dtype)
    scale = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    layouts = [
        (value(4, 3), scale(1, 3), (8, 0, None)),  # one scale per channel along axis 0
        (value(4, 3, dtype=jnp.int4), scale(4, 1), (4, 1, None)),
        (value(4, 6), scale(4, 2), (8, 1, 3)),  # groups of 3 along axis 1
        (value(4, 3), scale(4, 3), (8, 0, 1)),  # one scale per entry: groups of 1
        (value(2, 3), scale(2, 3), (8, 0, 1)),
        (value(3, 1), scale(3, 1), (8, 0, 1)),
        (value(1, 3), scale(1, 3), (8, 0, None)),  # (axis 0 has one entry: a channel)
    ]
    assert [_quant.parts_layout(v, s) for v, s, _ in layouts] == [want for _, _, want in layouts]
    ranks = "the scale must have as many axes as the value (at least one), got a value of shape"
    misfit = "does not fit a value of shape {}: it must be the value's shape with one axis " \
        "reduced to 1 (one scale per channel) or to a number of groups that divides it"  # fmt: skip
    refused = [
        (value(4, 3, dtype=jnp.float32), scale(1, 3), "the value must be int8 or int4, got float32"),
        (value(), scale(), f"{ranks} () and a scale of shape ()"),
        (value(4, 2), scale(2), f"{ranks} (4, 2) and a scale of shape (2,)"),
        (value(4, 6), scale(2, 3), "a scale of shape (2, 3) " + misfit.format((4, 6))),
        (value(4, 3), scale(0, 3), "a scale of shape (0, 3) " + misfit.format((4, 3))),
        (value(4, 3), scale(3, 3), "a scale of shape (3, 3) " + misfit.format((4, 3))),
    ]  # fmt: skip
    assert [_quant.parts_layout(v, s) for v, s, _ in refused] == [want for _, _, want in refused]


def test_group_sizes_start_at_1_and_a_group_size_of_0_is_refused():
    w = weights(8, 4)
    q = tt.QArray.quantize(w, group_size=1)  # a scale for each entry
    assert q.scale.shape == (8, 4)
    np.testing.assert_array_equal(np.asarray(q.value, np.int8), oracle(w, 8, 0, 1)[0])
    with pytest.raises(
        ValueError, match=r"group_size must divide axis 0 \(size 8\) into whole groups, got 0"
    ):
        tt.QArray.quantize(w, group_size=0)


def test_array_likes_quantize_as_their_arrays_do():
    rows = [[1.0, -2.0, 0.25], [0.5, 4.0, -8.0]]
    q, expected = tt.QArray.quantize(rows), tt.QArray.quantize(np.array(rows, np.float32))
    np.testing.assert_array_equal(np.asarray(q.value, np.int8), np.asarray(expected.value, np.int8))
    np.testing.assert_array_equal(q.scale, expected.scale)


def test_the_quantize_rule_refuses_an_integer_array():
    from taktiny import convert as cv

    with pytest.raises(TypeError, match=r"^cannot quantize the array: expected a float array"):
        cv.quantize()((np.ones((4, 4), np.int32),))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_an_axis_split_over_two_mesh_axes_or_per_channel_quantizes(axis_type):
    """Groups may not straddle devices: an axis split over ('data', 'model') is split 8
    ways; one scale per channel (no groups along the axis) takes any split."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    w = weights(64, 8)
    expected = {g: tt.QArray.quantize(w, group_size=g) for g in (8, None)}
    split = jax.device_put(w, NamedSharding(mesh, P(("data", "model"))))
    for group_size in (8, None):  # 8 groups of 8, or one scale per channel
        q = tt.QArray.quantize(split, group_size=group_size)
        assert q.value.sharding.is_equivalent_to(split.sharding, 2)
        np.testing.assert_array_equal(
            np.asarray(q.value, np.int8), np.asarray(expected[group_size].value, np.int8)
        )
        np.testing.assert_array_equal(q.scale, expected[group_size].scale)
    with pytest.raises(ValueError, match=r"is split 8 ways along axis 0 .* its 4 groups of 16"):
        tt.QArray.quantize(split, group_size=16)


def test_inside_jit_on_auto_axes_a_split_array_quantizes_as_outside():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    w = weights(64, 32)
    split = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    with jax.set_mesh(mesh):
        q = jax.jit(lambda w: tt.QArray.quantize(w, bits=4, group_size=16))(split)
    expected = tt.QArray.quantize(w, bits=4, group_size=16)
    np.testing.assert_array_equal(np.asarray(q.value, np.int8), np.asarray(expected.value, np.int8))
    np.testing.assert_array_equal(q.scale, expected.scale)


# Half-precision scales: the values are rounded by the scale as stored (max|w| / qmax rounded
# to float16 or bfloat16), not by max|w| / qmax itself. Weights drawn at random rarely tell
# the two apart (a float16 scale differs from its float32 value by at most 2**-11 of it),
# so each group's values are picked from those of its dtype that round to another integer
# by the one scale than by the other.


def straddling(dtype, bits, n, rng):
    """`n` values of `dtype` sharing one scale (their largest magnitude over qmax), all but
    the largest rounding to another integer by the scale as stored than by its float32
    value (found among all the values of `dtype` below the largest; some repeat), none
    next to a tie; random signs and order."""
    qmax = 127 if bits == 8 else 7
    bits_of = np.arange(0x7C00 if dtype == np.float16 else 0x7F80, dtype=np.uint16)
    pool = bits_of.view(dtype).astype(np.float32)[1:]  # every positive finite value
    for _ in range(1000):
        largest = rng.choice(pool[(pool > 1e-2) & (pool < 1e2)])
        exact = largest / np.float32(qmax)
        stored = exact.astype(dtype).astype(np.float32)
        below = pool[pool < largest]
        # (and not within 1e-4 of a tie by the stored scale: XLA divides by a scale it
        # broadcasts as a product with its reciprocal, a last bit off the quotient)
        clear = np.abs(below / stored % 1 - 0.5) > 1e-4
        differ = below[clear & (np.round(below / stored) != np.round(below / exact))]
        if len(differ) >= (3 if bits == 4 else 16):  # (at most one by each k + 1/2)
            break
    values = np.concatenate([[largest], rng.choice(differ, n - 1)])
    values *= rng.choice(np.float32([-1, 1]), n)
    return rng.permutation(values).astype(dtype)


def straddled(dtype, bits, shape, axis, group_size, seed=0):
    """An array of `shape` whose every channel (or group) along `axis` is `straddling`."""
    rng = np.random.default_rng(seed)
    size = shape[axis] if group_size is None else group_size
    moved = (shape[axis], *shape[:axis], *shape[axis + 1 :])
    count = int(np.prod(moved)) // size
    groups = np.stack([straddling(dtype, bits, size, rng) for _ in range(count)], axis=-1)
    w = groups.reshape(size, moved[0] // size, *moved[1:])  # (one group per column)
    return np.moveaxis(w.swapaxes(0, 1).reshape(moved), 0, axis)


HALF = [np.float16, ml_dtypes.bfloat16]
HALF_LAYOUTS = [(8, 0, None), (4, 0, None), (8, 1, None), (4, 1, None), (8, 0, 8), (4, 1, 8)]


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("bits, axis, group_size", HALF_LAYOUTS)
def test_values_are_rounded_by_the_half_precision_scale_as_stored(dtype, bits, axis, group_size):
    w = straddled(dtype, bits, (32, 16), axis, group_size)
    value, scale = oracle(w, bits, axis, group_size)
    slipped, _ = oracle(w, bits, axis, group_size, by_stored=False)
    # the inputs tell the two apart: all but each group's largest (and what clips)
    assert np.mean(value != slipped) > 0.5
    q = tt.QArray.quantize(w, bits=bits, axis=axis, group_size=group_size)
    assert q.scale.dtype == dtype
    assert np.asarray(q.scale).tobytes() == scale.tobytes()
    np.testing.assert_array_equal(np.asarray(q.value).astype(np.int8), value)


@pytest.mark.parametrize("stored", ["float32", "half"])
@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("bits, group_size", [(8, None), (4, None), (8, 8), (4, 4)])
def test_a_quantizing_load_rounds_by_the_scale_as_stored(tmp_path, dtype, bits, group_size, stored):
    """A float checkpoint loaded into a quantized model (a Linear kernel, quantized along
    its input axis, and an Embed table, along its features), from tensors of the model's
    half-precision dtype or of float32 (cast to it as they load)."""
    from taktiny.io import load_safetensors, save_safetensors

    kernel = straddled(dtype, bits, (32, 12), 0, group_size, seed=1)
    table = straddled(dtype, bits, (6, 16), 1, group_size, seed=2)

    def make():
        return {
            "dense": nn.Linear(32, 12, use_bias=False, param_dtype=dtype, rngs=nn.Rngs(0)),
            "embed": nn.Embed(6, 16, param_dtype=dtype, rngs=nn.Rngs(0)),
        }

    on_disk = np.float32 if stored == "float32" else dtype
    path = tmp_path / "float.safetensors"
    save_safetensors(path, {"dense.kernel": kernel.astype(on_disk),
                            "embed.embedding": table.astype(on_disk)})  # fmt: skip
    target = tt.quantize(jax.eval_shape(make), bits=bits, group_size=group_size)
    loaded = load_safetensors(target, path)
    for q, w, axis in [(loaded["dense"].kernel, kernel, 0), (loaded["embed"].embedding, table, 1)]:
        value, scale = oracle(w, bits, axis, group_size)
        assert (q.axis, q.scale.dtype) == (axis, dtype)
        assert np.asarray(q.scale).tobytes() == scale.tobytes()
        np.testing.assert_array_equal(np.asarray(q.value).astype(np.int8), value)
