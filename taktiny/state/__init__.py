"""Naming, reading and loading the leaves of any tree: flat names, name patterns, the two
views of a tree, resolution of names to leaves, value checks, other representations, the
load itself, and the problem records with `StateDictError`. The design note is `_state.md`
beside this file. Other packages import through this face; the public names are
re-exported by ``taktiny``. Each name is imported when first used, so that a process
reading only safetensors headers never imports JAX."""

from .. import _lazy

__getattr__, __dir__, __all__ = _lazy.face(__name__, __file__, globals())
