"""Input checks shared by the layers: one message style, naming the layer and both values."""

from __future__ import annotations

from typing import Any


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
