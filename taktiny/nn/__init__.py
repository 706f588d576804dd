"""Taktiny's modules and layers."""

from .._module import Module as Module
from .._module import field as field
from .._rngs import Rngs as Rngs
from ._linear import Linear as Linear
from ._sequential import Lambda as Lambda
from ._sequential import Sequential as Sequential
