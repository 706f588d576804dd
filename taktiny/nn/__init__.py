"""Taktiny's modules and layers."""

from .. import _lazy

__getattr__, __dir__, __all__ = _lazy.face(__name__, __file__, globals())
