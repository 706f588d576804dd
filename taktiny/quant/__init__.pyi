"""Quantized arrays: the `QArray` (its parts, its layout checks, quantizing and
dequantizing) and its format in safetensors files (4-bit tensors packed two per byte,
the layout recorded in the header), and the arithmetic of other libraries' quantized
weights (FP8 blocks, compressed-tensors' packed integers) that `taktiny.convert` reads. The
quantized layers, and the surgery that swaps them in (``tt.quantize``), are
`taktiny.nn`'s. Every name is imported when first used: reading a file's quantized
records imports no JAX."""

from ._format import FOUR_BIT as FOUR_BIT
from ._format import PACKED as PACKED
from ._format import QUANTIZED as QUANTIZED
from ._format import check_quantized as check_quantized
from ._format import pack as pack
from ._format import packed_record as packed_record
from ._format import packed_shape as packed_shape
from ._format import quantized_record as quantized_record
from ._format import unpack as unpack
from ._parameter import Parameter as Parameter
from ._qarray import INT_DTYPES as INT_DTYPES
from ._qarray import PARTS as PARTS
from ._qarray import QArray as QArray
from ._qarray import dequantize_array as dequantize_array
from ._qarray import parts_layout as parts_layout
from ._qarray import quantize_array as quantize_array
from ._qarray import quantize_like as quantize_like
from ._qarray import quantized as quantized

"For Taktiny's own packages (importable, not public):"

from ._compressed_tensors import pack_int32 as pack_int32
from ._compressed_tensors import packed_qarray as packed_qarray
from ._fp8 import blocks_held_bytes as blocks_held_bytes
from ._fp8 import dequantized_blocks as dequantized_blocks
from ._fp8 import placed_blocks as placed_blocks
from ._fp8 import scale_problem as scale_problem
from ._problems import stored_for_float as stored_for_float
from ._qarray import from_parts as from_parts
from ._qarray import part_names as part_names
