"""Taktiny quickstart: build, train, checkpoint, restore, partially load, inspect.

Run with `make demo` (or `python examples/quickstart.py` inside the project's venv).
"""

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from taktiny import nn


class MLP(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.input = nn.Linear(32, 64, rngs=rngs)
        self.output = nn.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.output(jax.nn.relu(self.input(x)))


def make_data(n=512):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, 32))
    y = jnp.tanh(x @ jax.random.normal(kw, (32, 4)) / 4)
    return x, y


def train(model, x, y, steps=300):
    optimizer = optax.adam(1e-2)

    @jax.jit  # plain jax.jit: a Taktiny model is just a PyTree
    def step(model, opt_state):
        loss, grads = jax.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, loss

    opt_state = optimizer.init(model)
    for i in range(steps):
        model, opt_state, loss = step(model, opt_state)
        if i % 50 == 0 or i == steps - 1:
            print(f"step {i:4d}  loss {float(loss):.5f}")
    return model


def print_state_table(model):
    flat = model.flat_state_dict()
    print(f"\n{'name':<16}{'shape':<12}{'dtype':<10}{'bytes':>8}")
    for name, value in flat.items():
        print(f"{name:<16}{tuple(value.shape)!s:<12}{value.dtype.name:<10}{value.nbytes:>8}")
    total = sum(value.size for value in flat.values())
    print(f"total parameters: {total:,}")
    return total


def main():
    x, y = make_data()
    model = train(MLP(rngs=nn.Rngs(0)), x, y)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "mlp").absolute()  # Orbax wants an absolute path that doesn't exist yet
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path, model.state_dict())
        print(f"\nsaved to {path}")

        fresh = MLP(rngs=nn.Rngs(1))  # another init, only its structure matters
        with ocp.StandardCheckpointer() as checkpointer:
            state = checkpointer.restore(path, target=fresh.state_dict())
        restored = fresh.load_state_dict(state, strict=True)

    same = bool(jnp.array_equal(restored(x), model(x)))
    print(f"restored model predicts identically: {same}")
    assert same

    partial = MLP(rngs=nn.Rngs(2)).load_state_dict({"input": model.state_dict()["input"]})
    assert np.array_equal(partial.input.kernel, model.input.kernel)
    assert not np.array_equal(partial.output.kernel, model.output.kernel)
    print("partially loaded the trained `input` layer into a new model; `output` kept its init")

    print_state_table(model)


if __name__ == "__main__":
    main()
