"""Safetensors files: write a model's state to one file or to indexed shards, open a
checkpoint by its headers, and stream one into a model tensor by tensor.

Every public name is imported when it is first used: opening a header imports no JAX."""

import typing as _typing

from .. import _lazy

if _typing.TYPE_CHECKING:
    from ..loading import LoadPlan as LoadPlan
    from ..loading import PlannedStep as PlannedStep
    from ..loading import load_safetensors as load_safetensors
    from ..loading import plan_load as plan_load
    from ._checkpoint import Checkpoint as Checkpoint
    from ._checkpoint import open_safetensors as open_safetensors
    from ._read import SafetensorsError as SafetensorsError
    from ._read import Tensor as Tensor
    from ._save import save_safetensors as save_safetensors
    from ._torch import read_torch as read_torch

# name -> (the module that defines it, its name there; None: the module itself)
_LAZY = {
    "Checkpoint": ("._checkpoint", "Checkpoint"),
    "open_safetensors": ("._checkpoint", "open_safetensors"),
    # the load, whose home is taktiny.loading (which imports this package, never the
    # reverse: imported only when one of these is first used)
    "load_safetensors": ("taktiny.loading", "load_safetensors"),
    "LoadPlan": ("taktiny.loading", "LoadPlan"),
    "PlannedStep": ("taktiny.loading", "PlannedStep"),
    "plan_load": ("taktiny.loading", "plan_load"),
    "SafetensorsError": ("._read", "SafetensorsError"),
    "Tensor": ("._read", "Tensor"),
    "save_safetensors": ("._save", "save_safetensors"),
    "read_torch": ("._torch", "read_torch"),
}

__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals())

__all__ = [
    "Checkpoint",
    "LoadPlan",
    "PlannedStep",
    "SafetensorsError",
    "Tensor",
    "load_safetensors",
    "open_safetensors",
    "plan_load",
    "read_torch",
    "save_safetensors",
]  # (the names of _LAZY)
