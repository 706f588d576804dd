"""Safetensors files: write a model's state to one file or to indexed shards."""

from ._save import save_safetensors as save_safetensors
