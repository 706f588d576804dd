"""Low-rank adapters: `tt.lora`, `tt.merge_lora`, `nn.LoRALinear` and `nn.LoRAEmbed` — their
names, their start as the base, what trains (QLoRA included, on one device and sharded),
the backward pass that forms no dense weight gradient, merging (float and quantized bases,
against NumPy), saving the adapters alone (safetensors, Orbax), and their placement by
`tt.shard`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import nn
from taktiny.io import load_safetensors, save_safetensors


class Block(nn.Module):
    def __init__(self, *, rngs: nn.Rngs, **sharding):
        self.up = nn.Linear(8, 16, rngs=rngs, **sharding)
        self.down = nn.Linear(16, 8, use_bias=False, rngs=rngs)


class Net(nn.Module):
    """ids [batch, length] -> logits [batch, length, 32], the output tied to the input."""

    def __init__(self, *, rngs: nn.Rngs, **sharding):
        self.embed = nn.Embed(32, 8, rngs=rngs)
        self.blocks = [Block(rngs=rngs, **sharding) for _ in range(2)]
        self.norm = nn.LayerNorm(8)

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block.down(jax.nn.relu(block.up(x)))
        return self.embed.attend(self.norm(x))


IDS = np.array([[0, 3, 31, 7], [5, 5, 1, 30]])


def ids():
    return jnp.asarray(IDS)


def randomised(model, seed=0):
    """`model` with every adapter factor random (lora_b is zeros at first)."""
    rng = np.random.default_rng(seed)
    flat = tt.flat_state_dict(model)
    return tt.load_flat_state_dict(
        model,
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in flat.items() if ".lora_" in k},
    )


def test_adapters_are_named_under_their_layers_and_the_output_starts_as_the_base():
    base = Net(rngs=nn.Rngs(0))
    model = tt.lora(base, 4, where=["blocks.*.*", "embed"], rngs=nn.Rngs(1))
    names = list(tt.flat_state_dict(model))
    assert names == [
        "embed.embedding", "embed.lora_a", "embed.lora_b",
        "blocks.0.up.kernel", "blocks.0.up.bias", "blocks.0.up.lora_a", "blocks.0.up.lora_b",
        "blocks.0.down.kernel", "blocks.0.down.lora_a", "blocks.0.down.lora_b",
        "blocks.1.up.kernel", "blocks.1.up.bias", "blocks.1.up.lora_a", "blocks.1.up.lora_b",
        "blocks.1.down.kernel", "blocks.1.down.lora_a", "blocks.1.down.lora_b",
        "norm.scale", "norm.bias",
    ]  # fmt: skip
    assert isinstance(model.blocks[0].up, nn.LoRALinear)
    assert isinstance(model.embed, nn.LoRAEmbed)
    up = model.blocks[0].up
    assert up.lora_a.shape == (8, 4) and up.lora_b.shape == (4, 16)
    assert model.embed.lora_a.shape == (32, 4) and model.embed.lora_b.shape == (4, 8)
    assert up.kernel is base.blocks[0].up.kernel  # the base's own arrays
    assert not np.any(np.asarray(up.lora_b))
    # PEFT's lora_A: kaiming-uniform with a = sqrt(5), uniform on ±1/sqrt(in_features)
    big = tt.lora({"p": nn.Linear(400, 30, rngs=nn.Rngs(0))}, 64, where="p", rngs=nn.Rngs(2))
    a = np.asarray(big["p"].lora_a)
    assert np.abs(a).max() <= 1 / 20 and np.abs(a).max() > 0.99 / 20
    assert abs(a.std() - 1 / 20 / np.sqrt(3)) < 1e-3
    assert np.array_equal(model(ids()), base(ids()))  # exactly: B is zero
    forward = jax.jit(lambda m, i: m(i))
    assert np.array_equal(forward(model, ids()), forward(base, ids()))


def test_the_adapter_adds_scale_times_x_a_b_to_the_base():
    base = Net(rngs=nn.Rngs(0))
    model = randomised(tt.lora(base, 2, where="**", alpha=6, rngs=nn.Rngs(1)))
    layer, plain = model.blocks[0].up, base.blocks[0].up
    assert layer.scale == 3.0
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    h = np.random.default_rng(2).normal(size=(2, 8)).astype(np.float32)
    with jax.default_matmul_precision("highest"):
        want = x @ np.asarray(plain.kernel) + np.asarray(plain.bias)
        want += 3.0 * (x @ np.asarray(layer.lora_a)) @ np.asarray(layer.lora_b)
        np.testing.assert_allclose(layer(jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)
        embed = model.embed
        table = np.asarray(base.embed.embedding) + 3.0 * np.asarray(embed.lora_a @ embed.lora_b)
        np.testing.assert_allclose(embed(ids()), table[IDS], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(embed.attend(jnp.asarray(h)), h @ table.T, rtol=1e-5, atol=1e-4)


def test_only_the_adapters_train(optax_promotion):
    """A model holding adapters is fine-tuned through them alone: tt.trainable marks only
    their factors, the adapted layers' base weights get no gradient at all, and optax
    labelled by tt.trainable changes nothing else (the norm and the layers left without an
    adapter included). The merged model trains whole again."""
    model = randomised(tt.lora(Net(rngs=nn.Rngs(0)), 4, where="blocks.**", rngs=nn.Rngs(1)))
    flags = tt.flat_state_dict(tt.trainable(model))
    assert [n for n, f in flags.items() if f] == [n for n in flags if ".lora_" in n]
    assert {"embed.embedding", "norm.scale", "blocks.0.up.kernel"} <= set(flags)
    loss = lambda m: jnp.mean(m(ids()) ** 2)
    grads = tt.flat_state_dict(jax.grad(loss)(model))
    for name in ("blocks.0.up.kernel", "blocks.0.up.bias", "blocks.1.down.kernel"):
        assert not np.any(np.asarray(grads[name])), name  # declared trainable=False
    assert np.any(np.asarray(grads["embed.embedding"]))  # (masked by the optimiser only)
    tx = optax.multi_transform({True: optax.adam(1e-2), False: optax.set_to_zero()}, tt.trainable)
    state = tx.init(model)
    updates, state = tx.update(jax.grad(loss)(model), state, model)
    trained = optax.apply_updates(model, updates)
    before, after = tt.flat_state_dict(model), tt.flat_state_dict(trained)
    changed = [n for n in before if not np.array_equal(before[n], after[n])]
    assert changed == [n for n in before if ".lora_" in n]
    assert all(jax.tree.leaves(tt.trainable(tt.merge_lora(model))))


def test_qlora_keeps_the_quantized_base_frozen_whole():
    base = tt.quantize(Net(rngs=nn.Rngs(0)), bits=4, group_size=4)
    model = tt.lora(base, 4, where="**", rngs=nn.Rngs(1))
    assert isinstance(model.blocks[0].up.kernel, tt.QArray)
    assert np.array_equal(model(ids()), base(ids()))
    flags = tt.flat_state_dict(tt.trainable(model))
    assert flags["blocks.0.up.kernel.value"] is False
    assert flags["blocks.0.up.kernel.scale"] is False
    assert flags["embed.embedding.scale"] is False
    assert flags["blocks.0.up.lora_a"] is True and flags["embed.lora_b"] is True
    up = randomised(model).blocks[0].up  # the adapted kernel: dequantized, plus scale * A @ B
    x = jax.random.normal(jax.random.key(0), (3, 8))
    kernel = np.asarray(up.kernel.dequantize(jnp.float32)) + np.asarray(up.lora_a @ up.lora_b)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(x) @ kernel + np.asarray(up.bias)
        np.testing.assert_allclose(up(x), want, rtol=1e-5, atol=1e-4)


SHARDING_RULES = [  # (groups of 4 along a quantized axis never straddle devices)
    ("blocks.*.up.kernel", (None, "model")),
    ("blocks.*.down.kernel", ("model", None)),
    ("embed.embedding", ("model", None)),
]


def partitioned_step(optimizer, loss):
    """The training step docs/adapters.md shows: the gradients of the trained half only."""

    @jax.jit
    def step(params, frozen, opt_state, *batch):
        value, grads = jax.value_and_grad(lambda p: loss(eqx.combine(p, frozen), *batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def train_partitioned(model, loss, batch, steps):
    """`steps` steps of the documented recipe: the model split by tt.trainable, plain
    jax.value_and_grad over the trained half, plain Adam on it."""
    params, frozen = eqx.partition(model, tt.trainable(model))
    assert all(jnp.issubdtype(p.dtype, jnp.floating) for p in jax.tree.leaves(params))
    optimizer = optax.adam(1e-2)
    step, opt_state, losses = partitioned_step(optimizer, loss), optimizer.init(params), []
    for _ in range(steps):
        params, opt_state, value = step(params, frozen, opt_state, *batch)
        losses.append(float(value))
    return eqx.combine(params, frozen), losses


def train_filtered(model, loss, batch, steps):
    """`steps` steps of equinox's idiom: eqx.filter_value_and_grad of the whole model (no
    gradient for its integers), optax's multi_transform labelled by tt.trainable (called on
    trees with holes), eqx.apply_updates."""
    optimizer = optax.multi_transform(
        {True: optax.adam(1e-2), False: optax.set_to_zero()}, tt.trainable
    )
    floats = lambda m: eqx.filter(m, eqx.is_inexact_array)

    @jax.jit
    def step(model, opt_state, *batch):
        value, grads = eqx.filter_value_and_grad(loss)(model, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, floats(model))
        return eqx.apply_updates(model, updates), opt_state, value

    opt_state, losses = optimizer.init(floats(model)), []
    for _ in range(steps):
        model, opt_state, value = step(model, opt_state, *batch)
        losses.append(float(value))
    return model, losses


@pytest.mark.parametrize(
    ("train", "bits", "group_size", "sharded"),
    [
        pytest.param(train_partitioned, 8, None, False, id="docs-int8"),
        pytest.param(train_partitioned, 8, None, True, id="docs-int8-sharded"),
        pytest.param(train_partitioned, 4, 4, False, id="docs-int4"),
        pytest.param(train_partitioned, 4, 4, True, id="docs-int4-sharded"),
        pytest.param(train_filtered, 4, 4, False, id="equinox-int4"),
        pytest.param(train_filtered, 8, None, True, id="equinox-int8-sharded"),
    ],
)
def test_qlora_trains_the_factors_alone(train, bits, group_size, sharded, optax_promotion):
    """20 steps on a quantized base: the loss falls and only lora_a / lora_b change; every
    other leaf (the integers, their scales, the norm left without an adapter) stays
    bitwise as it was, and the factors keep their placement."""
    base = tt.quantize(Net(rngs=nn.Rngs(0)), bits=bits, group_size=group_size)
    model = tt.lora(base, 4, where=["blocks.*.*", "embed"], alpha=8, rngs=nn.Rngs(1))
    mesh = mesh_of()
    if sharded:
        model = tt.shard(model, SHARDING_RULES, mesh)
    target = jax.random.normal(jax.random.key(2), (*IDS.shape, 32))
    loss = lambda m, ids, y: jnp.mean((m(ids) - y) ** 2)
    if sharded:
        with jax.set_mesh(mesh):
            trained, losses = train(model, loss, (ids(), target), 20)
    else:
        trained, losses = train(model, loss, (ids(), target), 20)
    assert losses[-1] < 0.8 * losses[0], losses
    before, after = tt.flat_state_dict(model), tt.flat_state_dict(trained)
    moved = [n for n in before if not np.array_equal(before[n], after[n])]
    assert moved == [n for n in before if ".lora_" in n]
    for name in before:
        assert after[name].dtype == before[name].dtype, name
        if ".lora_" not in name:
            assert np.asarray(after[name]).tobytes() == np.asarray(before[name]).tobytes()
    int_dtype = jnp.int8 if bits == 8 else jnp.int4
    assert after["blocks.0.up.kernel.value"].dtype == int_dtype
    if sharded:
        for name in ("blocks.0.up.lora_b", "blocks.1.down.lora_a", "blocks.0.up.kernel.value"):
            assert after[name].sharding.is_equivalent_to(before[name].sharding, 2), name


def dot_shapes(jaxpr):
    """The shape of every output of a dot_general in `jaxpr` and in the jaxprs inside it."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes += [tuple(v.aval.shape) for v in eqn.outvars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if hasattr(sub, "eqns"):
                    shapes += dot_shapes(sub)
    return shapes


class Wide(nn.Module):
    """Every weight of its own shape, none sized like a batch or a rank: (24, 12), (12, 20),
    (20, 12); ids [2, 3], rank 2."""

    def __init__(self, *, rngs):
        self.embed = nn.Embed(24, 12, rngs=rngs)
        self.up = nn.Linear(12, 20, rngs=rngs)
        self.down = nn.Linear(20, 12, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        return self.embed.attend(x + self.down(jax.nn.relu(self.up(x))))


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "qlora"])
def test_the_backward_pass_forms_no_dense_weight_gradient(quantized):
    """No matrix product of the training step (forward or backward) has a frozen weight's
    shape: the adapter's term goes through the rank, and no gradient of a frozen weight is
    formed, whether the trained half alone is differentiated or the whole model (whose
    frozen fields read through stop_gradient)."""
    base = Wide(rngs=nn.Rngs(0))
    base = tt.quantize(base, group_size=4) if quantized else base
    model = randomised(tt.lora(base, 2, where="*", rngs=nn.Rngs(1)))
    ids = jnp.asarray([[0, 5, 23], [7, 7, 1]])
    dense = {(24, 12), (12, 24), (12, 20), (20, 12)}
    loss = lambda m: jnp.mean(m(ids) ** 2)
    params, frozen = eqx.partition(model, tt.trainable(model))
    partial = jax.make_jaxpr(jax.grad(lambda p: loss(eqx.combine(p, frozen))))(params)
    whole = jax.make_jaxpr(eqx.filter_grad(loss))(model)
    for jaxpr in (partial, whole):
        shapes = dot_shapes(jaxpr)
        assert {(2, 20), (20, 2)} & set(shapes)  # the factors' gradients are there
        assert {(12, 2), (2, 12)} & set(shapes)
        assert not dense & set(shapes), sorted(dense & set(shapes))
    # one layer alone, its batch of 5
    layer = model.up
    x = jax.random.normal(jax.random.key(0), (5, 12))
    shapes = dot_shapes(jax.make_jaxpr(eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2)))(layer))
    assert {(12, 2), (2, 12)} & set(shapes) and not {(12, 20), (20, 12)} & set(shapes)


def test_merge_gives_the_original_names_and_structure_and_numpy_sums():
    base = Net(rngs=nn.Rngs(0))
    model = randomised(tt.lora(base, 4, where="**", alpha=8, rngs=nn.Rngs(1)))
    merged, errors = tt.merge_lora(model, report=True)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    assert list(tt.flat_state_dict(merged)) == list(tt.flat_state_dict(base))
    assert type(merged.blocks[0].up) is type(base.blocks[0].up)
    assert list(errors) == ["embed", "blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]
    up = model.blocks[1].up
    a, b = np.asarray(up.lora_a, np.float64), np.asarray(up.lora_b, np.float64)
    want = np.asarray(up.kernel, np.float64) + 2.0 * a @ b
    np.testing.assert_allclose(merged.blocks[1].up.kernel, want, rtol=1e-6, atol=1e-6)
    assert np.array_equal(merged.blocks[1].up.bias, up.bias)
    assert all(float(e) < 1e-5 for e in errors.values())
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(merged(ids()), model(ids()), rtol=1e-4, atol=1e-3)
    assert tt.merge_lora(model) is not model
    assert jax.tree.structure(tt.merge_lora(model)) == jax.tree.structure(base)


def exactly(kernel):
    """A Linear's kernel [in, out] in float64: a QArray's integers times the scale of their
    channel or of their group of rows (exact in float64)."""
    if not isinstance(kernel, tt.QArray):
        return np.asarray(kernel).astype(np.float64)
    value, scale = np.asarray(kernel.value).astype(np.float64), np.asarray(kernel.scale, np.float64)
    rows, columns = value.shape
    groups = scale.shape[0]
    return (value.reshape(groups, rows // groups, columns) * scale[:, None, :]).reshape(rows, -1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_merge_report_is_the_exact_distance_from_the_adapted_weight(dtype):
    """The report is the largest |merged weight - (W + scale * A @ B)|, the sum exact
    (NumPy, float64): the rounding of the stored dtype, which is not zero for float32."""
    base = {
        "p": nn.Linear(12, 20, param_dtype=dtype, rngs=nn.Rngs(0)),
        "e": nn.Embed(24, 12, param_dtype=dtype, rngs=nn.Rngs(1)),
    }
    model = randomised(tt.lora(base, 2, where="*", alpha=3, rngs=nn.Rngs(2)))
    merged, errors = tt.merge_lora(model, report=True)
    assert list(errors) == ["e", "p"] and all(type(e) is float for e in errors.values())
    for name, field in (("p", "kernel"), ("e", "embedding")):
        layer = model[name]
        a, b = (np.asarray(f).astype(np.float64) for f in (layer.lora_a, layer.lora_b))
        exact = exactly(getattr(layer, field)) + 1.5 * a @ b
        error = np.abs(exactly(getattr(merged[name], field)) - exact).max()
        assert errors[name] == pytest.approx(error, rel=1e-12)
        # the product's and the sum's roundings in float32, the store's in the dtype
        largest = max(np.abs(exact).max(), np.abs(1.5 * a @ b).max())
        assert 0 < errors[name] <= 2 * float(jnp.finfo(dtype).eps) * largest
    with pytest.raises(TypeError, match=r"'e' holds traced values.*Call it outside jax.jit"):
        jax.jit(lambda m: tt.merge_lora(m, report=True)[1])(model)


@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (4, 4)])
def test_merging_onto_a_quantized_base_requantizes_and_reports_the_error(bits, group_size):
    base = tt.quantize(Net(rngs=nn.Rngs(0)), bits=bits, group_size=group_size)
    model = randomised(tt.lora(base, 4, where="blocks.**", rngs=nn.Rngs(1)))
    merged, errors = tt.merge_lora(model, report=True)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    kernel, up = merged.blocks[0].up.kernel, model.blocks[0].up
    assert (kernel.bits, kernel.group_size) == (bits, group_size)
    exact = exactly(up.kernel)
    exact += np.asarray(up.lora_a, np.float64) @ np.asarray(up.lora_b, np.float64)
    error = np.abs(exactly(kernel) - exact).max()
    assert errors["blocks.0.up"] == pytest.approx(error, rel=1e-12)
    step = np.asarray(kernel.scale, np.float64).max()
    assert 0 < error <= step / 2 * 1.001  # the re-quantization's rounding, at most half a step


class Residual(nn.Module):
    """A Block that a stack calls: x + down(relu(up(x)))."""

    def __init__(self, *, rngs: nn.Rngs):
        self.up = nn.Linear(8, 16, rngs=rngs)
        self.down = nn.Linear(16, 8, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(x)))


class StackedNet(nn.Module):
    """Net with its blocks in an nn.Stack of 3: ids [batch, length] -> logits."""

    def __init__(self, *, rngs: nn.Rngs):
        self.embed = nn.Embed(32, 8, rngs=rngs)
        self.blocks = nn.Stack(lambda r: Residual(rngs=r), 3, rngs=rngs)
        self.norm = nn.LayerNorm(8)

    def __call__(self, ids):
        return self.embed.attend(self.norm(self.blocks(self.embed(ids))))


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stack"])
@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (4, 4)])
def test_the_float_model_of_a_qlora_model_is_the_merge_of_its_dequantized_base(
    bits, group_size, stacked
):
    """tt.dequantize keeps each adapter over its dequantized base weight (bitwise
    QArray.dequantize, the factors the same arrays), so tt.merge_lora of it is the float
    model: the float base's structure, each weight the dequantized one plus
    scale * A @ B rounded once into float32 (against NumPy in float64), in a stack each
    layer's. Its error is float32's, far below the re-quantizing merge's. Seen to fail
    with dequantize skipping adapted layers (the merge gave int layers again)."""
    make = StackedNet if stacked else Net
    float_base = make(rngs=nn.Rngs(0))
    base = tt.quantize(float_base, bits=bits, group_size=group_size)
    model = randomised(tt.lora(base, 4, where="**", alpha=8, rngs=nn.Rngs(1)))
    dequantized = tt.dequantize(model)
    assert jax.tree.structure(tt.dequantize(base)) == jax.tree.structure(float_base)
    up = lambda m: m.blocks.block.up if stacked else m.blocks[0].up
    for get, field in ((lambda m: m.embed, "embedding"), (up, "kernel")):
        layer, adapted = get(dequantized), get(model)
        assert type(layer) is type(adapted)  # still adapted
        assert layer.lora_a is adapted.lora_a and layer.lora_b is adapted.lora_b
        assert np.array_equal(getattr(layer, field), getattr(adapted, field).dequantize())
    merged, errors = tt.merge_lora(dequantized, report=True)
    requantized_errors = tt.merge_lora(model, report=True)[1]
    assert jax.tree.structure(merged) == jax.tree.structure(float_base)
    assert list(tt.flat_state_dict(merged)) == list(tt.flat_state_dict(float_base))
    for i in range(len(model.blocks)):  # (a stack's layer i: its arrays sliced)
        adapted, kernel = model.blocks[i].up, merged.blocks[i].up.kernel
        a, b = (np.asarray(f, np.float64) for f in (adapted.lora_a, adapted.lora_b))
        exact = exactly(adapted.kernel) + 2.0 * a @ b
        assert kernel.dtype == jnp.float32
        np.testing.assert_allclose(kernel, exact, rtol=2e-7, atol=2e-7 * np.abs(exact).max())
    assert max(errors.values()) < 1e-5 < min(requantized_errors.values())
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(merged(ids()), model(ids()), rtol=1e-4, atol=1e-4)


def test_merging_an_abstract_model_gives_the_abstract_merged_model():
    """An abstract adapted model (jax.eval_shape) merges into the abstract model of what a
    concrete merge gives, float or QLoRA, after tt.dequantize too; the report, which
    compares values, is refused by name. Seen to fail as an AttributeError (the factors'
    astype) before."""
    make = lambda: tt.lora(tt.quantize(Net(rngs=nn.Rngs(0)), bits=4, group_size=4), 2, where="blocks.**", rngs=nn.Rngs(1))  # fmt: skip
    for prepare in (lambda m: m, tt.dequantize):
        concrete = tt.merge_lora(prepare(make()))
        abstract = tt.merge_lora(prepare(jax.eval_shape(make)))
        assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
        for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete), strict=True):
            assert isinstance(a, jax.ShapeDtypeStruct) and (a.shape, a.dtype) == (c.shape, c.dtype)
    with pytest.raises(
        TypeError, match=r"^taktiny\.merge_lora\(report=True\): 'blocks\.0\.up' is abstract"
    ):
        tt.merge_lora(jax.eval_shape(make), report=True)


def test_merging_a_bfloat16_base_reports_its_rounding():
    base = {"p": nn.Linear(8, 8, param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))}
    model = randomised(tt.lora(base, 2, where="p", rngs=nn.Rngs(1)))
    assert model["p"].lora_a.dtype == jnp.float32
    merged, errors = tt.merge_lora(model, report=True)
    assert merged["p"].kernel.dtype == jnp.bfloat16
    assert 0 < float(errors["p"]) < 0.05


def test_where_that_adapts_nothing_is_refused_by_name(without_type_checks):
    model = Net(rngs=nn.Rngs(0))
    cases = {
        "norm": "'norm': matches no Linear, QuantizedLinear, Embed or QuantizedEmbed layer; it "
        "matches 'norm', a LayerNorm\\.$",
        "blocks.0.up.kernel": "the parameter 'blocks.0.up.kernel', not a layer; name the layer "
        "\\('blocks.0.up'\\)",
        "blokcs.*.up": "did you mean 'blocks.\\*.up'\\?",
        "blocks.0": "'blocks.0', a Block; name the layers inside it \\('blocks.0.\\*' or "
        "'blocks.0.\\*\\*'\\)\\.$",
    }
    for target, message in cases.items():
        with pytest.raises(tt.SelectionError, match=message):
            tt.lora(model, 4, where=["embed", target], rngs=nn.Rngs(1))
    adapted = tt.lora(model, 4, where="embed", rngs=nn.Rngs(1))
    with pytest.raises(ValueError, match="'embed', a LoRAEmbed, which already has an adapter"):
        tt.lora(adapted, 4, where="embed", rngs=nn.Rngs(1))
    with pytest.raises(ValueError, match="rank is a positive int"):
        tt.lora(model, 0, where="embed", rngs=nn.Rngs(1))
    with pytest.raises(TypeError, match="where is a pattern over layer names"):
        tt.lora(model, 4, where=[], rngs=nn.Rngs(1))
    with pytest.raises(TypeError, match=r"^taktiny\.lora: where= names the layers to adapt"):
        tt.lora(model, 4, rngs=nn.Rngs(1))
    with pytest.raises(TypeError, match="LoRALinear adapts a Linear or QuantizedLinear"):
        nn.LoRALinear(model.embed, 4, rngs=nn.Rngs(1))


def test_abstract_models_get_abstract_adapters():
    abstract = jax.eval_shape(lambda: Net(rngs=nn.Rngs(0)))
    model = tt.lora(abstract, 4, where="**", rngs=nn.Rngs(1))
    up = model.blocks[0].up
    assert isinstance(up.lora_a, jax.ShapeDtypeStruct) and up.lora_a.shape == (8, 4)
    assert up.lora_b.dtype == jnp.float32


def test_the_adapters_alone_save_and_load_onto_a_base_loaded_apart(tmp_path):
    base = Net(rngs=nn.Rngs(0))
    save_safetensors(tmp_path / "base.safetensors", base)
    model = randomised(tt.lora(base, 4, where="**", rngs=nn.Rngs(1)))
    adapters = {k: v for k, v in tt.flat_state_dict(model).items() if ".lora_" in k}
    save_safetensors(tmp_path / "adapters.safetensors", adapters)

    fresh = Net(rngs=nn.Rngs(5))  # other weights everywhere
    fresh = load_safetensors(fresh, tmp_path / "base.safetensors")
    fresh = tt.lora(fresh, 4, where="**", rngs=nn.Rngs(7))
    fresh = load_safetensors(fresh, tmp_path / "adapters.safetensors", strict=False)
    for name, value in tt.flat_state_dict(model).items():
        assert np.array_equal(tt.flat_state_dict(fresh)[name], value), name
    assert np.array_equal(fresh(ids()), model(ids()))

    path = (tmp_path / "orbax").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, adapters)
    again = tt.lora(base, 4, where="**", rngs=nn.Rngs(9))
    with ocp.StandardCheckpointer() as checkpointer:
        target = {k: v for k, v in tt.flat_state_dict(again).items() if ".lora_" in k}
        restored = checkpointer.restore(path, target=target)
    again = again.load_flat_state_dict(restored)
    assert np.array_equal(again(ids()), model(ids()))


def mesh_of():
    return jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices("cpu")
    )


def test_shard_rules_for_the_base_place_the_adapters_on_the_matching_axes():
    mesh = mesh_of()
    model = tt.lora(Net(rngs=nn.Rngs(0)), 4, where="**", rngs=nn.Rngs(1))
    rules = [
        ("blocks.*.up.kernel", (None, "model")),
        ("blocks.*.down.kernel", ("model", None)),
        ("embed.embedding", ("data", "model")),
    ]
    plan = tt.sharding_plan(model, rules, mesh)
    specs = plan.specs
    assert specs["blocks.0.up.lora_a"] == P(None, None)
    assert specs["blocks.0.up.lora_b"] == P(None, "model")
    assert specs["blocks.1.down.lora_a"] == P("model", None)
    assert specs["blocks.1.down.lora_b"] == P(None, None)
    assert specs["embed.lora_a"] == P("data", None)
    assert specs["embed.lora_b"] == P(None, "model")
    assert "blocks.0.up.lora_a" not in plan.unmatched
    sharded = tt.shard(model, rules, mesh)
    want = NamedSharding(mesh, P("model", None))
    assert sharded.blocks[0].down.lora_a.sharding.is_equivalent_to(want, 2)
    # a rule for the factor itself, before the weight's, wins; after it, the weight's does
    first = tt.sharding_plan(model, [("**.lora_b", ("data", None)), *rules], mesh).specs
    assert first["blocks.0.up.lora_b"] == P("data", None)
    last = tt.sharding_plan(model, [*rules, ("**.lora_b", ("data", None))], mesh).specs
    assert last["blocks.0.up.lora_b"] == P(None, "model")
    # a quantized base: the factors follow its value
    quantized = tt.lora(tt.quantize(Net(rngs=nn.Rngs(0))), 4, where="**", rngs=nn.Rngs(1))
    specs = tt.sharding_plan(quantized, rules, mesh).specs
    assert specs["blocks.0.up.lora_b"] == P(None, "model")
    assert specs["blocks.0.down.lora_a"] == P("model", None)


def test_adapters_of_a_model_built_split_are_split_as_its_kernels():
    mesh = mesh_of()
    with jax.set_mesh(mesh):
        base = Net(rngs=nn.Rngs(0), kernel_sharding=(None, "model"))
        model = tt.lora(base, 4, where="blocks.*.up", rngs=nn.Rngs(1))
        up = model.blocks[0].up
        assert up.lora_b.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
        assert up.lora_a.sharding.is_equivalent_to(NamedSharding(mesh, P()), 2)
        y = jax.jit(lambda m, i: m(i))(randomised(model), ids())
        merged = tt.merge_lora(randomised(model))
        kernel = merged.blocks[0].up.kernel
        assert kernel.sharding.is_equivalent_to(up.kernel.sharding, 2)
        with jax.default_matmul_precision("highest"):
            z = jax.jit(lambda m, i: m(i))(merged, ids())
    np.testing.assert_allclose(np.asarray(z), np.asarray(y), rtol=1e-4, atol=1e-3)
