"""Taktiny: a small, fast, pure-functional neural-network library for JAX."""

from . import nn as nn
from ._state import StateDictError as StateDictError
from ._state import StateProblem as StateProblem

__version__ = "0.1.0"
