"""Taktiny: a small, fast, pure-functional neural-network library for JAX."""

from . import convert as convert
from . import io as io
from . import nn as nn
from ._abstract import eval_shape as eval_shape
from ._errors import StateDictError as StateDictError
from ._errors import StateProblem as StateProblem
from ._quant import QArray as QArray
from ._shard import ShardingPlan as ShardingPlan
from ._shard import shard as shard
from ._shard import sharding_plan as sharding_plan
from ._summary import Summary as Summary
from ._summary import summary as summary
from ._tree import by_name as by_name
from ._tree import flat_state_dict as flat_state_dict
from ._tree import load_flat_state_dict as load_flat_state_dict
from ._tree import load_state_dict as load_state_dict
from ._tree import state_dict as state_dict
from ._tree import trainable as trainable
from .nn._quantized import dequantize as dequantize
from .nn._quantized import quantize as quantize

__version__ = "0.1.0"
