"""Reading PyTorch ``.bin`` / ``.pt`` files as NumPy arrays, without unpickling objects.

A PyTorch file is a pickle. Taktiny never unpickles anything itself: every file goes
through ``torch.load(..., weights_only=True)``, PyTorch's restricted unpickler, which
rebuilds tensors and plain containers (dicts, lists, numbers, strings) and refuses any
other object. torch is imported only when a file is read, so it is needed only then.
Files in PyTorch's zip format are memory-mapped (``mmap=True``): the arrays returned are
views of the mapped file, read from disk as they are touched.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._header import HEADER_LIMIT, parse_json

_INDEX = ".bin.index.json"  # Hugging Face names it pytorch_model.bin.index.json
_INDEX_LIMIT = HEADER_LIMIT  # as for a safetensors header; an index is a few kilobytes
_MAX_TENSORS = 2**20  # tensors a checkpoint may name (a repeated container once per path)
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
        ValueError: naming the file, for one that ``weights_only`` loading refuses or
            cannot read (truncated, members missing, impossible shapes, strides or
            offsets), one that holds no dict, a container inside itself, a shape NumPy
            cannot hold, or two values flattening to one name; an index that is no JSON
            object or has no ``weight_map``, naming a shard outside its folder or one that
            is no file name (a NUL byte, a symlink loop); or a shard that lacks a tensor
            the index puts in it.
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
        # a global of a module torch blocks (os, sys: a pickle that runs commands) is refused
        # in a message of its own, without "WeightsUnpickler error:"
        blocked = re.search(r"^Trying to load unsupported GLOBAL .* is blocked\.$", reason, re.M)
        if "WeightsUnpickler error:" not in reason and not blocked:  # a damaged or other file
            raise ValueError(
                f"read_torch: {file} is not a readable PyTorch file ({type(error).__name__}: "
                f"{reason}); expected a file written by torch.save"
            ) from error
        # torch's message goes on to explain how to unpickle the file anyway: left out
        why = (
            blocked.group(0)
            if blocked
            else reason.split("WeightsUnpickler error:", 1)[1].strip().split("\n")[0]
        )
        raise ValueError(
            f"read_torch: torch.load(weights_only=True) refused {file} "
            f"({why.split('. Please', 1)[0]}): it holds objects other than tensors and plain "
            f"containers, or is no PyTorch file. Taktiny never unpickles arbitrary objects. "
            f"Instead, {_SAFETENSORS}."
        ) from None


def _read_index(torch: Any, index: Path) -> dict[str, np.ndarray]:
    """The tensors of the shards `index` names, each shard checked before any is read."""
    try:
        if index.stat().st_size > _INDEX_LIMIT:
            raise ValueError(f"it has more than {_INDEX_LIMIT} bytes")
        weight_map = parse_json(index.read_bytes(), "its JSON").get("weight_map")
    except (ValueError, AttributeError) as error:
        raise ValueError(f"read_torch: {index} is not a JSON object: {error}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(
            f"read_torch: {index} has no 'weight_map' of tensor names to shard files "
            f"({{'name': 'pytorch_model-00001-of-00002.bin', ...}}): not a PyTorch index"
        )
    folder = index.parent.resolve()
    shards = list(dict.fromkeys(weight_map.values()))
    unnamed = [s for s in shards if _unresolved(folder, s)]
    if unnamed:
        raise ValueError(
            f"read_torch: {index} names shards that are no file names or cannot be resolved: "
            f"{', '.join(_unresolved(folder, s) or '' for s in unnamed[:3])}; an index may name "
            f"only files next to it"
        )
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
    counts = _counts(torch, file, loaded)
    flat: dict[str, np.ndarray] = {}
    # depth first, in the file's order, with a stack of the containers being walked (no
    # recursion: a pickle may nest containers a million deep); containers holding no
    # tensor are skipped (a pickle may repeat one inside another, 2**30 paths to it)
    stack = [("", _items(loaded))]
    while stack:
        prefix, items = stack[-1]
        for key, node in items:
            if isinstance(node, torch.Tensor):
                name = f"{prefix}.{key}" if prefix else str(key)
                if name in flat:
                    raise ValueError(
                        f"read_torch: {file} holds two tensors named {name!r} once nested "
                        f"names are joined with dots; rename one of them"
                    )
                flat[name] = _numpy(torch, file, name, node)
            elif isinstance(node, (Mapping, list, tuple)) and counts[id(node)]:
                stack.append((f"{prefix}.{key}" if prefix else str(key), _items(node)))
                break
            # anything else (a step, a learning rate, a string) is not a weight: left out
        else:
            stack.pop()
    return flat


def _counts(torch: Any, file: Path, loaded: Any) -> dict[int, int]:
    """How many tensors (names) each container in `loaded` holds, by its id: one walk that
    visits each container once, refusing a container inside itself and more than
    `_MAX_TENSORS` names (a pickle that repeats a container inside another names it once
    per path: 2**30 times in a few hundred bytes)."""
    counts: dict[int, int] = {}
    stack, walking, totals = [(id(loaded), _items(loaded))], {id(loaded)}, [0]
    while stack:
        ident, items = stack[-1]
        for key, node in items:
            if isinstance(node, torch.Tensor):
                totals[-1] += 1
            elif isinstance(node, (Mapping, list, tuple)):
                inner = id(node)
                if inner in counts:
                    totals[-1] += counts[inner]
                    continue
                if inner in walking:
                    raise ValueError(
                        f"read_torch: {file} holds a container inside itself (at {key!r}, "
                        f"{len(stack)} deep); it is no checkpoint"
                    )
                walking.add(inner)
                stack.append((inner, _items(node)))
                totals.append(0)
                break
        else:
            stack.pop()
            walking.discard(ident)
            counts[ident] = total = totals.pop()
            if totals:
                totals[-1] += total
            if total > _MAX_TENSORS:
                raise ValueError(
                    f"read_torch: {file} names more than {_MAX_TENSORS:,} tensors (it repeats "
                    f"containers inside each other); it is no checkpoint"
                )
    return counts


def _items(node: Any) -> Iterator[tuple[Any, Any]]:
    return iter(node.items()) if isinstance(node, Mapping) else enumerate(node)


def _unresolved(folder: Path, shard: str) -> str | None:
    """Why `shard` names no file beside the index (a NUL byte, a symlink loop, a name too
    long), or None."""
    try:
        if not shard or "\x00" in shard:
            raise ValueError("no file name")
        (folder / shard).resolve().is_file()
    except (OSError, RuntimeError, ValueError) as error:  # RuntimeError: a symlink loop
        text = repr(shard) if len(shard) <= 80 else f"{shard[:80]!r}..."
        return f"{text} ({error})"
    return None


def _numpy(torch: Any, file: Path, name: str, tensor: Any) -> np.ndarray:
    """`tensor`'s values as a NumPy array of the same dtype, bit for bit (no copy)."""
    tensor = tensor.detach()
    # NumPy has no bfloat16 or float8: their bits go through an integer of the same size
    bits = {
        torch.bfloat16: (torch.int16, jnp.bfloat16),
        torch.float8_e4m3fn: (torch.uint8, jnp.float8_e4m3fn),
        torch.float8_e5m2: (torch.uint8, jnp.float8_e5m2),
    }
    try:
        if tensor.layout == torch.strided and not tensor.is_quantized and tensor.dtype in bits:
            integer, dtype = bits[tensor.dtype]
            return tensor.view(integer).numpy().view(np.dtype(dtype))
        return tensor.numpy()
    except ValueError as error:  # NumPy's limits: 64 axes, 2**63 bytes
        raise ValueError(
            f"read_torch: {name!r} in {file} has the shape {list(tensor.shape)}, which NumPy "
            f"cannot hold ({error}); the file is corrupt"
        ) from None
    except (TypeError, RuntimeError) as error:
        raise TypeError(
            f"read_torch: {name!r} in {file} is a {tensor.dtype} tensor with layout "
            f"{tensor.layout}, which NumPy cannot hold ({error}); convert it before saving "
            f"(.to_dense() for a sparse tensor, .dequantize(), .float() for complex32)"
        ) from None
