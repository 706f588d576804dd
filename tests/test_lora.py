"""Low-rank adapters: `tt.lora`, `tt.merge_lora`, `nn.LoRALinear` and `nn.LoRAEmbed` — their
names, their start as the base, what trains, merging (float and quantized bases, against
NumPy), saving the adapters alone (safetensors, Orbax), and their placement by `tt.shard`."""

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
    model = tt.lora(base, 4, targets=["blocks.*.*", "embed"], rngs=nn.Rngs(1))
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
    big = tt.lora({"p": nn.Linear(400, 30, rngs=nn.Rngs(0))}, 64, targets="p", rngs=nn.Rngs(2))
    a = np.asarray(big["p"].lora_a)
    assert np.abs(a).max() <= 1 / 20 and np.abs(a).max() > 0.99 / 20
    assert abs(a.std() - 1 / 20 / np.sqrt(3)) < 1e-3
    assert np.array_equal(model(ids()), base(ids()))  # exactly: B is zero
    forward = jax.jit(lambda m, i: m(i))
    assert np.array_equal(forward(model, ids()), forward(base, ids()))


def test_the_adapter_adds_scale_times_x_a_b_to_the_base():
    base = Net(rngs=nn.Rngs(0))
    model = randomised(tt.lora(base, 2, targets="**", alpha=6, rngs=nn.Rngs(1)))
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
    model = randomised(tt.lora(Net(rngs=nn.Rngs(0)), 4, targets="blocks.**", rngs=nn.Rngs(1)))
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
    model = tt.lora(base, 4, targets="**", rngs=nn.Rngs(1))
    assert isinstance(model.blocks[0].up.kernel, tt.QArray)
    assert np.array_equal(model(ids()), base(ids()))
    flags = tt.flat_state_dict(tt.trainable(model))
    assert flags["blocks.0.up.kernel.value"] is False
    assert flags["blocks.0.up.kernel.scale"] is False  # trained in a plain QuantizedLinear
    assert flags["embed.embedding.scale"] is False
    assert flags["blocks.0.up.lora_a"] is True and flags["embed.lora_b"] is True
    up = randomised(model).blocks[0].up  # the adapted kernel: dequantized, plus scale * A @ B
    x = jax.random.normal(jax.random.key(0), (3, 8))
    kernel = np.asarray(up.kernel.dequantize(jnp.float32)) + np.asarray(up.lora_a @ up.lora_b)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(x) @ kernel + np.asarray(up.bias)
        np.testing.assert_allclose(up(x), want, rtol=1e-5, atol=1e-4)


def test_merge_gives_the_original_names_and_structure_and_numpy_sums():
    base = Net(rngs=nn.Rngs(0))
    model = randomised(tt.lora(base, 4, targets="**", alpha=8, rngs=nn.Rngs(1)))
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


@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (4, 4)])
def test_merging_onto_a_quantized_base_requantizes_and_reports_the_error(bits, group_size):
    base = tt.quantize(Net(rngs=nn.Rngs(0)), bits=bits, group_size=group_size)
    model = randomised(tt.lora(base, 4, targets="blocks.**", rngs=nn.Rngs(1)))
    merged, errors = tt.merge_lora(model, report=True)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    kernel, up = merged.blocks[0].up.kernel, model.blocks[0].up
    assert (kernel.bits, kernel.group_size) == (bits, group_size)
    exact = np.asarray(up.kernel.dequantize(jnp.float32), np.float64)
    exact += np.asarray(up.lora_a, np.float64) @ np.asarray(up.lora_b, np.float64)
    error = np.abs(np.asarray(kernel.dequantize(jnp.float32), np.float64) - exact).max()
    assert float(errors["blocks.0.up"]) == pytest.approx(error, rel=1e-4, abs=1e-6)
    step = np.asarray(kernel.scale, np.float64).max()
    assert 0 < error <= step / 2 * 1.001  # the re-quantization's rounding, at most half a step


def test_merging_a_bfloat16_base_reports_its_rounding():
    base = {"p": nn.Linear(8, 8, param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))}
    model = randomised(tt.lora(base, 2, targets="p", rngs=nn.Rngs(1)))
    assert model["p"].lora_a.dtype == jnp.float32
    merged, errors = tt.merge_lora(model, report=True)
    assert merged["p"].kernel.dtype == jnp.bfloat16
    assert 0 < float(errors["p"]) < 0.05


def test_targets_that_adapt_nothing_are_refused_by_name(without_type_checks):
    model = Net(rngs=nn.Rngs(0))
    cases = {
        "norm": "'norm': it matches 'norm', a LayerNorm, which is not an adaptable layer",
        "blocks.0.up.kernel": "the parameter 'blocks.0.up.kernel', not a layer; name the layer "
        "\\('blocks.0.up'\\)",
        "blokcs.*.up": "did you mean 'blocks.\\*.up'\\?",
        "blocks.0": "'blocks.0', a Block, which is not an adaptable layer",
    }
    for target, message in cases.items():
        with pytest.raises(ValueError, match=message):
            tt.lora(model, 4, targets=["embed", target], rngs=nn.Rngs(1))
    adapted = tt.lora(model, 4, targets="embed", rngs=nn.Rngs(1))
    with pytest.raises(ValueError, match="'embed', which already has an adapter"):
        tt.lora(adapted, 4, targets="embed", rngs=nn.Rngs(1))
    with pytest.raises(ValueError, match="rank is a positive int"):
        tt.lora(model, 0, targets="embed", rngs=nn.Rngs(1))
    with pytest.raises(TypeError, match="targets is a layer-name pattern"):
        tt.lora(model, 4, targets=[], rngs=nn.Rngs(1))
    with pytest.raises(TypeError, match="LoRALinear adapts a Linear or QuantizedLinear"):
        nn.LoRALinear(model.embed, 4, rngs=nn.Rngs(1))


def test_abstract_models_get_abstract_adapters():
    abstract = jax.eval_shape(lambda: Net(rngs=nn.Rngs(0)))
    model = tt.lora(abstract, 4, targets="**", rngs=nn.Rngs(1))
    up = model.blocks[0].up
    assert isinstance(up.lora_a, jax.ShapeDtypeStruct) and up.lora_a.shape == (8, 4)
    assert up.lora_b.dtype == jnp.float32


def test_the_adapters_alone_save_and_load_onto_a_base_loaded_apart(tmp_path):
    base = Net(rngs=nn.Rngs(0))
    save_safetensors(tmp_path / "base.safetensors", base)
    model = randomised(tt.lora(base, 4, targets="**", rngs=nn.Rngs(1)))
    adapters = {k: v for k, v in tt.flat_state_dict(model).items() if ".lora_" in k}
    save_safetensors(tmp_path / "adapters.safetensors", adapters)

    fresh = Net(rngs=nn.Rngs(5))  # other weights everywhere
    fresh = load_safetensors(fresh, tmp_path / "base.safetensors")
    fresh = tt.lora(fresh, 4, targets="**", rngs=nn.Rngs(7))
    fresh = load_safetensors(fresh, tmp_path / "adapters.safetensors", strict=False)
    for name, value in tt.flat_state_dict(model).items():
        assert np.array_equal(tt.flat_state_dict(fresh)[name], value), name
    assert np.array_equal(fresh(ids()), model(ids()))

    path = (tmp_path / "orbax").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, adapters)
    again = tt.lora(base, 4, targets="**", rngs=nn.Rngs(9))
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
    model = tt.lora(Net(rngs=nn.Rngs(0)), 4, targets="**", rngs=nn.Rngs(1))
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
    quantized = tt.lora(tt.quantize(Net(rngs=nn.Rngs(0))), 4, targets="**", rngs=nn.Rngs(1))
    specs = tt.sharding_plan(quantized, rules, mesh).specs
    assert specs["blocks.0.up.lora_b"] == P(None, "model")
    assert specs["blocks.0.down.lora_a"] == P("model", None)


def test_adapters_of_a_model_built_split_are_split_as_its_kernels():
    mesh = mesh_of()
    with jax.set_mesh(mesh):
        base = Net(rngs=nn.Rngs(0), kernel_sharding=(None, "model"))
        model = tt.lora(base, 4, targets="blocks.*.up", rngs=nn.Rngs(1))
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
