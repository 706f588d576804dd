"""Safetensors files: write a model's state to one file or to indexed shards, open a
checkpoint by its headers, and stream one into a model tensor by tensor.

Every name is imported when it is first used (the stub beside this file lists each
once): opening a header imports no JAX. The load's names are `taktiny.loading`'s, kept
here, where users import them; `taktiny.loading` imports this package, never the reverse
(these four are imported only when first used)."""

from .. import _lazy

__getattr__, __dir__, __all__ = _lazy.face(__name__, __file__, globals())
