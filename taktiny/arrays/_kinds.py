"""What a tree may hold as an array leaf or a number leaf, and how many tree structures a
cache of them keeps."""

import jax
import numpy as np

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)  # what is an array
SCALARS = (bool, int, float, complex)  # the Python numbers a tree may hold as leaves
CACHE_BOUND = 4096  # structures a cache of tree structures keeps before it starts again
