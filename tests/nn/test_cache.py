"""KVCache: a prompt and then one token at a time give what one causal forward over the
whole sequence gives, each step compiled once; the cache's errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _torch import assert_close
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_attention import _eqns

from taktiny import nn

E, MAX = 16, 12


def layer(**kw):
    kw = {"num_kv_heads": 2, "rope_theta": 10000.0, "precision": "highest", **kw}
    return nn.MultiHeadAttention(4, E, rngs=nn.Rngs(0), **kw)


def randn(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def decode(mha, x, prompt, *, max_length=MAX, mask=None, causal=True, **kw):
    """The prompt x[..., :prompt, :] in one call, then the rest one token at a time, each
    through one jitted step; the outputs concatenated, the final cache, the traces."""
    traces = []

    @jax.jit
    def step(mha, x, cache):
        traces.append(x.shape)  # runs only while tracing
        return mha(x, mask=mask, causal=causal, cache=cache)

    cache = mha.init_cache(int(np.prod(x.shape[:-2])), max_length, **kw)
    y, cache = step(mha, x[..., :prompt, :], cache)
    outputs = [y]
    for t in range(prompt, x.shape[-2]):
        y, cache = step(mha, x[..., t : t + 1, :], cache)
        outputs.append(y)
    return jnp.concatenate(outputs, axis=-2), cache, traces


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param({}, id="grouped-rotary"),
        pytest.param({"num_kv_heads": 1}, id="multi-query-rotary"),
        pytest.param({"num_kv_heads": None, "rope_theta": None}, id="plain"),
        pytest.param({"dropout_rate": 0.3}, id="dropout-off-without-key"),
    ],
)
def test_prompt_then_steps_equal_one_causal_forward(kw):
    mha = layer(**kw)
    x = randn(2, 9, E)
    full = mha(x, causal=True)
    ys, cache, traces = decode(mha, x, prompt=5)
    assert_close(ys, full)
    assert int(cache.length) == 9
    assert traces == [(2, 5, E), (2, 1, E)]  # compiled once for the prompt, once per step
    # the cache holds the keys written so far and zeros after them
    assert np.all(np.asarray(cache.keys)[:, 9:] == 0) and np.all(np.asarray(cache.keys)[:, :9])


def test_each_step_compiles_once_for_many_steps_and_batch_axes_fold():
    mha = layer()
    x = randn(2, 3, 10, E)  # two batch axes: the cache's batch is their product, 6
    ys, cache, traces = decode(mha, x, prompt=2, max_length=10)
    assert traces == [(2, 3, 2, E), (2, 3, 1, E)]  # 8 steps, one trace
    assert cache.keys.shape == (6, 10, 2, 4) and int(cache.length) == 10
    assert_close(ys, mha(x, causal=True))


def test_a_padding_mask_over_the_cache_positions_equals_the_full_forward():
    """With a cache the mask covers its max_length positions; what lies past the filled
    length does not matter (it is masked anyway)."""
    mha, x = layer(), randn(2, 8, E)
    valid = np.ones((2, MAX), bool)
    valid[1, [1, 2, 5]] = False  # tokens every query must ignore (each still sees the first)
    valid[:, 8:] = np.array([True, False, True, False])  # past the end: no effect
    full = mha(x, mask=jnp.asarray(valid[:, None, None, :8]), causal=True)
    ys, _, _ = decode(mha, x, prompt=4, mask=jnp.asarray(valid[:, None, None, :]))
    assert_close(ys, full)
    unmasked, _, _ = decode(mha, x, prompt=4)
    assert not np.allclose(unmasked[1], full[1], atol=1e-3)


def test_without_causal_a_chunk_sees_every_filled_position():
    mha, x = layer(), randn(2, 7, E)
    cache = mha.init_cache(2, MAX)
    first, cache = mha(x[:, :4], cache=cache)
    second, cache = mha(x[:, 4:], cache=cache)
    assert_close(first, mha(x[:, :4]))  # the prompt alone, not causal
    assert_close(second, mha(x)[:, 4:])  # all 7 filled positions
    assert not np.allclose(second, mha(x, causal=True)[:, 4:], atol=1e-3)


def test_positions_given_explicitly_replace_the_cache_offset():
    mha, x = layer(), randn(1, 6, E)
    at = jnp.array([[10, 11, 12, 13, 14, 15]], jnp.int32)
    full = mha(x, causal=True, positions=at)
    cache = mha.init_cache(1, MAX)
    y1, cache = mha(x[:, :4], causal=True, positions=at[:, :4], cache=cache)
    y2, cache = mha(x[:, 4:], causal=True, positions=at[:, 4:], cache=cache)
    assert_close(jnp.concatenate([y1, y2], 1), full)
    y3, _ = mha(
        x[:, 4:],
        causal=True,
        positions=at[:, :2],
        cache=cache.replace(length=jnp.asarray(4, jnp.int32)),
    )
    assert not np.allclose(y3, y2, atol=1e-3)  # other positions, other outputs


def test_a_low_precision_cache_stores_its_dtype_and_computes_close():
    mha, x = layer(), randn(2, 6, E)
    ys, cache, _ = decode(mha, x, prompt=3, dtype=jnp.bfloat16)
    assert cache.keys.dtype == cache.values.dtype == jnp.bfloat16 and ys.dtype == jnp.float32
    np.testing.assert_allclose(ys, mha(x, causal=True), atol=5e-2)
    assert mha.init_cache(2, MAX).keys.dtype == jnp.float32
    assert layer(dtype=jnp.bfloat16).init_cache(2, MAX).keys.dtype == jnp.bfloat16


def test_the_cache_is_a_module_with_state():
    cache = layer().init_cache(3, MAX)
    assert isinstance(cache, nn.KVCache) and cache.max_length == MAX
    shapes = {k: (v.shape, v.dtype) for k, v in cache.flat_state_dict().items()}
    assert shapes == {
        "keys": ((3, MAX, 2, 4), jnp.float32),
        "values": ((3, MAX, 2, 4), jnp.float32),
        "length": ((), jnp.int32),
    }
    assert len(jax.tree.leaves(cache)) == 3


def test_a_cache_split_over_a_mesh_stays_split_and_computes_as_unsplit():
    mesh = jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices("cpu")
    )
    heads = {f"{p}_kernel_sharding": (None, "model") for p in ("query", "key", "value")}
    reference = nn.MultiHeadAttention(8, 32, num_kv_heads=4, rope_theta=100.0, rngs=nn.Rngs(0))
    x = randn(2, 6, 32)
    with jax.set_mesh(mesh):
        mha = nn.MultiHeadAttention(
            8, 32, num_kv_heads=4, rope_theta=100.0, rngs=nn.Rngs(0), **heads
        )
        split = ("data", None, "model", None)
        ys, cache, _ = decode(mha, jax.device_put(x, P("data")), 4, sharding=split)
    assert cache.keys.sharding.spec == P(*split)
    np.testing.assert_allclose(ys, reference(x, causal=True), rtol=1e-5, atol=1e-5)


def test_a_prompt_longer_than_the_cache_is_refused_before_running():
    mha = layer()
    expected = (
        f"MultiHeadAttention's cache holds max_length={MAX} positions, fewer than the 13 "
        f"tokens of this input (its q_length); make a longer cache with init_cache(2, "
        f"max_length) where max_length is at least 13 plus the tokens to be generated."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}"):  # while tracing
        jax.jit(lambda m, x, c: m(x, cache=c))(mha, randn(2, 13, E), mha.init_cache(2, MAX))


@pytest.mark.parametrize("jit", [False, True])
def test_a_step_past_the_end_raises_at_run_time(jit):
    mha = layer()
    full = "MultiHeadAttention's cache is full: writing 1 more token(s) at its length would "
    call = lambda m, x, c: m(x, causal=True, cache=c)
    call = jax.jit(call) if jit else call
    cache = mha.init_cache(2, 4)
    _, cache = call(mha, randn(2, 3, E), cache)
    _, cache = call(mha, randn(2, 1, E), cache)  # the last position: fine
    # eagerly an EquinoxRuntimeError; from a compiled step whatever JAX wraps a failed host
    # callback in (a JaxRuntimeError or a ValueError), with the message inside
    with pytest.raises(
        (RuntimeError, ValueError), match=re.escape(full) + r"pass its max_length=4\."
    ):
        jax.block_until_ready(call(mha, randn(2, 1, E), cache))


@pytest.mark.parametrize(
    ("cache", "got"),
    [
        (lambda m: m.init_cache(3, MAX), "keys [3, 12, 2, 4], values [3, 12, 2, 4]"),
        (lambda m: layer(num_kv_heads=4).init_cache(2, MAX), "keys [2, 12, 4, 4]"),
        (lambda m: layer(qkv_features=32).init_cache(2, MAX), "keys [2, 12, 2, 8]"),
    ],
    ids=["batch", "heads", "head_dim"],
)
def test_rejects_a_cache_of_another_shape(cache, got):
    mha = layer()
    with pytest.raises(
        ValueError,
        match=r"^MultiHeadAttention's cache must hold keys and values of shape \[batch, "
        r"max_length, num_kv_heads, head_dim\] = \[2, 'max_length', 2, 4\] \(batch: the "
        r"product of the input's batch axes \[2\]\) and a scalar length, got "
        + re.escape(got)
        + r".* Make the cache with this layer's init_cache\(2, max_length\)\.$",
    ):
        mha(randn(2, 3, E), cache=cache(mha))


def test_a_cache_needs_self_attention_and_a_positive_size(without_type_checks):
    mha = layer(rope_theta=None)
    with pytest.raises(
        ValueError,
        match=r"^MultiHeadAttention with a cache attends from inputs_q to itself, but "
        r"inputs_kv was given; leave inputs_kv out, or use a layer without a cache\.$",
    ):
        mha(randn(2, 3, E), randn(2, 3, E), cache=mha.init_cache(2, MAX))
    with pytest.raises(ValueError, match=r"^MultiHeadAttention's cache must be a KVCache made "):
        mha(randn(2, 3, E), cache={"keys": jnp.zeros((2, MAX, 2, 4))})
    with pytest.raises(
        ValueError, match=r"^MultiHeadAttention.init_cache's max_length must be a positive int, "
    ):
        mha.init_cache(2, 0)


@pytest.mark.parametrize(
    ("change", "got"),
    [
        (
            lambda c: c.replace(values=jnp.zeros((2, MAX, 2, 3))),
            "keys [2, 12, 2, 4], values [2, 12, 2, 3] and length []",
        ),
        (
            lambda c: c.replace(length=jnp.zeros((1,), jnp.int32)),
            "keys [2, 12, 2, 4], values [2, 12, 2, 4] and length [1]",
        ),
    ],
    ids=["values", "length"],
)
def test_rejects_a_cache_whose_values_or_length_do_not_fit_its_keys(
    change, got, without_type_checks
):
    mha = layer()
    expected = (
        "MultiHeadAttention's cache must hold keys and values of shape [batch, max_length, "
        "num_kv_heads, head_dim] = [2, 'max_length', 2, 4] (batch: the product of the input's "
        f"batch axes [2]) and a scalar length, got {got}. Make the cache with this layer's "
        "init_cache(2, max_length)."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        mha(randn(2, 3, E), cache=change(mha.init_cache(2, MAX)))


def test_the_cache_errors_name_what_was_given(without_type_checks):
    mha = layer()
    with pytest.raises(
        ValueError,
        match=r"^MultiHeadAttention's cache must be a KVCache made by "
        r"layer\.init_cache\(batch, max_length\), got dict\.$",
    ):
        mha(randn(2, 3, E), cache={"keys": jnp.zeros((2, MAX, 2, 4))})
    for batch, max_length, name, value in [(0, MAX, "batch", "0"), (2, 2.5, "max_length", "2.5")]:
        with pytest.raises(
            ValueError,
            match=f"^MultiHeadAttention.init_cache's {name} must be a positive int, got "
            f"{re.escape(value)}\\.$",
        ):
            mha.init_cache(batch, max_length)
    # the keys and values are placed as parameters are, and named so in the errors
    with pytest.raises(TypeError, match=r"^KVCache\.keys: a sharding is a PartitionSpec "):
        mha.init_cache(2, MAX, sharding="data")  # pyright: ignore[reportArgumentType]


def test_a_prompt_may_fill_the_whole_cache():
    mha, x = layer(), randn(2, 5, E)
    y, cache = mha(x, causal=True, cache=mha.init_cache(2, 5))
    assert_close(y, mha(x, causal=True))
    assert int(cache.length) == 5


def test_a_low_precision_layer_attends_to_its_cache_in_its_dtype():
    """The cache's keys and values are read in the dtype the queries have (bfloat16 here,
    the layer's), so the attention's products take bfloat16 operands only."""
    mha, x = layer(dtype=jnp.bfloat16), randn(2, 3, E)
    cache = mha.init_cache(2, MAX, dtype=jnp.float32)  # stored wider than the queries
    jaxpr = jax.make_jaxpr(lambda m, x, c: m(x, causal=True, cache=c))(mha, x, cache).jaxpr
    dots = [e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 6
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


def test_decoding_with_x64_on_keeps_int32_positions():
    """With ``jax_enable_x64`` decoding works as without: the cache's length, the write's
    indices and the positions stay int32 (a Python 0 or JAX's default integers would be
    int64, which dynamic_update_slice and strict promotion refuse to mix with them)."""
    x = randn(2, 6, E)
    with jax.enable_x64(True):
        mha = layer()
        ys, cache, _ = decode(mha, x, prompt=3)
        full = mha(x, causal=True)
    assert cache.length.dtype == jnp.int32
    assert_close(ys, full)
