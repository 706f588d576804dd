"""What a Taktiny module is: the `Module` class and its metaclass, the node classes, declared
fields, the checks made when a module is built, `Rngs` and the trainable marker. The
design note is `_module.md` beside this file. Other packages import through this face;
the public names are re-exported by ``taktiny`` and ``taktiny.nn``. Each name is imported
when first used."""

from .. import _lazy

__getattr__, __dir__, __all__ = _lazy.face(__name__, __file__, globals())
