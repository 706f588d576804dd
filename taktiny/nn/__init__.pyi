"""Taktiny's modules and layers."""

from ..module import Module as Module
from ..module import Rngs as Rngs
from ..module import field as field
from ._attention import MultiHeadAttention as MultiHeadAttention
from ._batchnorm import BatchNorm as BatchNorm
from ._cache import KVCache as KVCache
from ._conv import Conv as Conv
from ._conv_transpose import ConvTranspose as ConvTranspose
from ._dropout import Dropout as Dropout
from ._embed import Embed as Embed
from ._group_norm import GroupNorm as GroupNorm
from ._linear import Linear as Linear
from ._lora import LoRAEmbed as LoRAEmbed
from ._lora import LoRALinear as LoRALinear
from ._norm import LayerNorm as LayerNorm
from ._norm import RMSNorm as RMSNorm
from ._pool import AvgPool as AvgPool
from ._pool import GlobalAvgPool as GlobalAvgPool
from ._pool import MaxPool as MaxPool
from ._quantized import QuantizedEmbed as QuantizedEmbed
from ._quantized import QuantizedLinear as QuantizedLinear
from ._rotary import RotaryEmbedding as RotaryEmbedding
from ._sequential import Lambda as Lambda
from ._sequential import Sequential as Sequential
from ._stack import Stack as Stack
from ._training import train_forward as train_forward

"For Taktiny's own packages (importable, not public):"

from ._surgery import dequantize as dequantize
from ._surgery import lora as lora
from ._surgery import merge_lora as merge_lora
from ._surgery import quantize as quantize
