"""Taktiny: a small, fast, pure-functional neural-network library for JAX.

Every public name is imported when it is first used."""

import typing as _typing

from . import _lazy

if _typing.TYPE_CHECKING:
    from . import convert as convert
    from . import io as io
    from . import nn as nn
    from ._qarray import QArray as QArray
    from ._summary import Summary as Summary
    from ._summary import summary as summary
    from .convert._migrate import migrate as migrate
    from .module._trainable import trainable as trainable
    from .nn._surgery import dequantize as dequantize
    from .nn._surgery import lora as lora
    from .nn._surgery import merge_lora as merge_lora
    from .nn._surgery import quantize as quantize
    from .sharding._eval_shape import eval_shape as eval_shape
    from .sharding._plan import ShardingPlan as ShardingPlan
    from .sharding._plan import shard as shard
    from .sharding._plan import sharding_plan as sharding_plan
    from .state._problems import SelectionError as SelectionError
    from .state._problems import StateDictError as StateDictError
    from .state._problems import StateProblem as StateProblem
    from .state._schema import Schema as Schema
    from .state._schema import schema as schema
    from .state._tree import by_name as by_name
    from .state._tree import flat_state_dict as flat_state_dict
    from .state._tree import load_flat_state_dict as load_flat_state_dict
    from .state._tree import load_state_dict as load_state_dict
    from .state._tree import state_dict as state_dict

# name -> (the module that defines it, its name there; None: the module itself)
_LAZY = {
    "convert": (".convert", None),
    "io": (".io", None),
    "nn": (".nn", None),
    "eval_shape": (".sharding._eval_shape", "eval_shape"),
    "SelectionError": (".state._problems", "SelectionError"),
    "StateDictError": (".state._problems", "StateDictError"),
    "StateProblem": (".state._problems", "StateProblem"),
    "Schema": (".state._schema", "Schema"),
    "schema": (".state._schema", "schema"),
    "QArray": ("._qarray", "QArray"),
    "ShardingPlan": (".sharding._plan", "ShardingPlan"),
    "shard": (".sharding._plan", "shard"),
    "sharding_plan": (".sharding._plan", "sharding_plan"),
    "Summary": ("._summary", "Summary"),
    "summary": ("._summary", "summary"),
    "by_name": (".state._tree", "by_name"),
    "flat_state_dict": (".state._tree", "flat_state_dict"),
    "load_flat_state_dict": (".state._tree", "load_flat_state_dict"),
    "load_state_dict": (".state._tree", "load_state_dict"),
    "state_dict": (".state._tree", "state_dict"),
    "trainable": (".module._trainable", "trainable"),
    "dequantize": (".nn._surgery", "dequantize"),
    "lora": (".nn._surgery", "lora"),
    "merge_lora": (".nn._surgery", "merge_lora"),
    "migrate": (".convert._migrate", "migrate"),
    "quantize": (".nn._surgery", "quantize"),
}

__version__ = "0.1.0"

__all__ = [
    "QArray",
    "Schema",
    "SelectionError",
    "ShardingPlan",
    "StateDictError",
    "StateProblem",
    "Summary",
    "by_name",
    "convert",
    "dequantize",
    "eval_shape",
    "flat_state_dict",
    "io",
    "load_flat_state_dict",
    "load_state_dict",
    "lora",
    "merge_lora",
    "migrate",
    "nn",
    "quantize",
    "schema",
    "shard",
    "sharding_plan",
    "state_dict",
    "summary",
    "trainable",
]  # (the names of _LAZY)

__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals())
