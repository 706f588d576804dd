"""Opening a safetensors checkpoint: a file, a Hugging Face index of shards, or a folder
holding one of them. Opening reads and checks the headers only; the `Checkpoint` maps each
name to a `Tensor` read on demand."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from . import _quantized as qz
from ._header import _header, _unique
from ._read import SafetensorsError, Tensor


class Checkpoint(Mapping[str, Tensor]):
    """A safetensors checkpoint, opened: a read-only mapping from tensor names to
    :class:`Tensor` handles, in the order of their bytes on disk (file by file). Made by
    :func:`open_safetensors`; ``metadata`` holds the header metadata of the first file
    (``{"format": "pt"}``, Taktiny's version, user metadata). ``quantized`` holds the
    layout of each quantized parameter saved from a :class:`~taktiny.QArray`, by name (its
    parts are the tensors ``<name>.value`` and ``<name>.scale``): ``{"bits": 4, "axis": 0,
    "group_size": 64, "shape": [512, 2048]}``, checked against those tensors."""

    def __init__(
        self,
        path: Path,
        tensors: dict[str, Tensor],
        metadata: dict[str, str],
        quantized: dict[str, dict[str, Any]] | None = None,
    ):
        self.path, self.metadata = path, metadata
        self.quantized = quantized or {}
        self._tensors = tensors

    def __getitem__(self, name: str) -> Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        """The bytes of all its tensors."""
        return sum(t.nbytes for t in self._tensors.values())

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self)} tensors, {self.nbytes:,} bytes)"


def open_safetensors(path: str | os.PathLike[str]) -> Checkpoint:
    """Opens a safetensors checkpoint, reading and checking its headers only.

    Args:
        path: a ``.safetensors`` file; a Hugging Face index (``*.safetensors.index.json``,
            whose ``weight_map`` names each tensor's shard); or a folder holding one index,
            or exactly one ``.safetensors`` file.

    Returns:
        A :class:`Checkpoint`: ``{name: Tensor}``, read tensor by tensor on demand.

    Raises:
        SafetensorsError: naming the file and tensor, for a truncated or corrupt file, a
            header whose shapes disagree with their bytes or whose ranges overlap or run
            past the file, a dtype safetensors does not define, an index naming a missing
            shard, the same shard twice or a shard outside its folder, or a tensor the
            index and its shard disagree on.
    """
    path = Path(path)
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        files = sorted(path.glob("*.safetensors"))
        if len(indexes) > 1 or (not indexes and len(files) != 1):
            raise SafetensorsError(
                f"{path}: a folder holding exactly one *.safetensors.index.json, or one "
                f"*.safetensors file and no index, was expected; it has {len(indexes)} "
                f"indexes and {len(files)} files. Name the file or index to read."
            )
        path = indexes[0] if indexes else files[0]
    if not path.is_file():
        raise SafetensorsError(f"{path}: no such file.")
    if path.name.endswith(".json"):
        return _open_index(path)
    tensors, metadata = _header(path)
    return Checkpoint(path, tensors, metadata, _layouts(path, [(path, metadata)], tensors))


def _layouts(
    where: Path, metadata: list[tuple[Path, dict[str, str]]], tensors: Mapping[str, Tensor]
) -> dict[str, dict[str, Any]]:
    """The quantized layouts the files record (every file records them all), each checked
    against its parts."""
    out: dict[str, dict[str, Any]] = {}
    for file, meta in metadata:
        if qz.QUANTIZED in meta:
            try:
                out.update(qz.quantized_record(qz.QUANTIZED, meta[qz.QUANTIZED]))
            except ValueError as error:
                raise SafetensorsError(f"{file}: {error}; the header is corrupt.") from None
    for name, record in out.items():
        problem = qz.check_quantized(name, record, tensors)
        if problem:
            raise SafetensorsError(
                f"{where}: the metadata {qz.QUANTIZED!r} records {name!r} as quantized "
                f"{qz.describe(record['bits'], record['axis'], record['group_size'])} of shape "
                f"{record['shape']}, but {problem}. The checkpoint is inconsistent; write it "
                f"again with taktiny.io.save_safetensors."
            )
    return out


def _open_index(index: Path) -> Checkpoint:
    try:
        weight_map = json.loads(index.read_bytes(), object_pairs_hook=_unique)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError) as error:
        raise SafetensorsError(
            f"{index}: not a safetensors index ({error or 'no weight_map'}); an index is JSON "
            f'with "weight_map": {{tensor name: shard file}}.'
        ) from None
    folder = index.parent.resolve()
    shards: dict[Path, str] = {}
    for name, shard in weight_map.items():
        file = (folder / str(shard)).resolve()
        if not isinstance(shard, str) or folder not in file.parents:
            raise SafetensorsError(
                f"{index}: the shard {shard!r} of {name!r} is outside the index's folder "
                f"{folder}; an index may name only files beside it."
            )
        if shards.setdefault(file, shard) != shard:
            raise SafetensorsError(
                f"{index}: names one shard twice, as {shards[file]!r} and {shard!r}; give "
                f"each shard one name."
            )
        if not file.is_file():
            raise SafetensorsError(f"{index}: the shard {shard!r} (of {name!r}) is missing.")
    tensors: dict[str, Tensor] = {}
    metas: list[tuple[Path, dict[str, str]]] = []
    for file, shard in sorted(shards.items(), key=lambda item: item[1]):
        found, meta = _header(file)
        metas.append((file, meta))
        for name, tensor in found.items():
            listed = weight_map.get(name)
            if listed is None or (folder / listed).resolve() != file:
                where = "does not list it" if listed is None else f"puts it in {listed!r}"
                raise SafetensorsError(
                    f"{index}: the shard {shard!r} holds {name!r}, but the index {where}; "
                    f"the index and its shards disagree. Write the checkpoint again."
                )
            tensors[name] = tensor
    lacking = [name for name in weight_map if name not in tensors]
    if lacking:
        raise SafetensorsError(
            f"{index}: the index lists {lacking[:5]} in shards that do not hold them."
        )
    metadata = metas[0][1] if metas else {}
    return Checkpoint(index, tensors, metadata, _layouts(index, metas, tensors))
