"""A functional training step under plain jax.jit with optax, then a checkpoint round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from _models import MLP

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

    outside = MLP(rngs=nn.Rngs(0)).load_state_dict(state)
    np.testing.assert_array_equal(predict_with(MLP(rngs=nn.Rngs(0)), state, x), outside(x))
