"""Models people load every day, importable: the Llama family of causal decoders (Llama
2, 3, 3.1 and 3.2, Mistral, Qwen2 and Qwen2.5, Qwen3; `_decoder.py`), from a Hugging Face
folder in one call and back (`_pretrained.py`); the BERT family of encoders (BERT, MiniLM,
sentence-transformers' sentence embeddings through `mean_pool`; `_encoder.py`). Above the
library's floors: nothing in the library imports it. Each name is imported when first
used."""

from .. import _lazy

__getattr__, __dir__, __all__ = _lazy.face(__name__, __file__, globals())
