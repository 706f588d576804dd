"""Converting weights from other frameworks: ordered rules from source names to Taktiny
names, a coverage check of every name before anything is loaded, export back, presets for
PyTorch's layers, and a parity check of the outputs."""

from ._compressed_tensors import export_compressed_tensors as export_compressed_tensors
from ._compressed_tensors import unpack_quantized as unpack_quantized
from ._convert import Converted as Converted
from ._convert import check as check
from ._convert import convert as convert
from ._convert import export as export
from ._convert import resume as resume
from ._convert import round_trip_check as round_trip_check
from ._coverage import ConversionError as ConversionError
from ._coverage import ConversionProblem as ConversionProblem
from ._coverage import Report as Report
from ._coverage import Step as Step
from ._fp8 import dequantize_blocks as dequantize_blocks
from ._parity import Parity as Parity
from ._parity import ParityOutput as ParityOutput
from ._parity import parity as parity
from ._presets import batch_norm as batch_norm
from ._presets import buffers as buffers
from ._presets import conv as conv
from ._presets import conv_transpose as conv_transpose
from ._presets import embedding as embedding
from ._presets import group_norm as group_norm
from ._presets import layer_norm as layer_norm
from ._presets import linear as linear
from ._presets import multihead_attention as multihead_attention
from ._presets import pytorch as pytorch
from ._quantized_rules import quantized_rules as quantized_rules
from ._rules import Ignore as Ignore
from ._rules import Init as Init
from ._rules import Rule as Rule
from ._rules import Tie as Tie
from ._torch_adam import torch_adam as torch_adam
from ._transforms import Transform as Transform
from ._transforms import cast as cast
from ._transforms import chain as chain
from ._transforms import concatenate as concatenate
from ._transforms import dequantize as dequantize
from ._transforms import flip as flip
from ._transforms import identity as identity
from ._transforms import quantize as quantize
from ._transforms import reshape as reshape
from ._transforms import split as split
from ._transforms import stack as stack
from ._transforms import transpose as transpose
from ._transforms import unstack as unstack

"For Taktiny's own packages (importable, not public):"

from ._convert import check_ties as check_ties
from ._convert import per_layer as per_layer
from ._coverage import Allowance as Allowance
from ._coverage import check_allow as check_allow
from ._coverage import plan as plan
from ._coverage import transformed_specs as transformed_specs
from ._migrate import PASS_ALLOWED as PASS_ALLOWED
from ._migrate import Stage as Stage
from ._migrate import explained as explained
from ._migrate import migrate as migrate
from ._migrate import migrated_schema as migrated_schema
from ._migrate import migration_rules as migration_rules
from ._migrate import stages as stages
from ._migrate import stages_text as stages_text
from ._migrate import without_values as without_values
from ._rules import AnyRule as AnyRule
