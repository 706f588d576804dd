"""Quantized arrays: the `QArray` (its parts, its layout checks, quantizing and
dequantizing) and its format in safetensors files (4-bit tensors packed two per byte,
the layout recorded in the header), and the arithmetic of other libraries' quantized
weights (FP8 blocks, compressed-tensors' packed integers) that `taktiny.convert` reads. The
quantized layers, and the surgery that swaps them in (``tt.quantize``), are
`taktiny.nn`'s. Every name is imported when first used: reading a file's quantized
records imports no JAX."""

from .. import _lazy

__getattr__, __dir__, __all__ = _lazy.face(__name__, __file__, globals())
