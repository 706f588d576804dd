"""The problems a load finds from the checkpoint's headers, before any data is read: a
float leaf whose checkpoint holds quantized parts, a packed tensor its file does not list,
leaves not loaded that must be. (A quantized parameter's float array or parts that do not
fit it are the parameter's to tell: `quant.Parameter`.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .._problems import StateProblem
from ..io import Checkpoint, SafetensorsError, Tensor
from ..quant import FOUR_BIT, PACKED, packed_shape, stored_for_float, stored_part
from ..state import problems as err


def quantized_into_float(
    checkpoint: Checkpoint, leaves: Mapping[str, Any], unknown: list[str]
) -> dict[str, StateProblem]:
    """A problem for each float leaf whose checkpoint holds quantized parts instead."""
    out: dict[str, StateProblem] = {}
    for name in unknown:
        base = stored_part(name)
        if base is None or base not in leaves or base in out:
            continue
        shape, dtype = spec_of(leaves[base])
        problem = stored_for_float(base, checkpoint, checkpoint.quantized, shape, dtype)
        if problem is not None:
            out[base] = problem
    return out


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


def absent_leaves(leaves: Mapping[str, Any], loaded: set[str], strict: bool) -> list[StateProblem]:
    """The leaves not loaded that must be: all of them under strict=True, and those of an
    abstract model (they have no value to keep); checked before anything is read."""
    absent = [(n, isinstance(leaves[n], jax.ShapeDtypeStruct)) for n in leaves if n not in loaded]
    if strict:
        return [err.missing(name, abstract) for name, abstract in absent]
    return [err.abstract(name) for name, abstract in absent if abstract]


def spec_of(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    dtype = getattr(leaf, "dtype", None)
    return tuple(np.shape(leaf)), np.dtype(dtype) if dtype is not None else np.result_type(leaf)
