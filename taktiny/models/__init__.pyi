"""Models people load every day, importable: the Llama family of causal decoders (Llama
2, 3, 3.1 and 3.2, Mistral, Qwen2 and Qwen2.5, Qwen3; `_decoder.py`), from a Hugging Face
folder in one call and back (`_pretrained.py`); the BERT family of encoders (BERT, MiniLM,
sentence-transformers' sentence embeddings through `mean_pool`; `_encoder.py`). Above the
library's floors: nothing in the library imports it. Each name is imported when first
used."""

from ._decoder import Decoder as Decoder
from ._decoder import DecoderConfig as DecoderConfig
from ._decoder import DecoderLayer as DecoderLayer
from ._encoder import Encoder as Encoder
from ._encoder import EncoderConfig as EncoderConfig
from ._encoder import EncoderLayer as EncoderLayer
from ._encoder import mean_pool as mean_pool
from ._pretrained import FAMILIES as FAMILIES
from ._pretrained import from_pretrained as from_pretrained
from ._pretrained import rules as rules
from ._pretrained import save_pretrained as save_pretrained
