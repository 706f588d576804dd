"""What a Taktiny module is: the `Module` class and its metaclass, the node classes, declared
fields, the checks made when a module is built, `Rngs` and the trainable marker. The
design note is `_module.md` beside this file. Other packages import through this face;
the public names are re-exported by ``taktiny`` and ``taktiny.nn``. Each name is imported
when first used."""

from ._module import Module as Module
from ._module import field as field
from ._module import fields_of as fields_of
from ._module import finalise as finalise
from ._rngs import Rngs as Rngs
from ._trainable import trainable as trainable
