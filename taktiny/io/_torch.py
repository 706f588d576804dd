"""Reading PyTorch ``.bin`` / ``.pt`` files as NumPy arrays, without unpickling objects.

A PyTorch file is a pickle. Taktiny never unpickles anything itself: every file goes
through ``torch.load(..., weights_only=True)``, PyTorch's restricted unpickler, which
rebuilds tensors and plain containers (dicts, lists, numbers, strings) and refuses any
other object. torch is imported only when a file is read, so it is needed only then.
Files in PyTorch's zip format are memory-mapped (``mmap=True``): the arrays returned are
views of the mapped file, read from disk as they are touched.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

_INDEX = ".bin.index.json"  # Hugging Face names it pytorch_model.bin.index.json
_SAFETENSORS = (
    "save the tensors as safetensors where PyTorch is installed, for example with "
    "safetensors.torch.save_file(model.state_dict(), 'model.safetensors'), and read that"
)


def read_torch(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The tensors of a PyTorch checkpoint, as NumPy arrays under their dotted names.

    Reads a file written by ``torch.save`` (``.bin``, ``.pt``, ``.pth``), a Hugging Face
    index of sharded ``.bin`` files (``pytorch_model.bin.index.json``), or a folder holding
    such an index or a ``pytorch_model.bin``. Every file is read with
    ``torch.load(..., map_location="cpu", weights_only=True)`` and nothing else: a file
    holding any other object than tensors and plain containers (a whole ``nn.Module``, a
    custom class) is refused, because Taktiny never unpickles arbitrary objects. Needs
    PyTorch installed.

    The file may hold a flat state dict (``{"encoder.weight": tensor, ...}``) or a
    checkpoint that nests one (``{"model": {...}, "optimizer": {...}, "step": 1000}``):
    nested dicts and lists are flattened with dots (``"model.encoder.weight"``, list
    elements ``"0"``, ``"1"``, ...). Values that are not tensors (a step count, a learning
    rate, a config string) are not weights and are left out.

    Tensors keep their dtype, bit for bit: bfloat16 and float8 tensors become
    ``ml_dtypes`` arrays (``jnp.bfloat16``, ...). Arrays from zip-format files (what
    ``torch.save`` writes since PyTorch 1.6) are memory-mapped views of the file; files in
    the older format are read into memory whole.

    Args:
        path: a file written by ``torch.save``, a ``*.bin.index.json`` index, or a folder
            holding exactly one index, or a ``pytorch_model.bin``.

    Returns:
        ``{name: array}``, in the file's order (an index's ``weight_map`` order).

    Raises:
        ImportError: PyTorch is not installed.
        FileNotFoundError: `path`, a folder's checkpoint, or a shard the index names does
            not exist.
        ValueError: a file that ``weights_only`` loading refuses or cannot read, one that
            holds no dict, two values flattening to one name, an index without a
            ``weight_map`` or naming a shard outside its folder, or a shard that lacks a
            tensor the index puts in it.
        TypeError: a tensor NumPy cannot hold (sparse, quantized, complex32), named.
    """
    try:
        import torch  # imported here: PyTorch is needed only to read its files
    except ImportError:
        raise ImportError(
            f"read_torch: reading the PyTorch file {path} needs PyTorch, which is not "
            f"installed: pip install torch. Or, instead, {_SAFETENSORS} "
            f"(taktiny.io reads safetensors without PyTorch)."
        ) from None
    target = Path(path)
    if target.is_dir():
        target = _in_folder(target)
    if not target.is_file():
        raise FileNotFoundError(f"read_torch: {target} does not exist")
    if target.name.endswith(".json"):
        return _read_index(torch, target)
    return _flatten(torch, target, _load(torch, target))


def _in_folder(folder: Path) -> Path:
    """The index, or else the one ``pytorch_model.bin``, that `folder` holds."""
    indexes = sorted(folder.glob(f"*{_INDEX}"))
    if len(indexes) == 1:
        return indexes[0]
    if not indexes and (folder / "pytorch_model.bin").is_file():
        return folder / "pytorch_model.bin"
    found = ", ".join(p.name for p in indexes) or "none, and no pytorch_model.bin"
    raise FileNotFoundError(
        f"read_torch: {folder} must hold one '*{_INDEX}' index or a 'pytorch_model.bin' "
        f"(found: {found}); pass the file to read"
    )


def _load(torch: Any, file: Path) -> Any:
    """``torch.load`` with ``weights_only=True``; memory-mapped where the format allows."""
    mappable = zipfile.is_zipfile(file)  # torch maps only its zip format, not legacy files
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mappable)
    except Exception as error:
        reason = str(error)
        if "WeightsUnpickler error:" not in reason:  # not a refusal: a damaged or other file
            raise ValueError(
                f"read_torch: {file} is not a readable PyTorch file ({type(error).__name__}: "
                f"{reason}); expected a file written by torch.save"
            ) from error
        # torch's message goes on to explain how to unpickle the file anyway: left out
        why = reason.split("WeightsUnpickler error:", 1)[1].strip().split("\n")[0]
        raise ValueError(
            f"read_torch: torch.load(weights_only=True) refused {file} "
            f"({why.split('. Please', 1)[0]}): it holds objects other than tensors and plain "
            f"containers, or is no PyTorch file. Taktiny never unpickles arbitrary objects. "
            f"Instead, {_SAFETENSORS}."
        ) from None


def _read_index(torch: Any, index: Path) -> dict[str, np.ndarray]:
    """The tensors of the shards `index` names, each shard checked before any is read."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as error:
        raise ValueError(f"read_torch: {index} is not a JSON object: {error}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(
            f"read_torch: {index} has no 'weight_map' of tensor names to shard files "
            f"({{'name': 'pytorch_model-00001-of-00002.bin', ...}}): not a PyTorch index"
        )
    folder = index.parent.resolve()
    shards = list(dict.fromkeys(weight_map.values()))
    outside = [s for s in shards if folder not in (folder / s).resolve().parents]
    if outside:
        raise ValueError(
            f"read_torch: {index} names shards outside its folder {folder}: "
            f"{', '.join(map(repr, outside))}; an index may name only files next to it"
        )
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise FileNotFoundError(
            f"read_torch: {index} names shards missing from {folder}: "
            f"{', '.join(map(repr, missing))}"
        )
    read: dict[str, np.ndarray] = {}
    for shard in shards:
        tensors = _flatten(torch, folder / shard, _load(torch, folder / shard))
        wanted = [name for name, s in weight_map.items() if s == shard]
        absent = [name for name in wanted if name not in tensors]
        if absent:
            raise ValueError(
                f"read_torch: {index} puts {', '.join(map(repr, absent))} in the shard "
                f"{shard!r}, which does not hold them (it holds {len(tensors)} tensors)"
            )
        read.update((name, tensors[name]) for name in wanted)
    return {name: read[name] for name in weight_map}


def _flatten(torch: Any, file: Path, loaded: Any) -> dict[str, np.ndarray]:
    """The tensors in `loaded`, under dotted names; values that are not tensors left out."""
    if not isinstance(loaded, Mapping):
        raise ValueError(
            f"read_torch: {file} holds a {type(loaded).__name__}, not a dict; expected a "
            f"state dict ({{name: tensor}}) or a checkpoint dict holding one"
        )
    flat: dict[str, np.ndarray] = {}

    def walk(node: Any, name: str) -> None:
        if isinstance(node, torch.Tensor):
            if name in flat:
                raise ValueError(
                    f"read_torch: {file} holds two tensors named {name!r} once nested names "
                    f"are joined with dots; rename one of them"
                )
            flat[name] = _numpy(torch, file, name, node)
        elif isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{name}.{key}" if name else str(key))
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{name}.{i}" if name else str(i))
        # anything else (a step, a learning rate, a string) is not a weight: left out

    walk(loaded, "")
    return flat


def _numpy(torch: Any, file: Path, name: str, tensor: Any) -> np.ndarray:
    """`tensor`'s values as a NumPy array of the same dtype, bit for bit (no copy)."""
    tensor = tensor.detach()
    # NumPy has no bfloat16 or float8: their bits go through an integer of the same size
    bits = {
        torch.bfloat16: (torch.int16, jnp.bfloat16),
        torch.float8_e4m3fn: (torch.uint8, jnp.float8_e4m3fn),
        torch.float8_e5m2: (torch.uint8, jnp.float8_e5m2),
    }
    if tensor.layout == torch.strided and not tensor.is_quantized and tensor.dtype in bits:
        integer, dtype = bits[tensor.dtype]
        return tensor.view(integer).numpy().view(np.dtype(dtype))
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError) as error:
        raise TypeError(
            f"read_torch: {name!r} in {file} is a {tensor.dtype} tensor with layout "
            f"{tensor.layout}, which NumPy cannot hold ({error}); convert it before saving "
            f"(.to_dense() for a sparse tensor, .dequantize(), .float() for complex32)"
        ) from None
