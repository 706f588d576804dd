"""MultiHeadAttention against torch.nn.MultiheadAttention and torch's scaled_dot_product_attention."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import assert_close, build, numpy, randomize_

from taktiny import nn


def convert(reference):
    """torch's packed in_proj [3E, in] (or q/k/v_proj_weight when kdim differs) -> the
    query/key/value Linear kernels [in, E]; out_proj.weight [E, E] -> out.kernel."""
    if reference._qkv_same_embed_dim:
        weights = reference.in_proj_weight.chunk(3)
    else:
        weights = (reference.q_proj_weight, reference.k_proj_weight, reference.v_proj_weight)
    state = {
        f"{name}.kernel": numpy(w.T)
        for name, w in zip(("query", "key", "value"), weights, strict=True)
    }
    state["out.kernel"] = numpy(reference.out_proj.weight.T)
    if reference.in_proj_bias is not None:
        for name, b in zip(("query", "key", "value"), reference.in_proj_bias.chunk(3), strict=True):
            state[f"{name}.bias"] = numpy(b)
        state["out.bias"] = numpy(reference.out_proj.bias)
    return state


def random_mask(shape, seed):
    """Random booleans with every query row allowed at least its first key."""
    mask = np.random.default_rng(seed).random(shape) < 0.6
    mask[..., 0] = True
    return mask


B, T, S, E = 2, 5, 7, 8


def randn(*shape, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize(
    "mask_kind", ["none", "shared", "per_head", "padding", "causal", "causal_and_padding"]
)
def test_self_attention_matches_torch(heads, mask_kind):
    reference = randomize_(torch.nn.MultiheadAttention(E, heads, batch_first=True))
    mha = build(
        lambda: nn.MultiHeadAttention(heads, E, precision="highest", rngs=nn.Rngs(0)),
        convert(reference),
    )
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(0))
    kwargs, torch_kwargs = {}, {}
    valid = np.ones((B, T), bool)
    valid[1, 3:] = False
    if mask_kind == "shared":
        mask = random_mask((T, T), 1)
        kwargs["mask"], torch_kwargs["attn_mask"] = jnp.asarray(mask), torch.from_numpy(~mask)
    elif mask_kind == "per_head":
        mask = random_mask((B, heads, T, T), 2)
        kwargs["mask"] = jnp.asarray(mask)
        torch_kwargs["attn_mask"] = torch.from_numpy(~mask.reshape(B * heads, T, T))
    elif mask_kind in ("padding", "causal_and_padding"):
        kwargs["mask"] = jnp.asarray(valid[:, None, None, :])
        torch_kwargs["key_padding_mask"] = torch.from_numpy(~valid)
    if "causal" in mask_kind:
        kwargs["causal"] = True
        torch_kwargs["attn_mask"] = torch.ones(T, T, dtype=torch.bool).triu(1)
    expected, _ = reference(x, x, x, need_weights=False, **torch_kwargs)
    assert_close(mha(jnp.asarray(numpy(x)), **kwargs), numpy(expected))


@pytest.mark.parametrize("use_bias", [True, False])
def test_cross_attention_with_other_key_features_matches_torch(use_bias):
    reference = torch.nn.MultiheadAttention(E, 2, bias=use_bias, kdim=6, vdim=6, batch_first=True)
    randomize_(reference)
    mha = build(
        lambda: nn.MultiHeadAttention(
            2, E, kv_features=6, use_bias=use_bias, precision="highest", rngs=nn.Rngs(0)
        ),
        convert(reference),
    )
    generator = torch.Generator().manual_seed(0)
    q, kv = torch.randn(B, T, E, generator=generator), torch.randn(B, S, 6, generator=generator)
    mask = random_mask((B, 1, T, S), 3)
    expected, _ = reference(
        q,
        kv,
        kv,
        need_weights=False,
        attn_mask=torch.from_numpy(~mask).repeat(1, 2, 1, 1).reshape(B * 2, T, S),
    )
    ours = mha(jnp.asarray(numpy(q)), jnp.asarray(numpy(kv)), mask=jnp.asarray(mask))
    assert_close(ours, numpy(expected))


def test_other_qkv_and_out_features_match_torch_sdpa():
    """torch's MultiheadAttention cannot change the inner or output width; the oracle is
    four torch Linear layers around torch's scaled_dot_product_attention."""
    heads, qkv, out = 3, 12, 5
    projections = {
        "query": torch.nn.Linear(E, qkv),
        "key": torch.nn.Linear(E, qkv),
        "value": torch.nn.Linear(E, qkv),
        "out": torch.nn.Linear(qkv, out),
    }
    for layer in projections.values():
        randomize_(layer)
    state = {}
    for name, layer in projections.items():
        state[f"{name}.kernel"], state[f"{name}.bias"] = numpy(layer.weight.T), numpy(layer.bias)
    mha = build(
        lambda: nn.MultiHeadAttention(
            heads, E, qkv_features=qkv, out_features=out, precision="highest", rngs=nn.Rngs(0)
        ),
        state,
    )
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(0))

    def heads_first(t):
        return t.reshape(B, T, heads, qkv // heads).transpose(1, 2)

    q, k, v = (heads_first(projections[n](x)) for n in ("query", "key", "value"))
    attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = projections["out"](attended.transpose(1, 2).reshape(B, T, qkv))
    assert_close(mha(jnp.asarray(numpy(x)), causal=True), numpy(expected))


def test_any_number_of_batch_axes():
    mha = nn.MultiHeadAttention(2, E, rngs=nn.Rngs(0))
    x = randn(3, 2, T, E, seed=0)
    mask = jnp.asarray(random_mask((3, 2, 1, T, T), 4))
    batched = mha(x.reshape(6, T, E), mask=mask.reshape(6, 1, T, T), causal=True)
    assert_close(mha(x, mask=mask, causal=True), batched.reshape(3, 2, T, E))
    assert_close(mha(x[0, 0], mask=mask[0, 0, 0]), mha(x[:1, 0], mask=mask[:1, 0])[0])


def test_dropout_only_with_a_key_and_the_key_decides():
    mha = nn.MultiHeadAttention(2, E, dropout_rate=0.5, rngs=nn.Rngs(0))
    x = randn(B, T, E, seed=0)
    plain = mha(x)
    a = mha(x, key=jax.random.key(1))
    b = jax.jit(lambda m, x, key: m(x, key=key))(mha, x, jax.random.key(1))
    assert_close(a, b)
    assert not np.allclose(a, plain, atol=1e-3)
    assert not np.allclose(a, mha(x, key=jax.random.key(2)), atol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("batch", "heads", "masked"),
    [(2, 2, "per_head"), (1, 4, None), (3, 1, "per_head"), (2, 4, "shared"), (2, 2, "padding")],
)
def test_the_dropout_path_masks_like_the_fused_path(causal, batch, heads, masked):
    """With a vanishing rate nothing is dropped, so the hand-written attention that
    supports dropout must equal jax.nn.dot_product_attention, for any batch size and number
    of heads, masks per head or shared by the heads included (and a query that may attend
    to nothing gets the mean of the values in both)."""
    mha = nn.MultiHeadAttention(heads, E, dropout_rate=1e-12, rngs=nn.Rngs(0))
    x = randn(batch, T, E, seed=0)
    kwargs = {"causal": causal}
    if masked:
        shape = {"per_head": (batch, heads, T, T), "shared": (batch, 1, T, T)}.get(masked)
        mask = random_mask(shape or (batch, 1, 1, T), 5)
        mask[-1, 0, -1 if masked == "padding" else 2] = False  # a query with nothing to attend to
        kwargs["mask"] = jnp.asarray(mask)
    assert_close(mha(x, key=jax.random.key(3), **kwargs), mha(x, **kwargs))


def _eqns(jaxpr):
    """The equations of `jaxpr` and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None:
                yield from _eqns(getattr(inner, "jaxpr", inner))


def test_bfloat16_dropout_attention_takes_logits_and_softmax_in_float32():
    """As jax.nn.dot_product_attention does: bfloat16 queries and keys give float32 logits,
    and the weights return to bfloat16 only to meet the values; the output stays bfloat16
    and matches the fused path within bfloat16's rounding."""
    half = nn.MultiHeadAttention(
        2, E, param_dtype=jnp.bfloat16, dropout_rate=1e-12, rngs=nn.Rngs(0)
    )
    x = randn(B, T, E, seed=0).astype(jnp.bfloat16)
    dropped = half(x, key=jax.random.key(3))
    assert dropped.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(dropped, np.float32), np.asarray(half(x), np.float32), atol=2e-2
    )
    jaxpr = jax.make_jaxpr(lambda m, x: m(x, key=jax.random.key(3)))(half, x).jaxpr
    logits = [
        e.outvars[0].aval
        for e in _eqns(jaxpr)
        # [batch, kv_heads, query heads per kv head, q_length, kv_length] in some order
        if e.primitive.name == "dot_general"
        and sorted(e.outvars[0].aval.shape) == sorted((B, 2, 1, T, T))
    ]
    assert [a.dtype for a in logits] == [jnp.float32]


def test_a_zero_dropout_rate_draws_no_random_numbers_even_with_a_key():
    mha = nn.MultiHeadAttention(2, E, dropout_rate=0.5, rngs=nn.Rngs(0))
    x = randn(B, T, E, seed=0)

    def program(m):
        return str(jax.make_jaxpr(lambda m, x: m(x, key=jax.random.key(0)))(m, x))

    assert "random_bits" in program(mha)
    assert "random_bits" not in program(mha.replace(dropout_rate=0.0))
    # nor on the written-out path that a pair of precisions takes
    pair = mha.replace(precision=("highest", "highest"))
    assert "random_bits" in program(pair)
    assert "random_bits" not in program(pair.replace(dropout_rate=0.0))


def test_the_fused_attention_runs_unless_dropout_or_a_pair_of_precisions_needs_another():
    """jax.nn.dot_product_attention (compiled as one unit) does the attention, except when
    dropout is on (a key and a rate) or the precision is a pair, which it cannot take."""
    mha = nn.MultiHeadAttention(2, E, dropout_rate=0.5, rngs=nn.Rngs(0))
    x = randn(B, T, E, seed=0)

    def fused(m, **kwargs):
        jaxpr = jax.make_jaxpr(lambda m, x: m(x, **kwargs))(m, x).jaxpr
        return any(e.params.get("name") == "dot_product_attention" for e in _eqns(jaxpr))

    key = jax.random.key(0)
    assert fused(mha)  # a rate but no key: no dropout
    assert not fused(mha, key=key)
    assert fused(mha.replace(dropout_rate=0.0), key=key)  # a key but no rate
    assert fused(mha.replace(precision=jax.lax.Precision.HIGHEST))
    assert not fused(mha.replace(precision=("highest", "highest")))


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_the_dropout_rate_must_be_in_zero_to_one(rate):
    expected = f"MultiHeadAttention's dropout_rate must be in [0, 1), got {rate!r}."
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        nn.MultiHeadAttention(2, E, dropout_rate=rate, rngs=nn.Rngs(0))
    assert nn.MultiHeadAttention(2, E, dropout_rate=0.0, rngs=nn.Rngs(0)).dropout_rate == 0.0


@pytest.mark.parametrize(
    ("q_shape", "kv_shape"), [((2, T, E), (3, S, E)), ((E,), (E,)), ((4, 2, T, E), (2, S, E))]
)
def test_rejects_queries_and_keys_with_other_batch_axes(q_shape, kv_shape, without_type_checks):
    mha = nn.MultiHeadAttention(2, E, rngs=nn.Rngs(0))
    expected = (
        "MultiHeadAttention expects inputs_q [*batch, q_length, features] and inputs_kv "
        f"[*batch, kv_length, features] with the same batch axes, got shapes {q_shape} and "
        f"{kv_shape}."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        mha(jnp.ones(q_shape), jnp.ones(kv_shape))


def test_rejects_a_mask_that_is_not_boolean(without_type_checks):
    mha = nn.MultiHeadAttention(2, E, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match=r"= \[2, 2, 5, 5\], got float32\[2, 2, 5, 5\]\."):
        mha(jnp.ones((2, T, E)), mask=jnp.ones((2, 2, T, T)))


def test_submodules_are_linear_layers_with_the_jax_names():
    mha = nn.MultiHeadAttention(4, 16, qkv_features=8, out_features=5, rngs=nn.Rngs(0))
    shapes = {k: v.shape for k, v in mha.flat_state_dict().items()}
    assert shapes == {
        "query.kernel": (16, 8),
        "query.bias": (8,),
        "key.kernel": (16, 8),
        "key.bias": (8,),
        "value.kernel": (16, 8),
        "value.bias": (8,),
        "out.kernel": (8, 5),
        "out.bias": (5,),
    }
    assert all(isinstance(getattr(mha, n), nn.Linear) for n in ("query", "key", "value", "out"))
    assert mha(jnp.ones((2, 3, 16), jnp.bfloat16)).dtype == jnp.float32
    half = nn.MultiHeadAttention(2, 4, param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    assert half(jnp.ones((2, 3, 4))).dtype == jnp.bfloat16


def test_rejects_inputs_of_the_wrong_feature_size():
    mha = nn.MultiHeadAttention(2, 8, kv_features=6, rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"MultiHeadAttention expects inputs whose last axis has 8 features \(its query "
        r"kernel is \(8, 8\)\), got an input of shape \(2, 5, 6\).*in_features=6",
    ):
        mha(jnp.ones((2, 5, 6)), jnp.ones((2, 5, 6)))
    with pytest.raises(
        ValueError,
        match=r"MultiHeadAttention expects inputs whose last axis has 6 features \(its key "
        r"kernel is \(6, 8\)\), got an input of shape \(2, 4, 8\).*kv_features=8",
    ):
        mha(jnp.ones((2, 5, 8)), jnp.ones((2, 4, 8)))


def test_rejects_a_mask_of_the_wrong_shape():
    mha = nn.MultiHeadAttention(2, 8, rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"MultiHeadAttention's mask must be booleans broadcastable to \[\*batch, "
        r"num_heads, q_length, kv_length\] = \[2, 2, 5, 5\], got bool\[2, 5\].*"
        r"valid\[\.\.\., None, None, :\]",
    ):
        mha(jnp.ones((2, 5, 8)), mask=jnp.ones((2, 5), bool))


def test_rejects_heads_that_do_not_divide_the_features():
    with pytest.raises(
        ValueError, match=r"MultiHeadAttention's num_heads \(3\) must divide qkv_features \(8\)"
    ):
        nn.MultiHeadAttention(3, 8, rngs=nn.Rngs(0))


@pytest.mark.parametrize("rate", [0.2, 0.5])
def test_attention_dropout_rescales_the_kept_weights(rate):
    # dropping attention weights keeps their expected value: each kept weight is scaled by
    # 1 / (1 - rate), so the output's mean over many keys is the output without dropout
    mha = nn.MultiHeadAttention(2, E, dropout_rate=rate, rngs=nn.Rngs(0))
    mha = mha.replace(out=mha.out.replace(bias=jnp.zeros(E)))
    x = randn(B, T, E, seed=0)
    plain = np.asarray(mha(x))
    draws = np.stack([np.asarray(mha(x, key=jax.random.key(i))) for i in range(400)])
    # without the rescale the mean would be off by `rate` of the output (20% to 50%)
    np.testing.assert_allclose(draws.mean(0), plain, atol=0.15 * np.abs(plain).max())
    assert np.abs(draws.mean(0) - plain).mean() < 0.1 * np.abs(plain).mean()
