"""`StateDictError` and the problems it lists: each kind is built in one place, and every
name is re-exported here, so that callers use ``_errors.<name>``.

``_errors_core``: the error, `StateProblem` and `describe`; ``_errors_names``: unknown names
(with suggestions), keys and structure, names not supplied; ``_errors_values``: shapes,
dtypes, casts and devices; ``_errors_quant``: quantized arrays and their parts.
"""

from ._errors_core import SHOWN as SHOWN
from ._errors_core import StateDictError as StateDictError
from ._errors_core import StateProblem as StateProblem
from ._errors_core import describe as describe
from ._errors_names import abstract as abstract
from ._errors_names import array_expected as array_expected
from ._errors_names import closest as closest
from ._errors_names import contains_itself as contains_itself
from ._errors_names import dotted_key as dotted_key
from ._errors_names import group_expected as group_expected
from ._errors_names import groups_of as groups_of
from ._errors_names import inside_array as inside_array
from ._errors_names import missing as missing
from ._errors_names import non_string_key as non_string_key
from ._errors_names import structure as structure
from ._errors_names import too_deep as too_deep
from ._errors_names import unknown as unknown
from ._errors_names import unknown_part as unknown_part
from ._errors_quant import float_expected as float_expected
from ._errors_quant import in_quantized as in_quantized
from ._errors_quant import not_float as not_float
from ._errors_quant import not_quantized as not_quantized
from ._errors_quant import parts_text as parts_text
from ._errors_quant import quantized_expected as quantized_expected
from ._errors_quant import unfit_parts as unfit_parts
from ._errors_values import bits as bits
from ._errors_values import deleted as deleted
from ._errors_values import devices as devices
from ._errors_values import dtype_kind as dtype_kind
from ._errors_values import leaked as leaked
from ._errors_values import masked as masked
from ._errors_values import narrowing as narrowing
from ._errors_values import not_an_array as not_an_array
from ._errors_values import overflow as overflow
from ._errors_values import shape as shape
