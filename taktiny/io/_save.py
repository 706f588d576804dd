"""Writing safetensors files: one file, or Hugging Face style shards with an index.

Every file is written under a temporary name in its own directory and renamed into place
only when all of them are written (the index last), so a failed save leaves nothing that
looks like a finished checkpoint. Quantized parameters are saved as their parts, 4-bit
tensors packed two per byte, with their layout in the header (see `_quantized`).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .. import _tree
from . import _quantized as qz

_SUFFIX = ".safetensors"
_RESERVED = ("format", "taktiny_version", qz.PACKED, qz.QUANTIZED)
# numpy dtype names safetensors stores (its own names: F32, BF16, F8_E4M3, ...)
_STORED = frozenset(
    "bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 float32 float64 "
    "bfloat16 float8_e4m3fn float8_e5m2 complex64".split()
)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def save_safetensors(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Saves a model, any PyTree of arrays, or a flat ``{name: array}`` mapping as
    safetensors.

    `path` names the file, ending in ``.safetensors``. When everything fits in one shard
    (always, without `max_shard_size`) that one file is written. Otherwise the tensors are
    split, in order, into shards next to it named as Hugging Face names them (for
    ``out/model.safetensors``: ``out/model-00001-of-00003.safetensors``, ...) and the index
    ``out/model.safetensors.index.json`` (``{"metadata": {"total_size": bytes},
    "weight_map": {name: shard file}}``) says which shard holds each tensor. A tensor larger
    than `max_shard_size` gets a shard of its own.

    A quantized parameter (a :class:`~taktiny.QArray`) is saved as its two parts,
    ``<name>.value`` (int8 as it is) and ``<name>.scale``, and its layout (bits, axis,
    group size, shape) is recorded in every file's header metadata under
    ``"taktiny_quantized"``. Safetensors has no 4-bit dtype: a 4-bit tensor (``int4``
    values, or any ``int4``, ``uint4`` or ``float4_e2m1fn`` array) is stored as uint8 of
    shape ``[..., ceil(n / 2)]``, packed two per byte along its last axis, low nibble
    first, and listed with its dtype and shape under ``"taktiny_packed"`` in its file's
    header. :func:`open_safetensors` and :func:`load_safetensors` unpack it.

    Args:
        path: the ``.safetensors`` file to write (its directory must exist).
        tree: a module or a container of arrays, saved under the names
            :func:`taktiny.flat_state_dict` gives; or a dict of string names to arrays
            (values that are all arrays), saved under its own keys.
        max_shard_size: the most bytes of tensor data per shard: an int, or a string such as
            ``"500MB"`` or ``"2GiB"``.
        metadata: strings to add to each file's header, besides ``"format": "taktiny"`` and
            ``"taktiny_version"``.

    Returns:
        The files written: the shards, then the index; or the one file.

    Raises:
        TypeError: a name or metadata entry that is not a string, or a tensor whose dtype
            safetensors cannot store (PRNG keys, say), named in the message.
        ValueError: a path not ending in ``.safetensors``, a bad `max_shard_size`, an
            array spread over several processes.
    """
    try:
        import safetensors.numpy  # imported here: it is an extra, and only saving needs it
    except ImportError:  # pragma: no cover - installed wherever the tests run
        raise ImportError(
            "taktiny.io.save_safetensors needs the safetensors package: "
            "pip install 'taktiny[safetensors]'."
        ) from None

    from .. import __version__

    target = Path(path)
    if target.name == _SUFFIX or not target.name.endswith(_SUFFIX):
        raise ValueError(f"save_safetensors: the path must name a '*.safetensors' file: {path}")
    header = {"format": "taktiny", "taktiny_version": __version__, **_metadata(metadata)}
    flat = _flat(tree)
    layouts = (
        {} if flat is tree else {n: qz.layout(q) for n, q in qz.quantized_arrays(tree).items()}
    )
    if layouts:
        header[qz.QUANTIZED] = json.dumps(layouts)
    tensors: dict[str, np.ndarray] = {}
    packed: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        array = _host(name, value)
        if array.dtype.name in qz.FOUR_BIT:
            packed[name] = {"dtype": array.dtype.name, "shape": list(array.shape)}
            array = qz.pack(array)
        tensors[name] = array
    shards = _split(tensors, _size(max_shard_size))
    stem = target.name[: -len(_SUFFIX)]
    if len(shards) == 1:
        names = [target.name]
    else:
        names = [f"{stem}-{i:05d}-of-{len(shards):05d}{_SUFFIX}" for i in range(1, len(shards) + 1)]
    done: list[Path] = []
    temps: list[Path] = []
    try:
        for name, shard in zip(names, shards, strict=True):
            temp = _temp(target.parent / name)
            temps.append(temp)
            records = {n: packed[n] for n in shard if n in packed}
            own = {**header, qz.PACKED: json.dumps(records)} if records else header
            try:
                safetensors.numpy.save_file(shard, temp, metadata=own)
            except Exception as error:
                raise OSError(
                    f"save_safetensors: writing {target.parent / name}: {error}"
                ) from error
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                "weight_map": {
                    k: name for name, shard in zip(names, shards, strict=True) for k in shard
                },
            }
            temp = _temp(target.parent / f"{target.name}.index.json")
            temps.append(temp)
            temp.write_text(json.dumps(index, indent=2) + "\n")
            names.append(f"{target.name}.index.json")
        # an index of an earlier save would name the shards as they are replaced one by one
        # (and a single file as it shadows it): it goes before any file is renamed
        (target.parent / f"{target.name}.index.json").unlink(missing_ok=True)
        for temp, name in zip(temps, names, strict=True):  # the index, if any, last
            os.replace(temp, target.parent / name)
            done.append(target.parent / name)
    except BaseException:
        for leftover in temps[len(done) :] + done:
            leftover.unlink(missing_ok=True)
        raise
    return done


def _metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The user's header entries, checked: string keys and values, no reserved key."""
    if metadata is None:
        return {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"save_safetensors: metadata must map strings to strings (a safetensors "
                f"header holds only text), got {key!r}: {value!r}; convert it with str() "
                f"or json.dumps()"
            )
        if key in _RESERVED:
            raise ValueError(f"save_safetensors: metadata key {key!r} is Taktiny's own; rename it")
    return dict(metadata)


def _flat(tree: Any) -> Mapping[str, Any]:
    """Names and values: a mapping whose values are all leaves keeps its own keys (and is
    returned as it is)."""
    if isinstance(tree, Mapping) and all(
        jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(v)) and v is not None
        for v in tree.values()
    ):
        for key in tree:
            if not isinstance(key, str):
                raise TypeError(f"save_safetensors: tensor names must be strings, got {key!r}")
        return tree
    return _tree.flat_state_dict(tree)


def _host(name: str, value: Any) -> np.ndarray:
    """`value` as a contiguous host array that safetensors can store."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"save_safetensors: {name!r} is an array of PRNG keys, which safetensors cannot "
            f"store; save jax.random.key_data() of it instead"
        )
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        raise ValueError(
            f"save_safetensors: {name!r} is spread over several processes and this process "
            f"holds only part of it; gather it first (for example with "
            f"jax.experimental.multihost_utils.process_allgather), or save from each process"
        )
    array = np.asarray(value, order="C")  # (np.ascontiguousarray makes a 0-d array 1-d)
    if array.dtype.name not in _STORED and array.dtype.name not in qz.FOUR_BIT:
        raise TypeError(
            f"save_safetensors: {name!r} has dtype {array.dtype.name}, which safetensors cannot "
            f"store; it stores {', '.join(sorted(_STORED))}, and {', '.join(qz.FOUR_BIT)} "
            f"packed two per byte"
        )
    return array


def _size(max_shard_size: int | str | None) -> int | None:
    """`max_shard_size` in bytes."""
    if max_shard_size is None or isinstance(max_shard_size, int):
        size = max_shard_size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", max_shard_size)
        unit = match and _UNITS.get(match.group(2).upper())
        if not match or unit is None:
            raise ValueError(
                f"save_safetensors: max_shard_size {max_shard_size!r} is not a size such as "
                f"'500MB', '2GiB' or a number of bytes"
            )
        size = int(float(match.group(1)) * unit)
    if size is not None and size <= 0:
        raise ValueError(
            f"save_safetensors: max_shard_size must be positive, got {max_shard_size!r}"
        )
    return size


def _split(tensors: dict[str, np.ndarray], limit: int | None) -> list[dict[str, np.ndarray]]:
    """The tensors in order, in shards of at most `limit` bytes (a larger tensor alone)."""
    shards: list[dict[str, np.ndarray]] = [{}]
    used = 0
    for name, array in tensors.items():
        if limit is not None and shards[-1] and used + array.nbytes > limit:
            shards.append({})
            used = 0
        shards[-1][name] = array
        used += array.nbytes
    return shards


def _temp(final: Path) -> Path:
    """A temporary name next to `final`, which no finished file has."""
    return final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.tmp")
