"""Safetensors' dtype codes: each one's NumPy name and item size, known without importing
anything (a header names dtypes, so opening one, and `taktiny inspect`, needs only the
names and sizes; `taktiny.arrays`' `numpy_dtype` makes the dtype when a tensor is read)."""

# code -> (NumPy's name of the dtype, its size in bytes), laid out by hand as a
# table of four codes a line (kept from the formatter)
CODES = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "U16": ("uint16", 2),
    "I16": ("int16", 2), "U32": ("uint32", 4), "I32": ("int32", 4), "U64": ("uint64", 8),
    "I64": ("int64", 8), "F16": ("float16", 2), "F32": ("float32", 4), "F64": ("float64", 8),
    "C64": ("complex64", 8), "BF16": ("bfloat16", 2), "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}  # fmt: skip
