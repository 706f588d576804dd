"""A NumPy dtype by NumPy's name for it, made when first asked for.

The bfloat16, float8 and 4-bit dtypes come from ml_dtypes, whose import registers NumPy
loops for every type it defines and takes about a second here, and NumPy's own import
takes a fifth of one: both are imported when a dtype is first asked for (a tensor is
read), never by a process that only reads headers.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from .. import _lazy

if TYPE_CHECKING:
    import numpy as np
else:
    np = _lazy.module("numpy")  # (imported when a dtype is first asked for)


@functools.cache
def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of NumPy's `name` for it (``"bfloat16"``: ml_dtypes', imported now)."""
    if name in np.sctypeDict:
        return np.dtype(name)
    import ml_dtypes  # (slow to import, and needed only here)

    return np.dtype(getattr(ml_dtypes, name))
