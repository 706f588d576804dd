"""Safetensors files: write a model's state to one file or to indexed shards, open a
checkpoint by its headers, and stream one into a model tensor by tensor.

Every public name is imported when it is first used: opening a header imports no JAX."""

import typing as _typing

from .. import _lazy

if _typing.TYPE_CHECKING:
    from ._checkpoint import Checkpoint as Checkpoint
    from ._checkpoint import open_safetensors as open_safetensors
    from ._load import load_safetensors as load_safetensors
    from ._load_plan import LoadPlan as LoadPlan
    from ._load_plan import PlannedStep as PlannedStep
    from ._load_plan import plan_load as plan_load
    from ._read import SafetensorsError as SafetensorsError
    from ._read import Tensor as Tensor
    from ._save import save_safetensors as save_safetensors
    from ._torch import read_torch as read_torch

# name -> (the module that defines it, its name there; None: the module itself)
_LAZY = {
    "Checkpoint": ("._checkpoint", "Checkpoint"),
    "open_safetensors": ("._checkpoint", "open_safetensors"),
    "load_safetensors": ("._load", "load_safetensors"),
    "LoadPlan": ("._load_plan", "LoadPlan"),
    "PlannedStep": ("._load_plan", "PlannedStep"),
    "plan_load": ("._load_plan", "plan_load"),
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
