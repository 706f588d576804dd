"""`taktiny.convert`'s transforms one by one: what each makes of NumPy and JAX arrays, its
inverse, and its repr and equality (rules and conversion errors show transforms by repr)."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taktiny import convert as cv


def arange(*shape: int) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


def both(transform: cv.Transform, x: np.ndarray, count: int | None = None) -> Any:
    """The transform's outputs on `x` as NumPy, and on `x` as JAX: each in its library."""
    mine = transform((x,), count)
    theirs = transform((jnp.asarray(x),), count)
    assert all(type(a) is np.ndarray for a in mine), [type(a) for a in mine]
    assert all(isinstance(a, jax.Array) for a in theirs), [type(a) for a in theirs]
    for a, b in zip(mine, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    return mine


def test_each_transform_reads_as_the_call_that_makes_it():
    cases = [
        (cv.Transform(), "Transform()"),
        (cv.identity(), "identity()"),
        (cv.transpose(), "transpose()"),
        (cv.transpose([1, 0, 2]), "transpose((1, 0, 2))"),
        (cv.reshape([2, -1]), "reshape((2, -1))"),
        (cv.reshape([6], source_shape=[2, 3]), "reshape((6,), source_shape=(2, 3))"),
        (cv.cast(np.float16), "cast('float16')"),
        (cv.cast("bfloat16", source_dtype=jnp.float32), "cast('bfloat16', source_dtype='float32')"),
        (cv.flip([0, 2]), "flip((0, 2))"),
        (cv.split(), "split(axis=0)"),
        (cv.split(1, [2, 3]), "split(axis=1, sizes=(2, 3))"),
        (cv.concatenate(-1), "concatenate(axis=-1)"),
        (cv.concatenate(1, [2, 3]), "concatenate(axis=1, sizes=(2, 3))"),
        (cv.stack(), "stack(axis=0)"),
        (cv.stack(2), "stack(axis=2)"),
        (cv.unstack(), "unstack(axis=0)"),
        (cv.unstack(2), "unstack(axis=2)"),
        (cv.chain(cv.split(), cv.transpose()), "chain(split(axis=0), transpose())"),
        (cv.quantize(), "quantize(bits=8, axis=0)"),
        (cv.quantize(group_size=2), "quantize(bits=8, axis=0, group_size=2)"),
        (cv.quantize(dtype=np.float16), "quantize(bits=8, axis=0, dtype='float16')"),
        (cv.quantize(4, 1, 8, dtype=jnp.bfloat16),
         "quantize(bits=4, axis=1, group_size=8, dtype='bfloat16')"),
        (cv.dequantize(), "dequantize(axis=0)"),
        (cv.dequantize(1, 4, bits=4, dtype=np.float16),
         "dequantize(axis=1, group_size=4, bits=4, dtype='float16')"),
    ]  # fmt: skip
    assert [repr(t) for t, _ in cases] == [text for _, text in cases]


def test_transforms_are_equal_when_they_read_alike_and_hash_so():
    assert cv.split(0) == cv.split(axis=0)
    assert hash(cv.split(0)) == hash(cv.split(axis=0))
    assert {cv.split(0): "found"}[cv.split(axis=0)] == "found"
    assert cv.transpose((1, 0)) != cv.transpose()  # one class, other arguments
    assert cv.stack(0) != cv.unstack(0)

    class identity(cv.Transform):  # reads as cv.identity() but is another class
        pass

    assert repr(identity()) == repr(cv.identity())
    assert identity() != cv.identity() and cv.identity() != identity()
    distinct = [cv.identity(), cv.transpose(), cv.transpose((1, 0)), cv.split(), cv.stack()]
    assert len({hash(t) for t in distinct}) == len(distinct)


def test_the_base_transform_is_abstract_and_has_no_inverse():
    with pytest.raises(NotImplementedError):
        cv.Transform()((arange(2),))
    assert cv.Transform().inverse is None


def test_identity_keeps_the_arrays_themselves():
    x, y = arange(2), jnp.ones(3)
    out = cv.identity()((x, y))
    assert out[0] is x and out[1] is y
    transform = cv.identity()
    assert transform.inverse is transform


def test_transpose_permutes_the_axes_and_inverts_the_permutation():
    x = arange(2, 3, 4)
    (full,) = both(cv.transpose(), x)
    np.testing.assert_array_equal(full, x.T)
    assert cv.transpose().inverse == cv.transpose()
    transform = cv.transpose((1, 2, 0))
    (moved,) = both(transform, x)
    np.testing.assert_array_equal(moved, np.transpose(x, (1, 2, 0)))
    assert transform.inverse == cv.transpose((2, 0, 1))
    (back,) = transform.inverse((moved,))
    np.testing.assert_array_equal(back, x)


def test_reshape_reshapes_each_array_and_inverts_with_its_source_shape():
    x = arange(2, 3)
    transform = cv.reshape([3, -1], source_shape=[2, 3])
    (out,) = both(transform, x)
    np.testing.assert_array_equal(out, x.reshape(3, 2))
    assert transform.inverse == cv.reshape((2, 3), source_shape=(3, -1))
    (back,) = both(transform.inverse, out)
    np.testing.assert_array_equal(back, x)
    a, b = cv.reshape((6,))((x, x + 1))  # each array of the tuple
    np.testing.assert_array_equal(b, x.ravel() + 1)
    assert a.shape == (6,)
    assert cv.reshape((6,)).inverse is None  # no source shape to go back to


def test_cast_casts_each_array_and_inverts_with_its_source_dtype():
    x = arange(2, 3) + 0.25
    transform = cv.cast(jnp.bfloat16, source_dtype="float32")
    (out,) = both(transform, x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, x.astype(jnp.bfloat16))
    assert transform.inverse == cv.cast(np.float32, source_dtype=jnp.bfloat16)
    (back,) = transform.inverse((out,))
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, x)  # exact in bfloat16
    assert cv.cast(np.float16).inverse is None


def test_flip_reverses_the_axes_named_and_is_its_own_inverse():
    x = arange(2, 3, 4)
    (out,) = both(cv.flip((0, 2)), x)
    np.testing.assert_array_equal(out, x[::-1, :, ::-1])
    transform = cv.flip([1])
    assert transform.inverse is transform


def test_split_cuts_by_its_sizes_or_into_as_many_parts_as_targets():
    x = arange(3, 5)
    parts = both(cv.split(axis=1, sizes=[2, 3]), x)
    assert [p.shape for p in parts] == [(3, 2), (3, 3)]
    np.testing.assert_array_equal(parts[1], x[:, 2:])
    parts = both(cv.split(axis=0, sizes=[1, 0, 2]), x)
    assert [p.shape for p in parts] == [(1, 5), (0, 5), (2, 5)]
    np.testing.assert_array_equal(parts[2], x[1:])
    thirds = both(cv.split(), x, count=3)
    np.testing.assert_array_equal(np.stack(thirds), x[:, None])
    with pytest.raises(ValueError, match=r"^split\(axis=0\) needs its sizes here: the number "):
        cv.split()((x,))
    with pytest.raises(ValueError, match=r"^split\(axis=1\) takes one array, got 2$"):
        cv.split(1)((x, x), 2)
    assert cv.split(1, (2, 3)).inverse == cv.concatenate(1, (2, 3))
    assert cv.split(-1).inverse == cv.concatenate(-1)


def test_concatenate_joins_along_its_axis_and_splits_back_into_its_sizes():
    a, b = arange(2, 1), arange(2, 3) + 10
    (out,) = cv.concatenate(axis=1)((a, b))
    assert type(out) is np.ndarray
    np.testing.assert_array_equal(out, np.concatenate([a, b], axis=1))
    (joined,) = cv.concatenate()((jnp.asarray(b), jnp.asarray(b)))
    assert isinstance(joined, jax.Array) and joined.shape == (4, 3)
    (alone,) = cv.concatenate(1)((a,))
    np.testing.assert_array_equal(alone, a)
    (mixed,) = cv.concatenate()((b, jnp.asarray(b)))  # in the first array's library
    assert type(mixed) is np.ndarray and mixed.shape == (4, 3)
    transform = cv.concatenate(1, [1, 3])
    assert transform.inverse == cv.split(1, (1, 3))
    back = transform.inverse(transform((a, b)))
    np.testing.assert_array_equal(back[0], a)
    np.testing.assert_array_equal(back[1], b)


def test_stack_adds_a_new_axis_and_unstack_removes_it():
    a, b = arange(3, 4), arange(3, 4) + 12
    (first,) = cv.stack()((a, b))
    np.testing.assert_array_equal(first, np.stack([a, b]))  # along axis 0 by default
    (middle,) = cv.stack(axis=1)((jnp.asarray(a), jnp.asarray(b)))
    assert isinstance(middle, jax.Array)
    np.testing.assert_array_equal(middle, np.stack([a, b], axis=1))
    (alone,) = cv.stack(2)((a,))
    assert type(alone) is np.ndarray and alone.shape == (3, 4, 1)
    assert cv.stack(1).inverse == cv.unstack(1)
    rows = both(cv.unstack(), first)  # along axis 0 by default
    assert len(rows) == 2
    np.testing.assert_array_equal(rows[1], b)
    columns = both(cv.unstack(axis=1), middle.__array__())
    assert len(columns) == 2 and columns[0].shape == (3, 4)
    np.testing.assert_array_equal(columns[0], a)
    assert cv.unstack(2).inverse == cv.stack(2)
    with pytest.raises(ValueError, match=r"^unstack\(axis=0\) takes one array, got 2$"):
        cv.unstack()((a, b))


def test_chain_runs_its_transforms_in_order_and_inverts_them_backwards():
    x = arange(6, 2)
    transform = cv.chain(cv.split(axis=0), cv.transpose())
    parts = both(transform, x, count=3)
    assert [p.shape for p in parts] == [(2, 2)] * 3
    np.testing.assert_array_equal(parts[2], x[4:].T)
    assert transform.inverse == cv.chain(cv.transpose(), cv.concatenate(0))
    (back,) = transform.inverse(parts, 3)
    np.testing.assert_array_equal(back, x)
    assert cv.chain(cv.transpose(), cv.cast(np.float16)).inverse is None


def test_quantize_makes_a_value_and_its_scales_as_qarray_quantize_does():
    w = np.random.default_rng(0).standard_normal((8, 6), dtype=np.float32)
    value, scale = cv.quantize()((w,))  # 8 bits along axis 0 by default
    assert value.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == (1, 6)
    expected = np.abs(w).max(axis=0, keepdims=True) / 127
    np.testing.assert_allclose(scale, expected, rtol=1e-6)
    np.testing.assert_array_equal(value, np.round(w / np.asarray(scale)))
    value, scale = cv.quantize(bits=4, axis=1, group_size=3)((jnp.asarray(w),))
    assert value.dtype == jnp.int4 and scale.shape == (8, 2)
    expected = np.abs(w.reshape(8, 2, 3)).max(axis=2) / 7
    np.testing.assert_allclose(scale, expected, rtol=1e-6)
    _, scale = cv.quantize(dtype=jnp.bfloat16)((w,))
    assert scale.dtype == jnp.bfloat16
    expected = np.abs(w).max(axis=0, keepdims=True) / 127
    np.testing.assert_array_equal(scale, expected.astype(jnp.bfloat16))  # rounded once
    assert cv.quantize(4, 1, 3, dtype=np.float16).inverse == cv.dequantize(1, 3, bits=4)
    with pytest.raises(ValueError, match=r"^quantize\(bits=8, axis=0\) takes one array, got 2$"):
        cv.quantize()((w, w))


def test_dequantize_multiplies_the_values_by_their_scales_in_the_dtype_asked():
    w = np.random.default_rng(1).standard_normal((4, 6), dtype=np.float32)
    value, scale = cv.quantize(bits=4, axis=1, group_size=2)((w,))
    (out,) = cv.dequantize(1, 2)((np.asarray(value), scale))
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32
    expected = np.asarray(value, np.float32) * np.repeat(np.asarray(scale), 2, axis=1)
    np.testing.assert_array_equal(out, expected)
    (half,) = cv.dequantize(1, 2, dtype=np.float16)((value, scale))
    assert half.dtype == jnp.float16
    scales = np.repeat(np.asarray(scale).astype(np.float16), 2, axis=1)
    np.testing.assert_array_equal(half, np.asarray(value, np.float16) * scales)  # in float16
    (brain,) = cv.dequantize(1, 2)((value, scale.astype(jnp.bfloat16)))  # the scales' dtype
    assert brain.dtype == jnp.bfloat16
    assert cv.dequantize(1, 2, bits=4).inverse == cv.quantize(4, 1, 2)
    assert cv.dequantize(1, 2).inverse is None
    with pytest.raises(ValueError, match=r"^dequantize\(axis=0\) takes two arrays, the values "):
        cv.dequantize()((value,))


@pytest.mark.parametrize("transform", [cv.concatenate(0), cv.stack(0)], ids=repr)
def test_joins_move_bfloat16_bits_as_they_are_and_keep_their_derivatives(transform):
    """A join of JAX arrays moves floats as the integers of their bits, so that a NaN's
    payload survives XLA's CPU backend (which joins bfloat16 through float32); its
    derivatives stay the join's (a bitcast alone has none: they would be zero)."""
    bits = np.array([0x7F81, 0xFFA5, 0x0001, 0x3F80], np.uint16)
    x = jnp.asarray(bits.view(jnp.bfloat16))
    (joined,) = transform((x, x))
    np.testing.assert_array_equal(np.asarray(joined).view(np.uint16).reshape(-1), np.tile(bits, 2))
    weights = jnp.arange(8.0).reshape(joined.shape)
    grad = jax.grad(lambda a, b: (transform((a, b))[0] * weights).sum(), argnums=(0, 1))
    a, b = grad(jnp.ones(4), jnp.ones(4))
    np.testing.assert_array_equal(np.concatenate([a, b]), np.asarray(weights).reshape(-1))
