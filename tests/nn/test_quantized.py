"""QuantizedLinear and QuantizedEmbed against their dequantized float layers; tt.quantize and
tt.dequantize; the error bound on an MLP; state, Orbax and sharding round trips; bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_attention import _eqns

import taktiny as tt
from taktiny import nn


def data(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def bitwise_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )


class Net(nn.Module):
    def __init__(self, *, rngs):
        self.embed = nn.Embed(50, 32, rngs=rngs)
        self.encoder = [nn.Linear(32, 64, rngs=rngs), nn.Linear(64, 32, rngs=rngs)]
        self.head = nn.Linear(32, 8, rngs=rngs)

    def __call__(self, ids):
        h = self.embed(ids)
        for layer in self.encoder:
            h = jax.nn.gelu(layer(h))
        return self.head(h)


@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 16), (4, None)])
@pytest.mark.parametrize("batch", [(), (3,), (2, 5)])
def test_linear_computes_with_the_dequantized_kernel(bits, group_size, batch, platform):
    # (on each platform: on a TPU, "highest" computes float32 products in six bfloat16
    # passes, whose sums round otherwise than NumPy's; within the same tolerance)
    layer = nn.QuantizedLinear(
        64, 16, bits=bits, group_size=group_size, precision="highest", rngs=nn.Rngs(0)
    )
    layer = layer.load_state_dict({"bias": data(16, seed=1)})
    x = data(*batch, 64, seed=2)
    expected = x @ np.asarray(layer.kernel.dequantize()) + np.asarray(layer.bias)
    np.testing.assert_allclose(layer(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-5)
    # the same draw as nn.Linear, then quantized
    linear = nn.Linear(64, 16, rngs=nn.Rngs(0))
    assert bitwise_equal(layer.kernel, tt.quantize(linear, bits=bits, group_size=group_size).kernel)
    no_bias = nn.QuantizedLinear(64, 16, use_bias=False, precision="highest", rngs=nn.Rngs(0))
    unbiased = x @ np.asarray(no_bias.kernel.dequantize())
    np.testing.assert_allclose(no_bias(jnp.asarray(x)), unbiased, rtol=1e-5, atol=1e-5)
    assert no_bias.bias is None and list(no_bias.flat_state_dict()) == [
        "kernel.value",
        "kernel.scale",
    ]


def _scaled_shapes(fn, *args):
    """The shapes of every multiply in `fn`'s program (nested ones too)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return {tuple(e.outvars[0].aval.shape) for e in _eqns(jaxpr) if e.primitive.name == "mul"}


@pytest.mark.parametrize("bits", [8, 4])
def test_per_channel_scales_multiply_the_product_not_the_weight(bits):
    # one scale per output channel: the integers enter the product and the scales multiply
    # its [*batch, out] result, so no float weight is scaled first (issue 53); in groups,
    # the weight is dequantized first
    layer = nn.QuantizedLinear(64, 16, bits=bits, rngs=nn.Rngs(0))
    x = jnp.asarray(data(3, 64, seed=2))
    assert _scaled_shapes(layer, x) == {(3, 16)}
    grouped = nn.QuantizedLinear(64, 16, bits=bits, group_size=16, rngs=nn.Rngs(0))
    assert (4, 16, 16) in _scaled_shapes(grouped, x)  # [groups, group_size, out]
    embed = nn.QuantizedEmbed(11, 64, bits=bits, rngs=nn.Rngs(0))
    assert _scaled_shapes(embed.attend, x) == {(3, 11)}
    linear = lambda rngs: nn.Linear(64, 64, use_bias=False, rngs=rngs)
    stack = tt.quantize(nn.Stack(linear, 3, rngs=nn.Rngs(0)), bits=bits)  # (each layer's slice)
    assert _scaled_shapes(stack, x) == {(3, 64)}
    # and the same values as the weight dequantized first, at full float32
    exact = layer.replace(precision="highest")
    dequantized = np.asarray(layer.kernel.dequantize(), np.float64)
    expected = np.asarray(x, np.float64) @ dequantized + np.asarray(layer.bias)
    np.testing.assert_allclose(exact(x), expected, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_product_of_per_channel_scales_is_within_bfloat16s_rounding():
    # in bfloat16 the scale rounds once per output, where a dequantized weight rounds once
    # per weight: both within a few units of bfloat16's last place of the exact product
    layer = nn.QuantizedLinear(256, 32, dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    x = jnp.asarray(data(8, 256, seed=3)).astype(jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ np.asarray(layer.kernel.dequantize(), np.float64)
    weight_first = x @ layer.kernel.dequantize(jnp.bfloat16)  # (the path before)
    scale = np.abs(exact).max()
    for got in (layer(x), weight_first):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float64), exact, atol=2**-7 * scale)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_unscaled_integer_products_do_not_overflow_a_half_precision_dtype(dtype):
    # 4096 inputs of 8 times 127: 4.2e6 before the scales (1e-3) bring it back to 4162,
    # beyond float16's range (65504): the product is taken in float32, then scaled
    layer = nn.QuantizedLinear(4096, 8, use_bias=False, dtype=dtype, rngs=nn.Rngs(0))
    layer = layer.load_flat_state_dict(
        {"kernel.value": np.full((4096, 8), 127, np.int8), "kernel.scale": np.full((1, 8), 1e-3)}
    )
    y = layer(jnp.full((2, 4096), 8.0, dtype))
    assert y.dtype == dtype
    np.testing.assert_allclose(np.asarray(y, np.float64), 8 * 127 * 4096 * 1e-3, rtol=2**-7)
    embed = nn.QuantizedEmbed(8, 4096, dtype=dtype, rngs=nn.Rngs(0)).load_flat_state_dict(
        {
            "embedding.value": np.full((8, 4096), 127, np.int8),
            "embedding.scale": np.full((8, 1), 1e-3),
        }
    )
    scores = embed.attend(jnp.full((2, 4096), 8.0, dtype))
    np.testing.assert_allclose(np.asarray(scores, np.float64), 8 * 127 * 4096 * 1e-3, rtol=2**-7)


def test_linear_stores_scales_in_param_dtype_and_computes_in_dtype_or_the_inputs():
    layer = nn.QuantizedLinear(8, 4, param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    assert layer.kernel.scale.dtype == jnp.bfloat16 and layer.bias is not None
    assert layer.bias.dtype == jnp.bfloat16 and layer.kernel.value.dtype == jnp.int8
    assert layer(jnp.ones((2, 8), jnp.float32)).dtype == jnp.float32  # the input's dtype
    float32 = nn.QuantizedLinear(8, 4, rngs=nn.Rngs(0))
    assert float32(jnp.ones(8, jnp.bfloat16)).dtype == jnp.bfloat16  # the input's dtype
    # a float32 layer computing in bfloat16: the kernel dequantized into bfloat16
    half = nn.QuantizedLinear(8, 4, dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    x = jnp.asarray(data(3, 8, seed=2))
    y = half(x)
    assert y.dtype == jnp.bfloat16 and half.kernel.scale.dtype == jnp.float32
    kernel = half.kernel.value.astype(jnp.bfloat16) * half.kernel.scale.astype(jnp.bfloat16)
    expected = np.asarray(x.astype(jnp.bfloat16), np.float64) @ np.asarray(kernel, np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=2**-7, atol=2e-2)


def test_embed_looks_up_dequantized_rows_and_attends_to_the_table():
    embed = nn.QuantizedEmbed(11, 16, bits=4, group_size=8, precision="highest", rngs=nn.Rngs(0))
    table = np.asarray(embed.embedding.dequantize())
    ids = jnp.array([[0, 3, 10], [-1, 11, 4]])
    y = jax.jit(embed.__call__)(ids)
    assert y.shape == (2, 3, 16) and y.dtype == jnp.float32
    np.testing.assert_array_equal(y[0], table[[0, 3, 10]])
    np.testing.assert_array_equal(y[1, 0], table[10])  # negative ids count from the end
    assert np.isnan(y[1, 1]).all()  # past the end: a row of NaNs
    x = data(4, 16, seed=1)
    np.testing.assert_allclose(embed.attend(jnp.asarray(x)), x @ table.T, rtol=1e-5, atol=1e-5)
    rows = nn.QuantizedEmbed(11, 16, bits=8, precision="highest", rngs=nn.Rngs(0))  # per row
    per_row = np.asarray(rows.embedding.dequantize())
    np.testing.assert_allclose(rows.attend(jnp.asarray(x)), x @ per_row.T, rtol=1e-5, atol=1e-5)
    assert embed.attend(jnp.ones(16, jnp.bfloat16)).dtype == jnp.bfloat16  # the input's
    half = embed.replace(dtype=jnp.dtype(jnp.bfloat16))  # looked up and attending in bfloat16
    assert half(ids).dtype == half.attend(jnp.ones(16)).dtype == jnp.bfloat16
    half_table = embed.embedding.dequantize(jnp.bfloat16)  # dequantized in bfloat16
    np.testing.assert_array_equal(half(ids)[0], half_table[np.array([0, 3, 10])])
    float_embed = nn.Embed(11, 16, rngs=nn.Rngs(0))
    assert bitwise_equal(embed.embedding, tt.quantize(float_embed, bits=4, group_size=8).embedding)
    assert embed.embedding.scale.shape == (11, 2)  # per row, in groups of 8 features


def test_wrong_inputs_are_refused_by_name(without_type_checks):
    with pytest.raises(
        ValueError,
        match=r"QuantizedLinear expects inputs whose last axis has 8 features \(its kernel is "
        r"\(8, 4\)\), got an input of shape \(2, 5\).*in_features=5",
    ):
        nn.QuantizedLinear(8, 4, rngs=nn.Rngs(0))(jnp.ones((2, 5)))
    embed = nn.QuantizedEmbed(10, 8, rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"QuantizedEmbed\.attend expects inputs whose last axis has 8 features \(its "
        r"embedding is \(10, 8\)\), got an input of shape \(2, 5\).*features=5",
    ):
        embed.attend(jnp.ones((2, 5)))
    with pytest.raises(
        TypeError, match=r"QuantizedEmbed expects integer ids, got an array of dtype float32"
    ):
        embed(jnp.ones(3))
    with pytest.raises(
        ValueError,
        match=r"cannot quantize QuantizedLinear\.kernel of shape \(8, 4\): group_size must divide axis 0",
    ):
        nn.QuantizedLinear(8, 4, group_size=3, rngs=nn.Rngs(0))


@pytest.mark.parametrize("make, scope", [  # made in the test: collecting must not start JAX
    (lambda: (nn.QuantizedLinear(4, 3, rngs=nn.Rngs(0)), jnp.ones((2, 4))), "QuantizedLinear"),
    (lambda: (nn.QuantizedEmbed(5, 4, rngs=nn.Rngs(0)), jnp.arange(3)), "QuantizedEmbed"),
])  # fmt: skip
def test_every_call_runs_in_a_named_scope(make, scope):
    layer, x = make()
    jaxpr = jax.make_jaxpr(lambda layer, x: layer(x))(layer, x).jaxpr
    assert all(str(eqn.source_info.name_stack).startswith(scope) for eqn in jaxpr.eqns)
    if scope == "QuantizedEmbed":
        jaxpr = jax.make_jaxpr(lambda layer, x: layer.attend(x))(layer, jnp.ones(4)).jaxpr
        stacks = [str(eqn.source_info.name_stack) for eqn in jaxpr.eqns]
        assert all(stack.startswith("QuantizedEmbed.attend") for stack in stacks)


# --- tt.quantize and tt.dequantize ------------------------------------------------------


def test_quantize_swaps_every_linear_and_embed_and_leaves_the_model_alone():
    net = Net(rngs=nn.Rngs(0))
    q = tt.quantize(net)
    assert isinstance(q.embed, nn.QuantizedEmbed) and isinstance(q.head, nn.QuantizedLinear)
    assert all(isinstance(layer, nn.QuantizedLinear) for layer in q.encoder)
    assert isinstance(net.head, nn.Linear) and not isinstance(net.head, nn.QuantizedLinear)
    assert q.head.bias is net.head.bias  # biases are kept as they are
    assert list(q.flat_state_dict()) == [
        "embed.embedding.value", "embed.embedding.scale",
        "encoder.0.kernel.value", "encoder.0.kernel.scale", "encoder.0.bias",
        "encoder.1.kernel.value", "encoder.1.kernel.scale", "encoder.1.bias",
        "head.kernel.value", "head.kernel.scale", "head.bias",
    ]  # fmt: skip
    assert q.embed.embedding.axis == 1 and q.head.kernel.axis == 0
    ids = jnp.arange(6)
    error = jnp.linalg.norm(q(ids) - net(ids)) / jnp.linalg.norm(net(ids))
    assert 0 < float(error) < 0.02


def test_a_filter_picks_layers_by_pattern_or_predicate():
    net = Net(rngs=nn.Rngs(0))
    by_pattern = tt.quantize(net, bits=4, group_size=16, where="encoder.**")
    assert [type(layer).__name__ for layer in by_pattern.encoder] == ["QuantizedLinear"] * 2
    assert by_pattern.head is net.head and by_pattern.embed is net.embed
    assert by_pattern.encoder[0].kernel.bits == 4
    seen = []
    kept = tt.quantize(net, where=lambda name, layer: seen.append(name) or name != "head")
    assert seen == ["embed", "encoder.0", "encoder.1", "head"]
    assert kept.head is net.head and isinstance(kept.embed, nn.QuantizedEmbed)
    assert tt.quantize(nn.Linear(4, 2, rngs=nn.Rngs(0))).kernel.shape == (4, 2)  # the root


def test_quantize_refuses_selections_and_group_sizes_that_cannot_work(without_type_checks):
    net = Net(rngs=nn.Rngs(0))
    with pytest.raises(
        tt.SelectionError,
        match=r"^taktiny\.quantize on Net: 1 problem:\n  - 'heads': matches no Linear or Embed "
        r"layer; did you mean 'head'\?$",
    ):
        tt.quantize(net, where="heads")
    with pytest.raises(
        TypeError,
        match=r"^taktiny\.quantize: where is a pattern over layer names \('\*\*\.attention\.\*'\), "
        r"a non-empty list of them, or a function \(name, layer\) -> bool; got 3\.$",
    ):
        tt.quantize(net, where=3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(
        ValueError,
        match=r"cannot quantize encoder\.1\.kernel of shape \(64, 32\): group_size must divide axis 0 \(size 64\).*got 24",
    ):
        tt.quantize(net, group_size=24, where="encoder.1")
    with pytest.raises(
        ValueError,
        match=r"cannot quantize head\.kernel of shape \(32, 8\): bits must be 8 or 4, got 2",
    ):
        tt.quantize(net, bits=2, where="head")


def test_dequantize_gives_float_layers_back():
    net = Net(rngs=nn.Rngs(0))
    q = tt.quantize(net, bits=4, group_size=8, where=lambda name, _: name != "head")
    back = tt.dequantize(q)
    # the layers a float build has (JAX's treedef equality alone ignores the field order)
    assert [type(x) for x in (back.embed, *back.encoder)] == [
        type(x) for x in (net.embed, *net.encoder)
    ]
    assert list(back.flat_state_dict()) == list(net.flat_state_dict())
    np.testing.assert_array_equal(back.encoder[1].kernel, q.encoder[1].kernel.dequantize())
    np.testing.assert_array_equal(back.embed.embedding, q.embed.embedding.dequantize())
    assert back.head is net.head and back.encoder[0].bias is net.encoder[0].bias
    again = tt.quantize(back, bits=4, group_size=8, where="e*.**")  # the same values again
    assert jax.tree.structure(again) == jax.tree.structure(q)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(q), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6)


def test_quantize_and_dequantize_keep_each_layers_dtype_and_precision():
    class Pair(nn.Module):
        def __init__(self, **config):
            self.dense = nn.Linear(8, 4, **config, rngs=nn.Rngs(0))
            self.embed = nn.Embed(5, 8, **config, rngs=nn.Rngs(1))

    config = {"dtype": jnp.bfloat16, "precision": "highest"}
    q = tt.quantize(Pair(**config))
    for layer in (q.dense, q.embed):
        assert layer.dtype == jnp.bfloat16 and layer.precision == jax.lax.Precision.HIGHEST
    built = (nn.QuantizedLinear(8, 4, **config, rngs=nn.Rngs(0)),
             nn.QuantizedEmbed(5, 8, **config, rngs=nn.Rngs(1)))  # fmt: skip
    assert jax.tree.structure((q.dense, q.embed)) == jax.tree.structure(built)
    assert q.dense(jnp.ones(8)).dtype == jnp.bfloat16
    back = tt.dequantize(q)
    assert jax.tree.structure(back) == jax.tree.structure(Pair(**config))
    assert back.dense.dtype == back.embed.dtype == jnp.bfloat16
    assert back.embed.precision == jax.lax.Precision.HIGHEST
    assert tt.quantize(Pair()).dense.dtype is None  # the default stays the default


def test_abstract_models_quantize_without_computing():
    abstract = jax.eval_shape(lambda: Net(rngs=nn.Rngs(0)))
    q = tt.quantize(abstract, bits=4, group_size=16)
    assert isinstance(q.head.kernel.value, jax.ShapeDtypeStruct)
    assert q.head.kernel.value.dtype == jnp.int4 and q.head.kernel.scale.shape == (2, 8)
    assert jax.tree.structure(q) == jax.tree.structure(
        tt.quantize(Net(rngs=nn.Rngs(0)), bits=4, group_size=16)
    )
    assert isinstance(tt.dequantize(q).head.kernel, jax.ShapeDtypeStruct)


def test_error_bound_on_a_gelu_mlp():
    # relative output error against the float model: symmetric max-abs rounding gives about
    # 0.8% (int8, per channel) and 13% (int4, groups of 64) here
    mlp = nn.Sequential(
        nn.Linear(512, 2048, rngs=nn.Rngs(0)), jax.nn.gelu, nn.Linear(2048, 512, rngs=nn.Rngs(1))
    )
    x = jnp.asarray(data(64, 512, seed=2))
    forward = jax.jit(lambda model: model(x))
    y = forward(mlp)
    errors = {}
    for bits, group_size in [(8, None), (4, 64)]:
        yq = forward(tt.quantize(mlp, bits=bits, group_size=group_size))
        errors[bits] = float(jnp.linalg.norm(yq - y) / jnp.linalg.norm(y))
    assert 0.001 < errors[8] < 0.02 and 0.05 < errors[4] < 0.18, errors


# --- state, Orbax, sharding ---------------------------------------------------------------


@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 8)])
def test_the_state_holds_qarrays_whole_and_flat_and_both_load(bits, group_size):
    q = tt.quantize(Net(rngs=nn.Rngs(0)), bits=bits, group_size=group_size)
    state = q.state_dict()
    assert state["head"]["kernel"] is not None and isinstance(state["head"]["kernel"], tt.QArray)
    assert state["head"]["kernel"].value is q.head.kernel.value
    other = tt.quantize(Net(rngs=nn.Rngs(1)), bits=bits, group_size=group_size)
    assert not bitwise_equal(other, q)
    assert bitwise_equal(other.load_state_dict(state, strict=True), q)
    assert bitwise_equal(other.load_flat_state_dict(q.flat_state_dict(), strict=True), q)
    parts = {"value": np.asarray(q.head.kernel.value), "scale": np.asarray(q.head.kernel.scale)}
    loaded = other.load_state_dict({"head": {"kernel": parts}})
    assert bitwise_equal(loaded.head, other.head.replace(kernel=q.head.kernel))
    assert loaded.encoder[0].kernel is other.encoder[0].kernel
    jitted = jax.jit(lambda m, s: m.load_state_dict(s))(other, state)
    assert bitwise_equal(jitted, q)


@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 8)])
def test_orbax_restores_qarrays_bitwise_with_or_without_a_target(tmp_path, bits, group_size):
    q = tt.quantize(Net(rngs=nn.Rngs(0)), bits=bits, group_size=group_size)
    fresh = tt.quantize(Net(rngs=nn.Rngs(1)), bits=bits, group_size=group_size)
    path = (tmp_path / "model").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, q.state_dict())
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(path, target=fresh.state_dict())
        untargeted = checkpointer.restore(path)
    assert isinstance(state["head"]["kernel"], tt.QArray)
    assert bitwise_equal(fresh.load_state_dict(state, strict=True), q)
    assert set(untargeted["head"]["kernel"]) == {"value", "scale"}  # plain dicts of the parts
    assert untargeted["head"]["kernel"]["value"].dtype == q.head.kernel.value.dtype
    assert bitwise_equal(fresh.load_state_dict(untargeted, strict=True), q)


def mesh_of(axis_type, shape=(2, 4)):
    return jax.make_mesh(
        shape, ("data", "model"), axis_types=(axis_type,) * 2, devices=jax.devices("cpu")
    )


SPLITS = {  # kernel_sharding, bias_sharding, layer arguments, the scale's spec
    "columns": ((None, "model"), ("model",), {}, (None, "model")),
    "rows-int4": (("model", None), (None,), {"bits": 4, "group_size": 16}, (None, None)),
    "columns-int4": ((None, "model"), ("model",), {"bits": 4, "group_size": 8}, (None, "model")),
}


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("split", SPLITS)
def test_a_split_quantized_linear_splits_its_parts_alike_and_computes_the_same(axis_type, split):
    kernel_sharding, bias_sharding, kw, scale_spec = SPLITS[split]
    mesh = mesh_of(axis_type)
    x = data(4, 6, 64)
    reference = nn.QuantizedLinear(64, 32, rngs=nn.Rngs(0), **kw)
    build = lambda: nn.QuantizedLinear(
        64, 32, kernel_sharding=kernel_sharding, bias_sharding=bias_sharding, rngs=nn.Rngs(0), **kw
    )
    with jax.set_mesh(mesh):
        layer = build()
        abstract = tt.eval_shape(build)  # traced: the same shardings, from the arrays' types
        y = jax.jit(lambda layer, x: layer(x))(layer, jax.device_put(x, P("data")))
    for concrete, traced in zip(jax.tree.leaves(layer), jax.tree.leaves(abstract), strict=True):
        assert concrete.sharding.is_equivalent_to(traced.sharding, concrete.ndim)
    value, scale = layer.kernel.value.sharding, layer.kernel.scale.sharding
    assert value.is_equivalent_to(jax.NamedSharding(mesh, P(*kernel_sharding)), 2)
    assert scale.is_equivalent_to(jax.NamedSharding(mesh, P(*scale_spec)), 2)
    assert bitwise_equal(layer, reference)  # the values of an unsharded build
    np.testing.assert_allclose(y, reference(jnp.asarray(x)), rtol=1e-5, atol=1e-5)
    assert y.sharding.spec[0] == "data"


def test_groups_may_not_straddle_devices():
    with (
        jax.set_mesh(mesh_of(AxisType.Explicit)),
        pytest.raises(
            ValueError,
            match=r"QuantizedLinear\.kernel of shape \(64, 32\) is split 4 ways along axis 0 .* "
            r"does not divide its 2 groups of 32: a group would straddle two devices\. Use a group "
            r"size that gives a multiple of 4 groups, or do not split axis 0\.",
        ),
    ):
        nn.QuantizedLinear(64, 32, group_size=32, kernel_sharding=("model", None), rngs=nn.Rngs(0))


def test_a_split_embed_looks_up_as_the_unsplit_one():
    ids = np.array([[0, 3, 5, 17], [1, 2, -1, 15]], np.int32)
    reference = nn.QuantizedEmbed(16, 32, group_size=8, rngs=nn.Rngs(0))
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        for spec, scale_spec in [
            (("model", None), ("model", None)),
            ((None, "model"), (None, None)),
        ]:
            mesh = mesh_of(axis_type)
            with jax.set_mesh(mesh):
                embed = nn.QuantizedEmbed(
                    16, 32, group_size=8, embedding_sharding=spec, rngs=nn.Rngs(0)
                )
                y = jax.jit(lambda e, i: e(i))(embed, jax.device_put(ids, P("data")))
            assert embed.embedding.scale.sharding.is_equivalent_to(
                jax.NamedSharding(mesh, P(*scale_spec)), 2
            )
            np.testing.assert_array_equal(y, reference(jnp.asarray(ids)))


def test_quantize_and_dequantize_keep_the_shardings_of_a_split_model():
    mesh = mesh_of(AxisType.Explicit)
    with jax.set_mesh(mesh):
        linear = nn.Linear(
            64, 32, kernel_sharding=(None, "model"), bias_sharding=("model",), rngs=nn.Rngs(0)
        )
    q = tt.quantize(linear, bits=4, group_size=16)
    assert q.kernel.value.sharding == linear.kernel.sharding and q.bias is linear.bias
    assert q.kernel.scale.sharding.spec == P(None, "model")
    back = tt.dequantize(q)
    assert back.kernel.sharding.is_equivalent_to(linear.kernel.sharding, 2)


def test_a_split_quantized_model_round_trips_through_orbax_onto_another_mesh(tmp_path):
    def build():
        return nn.QuantizedLinear(
            64,
            32,
            bits=4,
            group_size=8,
            kernel_sharding=(None, "model"),
            bias_sharding=("model",),
            rngs=nn.Rngs(0),
        )

    with jax.set_mesh(mesh_of(AxisType.Explicit)):
        layer = build()
    path = (tmp_path / "model").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, layer.state_dict())
    other = mesh_of(AxisType.Explicit, (4, 2))
    with jax.set_mesh(other):
        abstract = tt.eval_shape(build)
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(path, target=abstract.state_dict())
    restored = abstract.load_state_dict(state, strict=True)
    assert bitwise_equal(restored, layer)
    assert restored.kernel.value.sharding == jax.NamedSharding(other, P(None, "model"))
    assert restored.kernel.scale.sharding.is_equivalent_to(
        jax.NamedSharding(other, P(None, "model")), 2
    )


# --- bad input ------------------------------------------------------------------------------


@pytest.fixture
def layers():
    return (nn.QuantizedLinear(32, 8, rngs=nn.Rngs(0)),
            nn.QuantizedLinear(32, 8, bits=4, group_size=8, rngs=nn.Rngs(0)),
            nn.Linear(32, 8, rngs=nn.Rngs(0)))  # fmt: skip


def test_a_value_and_scale_of_mismatched_shapes_are_refused(layers):
    int8_layer, _, _ = layers
    with pytest.raises(
        tt.StateDictError,
        match=r"1 problem; nothing was loaded\.\n  - 'kernel\.scale': the scale of 'kernel', "
        r"QArray\(i8\[32,8\], scale=f32\[1,8\], axis=0\), has shape \(1, 8\) \(one per channel "
        r"along axis 0\), got \(4, 8\): the scales of another layout\.",
    ):
        int8_layer.load_state_dict(
            {"kernel": {"value": int8_layer.kernel.value, "scale": np.ones((4, 8), np.float32)}}
        )
    with pytest.raises(
        tt.StateDictError,
        match=r"'kernel\.value': shape mismatch: expected \(32, 8\), got \(8, 32\)",
    ):
        int8_layer.load_flat_state_dict({"kernel.value": np.zeros((8, 32), np.int8)})


def test_an_int8_value_where_int4_is_expected_is_refused(layers):
    int8_layer, int4_layer, _ = layers
    with pytest.raises(
        tt.StateDictError,
        match=r"'kernel\.value': the value of 'kernel', QArray\(i4\[32,8\], scale=f32\[4,8\], "
        r"axis=0, group_size=8\), holds int4 \(a 4-bit quantization\); got int8, the integers of "
        r"another one \(8-bit\), which a cast would not re-scale",
    ):
        int4_layer.load_flat_state_dict({"kernel.value": int8_layer.kernel.value})
    with pytest.raises(
        tt.StateDictError,
        match=r"'kernel': the model holds QArray\(i4\[32,8\], scale=f32\[4,8\], axis=0, "
        r"group_size=8\) here and the state QArray\(i8\[32,8\], scale=f32\[1,8\], axis=0\): "
        r"quantized another way\. Pass match_quantization=True to re-quantize it on load",
    ):
        int4_layer.load_state_dict({"kernel": int8_layer.kernel})


def test_a_float_array_where_a_qarray_belongs_is_refused(layers):
    int8_layer, _, float_layer = layers
    with pytest.raises(
        tt.StateDictError,
        match=r"'kernel': the model holds a quantized array here, QArray\(i8\[32,8\], "
        r"scale=f32\[1,8\], axis=0\), and the state an array float32\[32, 8\]: the "
        r"representations differ\. Pass match_quantization=True to quantize it on load",
    ):
        int8_layer.load_state_dict(float_layer.state_dict())
    with pytest.raises(
        tt.StateDictError,
        match=r"'kernel': the model holds a quantized array here, QArray\(i8\[32,8\]",
    ):
        int8_layer.load_flat_state_dict(float_layer.flat_state_dict())
    with pytest.raises(
        tt.StateDictError,
        match=r"'kernel\.value': the value of 'kernel', QArray\(i8\[32,8\].*holds int8 \(an 8-bit "
        r"quantization\); got float32, a float array where the quantized integers belong",
    ):
        int8_layer.load_flat_state_dict({"kernel.value": float_layer.kernel})
    with pytest.raises(
        tt.StateDictError,
        match=r"'kernel': the model holds an array float32\[32, 8\] here and the state a "
        r"QArray\(i8\[32,8\], scale=f32\[1,8\], axis=0\): the representations differ\. Pass "
        r"match_quantization=True to dequantize it on load",
    ):
        float_layer.load_state_dict(int8_layer.state_dict())


def test_a_predicate_sees_each_layer_and_may_choose_none():
    net = Net(rngs=nn.Rngs(0))
    embeds = tt.quantize(net, where=lambda name, layer: isinstance(layer, nn.Embed))
    assert isinstance(embeds.embed, nn.QuantizedEmbed) and embeds.head is net.head
    assert all(q is f for q, f in zip(embeds.encoder, net.encoder, strict=True))
    # a function that picks nothing is a choice, not a mistake: the model comes back as is
    none = tt.quantize(net, where=lambda name, layer: False)
    assert none.embed is net.embed and none.head is net.head


def test_a_pattern_that_matches_nothing_names_the_closest_layer_or_lists_them(
    without_type_checks,
):
    with pytest.raises(
        ValueError,
        match=r"^taktiny\.quantize on list: 1 problem:\n  - 'x': matches no Linear or Embed "
        r"layer; the model has none\.$",
    ):
        tt.quantize([jnp.ones(3)], where="x")
    five = [nn.Linear(2, 2, rngs=nn.Rngs(i)) for i in range(5)]
    with pytest.raises(
        ValueError,
        match=r"^taktiny\.quantize on list: 1 problem:\n  - 'x': matches no Linear or Embed "
        r"layer; no name is close to it; the layers it may name: '0', '1', '2', '3' and 1 "
        r"more\.$",
    ):
        tt.quantize(five, where="x")


def test_quantize_errors_name_the_weight_from_the_models_root():
    with pytest.raises(ValueError, match=r"^cannot quantize kernel of shape \(8, 4\): group_size "):
        tt.quantize(nn.Linear(8, 4, rngs=nn.Rngs(0)), group_size=3)
    with pytest.raises(ValueError, match=r"^cannot quantize embedding of shape \(10, 8\): group_"):
        tt.quantize(nn.Embed(10, 8, rngs=nn.Rngs(0)), group_size=3)
    with pytest.raises(ValueError, match=r"^cannot quantize 1\.embedding of shape \(10, 8\): "):
        tt.quantize(
            [nn.Linear(6, 4, rngs=nn.Rngs(0)), nn.Embed(10, 8, rngs=nn.Rngs(0))], group_size=3
        )


def test_the_layers_errors_name_their_weights(without_type_checks):
    with pytest.raises(
        ValueError,
        match=r"^cannot quantize QuantizedEmbed\.embedding of shape \(10, 8\): group_size must "
        r"divide axis 1",
    ):
        nn.QuantizedEmbed(10, 8, group_size=3, rngs=nn.Rngs(0))
    for make, where in [
        (lambda: nn.QuantizedLinear(8, 4, kernel_sharding="model", rngs=nn.Rngs(0)), "QuantizedLinear.kernel"),
        (lambda: nn.QuantizedLinear(8, 4, bias_sharding="model", rngs=nn.Rngs(0)), "QuantizedLinear.bias"),
        (lambda: nn.QuantizedEmbed(10, 8, embedding_sharding="model", rngs=nn.Rngs(0)), "QuantizedEmbed.embedding"),
    ]:  # fmt: skip
        with pytest.raises(TypeError, match=f"^{re.escape(where)}: a sharding is a PartitionSpec"):
            make()
    for make, layer in [
        (lambda: nn.QuantizedLinear(8, 4, precision="bogus", rngs=nn.Rngs(0)), "QuantizedLinear"),
        (lambda: nn.QuantizedEmbed(10, 8, precision="bogus", rngs=nn.Rngs(0)), "QuantizedEmbed"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^{layer}'s precision must be None, a "):
            make()


@pytest.mark.parametrize(("features", "out"), [("model", "model"), ("data", None)])
def test_a_lookup_on_explicit_axes_is_split_as_the_ids_and_the_tables_features(features, out):
    """The rows come back split as the ids on their axes and as the table on the features,
    unless the ids already use that mesh axis (then the features are gathered)."""
    ids = np.array([[0, 3, 5, 17], [1, 2, -1, 15]], np.int32)
    reference = nn.QuantizedEmbed(16, 32, group_size=8, rngs=nn.Rngs(0))
    with jax.set_mesh(mesh_of(AxisType.Explicit)):
        embed = nn.QuantizedEmbed(
            16, 32, group_size=8, embedding_sharding=(None, features), rngs=nn.Rngs(0)
        )
        y = jax.jit(lambda e, i: e(i))(embed, jax.device_put(ids, P("data")))
    assert y.sharding.spec == P("data", None, out)
    np.testing.assert_array_equal(y, reference(jnp.asarray(ids)))


def test_on_explicit_axes_each_device_gathers_the_scales_of_its_own_ids():
    """The scales are gathered split as the ids (never on the features: there are fewer
    groups than features), as the values are, not whole on every device."""
    ids = np.array([[0, 3, 5, 17], [1, 2, -1, 15]], np.int32)
    with jax.set_mesh(mesh_of(AxisType.Explicit)):
        embed = nn.QuantizedEmbed(
            16, 32, group_size=8, embedding_sharding=(None, "model"), rngs=nn.Rngs(0)
        )
        split = jax.device_put(ids, P("data"))
        jaxpr = jax.make_jaxpr(lambda e, i: e(i))(embed, split).jaxpr
    dequantize = [e for e in _eqns(jaxpr) if e.params.get("name") == "dequantize_array"]
    assert len(dequantize) == 1
    value, scale = (v.aval for v in dequantize[0].invars)
    assert (value.shape, value.sharding.spec) == ((2, 4, 32), P("data", None, "model"))
    assert (scale.shape, scale.sharding.spec) == ((2, 4, 4), P("data", None, None))


def test_integer_inputs_are_computed_in_the_scales_dtype(without_type_checks):
    """With dtype=None a float input sets the dtype; an integer one has none to give, so
    the layer computes in its scales' dtype. (The signatures say Float, so the test-time
    type checks are off.)"""
    x = jnp.arange(8) - 4
    layer = nn.QuantizedLinear(8, 4, param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    assert layer(x).dtype == jnp.bfloat16
    np.testing.assert_array_equal(layer(x), layer(x.astype(jnp.bfloat16)))
    embed = nn.QuantizedEmbed(5, 8, rngs=nn.Rngs(0))
    assert embed.attend(x).dtype == jnp.float32
    np.testing.assert_array_equal(embed.attend(x), embed.attend(x.astype(jnp.float32)))


def test_the_products_run_at_the_layers_precision():
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    linear = nn.QuantizedLinear(8, 4, precision="highest", rngs=nn.Rngs(0))
    embed = nn.QuantizedEmbed(5, 8, precision="highest", rngs=nn.Rngs(0))
    for layer, call in [(linear, lambda m, x: m(x)), (embed, lambda m, x: m.attend(x))]:
        jaxpr = jax.make_jaxpr(call)(layer, jnp.ones((2, 8))).jaxpr
        dots = [e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
        assert len(dots) == 1 and dots[0].params["precision"] == highest


def test_dequantize_leaves_other_leaves_and_modules_as_they_are():
    q = tt.quantize(nn.Linear(4, 2, rngs=nn.Rngs(0)))
    w, norm = jnp.ones(3), nn.GroupNorm(2, 4)
    back = tt.dequantize({"q": q, "w": w, "norm": norm})
    assert isinstance(back["q"], nn.Linear) and back["w"] is w
    assert isinstance(back["norm"], nn.GroupNorm) and back["norm"].scale is norm.scale
