"""A functional training step under plain jax.jit with optax, then a checkpoint round trip."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _models import MLP

import taktiny as tt
from taktiny import nn


def make_data():
    kx, kw = jax.random.split(jax.random.key(42))
    x = jax.random.normal(kx, (256, 32))
    y = jnp.tanh(x @ jax.random.normal(kw, (32, 4)) / 4)
    return x, y


def train(model, x, y, steps=300):
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(model, opt_state, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, loss

    opt_state = optimizer.init(model)
    losses = []
    for _ in range(steps):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    return model, losses


def test_train_save_restore(tmp_path, optax_promotion):
    x, y = make_data()
    model, losses = train(MLP(rngs=nn.Rngs(0)), x, y)
    assert isinstance(model, MLP)
    assert losses[-1] < losses[0] / 10, (losses[0], losses[-1])

    path = (tmp_path / "ckpt").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, model.state_dict())
    fresh = MLP(rngs=nn.Rngs(7))
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(path, target=fresh.state_dict())
    restored = fresh.load_state_dict(state)
    np.testing.assert_array_equal(restored(x), model(x))
    assert not np.array_equal(fresh(x), model(x))


def test_load_inside_jit_gives_the_same_model_as_outside():
    trained = MLP(rngs=nn.Rngs(1))
    state = trained.state_dict()
    x, _ = make_data()

    @jax.jit
    def predict_with(model, state, x):
        model = model.load_state_dict(state)
        return model(x)

    fresh = MLP(rngs=nn.Rngs(0))
    inside = predict_with(fresh, state, x)
    np.testing.assert_array_equal(inside, fresh.load_state_dict(state)(x))
    np.testing.assert_allclose(inside, trained(x), rtol=1e-6)  # the trained model's outputs
    assert not np.allclose(inside, fresh(x))  # not the fresh model's: the load happened


# --- tied weights -----------------------------------------------------------------------


class TiedLM(nn.Module):
    """Input embedding and output projection share one table (Embed.attend)."""

    def __init__(self, *, rngs):
        self.embed = nn.Embed(16, 8, rngs=rngs)
        self.hidden = nn.Linear(8, 8, rngs=rngs)

    def __call__(self, ids):
        return self.embed.attend(jnp.tanh(self.hidden(self.embed(ids))))


def test_tied_weights_are_one_parameter_through_training_and_checkpoints(tmp_path):
    model = TiedLM(rngs=nn.Rngs(0))
    assert list(model.flat_state_dict()) == [
        "embed.embedding", "hidden.kernel", "hidden.bias",
    ]  # fmt: skip
    ids = jnp.array([1, 2, 3, 4])
    targets = jnp.array([2, 3, 4, 5])

    def loss_fn(model):
        logits = model(ids)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), targets])

    # the gradient of the shared table adds its two uses: check against the same model
    # written with two separate (equal) tables
    table = model.embed.embedding

    def untied_loss(tables):
        h = jnp.tanh(model.hidden(tables[0][ids]))
        logits = h @ tables[1].T
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), targets])

    g_in, g_out = jax.grad(untied_loss)((table, table))
    grads = jax.grad(loss_fn)(model)
    np.testing.assert_allclose(grads.embed.embedding, g_in + g_out, rtol=1e-5, atol=1e-7)

    optimizer = optax.sgd(0.5)
    opt_state = optimizer.init(model)
    step = jax.jit(lambda m, s: _sgd_step(optimizer, loss_fn, m, s))
    first = float(loss_fn(model))
    for _ in range(20):
        model, opt_state = step(model, opt_state)
    assert float(loss_fn(model)) < first / 2
    assert list(model.flat_state_dict()) == ["embed.embedding", "hidden.kernel", "hidden.bias"]

    path = (tmp_path / "tied").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, model.state_dict())
        fresh = TiedLM(rngs=nn.Rngs(5))
        restored = fresh.load_state_dict(
            checkpointer.restore(path, target=fresh.state_dict()), strict=True
        )
    np.testing.assert_array_equal(restored(ids), model(ids))


def _sgd_step(optimizer, loss_fn, model, opt_state):
    grads = jax.grad(loss_fn)(model)
    updates, opt_state = optimizer.update(grads, opt_state, model)
    return optax.apply_updates(model, updates), opt_state


# --- BatchNorm deep inside a model --------------------------------------------------------


class Block(nn.Module):
    def __init__(self, *, rngs):
        self.conv = nn.Linear(4, 4, rngs=rngs)
        self.norm = nn.BatchNorm(4, momentum=0.5)

    def __call__(self, x):
        return jax.nn.relu(self.norm(self.conv(x)))


class Stage(nn.Module):
    def __init__(self, *, rngs):
        self.blocks = [Block(rngs=rngs), Block(rngs=rngs)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Deep(nn.Module):
    """BatchNorm three levels down (Deep -> Stage -> Block -> BatchNorm); no parent knows."""

    def __init__(self, *, rngs):
        self.stage = Stage(rngs=rngs)
        self.head = nn.Sequential(nn.BatchNorm(4), nn.Linear(4, 1, rngs=rngs))

    def __call__(self, x):
        return self.head(self.stage(x))


def test_train_forward_updates_batchnorm_at_any_depth_as_threading_would():
    model = Deep(rngs=nn.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (16, 4)) * 2 + 1
    out, new = nn.train_forward(model, x)
    # the same computation with every (y, new_bn) threaded by hand
    h, expected = x, []
    for block in model.stage.blocks:
        y, bn = block.norm(block.conv(h), train=True)
        expected.append(bn)
        h = jax.nn.relu(y)
    y, head_bn = model.head.layers[0](h, train=True)
    np.testing.assert_allclose(out, model.head.layers[1](y), rtol=1e-6)
    for block, bn in zip(new.stage.blocks, expected, strict=True):
        np.testing.assert_allclose(block.norm.mean, bn.mean, rtol=1e-6)
        np.testing.assert_allclose(block.norm.var, bn.var, rtol=1e-6)
    np.testing.assert_allclose(new.head.layers[0].var, head_bn.var, rtol=1e-6)
    # the parameters are the same arrays; the original model is untouched
    assert new.stage.blocks[0].conv.kernel is model.stage.blocks[0].conv.kernel
    np.testing.assert_array_equal(model.stage.blocks[0].norm.mean, np.zeros(4))
    # outside train_forward the same call is inference, with the running statistics
    np.testing.assert_allclose(new(x), new.head.layers[1](new.head.layers[0](new.stage(x))))


def test_a_jitted_training_loop_with_train_forward(optax_promotion):
    model = Deep(rngs=nn.Rngs(1))
    optimizer = optax.adamw(3e-2, mask=tt.trainable)
    x = jax.random.normal(jax.random.key(1), (32, 4)) * 3 + 2
    y = jnp.sum(x, axis=1, keepdims=True)

    @jax.jit
    def step(model, opt_state):
        def loss_fn(model):
            pred, model = nn.train_forward(model, x)
            return jnp.mean((pred - y) ** 2), model

        (loss, model), grads = jax.value_and_grad(loss_fn, has_aux=True)(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, loss

    opt_state = optimizer.init(model)
    losses = []
    for _ in range(60):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] / 3
    h = model.stage.blocks[0].conv(x)  # the first BatchNorm tracked its input's statistics
    np.testing.assert_allclose(model.stage.blocks[0].norm.mean, h.mean(0), rtol=0.1, atol=0.1)


def test_a_layer_called_twice_updates_twice_and_strays_are_refused():
    class Twice(nn.Module):
        def __init__(self):
            self.norm = nn.BatchNorm(2, momentum=0.5)

        def __call__(self, x):
            return self.norm(self.norm(x) + 1.0)

    x = jnp.array([[0.0, 2.0], [2.0, 6.0]])
    out, new = nn.train_forward(Twice(), x)
    first, bn = Twice().norm(x, train=True)
    second, bn = bn(first + 1.0, train=True)
    np.testing.assert_allclose(out, second)
    np.testing.assert_allclose(new.norm.mean, bn.mean)
    np.testing.assert_allclose(new.norm.var, bn.var)

    class Stray(nn.Module):
        def __call__(self, x):
            return nn.BatchNorm(2)(x)  # made during the call, so not part of the model

    with pytest.raises(
        ValueError,
        match=r"1 layer\(s\) \(BatchNorm\) ran in training mode but are not part of the Stray",
    ):
        nn.train_forward(Stray(), x)


@pytest.mark.parametrize("transform", ["scan", "checkpoint"])
def test_a_layer_inside_a_transformation_of_its_own_is_refused_saying_why(transform):
    class Inner(nn.Module):
        def __init__(self):
            self.norm = nn.BatchNorm(2, momentum=0.5)

        def __call__(self, x):
            if transform == "checkpoint":
                return jax.checkpoint(lambda norm, x: norm(x))(self.norm, x)
            step = lambda norm, batch: (norm, norm(batch))
            return jax.lax.scan(step, self.norm, jnp.stack([x, x]))[1]

    x = jnp.array([[0.0, 2.0], [2.0, 6.0]])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "train_forward: 1 layer(s) (BatchNorm) ran in training mode on traced copies that "
            "are not part of the Inner given, so their new statistics have nowhere to go. This "
            "happens to a layer called inside a transformation of its own within "
            "Inner.__call__ (jax.lax.scan, jax.checkpoint, jax.vmap, jax.jit), which calls a "
            "copy of it: call such a layer with train=True"
        ),
    ):
        nn.train_forward(Inner(), x)
