"""Orbax checkpoints of Taktiny state, with the current orbax-checkpoint API."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _models import MLP
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import taktiny as tt
from taktiny import nn


class Deep(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.layers = [nn.Linear(8, 8, rngs=rngs) for _ in range(12)]


def assert_bitwise_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_standard_checkpointer_save_and_restore_12_layers(tmp_path):
    path = (tmp_path / "model").absolute()
    model = Deep(rngs=nn.Rngs(0))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, model.state_dict())
    fresh = Deep(rngs=nn.Rngs(1))
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(path, target=fresh.state_dict())
    # Orbax hands dicts back with keys in string order ('0', '1', '10', ...); loading goes by
    # name, so layer i still lands in layer i and the model keeps its own order
    assert list(state["layers"]) == sorted(str(i) for i in range(12))
    assert list(state["layers"]) != [str(i) for i in range(12)]
    restored = fresh.load_state_dict(state, strict=True)
    assert list(restored.flat_state_dict()) == list(model.flat_state_dict())
    assert_bitwise_equal(restored, model)
    for i in range(12):  # layer i came back as layer i
        assert np.array_equal(restored.layers[i].kernel, model.layers[i].kernel)


def test_checkpointer_with_standard_handler_and_args(tmp_path):
    path = (tmp_path / "model").absolute()
    model = MLP(rngs=nn.Rngs(0))
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        checkpointer.save(path, args=ocp.args.StandardSave(model.state_dict()))
        fresh = MLP(rngs=nn.Rngs(1))
        state = checkpointer.restore(path, args=ocp.args.StandardRestore(fresh.state_dict()))
    assert_bitwise_equal(fresh.load_state_dict(state), model)


def test_checkpoint_manager(tmp_path):
    model = MLP(rngs=nn.Rngs(0))
    with ocp.CheckpointManager((tmp_path / "run").absolute()) as manager:
        manager.save(3, args=ocp.args.StandardSave(model.state_dict()))
        manager.wait_until_finished()
        assert manager.latest_step() == 3
        fresh = MLP(rngs=nn.Rngs(1))
        state = manager.restore(3, args=ocp.args.StandardRestore(fresh.state_dict()))
    assert_bitwise_equal(fresh.load_state_dict(state), model)


def test_restore_into_abstract_model_without_random_init(tmp_path):
    path = (tmp_path / "model").absolute()
    model = Deep(rngs=nn.Rngs(0))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, model.state_dict())
    abstract = jax.eval_shape(lambda: Deep(rngs=nn.Rngs(0)))
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(path, target=abstract.state_dict())
    restored = abstract.load_state_dict(state)
    assert_bitwise_equal(restored, model)


def test_partial_and_selected_parameter_checkpoints(tmp_path):
    class Classifier(nn.Module):
        def __init__(self, *, rngs):
            self.encoder = MLP(rngs=rngs)
            self.head = nn.Linear(4, 10, rngs=rngs)

    trained = Classifier(rngs=nn.Rngs(0))
    flat = trained.flat_state_dict()
    encoder_state = {k: v for k, v in flat.items() if k.startswith("encoder.")}
    path = (tmp_path / "encoder").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, encoder_state)
    fresh = Classifier(rngs=nn.Rngs(1))
    target = {k: v for k, v in fresh.flat_state_dict().items() if k.startswith("encoder.")}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, target=target)
    model = fresh.load_flat_state_dict(restored)
    assert_bitwise_equal(model.encoder, trained.encoder)
    assert model.head.kernel is fresh.head.kernel


def test_restore_places_leaves_like_the_target(tmp_path):
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices("cpu"))
    sharded = NamedSharding(mesh, PartitionSpec(None, "model"))
    model = MLP(rngs=nn.Rngs(0))
    path = (tmp_path / "model").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, model.state_dict())
    target_model = MLP(rngs=nn.Rngs(1))
    target_model = target_model.replace(
        input=target_model.input.replace(kernel=jax.device_put(jnp.zeros((32, 64)), sharded))
    )
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(path, target=target_model.state_dict())
    restored = target_model.load_state_dict(state)
    assert restored.input.kernel.sharding == sharded
    assert_bitwise_equal(restored, model)


def test_large_checkpoint_settings_round_trip(tmp_path):
    """The docs' large-checkpoint recipe: uncompressed, several chunks per array, bounded reads."""
    path = (tmp_path / "model").absolute()
    model = Deep(rngs=nn.Rngs(0))
    state = model.state_dict()
    chunk = 64  # bytes: a [8, 8] float32 kernel (256 bytes) is split into several chunks
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk), state)
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, restore_concurrent_gb=0.1)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(state, save_args=save_args))
        metadata = checkpointer.metadata(path).item_metadata.tree
        kernel = metadata["layers"]["0"]["kernel"]
        assert kernel.storage.chunk_shape != kernel.shape  # really more than one chunk
        abstract = jax.eval_shape(lambda: Deep(rngs=nn.Rngs(1)))
        target = abstract.state_dict()
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        tuned = checkpointer.restore(
            path, args=ocp.args.PyTreeRestore(target, restore_args=restore_args)
        )
    assert_bitwise_equal(abstract.load_state_dict(tuned, strict=True), model)
    with ocp.StandardCheckpointer() as checkpointer:  # any checkpointer reads it back
        plain = checkpointer.restore(path, target=abstract.state_dict())
    assert_bitwise_equal(abstract.load_state_dict(plain, strict=True), model)


RULES = {"input.kernel": (None, "model"), "input.bias": ("model",), "output.kernel": ("model",)}


def _mesh(shape):
    return jax.make_mesh(shape, ("data", "model"), devices=jax.devices("cpu"))


@pytest.fixture
def sharded_checkpoint(tmp_path, optax_promotion):
    """A sharded MLP on a (2, 4) mesh after one Adam step, saved with its optimizer state."""
    mesh = _mesh((2, 4))
    model = tt.shard(MLP(rngs=nn.Rngs(0)), RULES, mesh)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(model)
    with jax.set_mesh(mesh):  # the mesh's axes are Explicit: computations run under it
        grads = jax.grad(lambda m: jnp.sum(m(jnp.ones((2, 32))) ** 2))(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        model = optax.apply_updates(model, updates)
    assert model.input.kernel.sharding.spec == PartitionSpec(None, "model")
    path = (tmp_path / "run").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, {"model": model.state_dict(), "opt": tt.state_dict(opt_state)})
    return path, model, opt_state, optimizer


def _restore(path, model, opt_state):
    """Restores onto `model` and `opt_state` (concrete or abstract) as the targets."""
    target = {"model": model.state_dict(), "opt": tt.state_dict(opt_state)}
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(path, target=target)
    restored = model.load_state_dict(state["model"], strict=True)
    return restored, tt.load_state_dict(opt_state, state["opt"], strict=True)


def _placed_like(tree, target):
    """Every leaf of `tree` sits where the leaf of `target` with its name does."""
    want = tt.flat_state_dict(target)
    for name, leaf in tt.flat_state_dict(tree).items():
        assert isinstance(leaf, jax.Array), name
        assert leaf.sharding.is_equivalent_to(want[name].sharding, leaf.ndim), name


@pytest.mark.parametrize("where", ["same mesh", "(4, 2) mesh", "one device"])
def test_a_sharded_model_and_its_adam_state_restore_onto_the_targets_placement(
    sharded_checkpoint, where
):
    path, model, opt_state, optimizer = sharded_checkpoint
    fresh = MLP(rngs=nn.Rngs(1))  # other values, so a restore that skipped a leaf shows
    if where != "one device":
        fresh = tt.shard(fresh, RULES, _mesh((2, 4) if where == "same mesh" else (4, 2)))
    target_opt = optimizer.init(fresh)
    restored, restored_opt = _restore(path, fresh, target_opt)
    assert_bitwise_equal(restored, model)
    assert_bitwise_equal(restored_opt, opt_state)
    _placed_like(restored, fresh)
    _placed_like(restored_opt, target_opt)
    kernel = restored.input.kernel.sharding
    if where == "one device":
        assert kernel == SingleDeviceSharding(jax.devices()[0])
    else:
        assert kernel.mesh.devices.shape == ((2, 4) if where == "same mesh" else (4, 2))
        assert kernel.spec == PartitionSpec(None, "model")


def test_the_resume_recipe_restores_onto_an_abstract_target_on_a_new_mesh(sharded_checkpoint):
    """Nothing random-initialised, nothing on the old mesh: the abstract model and optimizer
    state of `tt.eval_shape` carry the new mesh's shardings into Orbax."""
    path, model, opt_state, optimizer = sharded_checkpoint
    new = _mesh((4, 2))
    abstract = tt.shard(tt.eval_shape(lambda: MLP(rngs=nn.Rngs(1))), RULES, new)
    abstract_opt = tt.eval_shape(optimizer.init, abstract)
    for name, leaf in tt.flat_state_dict(abstract_opt).items():
        assert isinstance(leaf, jax.ShapeDtypeStruct), name
        assert leaf.sharding.mesh == new, name  # never missing, never the old mesh
    restored, restored_opt = _restore(path, abstract, abstract_opt)
    assert_bitwise_equal(restored, model)
    assert_bitwise_equal(restored_opt, opt_state)
    _placed_like(restored, abstract)
    _placed_like(restored_opt, abstract_opt)
    assert restored_opt[0].mu.input.kernel.sharding.spec == PartitionSpec(None, "model")
