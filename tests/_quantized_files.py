"""Quantized checkpoints as other libraries write them, for the tests of
`taktiny.convert.quantized_rules` and `export_compressed_tensors`.

- `fp8_folder`: a Hugging Face FP8 block-scaled checkpoint, written as the format has it
  (DeepSeek-V3's and transformers' ``FineGrainedFP8``): each quantized ``weight`` in
  ``float8_e4m3fn`` beside a float32 ``weight_scale_inv`` of one factor per block (the
  block's max magnitude / 448, ragged edge blocks included), sharded with an index, and the
  ``quantization_config`` in ``config.json``.
- `compressed_folder`: a compressed-tensors checkpoint written by ``compressed_tensors``
  itself: its quantization config applied to a torch model, the scales its own
  ``calculate_qparams`` gives, compressed by its ``ModelCompressor``, saved by
  ``save_pretrained`` with the config it writes.
- `decompressed`: one module's weight as ``compressed_tensors``' own pack-quantized
  compressor decompresses it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
E4M3_MAX = 448.0


def llama_reference(config: Any, seed: int = 0) -> Any:
    """The example's reference `LlamaForCausalLM` of `config`, every parameter moved off
    its initial value (RMSNorm weights are ones)."""
    import torch

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    import llama

    torch.manual_seed(seed)
    model = llama.hugging_face(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def fp8_blocks(w: np.ndarray, block: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """`w` (float32, [..., out, in]) as float8_e4m3fn weights and float32 block scales
    ([..., ceil(out / b0), ceil(in / b1)]): each block divided by its max magnitude / 448."""
    *lead, o, i = w.shape
    bo, bi = -(-o // block[0]), -(-i // block[1])
    padded = np.zeros((*lead, bo * block[0], bi * block[1]), np.float32)
    padded[..., :o, :i] = w
    blocks = padded.reshape(*lead, bo, block[0], bi, block[1])
    scale = np.abs(blocks).max(axis=(-3, -1)) / E4M3_MAX
    scale = np.where(scale == 0, 1, scale).astype(np.float32)
    full = np.repeat(np.repeat(scale, block[0], -2), block[1], -1)[..., :o, :i]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), scale


def dequantized(weight: np.ndarray, scale: np.ndarray, block: Sequence[int]) -> np.ndarray:
    """The NumPy oracle: each float8 entry times its block's scale, in float32."""
    o, i = weight.shape[-2:]
    full = np.repeat(np.repeat(scale, block[0], -2), block[1], -1)[..., :o, :i]
    return weight.astype(np.float32) * full


def fp8_folder(
    tensors: dict[str, np.ndarray],
    folder: Path,
    *,
    quantized: Callable[[str], bool],
    config: dict[str, Any] | None = None,
    block: Sequence[int] = (128, 128),
    shards: int = 2,
) -> dict[str, np.ndarray]:
    """Writes `tensors` (float32) as an FP8 block-scaled checkpoint in `folder`: the names
    `quantized` picks as float8 weights with their ``weight_scale_inv``, the rest as they
    are; in `shards` files with an index, and `config` (a Hugging Face config dict) with
    its quantization_config. Returns what it wrote, by name."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        if quantized(name):
            out[name], out[name + "_scale_inv"] = fp8_blocks(array, block)
        else:
            out[name] = array
    names = list(out)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: np.ascontiguousarray(out[n]) for n in part}, folder / file, {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    quantization = {**FP8_CONFIG, "weight_block_size": list(block)}
    (folder / "config.json").write_text(
        json.dumps({**(config or {}), "quantization_config": quantization})
    )
    return out


def compressed_folder(
    model: Any,
    folder: Path,
    *,
    bits: int,
    group_size: int | None,
    ignore: Sequence[str] = ("lm_head",),
    **weights: Any,
) -> None:
    """Quantizes the torch `model`'s Linear layers (but `ignore`) with compressed_tensors
    (symmetric int, per channel or per group of `group_size`; `weights` overrides its
    QuantizationArgs) and saves the compressed checkpoint in `folder` as its library does
    (a module without ``save_pretrained``: its state dict in ``model.safetensors``, and
    the config compressed_tensors writes alone in ``config.json``). The model is changed
    (compressed)."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    strategy = "channel" if group_size is None else "group"
    fields = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": strategy}
    args = QuantizationArgs(**{**fields, "group_size": group_size, **weights})
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                w = module.weight
                grouped = w.reshape(w.shape[0], -1, group_size or w.shape[1])
                scale, zero = calculate_qparams(
                    grouped.amin(-1), grouped.amax(-1), module.quantization_scheme.weights
                )
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(folder)
    else:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file(model.state_dict(), folder / "model.safetensors", {"format": "pt"})
        (folder / "config.json").write_text("{}")
    compressor.update_config(str(folder))


def as_torch(array: Any) -> Any:
    """A NumPy array (bfloat16 included, by its bits) as a torch tensor of its dtype."""
    import torch

    array = np.asarray(array).copy()  # (writable: torch takes no read-only memory)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def decompressed(tensors: Any, group: dict[str, Any], module: str) -> Any:
    """`module`'s weight (a torch tensor ``[out, in]``) as compressed_tensors' own
    ``PackedQuantizationCompressor`` decompresses its ``weight_packed``, ``weight_scale``
    and ``weight_shape`` from `tensors` (a name -> array mapping) with the config `group`
    (one of a ``quantization_config``'s ``config_groups``): the integers times their
    scales, in the scales' dtype."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    parts = ("weight_packed", "weight_scale", "weight_shape")
    state = {part: as_torch(tensors[f"{module}.{part}"]) for part in parts}
    weight = PackedQuantizationCompressor.decompress(state, QuantizationScheme(**group))["weight"]
    assert weight.dtype == state["weight_scale"].dtype
    return weight
