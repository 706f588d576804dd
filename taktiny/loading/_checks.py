"""The problems a load finds from the checkpoint's headers, before any data is read, that
the state walk's resolve does not: a packed tensor its file does not list."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..io import SafetensorsError, Tensor
from ..quant import FOUR_BIT, PACKED, packed_shape


def check_packed_listed(tensor: Tensor, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Raises when a uint8 tensor stands where the model holds a 4-bit array of which it
    could be the packed bytes, but its file does not list it as packed."""
    if dtype.name in FOUR_BIT and tensor.dtype == np.uint8 and not tensor.packed:
        if tuple(tensor.shape) == packed_shape(shape):
            raise SafetensorsError(
                f"{tensor.file}: {tensor.name!r} is stored as uint8{list(tensor.shape)}, where "
                f"the model holds {dtype.name}{list(shape)}: 4-bit tensors are stored packed "
                f"two per byte, but the header metadata {PACKED!r}, which lists each packed "
                f"tensor with its dtype and shape, does not list it, so it cannot be unpacked. "
                f"Write the checkpoint with taktiny.io.save_safetensors, which records it."
            )


def spec_of(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    dtype = getattr(leaf, "dtype", None)
    return tuple(np.shape(leaf)), np.dtype(dtype) if dtype is not None else np.result_type(leaf)
