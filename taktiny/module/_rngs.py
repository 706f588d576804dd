"""`Rngs`: the construction-time key stream."""

from __future__ import annotations

from typing import Any

import jax


class Rngs:
    """A stream of PRNG keys for building modules: ``key = rngs()`` draws the next one.

    The same seed gives the same sequence of keys, so the same model construction
    gives the same parameters. An ``Rngs`` is only used while modules are being
    built; modules never store it, and randomness at call time (dropout) takes an
    explicit ``key=`` argument instead.

    Args:
        seed: an integer seed, or a JAX PRNG key (typed or raw ``uint32[2]``).
    """

    def __init__(self, seed: int | jax.Array):
        if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
            self._key = seed
        elif isinstance(seed, jax.Array) and seed.shape == (2,):
            self._key = jax.random.wrap_key_data(seed)
        else:
            self._key = jax.random.key(seed)
        self._count = 0

    def __call__(self) -> Any:
        """Draws the next key of the stream.

        Returns:
            A typed PRNG key array of shape ``()``, a new one on every call.
        """
        key = jax.random.fold_in(self._key, self._count)
        self._count += 1
        return key

    def __repr__(self) -> str:
        return f"Rngs(drawn={self._count})"
