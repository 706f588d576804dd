"""Models shared by the unit tests."""

import dataclasses

import jax

from taktiny import nn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scaled:
    """A custom PyTree parameter: an integer value and its scale (a quantized weight)."""

    value: jax.Array
    scale: jax.Array


class MLP(nn.Module):
    """The guide's MLP: 32 -> 64 -> 4 with a ReLU between."""

    def __init__(self, *, rngs: nn.Rngs):
        self.input = nn.Linear(32, 64, rngs=rngs)
        self.output = nn.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.output(jax.nn.relu(self.input(x)))
