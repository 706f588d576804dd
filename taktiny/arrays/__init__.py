"""What an array is and where it lives: the array and number types a tree may hold, a
NumPy dtype by name, PartitionSpecs and the ambient mesh, and abstract arrays that keep
their shardings (``tt.eval_shape``), and floats moved as their bits by programs that only
move values and between meshes. Every other package stands on it; it imports none.
Every name is imported when first used (the stub beside this file lists them)."""

from .. import _lazy

__getattr__, __dir__, __all__ = _lazy.face(__name__, __file__, globals())
