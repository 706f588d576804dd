"""Taktiny: a small, fast, pure-functional neural-network library for JAX.

Every public name is imported when it is first used; the stub beside this file lists each
once (type checkers read it too)."""

from . import _lazy

__getattr__, __dir__, __all__ = _lazy.face(__name__, __file__, globals())
