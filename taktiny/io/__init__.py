"""Safetensors files: write a model's state to one file or to indexed shards, open a
checkpoint by its headers, and stream one into a model tensor by tensor."""

from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import open_safetensors as open_safetensors
from ._load import load_safetensors as load_safetensors
from ._read import SafetensorsError as SafetensorsError
from ._read import Tensor as Tensor
from ._save import save_safetensors as save_safetensors
from ._torch import read_torch as read_torch
