"""Training a model whose BatchNorm layers sit deep inside it, with `nn.train_forward`.

The model is a stack of residual blocks, each with its own BatchNorm. No `__call__` takes a
`train=` flag or returns updated layers: `nn.train_forward` runs the model in training mode
and hands back the model with every BatchNorm's new running statistics. `tt.trainable` keeps
adamw's weight decay off those statistics. Run: python examples/batchnorm.py
"""

import jax
import jax.numpy as jnp
import optax

import taktiny as tt
from taktiny import nn


class Residual(nn.Module):
    def __init__(self, width: int, *, rngs: nn.Rngs):
        self.linear = nn.Linear(width, width, rngs=rngs)
        self.norm = nn.BatchNorm(width, momentum=0.9)

    def __call__(self, x):
        return x + jax.nn.relu(self.norm(self.linear(x)))


class Stage(nn.Module):
    def __init__(self, width: int, depth: int, *, rngs: nn.Rngs):
        self.blocks = [Residual(width, rngs=rngs) for _ in range(depth)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Regressor(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.embed = nn.Linear(8, 32, rngs=rngs)
        self.stages = [Stage(32, 2, rngs=rngs), Stage(32, 2, rngs=rngs)]
        self.head = nn.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def main() -> None:
    model = Regressor(rngs=nn.Rngs(0))
    print(tt.summary(model, depth=2))

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (512, 8)) * 4 + 3  # far from zero mean, unit variance
    y = jnp.sin(x @ jax.random.normal(kw, (8, 1)) / 4)
    optimizer = optax.adamw(3e-3, weight_decay=1e-2, mask=tt.trainable)
    opt_state = optimizer.init(model)

    @jax.jit
    def step(model, opt_state, x, y):
        def loss_fn(model):
            prediction, model = nn.train_forward(model, x)  # batch statistics, updated model
            return jnp.mean((prediction - y) ** 2), model

        (loss, model), grads = jax.value_and_grad(loss_fn, has_aux=True)(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, loss

    for i in range(201):
        batch = slice((i % 8) * 64, (i % 8 + 1) * 64)
        model, opt_state, loss = step(model, opt_state, x[batch], y[batch])
        if i % 50 == 0:
            print(f"step {i:3d}  loss {float(loss):.4f}")

    norm = model.stages[1].blocks[1].norm  # three levels down
    print(f"stages.1.blocks.1.norm running mean, first 3: {norm.mean[:3]}")
    eval_loss = float(jnp.mean((model(x) - y) ** 2))  # a plain call: inference mode
    print(f"evaluation loss with the running statistics: {eval_loss:.4f}")


if __name__ == "__main__":
    with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes int32 and float32
        main()
