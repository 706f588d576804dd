"""Taktiny: a small, fast, pure-functional neural-network library for JAX.

Every public name is imported when it is first used; the stub beside this file lists each
once (type checkers read it too)."""

from . import convert as convert
from . import io as io
from . import nn as nn
from ._summary import Summary as Summary
from ._summary import summary as summary
from ._version import __version__ as __version__
from .arrays import eval_shape as eval_shape
from .convert import migrate as migrate
from .module import trainable as trainable
from .nn import dequantize as dequantize
from .nn import lora as lora
from .nn import merge_lora as merge_lora
from .nn import quantize as quantize
from .quant import QArray as QArray
from .sharding import ShardingPlan as ShardingPlan
from .sharding import shard as shard
from .sharding import sharding_plan as sharding_plan
from .state import Schema as Schema
from .state import SelectionError as SelectionError
from .state import StateDictError as StateDictError
from .state import StateProblem as StateProblem
from .state import by_name as by_name
from .state import flat_state_dict as flat_state_dict
from .state import load_flat_state_dict as load_flat_state_dict
from .state import load_state_dict as load_state_dict
from .state import schema as schema
from .state import state_dict as state_dict
