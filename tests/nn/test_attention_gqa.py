"""MultiHeadAttention with grouped key/value heads against torch's scaled_dot_product_attention;
its precision and dtypes read in the jaxpr; position ids' errors; grouped heads on meshes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import assert_close, build, numpy, randomize_
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_attention import _eqns

from taktiny import nn

B, T, E, D = 2, 6, 16, 4  # batch, length, features, head_dim
HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def randn(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def dot_generals(fn, *args):
    return [e for e in _eqns(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == "dot_general"]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 1), (6, 3), (2, 2)])
@pytest.mark.parametrize("masks", ["causal", "padding", "causal_and_padding"])
def test_grouped_heads_match_torch_sdpa(heads, kv_heads, masks):
    projections = {
        "query": torch.nn.Linear(E, heads * D),
        "key": torch.nn.Linear(E, kv_heads * D),
        "value": torch.nn.Linear(E, kv_heads * D),
        "out": torch.nn.Linear(heads * D, E),
    }
    state = {}
    for name, linear in projections.items():
        randomize_(linear)
        state[f"{name}.kernel"], state[f"{name}.bias"] = numpy(linear.weight.T), numpy(linear.bias)
    mha = build(
        lambda: nn.MultiHeadAttention(
            heads, E, qkv_features=heads * D, num_kv_heads=kv_heads, precision="highest",
            rngs=nn.Rngs(0),
        ),
        state,
    )  # fmt: skip
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(0))
    valid = np.ones((B, T), bool)
    valid[1, 4:] = False
    allowed = np.ones((B, 1, T, T), bool)  # torch's boolean attn_mask: True takes part
    kwargs = {}
    if "causal" in masks:
        allowed &= np.tril(np.ones((T, T), bool))
        kwargs["causal"] = True
    if "padding" in masks:
        allowed &= valid[:, None, None, :]
        kwargs["mask"] = jnp.asarray(valid[:, None, None, :])

    def heads_first(t, n):
        return t.reshape(B, T, n, D).transpose(1, 2)

    q = heads_first(projections["query"](x), heads)
    k, v = (heads_first(projections[n](x), kv_heads) for n in ("key", "value"))
    attended = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.from_numpy(allowed), enable_gqa=True
    )
    expected = projections["out"](attended.transpose(1, 2).reshape(B, T, heads * D))
    assert_close(mha(jnp.asarray(numpy(x)), **kwargs), numpy(expected))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_written_out_attention_groups_and_masks_as_the_fused_one(kv_heads):
    """Dropout (at a vanishing rate) and a pair of precisions take the written-out path; a
    mask per query head must reach the same heads there."""
    mha = nn.MultiHeadAttention(4, E, num_kv_heads=kv_heads, dropout_rate=1e-12, rngs=nn.Rngs(0))
    x = randn(B, T, E)
    mask = np.random.default_rng(1).random((B, 4, T, T)) < 0.5
    mask[..., 0] = True
    fused = mha(x, mask=jnp.asarray(mask), causal=True)
    assert_close(mha(x, mask=jnp.asarray(mask), causal=True, key=jax.random.key(0)), fused)
    pair = mha.replace(precision=("highest", "highest"))
    assert_close(pair(x, mask=jnp.asarray(mask), causal=True), fused)


def test_state_names_and_shapes_with_fewer_key_value_heads():
    mha = nn.MultiHeadAttention(8, 32, num_kv_heads=2, rope_theta=1e4, rngs=nn.Rngs(0))
    shapes = {k: v.shape for k, v in mha.flat_state_dict().items()}
    assert shapes == {
        "query.kernel": (32, 32),
        "query.bias": (32,),
        "key.kernel": (32, 8),  # 2 heads of 4
        "key.bias": (8,),
        "value.kernel": (32, 8),
        "value.bias": (8,),
        "out.kernel": (32, 32),
        "out.bias": (32,),
    }
    assert mha.head_dim == 4 and mha.num_kv_heads == 2 and mha.rotary.theta == 1e4
    assert nn.MultiHeadAttention(8, 32, rngs=nn.Rngs(0)).num_kv_heads == 8


@pytest.mark.parametrize("kv_heads", [3, 0, -2])
def test_key_value_heads_must_divide_the_heads(kv_heads):
    expected = (
        f"MultiHeadAttention's num_kv_heads ({kv_heads}) must be at least 1 and divide "
        f"num_heads (8), so that each key/value head serves the same number of query heads; "
        f"pass one of [1, 2, 4, 8]."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        nn.MultiHeadAttention(8, 32, num_kv_heads=kv_heads, rngs=nn.Rngs(0))


@pytest.mark.parametrize("call", ["plain", "dropout", "cache", "pair"])
def test_highest_precision_reaches_every_product(call):
    """The four projections and the two products of the attention, on every path (a pair
    of precisions, one per operand, takes the written-out attention)."""
    kw = {"num_kv_heads": 2, "rope_theta": 1e4, "dropout_rate": 0.1}
    mha = nn.MultiHeadAttention(4, E, precision="highest", rngs=nn.Rngs(0), **kw)
    x = randn(B, T, E)
    if call == "plain":
        fn, args = (lambda m, x: m(x, causal=True)), (mha, x)
    elif call == "pair":
        fn, args = (lambda m, x: m(x, causal=True)), (mha.replace(precision=HIGHEST), x)
    elif call == "dropout":
        fn, args = (lambda m, x: m(x, key=jax.random.key(0))), (mha, x)
    else:
        fn, args = (lambda m, x, c: m(x, causal=True, cache=c)), (mha, x, mha.init_cache(B, 8))
    dots = dot_generals(fn, *args)
    assert len(dots) == 6 and all(e.params["precision"] == HIGHEST for e in dots)
    default = dot_generals(fn, mha.replace(precision=None), *args[1:])  # the projections'
    assert sum(e.params["precision"] == HIGHEST for e in default) == 4  # stay: 4, not 6


def test_dtype_computes_in_it_and_param_dtype_stores():
    mha = nn.MultiHeadAttention(2, 8, dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    assert {leaf.dtype for leaf in jax.tree.leaves(mha)} == {jnp.dtype(jnp.float32)}
    x = randn(B, T, 8)
    assert mha(x).dtype == jnp.bfloat16
    dots = dot_generals(lambda m, x: m(x, key=jax.random.key(0)), mha.replace(dropout_rate=0.1), x)
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    logits = next(e.outvars[0].aval.dtype for e in dots if e.outvars[0].aval.ndim == 5)
    assert logits == jnp.float32  # logits and softmax in float32
    reference = mha.replace(dtype=None)(x)
    np.testing.assert_allclose(np.asarray(mha(x), np.float32), reference, atol=5e-2)


@pytest.mark.parametrize(
    ("positions", "got"),
    [
        (np.arange(5, dtype=np.int32), "int32[5]"),
        (np.zeros((3, T), np.int32), "int32[3, 6]"),
        (np.arange(T, dtype=np.float32), "float32[6]"),
    ],
)
def test_rejects_positions_of_the_wrong_shape_or_dtype(positions, got, without_type_checks):
    mha = nn.MultiHeadAttention(4, E, rope_theta=1e4, rngs=nn.Rngs(0))
    expected = (
        f"MultiHeadAttention's positions must be integer position ids of shape "
        f"[*batch, q_length] = [2, 6] (or broadcastable to it, such as [6]), got {got}. Pass "
        f"one integer position per token, such as jnp.arange(6) + offset."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        mha(randn(B, T, E), positions=jnp.asarray(positions))


def test_positions_need_rotary_embeddings_and_rotary_needs_self_attention():
    plain = nn.MultiHeadAttention(4, E, rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"^MultiHeadAttention got positions, but it has no rotary embeddings to use them "
        r"\(rope_theta=None\); build it with rope_theta=10000\.0 \(say\), or leave positions "
        r"out\.$",
    ):
        plain(randn(B, T, E), positions=jnp.arange(T))
    rotary = nn.MultiHeadAttention(4, E, rope_theta=1e4, rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"^MultiHeadAttention with rotary embeddings \(rope_theta\) attends from inputs_q "
        r"to itself, but inputs_kv was given; leave inputs_kv out, or use a layer without "
        r"rotary embeddings \(rope_theta\)\.$",
    ):
        rotary(randn(B, T, E), randn(B, 3, E))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
@pytest.mark.parametrize(("kv_heads", "precision"), [(4, None), (2, None), (4, "highest")])
def test_grouped_heads_split_over_a_mesh_compute_as_unsplit(axis_type, kv_heads, precision):
    """With 4 key/value heads on a 4-way "model" axis each device holds whole groups; with
    2 the heads stay whole (the projections' features are still split)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    shardings: dict = {f"{p}_kernel_sharding": (None, "model") for p in ("query", "key", "value")}
    shardings["out_kernel_sharding"] = ("model", None)
    kw = {"num_kv_heads": kv_heads, "rope_theta": 100.0, "precision": precision}
    reference = nn.MultiHeadAttention(8, 32, rngs=nn.Rngs(0), **kw)
    x, valid = randn(4, T, 32), jnp.arange(T) < 5
    with jax.set_mesh(mesh):
        mha = nn.MultiHeadAttention(8, 32, rngs=nn.Rngs(0), **kw, **shardings)
        forward = jax.jit(lambda m, x: m(x, mask=valid, causal=True))
        got = forward(mha, jax.device_put(x, P("data")))
    np.testing.assert_allclose(got, reference(x, mask=valid, causal=True), rtol=1e-5, atol=1e-5)
    if axis_type == AxisType.Explicit:
        assert tuple(got.sharding.spec) == ("data", None, None)


@pytest.mark.parametrize("precision", [None, ("highest", "highest")], ids=["fused", "written-out"])
@pytest.mark.parametrize(
    ("kv_heads", "features", "x_spec", "heads_split"),
    [
        (4, "model", P("data"), "model"),  # 4 key/value heads on 4 devices: whole groups
        (2, "model", P("data"), None),  # 2 on 4: the heads are gathered
        (8, ("data", "model"), P(), ("data", "model")),  # over both mesh axes
        (4, None, P("data"), None),  # unsplit projections
    ],
)
def test_on_explicit_axes_the_heads_are_split_as_their_projections_features(
    kv_heads, features, x_spec, heads_split, precision
):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    splits: dict = {}
    if features is not None:
        for p in ("query", "key", "value"):
            splits[f"{p}_kernel_sharding"] = (None, features)
            splits[f"{p}_bias_sharding"] = (features,)
    kw = {"num_kv_heads": kv_heads, "precision": precision}
    reference = nn.MultiHeadAttention(8, 32, rngs=nn.Rngs(0), **kw)
    x = randn(4, T, 32)
    forward = lambda m, x: m(x, causal=True)
    with jax.set_mesh(mesh):
        mha = nn.MultiHeadAttention(8, 32, rngs=nn.Rngs(0), **kw, **splits)
        split_x = jax.device_put(x, x_spec)
        jaxpr = jax.make_jaxpr(forward)(mha, split_x).jaxpr
        y = jax.jit(forward)(mha, split_x)
    if features is not None:
        assert mha.key.kernel.sharding.spec == P(None, features)
        assert mha.value.bias is not None and mha.value.bias.sharding.spec == P(features)
    reshaped = [e.outvars[0].aval for e in _eqns(jaxpr) if e.primitive.name == "reshape"]
    # queries [4, 6, 8, 4], keys and values [4, 6, kv_heads, 4], the written-out attention's
    # grouped views, and the heads merged again [4, 6, 32]: the batch split as the input's,
    # the heads' axis alike
    heads = [a for a in reshaped if a.ndim >= 4] + [a for a in reshaped if a.shape == (4, T, 32)]
    assert len(heads) >= 4
    batch = x_spec[0] if len(x_spec) else None
    assert [tuple(a.sharding.spec)[:3] for a in heads] == [(batch, None, heads_split)] * len(heads)
    np.testing.assert_allclose(y, reference(x, causal=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", [None, ("highest", "highest")], ids=["fused", "written-out"])
def test_on_explicit_axes_a_time_split_input_keeps_its_queries_split_and_gathers_the_keys(
    precision,
):
    """Sequence parallelism: an input split along time attends as the unsplit one does. The
    queries keep their split (each device attends from its own positions), the keys and
    values are gathered whole (every query reads them all; split as the queries, the
    products would raise a ShardingTypeError), and the output comes back split as the input."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    kw = {"num_kv_heads": 2, "rope_theta": 100.0, "precision": precision}
    reference = nn.MultiHeadAttention(8, 32, rngs=nn.Rngs(0), **kw)
    x, valid = randn(4, T, 32), jnp.arange(T) < 5
    forward = lambda m, x: m(x, mask=valid, causal=True)
    with jax.set_mesh(mesh):
        mha = nn.MultiHeadAttention(8, 32, rngs=nn.Rngs(0), **kw)
        split_x = jax.device_put(x, P(None, "data"))
        jaxpr = jax.make_jaxpr(forward)(mha, split_x).jaxpr
        y = jax.jit(forward)(mha, split_x)
    heads = [e.outvars[0].aval for e in _eqns(jaxpr) if e.primitive.name == "reshape"]
    q, k, v = [tuple(a.sharding.spec)[:2] for a in heads if a.ndim == 4][:3]
    assert (q, k, v) == ((None, "data"), (None, None), (None, None))
    assert y.sharding.spec == P(None, "data", None)
    np.testing.assert_allclose(y, reference(x, mask=valid, causal=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("projection", ["query", "key", "value", "out"])
def test_sharding_errors_name_the_projection(projection, without_type_checks):
    for kind in ("kernel", "bias"):
        with pytest.raises(
            TypeError, match=rf"^MultiHeadAttention\.{projection}\.{kind}: a sharding is a "
        ):
            nn.MultiHeadAttention(
                4, E, **{f"{projection}_{kind}_sharding": "model"}, rngs=nn.Rngs(0)
            )
    # without biases a bias sharding has nothing to place
    bare = nn.MultiHeadAttention(
        4, E, use_bias=False, **{f"{projection}_bias_sharding": "model"}, rngs=nn.Rngs(0)
    )
    assert getattr(bare, projection).bias is None


def test_shardings_that_do_not_fit_the_mesh_name_the_projection_and_its_shape():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    with jax.set_mesh(mesh):
        with pytest.raises(
            ValueError, match=r"^MultiHeadAttention\.query\.kernel of shape \(16, 6\) cannot be "
        ):
            nn.MultiHeadAttention(2, E, qkv_features=6, query_kernel_sharding=(None, "model"),
                                  rngs=nn.Rngs(0))  # fmt: skip
        with pytest.raises(
            ValueError, match=r"^MultiHeadAttention\.key\.bias of shape \(6,\) cannot be placed"
        ):
            nn.MultiHeadAttention(2, E, qkv_features=6, key_bias_sharding=("model",),
                                  rngs=nn.Rngs(0))  # fmt: skip


def test_a_bad_precision_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^MultiHeadAttention's precision must be None, a "):
        nn.MultiHeadAttention(2, E, precision="bogus", rngs=nn.Rngs(0))


def test_on_explicit_axes_several_batch_axes_come_back_split_as_they_came():
    """Batch axes [3, 2] with the second split: folded into one for the attention, and
    unfolded again into the input's splits (which JAX could not infer for this reshape)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip
    heads = {f"{p}_kernel_sharding": (None, "model") for p in ("query", "key", "value")}
    reference = nn.MultiHeadAttention(8, 32, num_kv_heads=4, rngs=nn.Rngs(0))
    x = randn(3, 2, T, 32)
    with jax.set_mesh(mesh):
        mha = nn.MultiHeadAttention(8, 32, num_kv_heads=4, rngs=nn.Rngs(0), **heads)
        y = jax.jit(lambda m, x: m(x, causal=True))(mha, jax.device_put(x, P(None, "data")))
    assert y.sharding.spec == P(None, "data", None, None)
    np.testing.assert_allclose(y, reference(x, causal=True), rtol=1e-5, atol=1e-5)


def test_positions_of_several_batch_axes_fold_with_them():
    """Batch axes [3, 2]: positions [3, 2, q_length] (or any shape broadcastable to it) are
    folded with the batch, as if the batch were one axis of 6."""
    mha = nn.MultiHeadAttention(4, E, rope_theta=1e4, rngs=nn.Rngs(0))
    x = randn(3, 2, T, E)
    at = np.random.default_rng(0).integers(0, 50, size=(3, 2, T)).astype(np.int32)
    flat = mha(x.reshape(6, T, E), causal=True, positions=jnp.asarray(at.reshape(6, T)))
    assert_close(mha(x, causal=True, positions=jnp.asarray(at)), flat.reshape(3, 2, T, E))
    for shared in (at[0], at[:1]):  # [2, q_length] and [1, 2, q_length]
        tiled = jnp.asarray(np.broadcast_to(shared, (3, 2, T)))
        assert_close(
            mha(x, causal=True, positions=jnp.asarray(shared)), mha(x, causal=True, positions=tiled)
        )
