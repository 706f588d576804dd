"""`Dropout`: randomly zeroes elements during training, with an explicit key."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..module import Module
from ._random import keep_mask


class Dropout(Module):
    """Zeroes each element with probability ``rate`` and scales the rest by
    ``1 / (1 - rate)``, so the expected value is unchanged (inverted dropout, as PyTorch's
    ``nn.Dropout`` in training mode).

    There is no train/eval flag and no hidden random state: called without a key the
    layer is the identity (evaluation); called with ``key=`` it drops, and the same key
    drops the same elements. Split a fresh key per step and per layer
    (``jax.random.split``), or let :class:`Sequential` split one for its layers.

    Dropout has no parameters; it computes in the input's dtype.

    Args:
        rate: the probability of zeroing an element, in ``[0, 1]``.

    Raises:
        ValueError: `rate` is outside ``[0, 1]``.
    """

    rate: float

    def __init__(self, rate: float):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"Dropout's rate is a probability in [0, 1], got {rate!r}.")
        self.rate = float(rate)

    def __call__(self, x: Float[Array, "*shape"], *, key: Any = None) -> Float[Array, "*shape"]:
        """Drops elements of `x` at random, or none without a key.

        Args:
            x: an array of any shape.
            key: a PRNG key (``jax.random.key``) that chooses the elements to drop; None
                returns `x` unchanged.

        Returns:
            An array of `x`'s shape and dtype.
        """
        with jax.named_scope("Dropout"):
            if key is None or self.rate == 0.0:
                return x
            if self.rate == 1.0:
                return jnp.zeros_like(x)
            keep = keep_mask(key, self.rate, x.shape)
            # a Python float is weakly typed: the division stays in x's dtype
            return jnp.where(keep, x / (1.0 - self.rate), jnp.zeros((), x.dtype))
