"""What an array is and where it lives: the array and number types a tree may hold, a
NumPy dtype by name, PartitionSpecs and the ambient mesh, and abstract arrays that keep
their shardings (``tt.eval_shape``), and floats moved as their bits by programs that only
move values. Every other package stands on it; it imports none.
Every name is imported when first used (the stub beside this file lists them)."""

from ._bits import as_bits as as_bits
from ._bits import bits_kept as bits_kept
from ._bits import from_bits as from_bits
from ._bits import moved as moved
from ._bits import put as put
from ._dtypes import numpy_dtype as numpy_dtype
from ._eval_shape import default_device as default_device
from ._eval_shape import eval_shape as eval_shape
from ._kinds import ARRAY_TYPES as ARRAY_TYPES
from ._kinds import CACHE_BOUND as CACHE_BOUND
from ._kinds import SCALARS as SCALARS
from ._specs import Spec as Spec
from ._specs import ambient_mesh as ambient_mesh
from ._specs import as_spec as as_spec
from ._specs import mesh_text as mesh_text
from ._specs import part as part
from ._specs import placement as placement
from ._specs import spec_problems as spec_problems
