"""nn.Stack: identical blocks with a leading layer axis, run by lax.scan; built, called,
trained, sharded and operated on (quantize, lora) as its layers would be one by one."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import nn


class Block(nn.Module):
    """A residual MLP block; `scale` [features] is a per-layer input."""

    def __init__(self, features: int = 8, *, rngs: nn.Rngs):
        self.norm = nn.RMSNorm(features)
        self.up = nn.Linear(features, 2 * features, rngs=rngs)
        self.down = nn.Linear(2 * features, features, rngs=rngs)

    def __call__(self, x, scale=None, *, shift=0.0):
        y = self.down(jax.nn.gelu(self.up(self.norm(x))))
        return x + y * (1.0 if scale is None else scale) + shift


class Model(nn.Module):
    def __init__(self, count: int = 3, *, rngs: nn.Rngs, **options):
        self.embed = nn.Linear(4, 8, rngs=rngs)
        self.layers = nn.Stack(lambda rngs: Block(rngs=rngs), count, rngs=rngs, **options)

    def __call__(self, x):
        return self.layers(self.embed(x))


def layers_of(stack):
    return [stack[i] for i in range(len(stack))]


def equal(a, b):
    return jax.tree.all(jax.tree.map(lambda u, v: bool(np.array_equal(u, v)), a, b))


def test_each_layer_is_built_from_its_own_key_as_a_block_of_its_own():
    stack = nn.Stack(lambda rngs: Block(rngs=rngs), 3, rngs=nn.Rngs(0))
    keys = jax.random.split(nn.Rngs(0)(), 3)
    for i, layer in enumerate(layers_of(stack)):
        assert equal(layer, Block(rngs=nn.Rngs(keys[i])))
    assert not np.array_equal(stack[0].up.kernel, stack[1].up.kernel)
    assert stack.block.up.kernel.shape == (3, 8, 16)
    assert len(stack) == 3 and equal(stack[-1], stack[2])


def test_count_and_index_are_checked():
    with pytest.raises(ValueError, match=r"count is the number of layers, an int >= 1; got 0"):
        nn.Stack(lambda rngs: Block(rngs=rngs), 0, rngs=nn.Rngs(0))
    stack = nn.Stack(lambda rngs: Block(rngs=rngs), 2, rngs=nn.Rngs(0))
    with pytest.raises(IndexError, match=r"nn.Stack of 2 layers has no layer 2"):
        stack[2]


def test_repr_names_the_count_and_options():
    stack = nn.Stack(
        lambda rngs: nn.Linear(2, 2, rngs=rngs), 4, rngs=nn.Rngs(0), remat=True, layer_axis="x"
    )
    assert repr(stack) == (
        "Stack(4 x Linear(kernel=f32[4,2,2], bias=f32[4,2]), remat=True, layer_axis='x')"
    )


def run_by_hand(stack, x, *xs, **kwargs):
    for i, layer in enumerate(layers_of(stack)):
        x = layer(x, *(jax.tree.map(lambda a, i=i: a[i], v) for v in xs), **kwargs)
    return x


def test_a_call_runs_the_layers_in_order_with_their_slices_and_the_same_keywords():
    stack = nn.Stack(lambda rngs: Block(rngs=rngs), 4, rngs=nn.Rngs(1))
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    scales = jax.random.normal(jax.random.key(1), (4, 8))
    want = run_by_hand(stack, x, scales, shift=0.5)
    got = jax.jit(lambda s, x, v: s(x, v, shift=0.5))(stack, x, scales)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, run_by_hand(stack, x, scales[::-1], shift=0.5), atol=1e-3)


@pytest.mark.parametrize("remat", [True, jax.checkpoint_policies.dots_saveable])
def test_remat_gives_the_same_values_and_gradients(remat):
    plain = Model(rngs=nn.Rngs(0))
    again = Model(rngs=nn.Rngs(0), remat=remat)
    x = jax.random.normal(jax.random.key(0), (3, 4))
    loss = lambda m: jnp.sum(m(x) ** 2)
    np.testing.assert_allclose(loss(again), loss(plain), rtol=1e-6)
    g1, g2 = jax.grad(loss)(plain), jax.grad(loss)(again)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    text = str(jax.make_jaxpr(jax.grad(loss))(again))
    assert "remat" in text or "checkpoint" in text


class Noisy(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.dense = nn.Linear(6, 6, rngs=rngs)
        self.dropout = nn.Dropout(0.5)

    def __call__(self, x, *, key=None):
        return self.dropout(self.dense(x), key=key)


def test_a_key_is_split_into_one_per_layer():
    stack = nn.Stack(lambda rngs: Noisy(rngs=rngs), 3, rngs=nn.Rngs(0))
    x, key = jnp.ones((2, 6)), jax.random.key(7)
    want = x
    for layer, k in zip(layers_of(stack), jax.random.split(key, 3), strict=True):
        want = layer(want, key=k)
    np.testing.assert_allclose(stack(x, key=key), want, rtol=1e-6)
    np.testing.assert_allclose(stack(x), run_by_hand(stack, x), rtol=1e-6)


class Pair(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.dense = nn.Linear(3, 3, rngs=rngs)

    def __call__(self, x, seen):
        y = self.dense(x)
        return y, seen + y.sum()


def test_a_block_returning_a_pair_gives_its_outputs_stacked():
    stack = nn.Stack(lambda rngs: Pair(rngs=rngs), 3, rngs=nn.Rngs(0))
    x, seen = jnp.ones((2, 3)), jnp.arange(3.0)
    y, outs = stack(x, seen)
    want, each = x, []
    for i, layer in enumerate(layers_of(stack)):
        want, out = layer(want, seen[i])
        each.append(out)
    np.testing.assert_allclose(y, want, rtol=1e-6)
    np.testing.assert_allclose(outs, jnp.stack(each), rtol=1e-5, atol=1e-6)


class Wrong(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.dense = nn.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        return x, x, x


def test_a_block_returning_neither_carry_nor_pair_is_refused():
    stack = nn.Stack(lambda rngs: Wrong(rngs=rngs), 2, rngs=nn.Rngs(0))
    with pytest.raises(TypeError, match=r"a stacked block returns its carry .* or a pair"):
        stack(jnp.ones((2, 3)))


def test_it_trains_with_optax_under_jit(optax_promotion):
    model = Model(rngs=nn.Rngs(0))
    optimizer = optax.adam(1e-2)
    state = optimizer.init(model)
    assert jax.tree.all(tt.trainable(model))
    x = jax.random.normal(jax.random.key(0), (16, 4))
    target = jnp.zeros((16, 8))

    @jax.jit
    def step(model, state):
        loss, grads = jax.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
        updates, state = optimizer.update(grads, state, model)
        return optax.apply_updates(model, updates), state, loss

    first = None
    for _ in range(20):
        model, state, loss = step(model, state)
        first = loss if first is None else first
    assert float(loss) < 0.5 * float(first)
    assert model.layers.block.up.kernel.shape == (3, 8, 16)


def test_quantize_dequantize_and_lora_act_on_each_layer(platform):
    # (on each platform; the outputs compared at full float32, as a TPU's default product
    # takes bfloat16 passes, whose rounding would stand for the merge's)
    model = Model(rngs=nn.Rngs(0))
    quantized = tt.quantize(model, bits=4, group_size=4, where="layers.**")
    for i, layer in enumerate(layers_of(quantized.layers)):
        want = tt.quantize(model.layers[i], bits=4, group_size=4)
        assert equal(layer, want)
    back = tt.dequantize(quantized)
    assert equal(back.layers[1], tt.dequantize(quantized.layers[1]))

    adapted = tt.lora(model, 2, where="layers.block.up", rngs=nn.Rngs(3))
    a = adapted.layers.block.up.lora_a
    assert a.shape == (3, 8, 2) and not np.array_equal(a[0], a[1])
    x = jax.random.normal(jax.random.key(0), (2, 4))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(adapted(x), model(x), rtol=1e-6)
    trained = adapted.replace(
        layers=adapted.layers.replace(
            block=jax.tree.map(lambda v: v, adapted.layers.block).replace(
                up=adapted.layers.block.up.replace(lora_b=jnp.ones((3, 2, 16)) * 0.1)
            )
        )
    )
    merged, report = tt.merge_lora(trained, report=True)
    assert list(report) == ["layers.block.up"] and report["layers.block.up"] < 1e-5
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(merged(x), trained(x), rtol=1e-5, atol=1e-5)
    for i in range(3):
        assert equal(merged.layers[i], tt.merge_lora(trained.layers[i]))


RULES = {  # one layer's: the up kernel split by columns, the down kernel by rows
    "layers.*.up.kernel": P(None, "model"),
    "layers.*.up.bias": P("model"),
    "layers.*.down.kernel": P("model", None),
    "**": P(),
}
ON_THE_MESH = [  # the layer axis split over 'data' too, or not
    "data",
    pytest.param(None, marks=pytest.mark.thorough),
]


def sharded_stack(layer_axis):
    """A model of 2 layers, and the same split over the 8 devices by RULES."""
    model = Model(2, rngs=nn.Rngs(0), layer_axis=layer_axis)
    return model, tt.shard(model, RULES, jax.make_mesh((2, 4), ("data", "model")))


def specs(layer, *names):
    return [getattr(layer, n).sharding.spec for n in names]


@pytest.mark.parametrize("layer_axis", ON_THE_MESH)
def test_quantize_and_dequantize_on_a_sharded_stack_act_per_layer(layer_axis):
    """Bit for bit what the unsharded stack gets (itself each layer's alone: the test
    above), checked again on its last layer; the values keep their kernel's split, each
    scale split as its kernel on its other axis and never along the quantized one (the
    down kernel's input axis: its scales unsplit), the layer axis as the stack's
    layer_axis; rules that name a stacked QArray whole place it so too."""
    model, sharded = sharded_stack(layer_axis)
    quantized = tt.quantize(sharded, bits=4, group_size=4, where="layers.**")
    plain = tt.quantize(model, bits=4, group_size=4, where="layers.**")
    assert equal(quantized, plain)
    assert equal(quantized.layers[1], tt.quantize(model.layers[1], bits=4, group_size=4))
    up, down = quantized.layers.block.up.kernel, quantized.layers.block.down.kernel
    assert specs(up, "value", "scale") == [P(layer_axis, None, "model")] * 2
    assert specs(down, "value", "scale") == [
        P(layer_axis, "model", None),
        P(layer_axis, None, None),
    ]
    back = tt.dequantize(quantized)
    assert equal(back, tt.dequantize(plain))
    assert specs(back.layers.block.up, "kernel") == [P(layer_axis, None, "model")]
    assert specs(back.layers.block.down, "kernel") == [P(layer_axis, "model", None)]
    placed = tt.shard(plain, RULES, up.value.sharding.mesh)
    assert jax.tree.all(jax.tree.map(lambda a, b: a.sharding == b.sharding, placed, quantized))


@pytest.mark.parametrize("layer_axis", ON_THE_MESH)
def test_lora_and_merge_lora_on_a_sharded_stack_act_per_layer(layer_axis):
    """Adapters drawn as on the unsharded stack (each layer's from its own key), placed as
    documented: lora_a split as its kernel's input axis, lora_b as its output axis, the
    rank never, the layer axis as the stack's; merged, float and QLoRA (requantized), as
    the unsharded stack is, on the kernel's sharding."""
    model, sharded = sharded_stack(layer_axis)
    adapted = tt.lora(sharded, 2, where="layers.block.*", rngs=nn.Rngs(3))
    plain = tt.lora(model, 2, where="layers.block.*", rngs=nn.Rngs(3))
    assert equal(adapted, plain)
    up, down = adapted.layers.block.up, adapted.layers.block.down
    assert specs(up, "lora_a", "lora_b") == [
        P(layer_axis, None, None),
        P(layer_axis, None, "model"),
    ]
    assert specs(down, "lora_a", "lora_b") == [
        P(layer_axis, "model", None),
        P(layer_axis, None, None),
    ]
    steps = {n: jax.random.normal(jax.random.key(7), v.shape) / 10
             for n, v in adapted.flat_state_dict().items() if n.endswith("lora_b")}  # fmt: skip
    trained, trained_plain = (tt.load_flat_state_dict(m, steps) for m in (adapted, plain))
    merged, want = tt.merge_lora(trained), tt.merge_lora(trained_plain)
    for got, expected in zip(jax.tree.leaves(merged), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert specs(merged.layers.block.up, "kernel") == [P(layer_axis, None, "model")]
    assert specs(merged.layers.block.down, "kernel") == [P(layer_axis, "model", None)]
    quantize = lambda m: tt.quantize(m, bits=4, group_size=4, where="layers.**")
    qlora, qplain = (tt.lora(quantize(m), 2, where="layers.block.up", rngs=nn.Rngs(3))
                     for m in (sharded, model))  # fmt: skip
    assert specs(qlora.layers.block.up, "lora_a", "lora_b") == specs(up, "lora_a", "lora_b")
    step = {"layers.block.up.lora_b": steps["layers.block.up.lora_b"]}
    requantized, want = (tt.merge_lora(tt.load_flat_state_dict(m, step)) for m in (qlora, qplain))
    kernel = requantized.layers.block.up.kernel
    assert isinstance(kernel, tt.QArray) and equal(kernel, want.layers.block.up.kernel)
    assert specs(kernel, "value") == [P(layer_axis, None, "model")]


def test_surgery_on_an_abstract_stack_gives_the_abstract_result():
    abstract = jax.eval_shape(lambda: Model(rngs=nn.Rngs(0)))
    quantized = tt.quantize(abstract, bits=8, where="layers.**")
    kernel = quantized.layers.block.up.kernel
    assert isinstance(kernel.value, jax.ShapeDtypeStruct)
    assert kernel.value.shape == (3, 8, 16) and kernel.scale.shape == (3, 1, 16)


def test_shard_rules_give_one_layer_s_spec_and_the_stack_its_layer_axis():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rules = {"layers.*.up.kernel": P(None, "model"), "**": P()}
    model = tt.shard(Model(rngs=nn.Rngs(0)), rules, mesh)
    assert model.layers.block.up.kernel.sharding.spec == P(None, None, "model")
    assert model.layers.block.norm.scale.sharding.spec == P(None)
    split = tt.shard(Model(4, rngs=nn.Rngs(0), layer_axis="data"), rules, mesh)
    assert split.layers.block.up.kernel.sharding.spec == P("data", None, "model")
    # a layer of a stack split over 'data' (explicit axes: JAX asks where the slice goes),
    # as a block and per layer, on the layer's own spec
    assert equal(split.layers[1], Model(4, rngs=nn.Rngs(0)).layers[1])
    assert split.layers[1].up.kernel.sharding.spec == P(None, "model")
    per_layer = tt.flat_state_dict(split, unstacked=True)["layers.3.up.kernel"]
    assert per_layer.sharding.spec == P(None, "model")
    # a stacked QArray placed by a rule naming it whole: its scale split as one layer's is
    # (on the axis it shares with the value), the layer axis as the stack's
    quantized = tt.quantize(Model(4, rngs=nn.Rngs(0), layer_axis="data"), bits=4, group_size=4,
                            where="layers.*.up")  # fmt: skip
    kernel = tt.shard(quantized, rules, mesh).layers.block.up.kernel
    assert kernel.value.sharding.spec == kernel.scale.sharding.spec == P("data", None, "model")
    assert kernel.scale.shape == (4, 2, 16)
    x = jnp.ones((2, 4))
    np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(model, x), Model(rngs=nn.Rngs(0))(x),
                               rtol=1e-5)  # fmt: skip
    plan = tt.sharding_plan(Model(rngs=nn.Rngs(0)), {"layers.*.up.kernel": P("model")}, mesh)
    assert plan.specs["layers.block.up.kernel"] == P(None, "model")


def test_summary_counts_every_layer():
    text = str(tt.summary(Model(rngs=nn.Rngs(0))))
    assert re.search(r"layers\.block\.up\.kernel\s+\(3, 8, 16\)", text)
    assert f"{4 * 8 + 8 + 3 * (8 + 8 * 16 + 16 + 16 * 8 + 8):,} parameters" in text


def test_a_stack_inside_a_stack_is_refused():
    inner = lambda rngs: nn.Stack(lambda r: nn.Linear(2, 2, rngs=r), 2, rngs=rngs)
    outer = nn.Stack(inner, 2, rngs=nn.Rngs(0))
    with pytest.raises(TypeError, match=r"a stack's block cannot hold another stack"):
        tt.flat_state_dict(outer)


def test_gradients_flow_through_a_load_of_every_layer_given_by_name():
    """Layers given one by one under ``jax.grad`` (traced values) are set into their
    stacked leaf, and each layer's gradient is its own."""

    class Two(nn.Module):
        def __init__(self, *, rngs):
            self.layers = nn.Stack(
                lambda rngs: nn.Linear(3, 3, use_bias=False, rngs=rngs), 2, rngs=rngs
            )

    model, x = Two(rngs=nn.Rngs(0)), jnp.ones((1, 3))

    def loss(first, second):
        named = {"layers.0.kernel": first, "layers.1.kernel": second}
        return model.load_flat_state_dict(named).layers(x).sum()

    eye = jnp.eye(3)
    first, second = jax.grad(loss, argnums=(0, 1))(eye, 2 * eye)
    np.testing.assert_array_equal(first, np.full((3, 3), 2.0))
    np.testing.assert_array_equal(second, np.ones((3, 3)))
