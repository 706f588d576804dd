"""`Sequential` and `Lambda`: chaining layers and plain functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._module import Module, field


class Lambda(Module):
    """Wraps a plain function (``jax.nn.relu``, say) as a module with no parameters.

    The function is static: it is part of the tree structure, never a leaf.
    """

    fn: Callable[..., Any] = field(static=True)

    def __call__(self, x: Any) -> Any:
        """Returns ``fn(x)``."""
        with jax.named_scope("Lambda"):
            return self.fn(x)


class Sequential(Module):
    """Calls its layers in order, each on the previous one's output.

    Plain functions among the layers are wrapped in :class:`Lambda`. The layers are
    stored in ``layers``, so their state names are ``layers.0...``, ``layers.1...``.
    """

    layers: tuple[Module, ...]

    def __init__(self, *layers: Module | Callable[..., Any]):
        self.layers = tuple(x if isinstance(x, Module) else Lambda(x) for x in layers)

    def __call__(self, x: Any) -> Any:
        """Returns ``layers[-1](...layers[1](layers[0](x)))``."""
        with jax.named_scope("Sequential"):
            for layer in self.layers:
                x = layer(x)  # pyright: ignore[reportCallIssue]
            return x

    def __getitem__(self, index: int) -> Module:
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)
