"""The checks layers make of their inputs and arguments: one message style, naming the layer
and both values."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def check_features(layer: str, x: Any, expected: int, *, why: str, argument: str) -> None:
    """Raises a ValueError naming `layer` when the last axis of `x` does not have `expected`
    entries; `why` says which parameter fixes the size, `argument` which constructor
    argument would make the layer fit the input instead."""
    if x.ndim == 0 or x.shape[-1] != expected:
        fit = f"{argument}={x.shape[-1]}" if x.ndim else f"a batch of vectors of {expected}"
        raise ValueError(
            f"{layer} expects inputs whose last axis has {expected} features ({why}), got an "
            f"input of shape {tuple(x.shape)}. Pass inputs with {expected} features on the "
            f"last axis, or build the layer for this input ({fit})."
        )


def check_ids(layer: str, ids: Any) -> None:
    """Raises a TypeError naming `layer` (a lookup table) when `ids` are not integers."""
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"{layer} expects integer ids, got an array of dtype {ids.dtype} and shape "
            f"{tuple(ids.shape)}; cast it first: ids.astype(jnp.int32)."
        )


def divisors(n: int) -> list[int]:
    """The counts that split `n` into equal parts (1 to `n`), which an error about a count
    that must divide `n` suggests."""
    return [d for d in range(1, n + 1) if n % d == 0]
