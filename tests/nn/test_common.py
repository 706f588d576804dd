"""What every layer shares: named scopes, the dtype rule, jit/grad, init draws, reprs."""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taktiny import nn
from taktiny.nn import _random


def rngs():
    return nn.Rngs(0)


# name -> (factory taking the dtype keywords, input shape, call keyword arguments)
LAYERS = {
    "Linear": (lambda **kw: nn.Linear(4, 3, **kw, rngs=rngs()), (2, 4), {}),
    "LayerNorm": (lambda **kw: nn.LayerNorm(4, **kw), (2, 4), {}),
    "RMSNorm": (lambda **kw: nn.RMSNorm(4, **kw), (2, 4), {}),
    "Conv": (lambda **kw: nn.Conv(4, 3, (3,), **kw, rngs=rngs()), (2, 5, 4), {}),
    "ConvTranspose": (
        lambda **kw: nn.ConvTranspose(4, 3, (3,), strides=2, **kw, rngs=rngs()),
        (2, 5, 4),
        {},
    ),
    "BatchNorm": (lambda **kw: nn.BatchNorm(4, **kw), (2, 4), {}),
    "GroupNorm": (lambda **kw: nn.GroupNorm(2, 4, **kw), (2, 3, 4), {}),
    "MultiHeadAttention": (
        lambda **kw: nn.MultiHeadAttention(2, 4, **kw, rngs=rngs()),
        (2, 5, 4),
        {"causal": True},
    ),
}


def plain(layer, x):
    return layer(x)


# The dtype rule covers every layer with parameters, each of its calls:
# name -> (factory taking the dtype keywords, the input (made in the test), the call)
CALLS = {
    **{
        name: (factory, lambda shape=shape: jnp.ones(shape), lambda f, x, kw=kwargs: f(x, **kw))
        for name, (factory, shape, kwargs) in LAYERS.items()
    },
    "BatchNorm(train=True)": (
        LAYERS["BatchNorm"][0],
        lambda: jnp.arange(8.0).reshape(2, 4),
        lambda bn, x: bn(x, train=True)[0],
    ),
    "Embed": (lambda **kw: nn.Embed(5, 4, **kw, rngs=rngs()), lambda: jnp.arange(3), plain),
    "Embed.attend": (
        lambda **kw: nn.Embed(5, 4, **kw, rngs=rngs()),
        lambda: jnp.ones((2, 4)),
        lambda embed, x: embed.attend(x),
    ),
    "QuantizedLinear": (lambda **kw: nn.QuantizedLinear(4, 3, **kw, rngs=rngs()), lambda: jnp.ones((2, 4)), plain),
    "QuantizedEmbed": (lambda **kw: nn.QuantizedEmbed(5, 4, **kw, rngs=rngs()), lambda: jnp.arange(3), plain),
    "QuantizedEmbed.attend": (
        lambda **kw: nn.QuantizedEmbed(5, 4, **kw, rngs=rngs()),
        lambda: jnp.ones((2, 4)),
        lambda embed, x: embed.attend(x),
    ),
}  # fmt: skip

# the calls that multiply matrices or convolve, and so take a precision
PRECISE = ["Linear", "Conv", "ConvTranspose", "MultiHeadAttention", "Embed.attend",
           "QuantizedLinear", "QuantizedEmbed.attend"]  # fmt: skip

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def _call(name, **dtypes):
    """The layer `name` built with `dtypes`, and the output of its call on its input."""
    factory, x, call = CALLS[name]
    layer = factory(**dtypes)
    return layer, call(layer, x())


def _floats(tree):
    """The dtypes of the float leaves of `tree` (a quantized weight's scale; not its ints)."""
    return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


# Quantized layers compute in their input's dtype when ``dtype=None`` (their parameters
# are ints): one int8 kernel serves float32 and bfloat16 callers alike.
FOLLOW_THE_INPUT = {"QuantizedLinear", "QuantizedEmbed.attend"}


@pytest.mark.parametrize("name", CALLS)
def test_parameters_are_stored_in_param_dtype_and_computed_in_it_by_default(name):
    """``dtype=None`` (the default) computes in the parameters' dtype, whatever the input's
    (the quantized layers: in the input's)."""
    layer, y = _call(name, param_dtype=jnp.bfloat16)
    assert _floats(layer) == {BF16} and y.dtype == (F32 if name in FOLLOW_THE_INPUT else BF16)
    layer, y = _call(name)  # float32 parameters by default
    assert _floats(layer) == {F32} and y.dtype == F32
    _, x, call = CALLS[name]
    if x().dtype == F32:  # a bfloat16 input to a float32 layer: float32 out
        y = call(layer, x().astype(jnp.bfloat16))
        assert y.dtype == (BF16 if name in FOLLOW_THE_INPUT else F32)


@pytest.mark.parametrize("name", CALLS)
def test_dtype_is_the_compute_and_output_dtype_and_the_state_keeps_param_dtype(name):
    """A float32 layer computing in bfloat16 returns bfloat16, and its state (BatchNorm's
    updated running statistics too) stays float32; and the other way round."""
    layer, y = _call(name, dtype=jnp.bfloat16)
    assert y.dtype == BF16 and _floats(layer) == {F32} and layer.dtype == BF16
    # and the gradients are float32, as the parameters (not MultiHeadAttention: the backward
    # pass of jax.nn.dot_product_attention in bfloat16 fails under strict promotion)
    if name in LAYERS and name != "MultiHeadAttention":
        _, x, call = CALLS[name]
        grads = jax.grad(lambda layer: jnp.sum(call(layer, x()).astype(F32)))(layer)
        assert _floats(grads) == {F32}
    layer, y = _call(name, dtype=jnp.float32, param_dtype=jnp.bfloat16)
    assert y.dtype == F32 and _floats(layer) == {BF16}


def test_a_float32_batch_norm_training_in_bfloat16_keeps_float32_statistics():
    bn = nn.BatchNorm(4, dtype=jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)) * 3 + 1, jnp.float32)
    y, new = bn(x, train=True)
    assert y.dtype == BF16 and _floats(new) == {F32}
    np.testing.assert_allclose(new.mean, 0.01 * np.asarray(x).mean(0), rtol=1e-6)
    y, new = nn.train_forward(nn.Sequential(bn), x)
    assert y.dtype == BF16 and _floats(new) == {F32}


def _products(fn, *args):
    """Every dot_general and conv_general_dilated in `fn`'s jaxpr, nested ones too."""
    found, todo = [], [jax.make_jaxpr(fn)(*args).jaxpr]
    while todo:
        jaxpr = todo.pop()
        found += [
            e for e in jaxpr.eqns if e.primitive.name in ("dot_general", "conv_general_dilated")
        ]
        todo += jax.extend.core.subjaxprs(jaxpr)
    return found


@pytest.mark.parametrize("name", PRECISE)
def test_products_run_in_the_compute_dtype(name):
    """``dtype=bfloat16`` on float32 parameters casts both operands of every product."""
    factory, x, call = CALLS[name]
    layer = factory(dtype=jnp.bfloat16)
    products = _products(lambda x: call(layer, x), x())
    assert products and all(v.aval.dtype == BF16 for e in products for v in e.invars)


@pytest.mark.parametrize("name", PRECISE)
def test_precision_reaches_every_product(name):
    """``precision="highest"`` sets ``Precision.HIGHEST`` on every matrix product and
    convolution the call makes; without it none has a precision (JAX's default)."""
    factory, x, call = CALLS[name]
    for precision, expected in (("highest", HIGHEST), (None, None)):
        products = _products(partial(call, factory(precision=precision)), x())
        assert products and all(e.params["precision"] == expected for e in products), [
            e.params["precision"] for e in products
        ]


@pytest.mark.parametrize("name", PRECISE)
def test_a_bad_precision_is_refused_when_the_layer_is_built(name):
    layer = name.split(".")[0]
    with pytest.raises(ValueError) as raised:
        CALLS[name][0](precision="best")
    assert str(raised.value) == (
        f"{layer}'s precision must be None, a jax.lax.Precision or one of the names 'default', "
        f"'high', 'highest' (or a pair of them, one per operand), or a "
        f"jax.lax.DotAlgorithmPreset; got 'best'. Use precision='highest' for full float32 "
        f"products on GPUs and TPUs."
    )


def test_precision_takes_names_in_any_case_pairs_and_precisions(without_type_checks):
    """Names become ``jax.lax.Precision`` when the layer is built; anything else that is
    not a precision is refused then (type checks off: the layer's own check)."""
    make = lambda precision: nn.Linear(2, 2, precision=precision, rngs=rngs()).precision
    assert make("HIGH") == jax.lax.Precision.HIGH
    assert make(("highest", "Default")) == (HIGHEST[0], jax.lax.Precision.DEFAULT)
    assert make(jax.lax.Precision.HIGH) == jax.lax.Precision.HIGH
    preset = jax.lax.DotAlgorithmPreset.F32_F32_F32
    assert make(preset) is preset
    assert make(None) is None
    for bad in [3, ("highest",), ("highest", 3), ["highest", "highest"]]:
        with pytest.raises(ValueError, match=r"Linear's precision must be None.*got "):
            make(bad)


POOLS = {
    "MaxPool": lambda: nn.MaxPool((2,)),
    "AvgPool": lambda: nn.AvgPool((3,), 2, 1),
    "GlobalAvgPool": lambda: nn.GlobalAvgPool(),
}


@pytest.mark.parametrize("name", [*LAYERS, "Embed", "Dropout", "Sequential", *POOLS])
def test_every_call_runs_in_a_named_scope(name):
    if name == "Embed":
        layer, x, kwargs = nn.Embed(5, 4, rngs=rngs()), jnp.arange(3), {}
    elif name == "Dropout":
        layer, x, kwargs = nn.Dropout(0.5), jnp.ones((2, 4)), {"key": jax.random.key(0)}
    elif name == "Sequential":
        layer, x, kwargs = nn.Sequential(nn.LayerNorm(4), jax.nn.relu), jnp.ones((2, 4)), {}
    elif name in POOLS:  # no parameters, so not in LAYERS
        layer, x, kwargs = POOLS[name](), jnp.ones((2, 5, 4)), {}
    else:
        factory, shape, kwargs = LAYERS[name]
        layer, x = factory(), jnp.ones(shape)
    jaxpr = jax.make_jaxpr(lambda layer, x: layer(x, **kwargs))(layer, x).jaxpr
    stacks = {str(eqn.source_info.name_stack) for eqn in jaxpr.eqns}
    assert stacks and all(stack.startswith(name) for stack in stacks), stacks


def test_sequential_nests_its_layers_scopes_in_its_own():
    """Each layer of a Sequential, a wrapped function too, keeps its own scope inside it."""
    seq = nn.Sequential(nn.LayerNorm(4), jax.nn.relu)
    jaxpr = jax.make_jaxpr(lambda seq, x: seq(x))(seq, jnp.ones((2, 4))).jaxpr
    stacks = {str(e.source_info.name_stack) for e in jaxpr.eqns}
    assert stacks == {"Sequential/LayerNorm", "Sequential/Lambda"}


def test_attend_has_its_own_scope():
    embed = nn.Embed(5, 4, rngs=rngs())
    jaxpr = jax.make_jaxpr(embed.attend)(jnp.ones((2, 4))).jaxpr
    assert {str(e.source_info.name_stack) for e in jaxpr.eqns} == {"Embed.attend"}


@pytest.mark.parametrize("name", LAYERS)
def test_layers_jit_and_differentiate(name):
    factory, shape, kwargs = LAYERS[name]
    layer = factory()
    x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
    eager = layer(x, **kwargs)
    jitted = jax.jit(lambda layer, x: layer(x, **kwargs))(layer, x)
    np.testing.assert_allclose(jitted, eager, atol=1e-6)
    grads = jax.grad(lambda layer: jnp.sum(layer(x, **kwargs) ** 2))(layer)
    assert type(grads) is type(layer)
    assert jax.tree.structure(grads) == jax.tree.structure(layer)


def test_flat_draws_equal_jax_initializers_on_the_full_shape():
    """A [window, in, out] kernel: fan_in is window * in, and the draws are JAX's own
    (to the rounding of the standard deviation)."""
    shape, key = (3, 2, 4), jax.random.key(3)
    np.testing.assert_allclose(
        _random.lecun_normal(key, shape, jnp.float32),
        jax.nn.initializers.lecun_normal()(key, shape, jnp.float32),
        rtol=1e-6,
    )
    np.testing.assert_array_equal(
        _random.normal(key, shape, jnp.bfloat16, stddev=2.0),
        jax.nn.initializers.normal(2.0)(key, shape, jnp.bfloat16),
    )
    np.testing.assert_array_equal(
        _random.keep_mask(key, 0.3, shape), jax.random.bernoulli(key, 0.7, shape)
    )
    assert math.prod(shape) == _random.keep_mask(key, 0.3, shape).size


def test_reprs_show_parameters_and_configuration():
    assert repr(nn.LayerNorm(4)) == "LayerNorm(scale=f32[4], bias=f32[4], epsilon=1e-06)"
    assert repr(nn.Embed(5, 4, rngs=rngs())) == "Embed(embedding=f32[5,4])"
    assert "strides=(2,)" in repr(nn.Conv(1, 2, (3,), strides=2, rngs=rngs()))


BAD_INPUTS = [  # (the layer, the input): made in the test, not at import
    (
        lambda: nn.Linear(4, 3, rngs=rngs()),
        lambda: jnp.ones((2, 5)),
        ValueError,
        "Linear expects inputs whose last axis has 4 features (its kernel is (4, 3)), got an "
        "input of shape (2, 5). Pass inputs with 4 features on the last axis, or build the "
        "layer for this input (in_features=5).",
    ),
    (
        lambda: nn.Linear(4, 3, rngs=rngs()),
        lambda: jnp.ones(()),
        ValueError,
        "Linear expects inputs whose last axis has 4 features (its kernel is (4, 3)), got an "
        "input of shape (). Pass inputs with 4 features on the last axis, or build the layer "
        "for this input (a batch of vectors of 4).",
    ),
    (
        lambda: nn.Embed(5, 4, rngs=rngs()),
        lambda: jnp.ones((2, 3)),
        TypeError,
        "Embed expects integer ids, got an array of dtype float32 and shape (2, 3); cast it "
        "first: ids.astype(jnp.int32).",
    ),
    (
        lambda: nn.RMSNorm(4),
        lambda: jnp.ones(()),
        ValueError,
        "RMSNorm expects inputs whose last axis has 4 features (its scale is (4,)), got an "
        "input of shape (). Pass inputs with 4 features on the last axis, or build the layer "
        "for this input (a batch of vectors of 4).",
    ),
    (
        lambda: nn.LayerNorm(4),
        lambda: jnp.ones((3,)),
        ValueError,
        "LayerNorm expects inputs whose last axis has 4 features (its scale is (4,)), got an "
        "input of shape (3,). Pass inputs with 4 features on the last axis, or build the "
        "layer for this input (num_features=3).",
    ),
]


@pytest.mark.parametrize("layer, x, error, message", BAD_INPUTS)
def test_a_bad_input_is_rejected_with_the_layer_and_both_shapes(
    layer, x, error, message, without_type_checks
):
    """An input of the wrong size (or a scalar, or float ids) is an error naming the layer,
    what fixes its size and the input's shape; a scalar cannot be fitted by a constructor
    argument, so the hint asks for a batch of vectors instead."""
    layer = layer()
    with pytest.raises(error) as raised:  # the layer's own check, as users see it
        layer(x())
    assert str(raised.value) == message


@pytest.mark.parametrize("batch", [(), (3,), (3, 2), (2, 3, 5)])
def test_linear_maps_the_last_axis_of_any_batch_shape(batch):
    """Only the last axis must match ``in_features``; any leading axes are batch axes."""
    layer = nn.Linear(4, 3, precision="highest", rngs=rngs())
    layer = layer.load_flat_state_dict({"bias": np.arange(3.0, dtype=np.float32)})
    x = np.random.default_rng(0).normal(size=(*batch, 4))
    expected = x @ np.asarray(layer.kernel, np.float64) + np.arange(3.0)
    np.testing.assert_allclose(layer(jnp.asarray(x, jnp.float32)), expected, atol=1e-5)
