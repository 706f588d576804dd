"""Converting weights from other frameworks: ordered rules from source names to Taktiny
names, a coverage check of every name before anything is loaded, export back, presets for
PyTorch's layers, and a parity check of the outputs."""

from .. import _lazy

__getattr__, __dir__, __all__ = _lazy.face(__name__, __file__, globals())
