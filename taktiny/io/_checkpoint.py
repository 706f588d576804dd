"""Opening a safetensors checkpoint: a file, a Hugging Face index of shards, or a folder
holding one of them. Opening reads and checks the headers only; the `Checkpoint` maps each
name to a `Tensor` read on demand."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._messages import layout_text, short
from ..quant import QUANTIZED, check_quantized, quantized_record
from ._errors import SafetensorsError
from ._header import HEADER_LIMIT, parse_json, read_header, unpaired_surrogate
from ._object_store import NoSuchBucket, Replaced, Url, listed, locate
from ._read import Tensor
from ._storage import Storage, open_storage, read_range

if TYPE_CHECKING:
    from ..state import Schema


class Checkpoint(Mapping[str, Tensor]):
    """A safetensors checkpoint, opened: a read-only mapping from tensor names to
    :class:`Tensor` handles, in the order of their bytes on disk (file by file).

    Made by :func:`open_safetensors`, which checks what it is built from. It holds its
    files open (one descriptor each) until it and all its tensors are dropped: reads give
    the bytes the files had when it was opened, whatever saves did to their paths since
    (in object storage, through one save: after a second, reads raise an error saying
    the checkpoint was replaced; docs/storage.md).

    Args:
        path: the file or index the checkpoint was opened from.
        tensors: ``{name: Tensor}``, in the order of their bytes on disk.
        metadata: the header metadata of the first file.
        quantized: the layout of each quantized parameter, by name; None for none.

    Attributes:
        path: the file or index the checkpoint was opened from.
        metadata: the header metadata of the first file (``{"format": "pt"}``,
            Taktiny's version, user metadata).
        schema: the schema saved with it, or None (see the property).
        quantized: the layout of each quantized parameter saved from a
            :class:`~taktiny.QArray`, by name (its parts are the tensors
            ``<name>.value`` and ``<name>.scale``): ``{"bits": 4, "axis": 0,
            "group_size": 64, "shape": [512, 2048]}``, checked against those tensors.
    """

    def __init__(
        self,
        path: Path | Url,
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

    @property
    def schema(self) -> Schema | None:
        """The :func:`~taktiny.schema` of the tree this checkpoint was saved from, as
        :func:`save_safetensors` records it in the header metadata (``"taktiny_schema"``):
        its names with their shapes, dtypes, shardings and quantization, and its
        fingerprint. None for a file written by another program.

        Raises:
            SafetensorsError: the recorded schema is malformed, or its fingerprint is not
                its entries' (it was edited), naming the file.
        """
        from ..state import Schema

        return schema_part(self, Schema.from_json)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self)} tensors, {self.nbytes:,} bytes)"


def schema_part(checkpoint: Checkpoint, read: Callable[[str], Any]) -> Any:
    """`read` (:meth:`taktiny.Schema.from_json`, or `recorded_versions` for the
    versions alone) of the schema the checkpoint's header records; None without one.
    Raises SafetensorsError naming the file for one Taktiny did not write."""
    from ..state import KEY

    text = checkpoint.metadata.get(KEY)
    if text is None:
        return None
    try:
        return read(text)
    except ValueError as error:
        raise SafetensorsError(
            f"{checkpoint.path}: the header metadata {KEY!r} is not a schema Taktiny "
            f"wrote: {error}. Save the checkpoint again, or ignore its schema."
        ) from None


def open_safetensors(path: str | os.PathLike[str]) -> Checkpoint:
    """Opens a safetensors checkpoint, reading and checking its headers only.

    Each file is held open from when its header is read, and the tensors read through it:
    a save over `path` (:func:`save_safetensors`) at any moment leaves the checkpoint
    opened whole, bitwise the one before the save or the one after. The shards of an index
    are those of one save: when a save replaces the index (or removes a shard) while they
    are opened, `path` is opened again. docs/safetensors.md gives the limits.

    Args:
        path: a ``.safetensors`` file; a Hugging Face index (``*.safetensors.index.json``,
            whose ``weight_map`` names each tensor's shard); the path a sharded checkpoint
            was saved to (``out/model.safetensors``, when only its index
            ``out/model.safetensors.index.json`` exists); or a folder holding one
            checkpoint: one index, one ``.safetensors`` file, or both (a file and an index
            of the same name: the file is read, as Hugging Face's loaders read it). Shard
            files (``*-00001-of-00003.safetensors``) and the hidden temporaries of a killed
            save are not checkpoints of their own: name a lone shard to read it. Or the
            same in object storage: an ``s3://``, ``gs://``, ``az://`` or ``https://`` URL
            (a prefix, with or without its final ``/``, for a folder; docs/storage.md),
            whose objects are then read by their ETags: through one save over them (from
            the copies it keeps), and once a second save has committed, its reads raise.

    Returns:
        A :class:`Checkpoint`: ``{name: Tensor}``, read tensor by tensor on demand.

    Raises:
        SafetensorsError: naming the file and tensor, for a truncated or corrupt file, a
            header whose shapes disagree with their bytes or whose ranges overlap or run
            past the file, a dtype safetensors does not define, an index naming a missing
            shard, the same shard twice or a shard outside its folder, or a tensor the
            index and its shard disagree on; a checkpoint that saves replaced 20 times in
            a row while it was being opened.
    """
    given = locate(path)
    for _ in range(RETRIES):
        found = _resolve(given)
        try:
            if found.name.endswith(".json"):
                return _open_index(found)
            tensors, metadata = read_header(found)
        except (FileNotFoundError, _Replaced, Replaced):  # a save replaced it: open what it saved
            continue
        return Checkpoint(found, tensors, metadata, _layouts(found, [(found, metadata)], tensors))
    raise SafetensorsError(
        f"{given}: the checkpoint was replaced {RETRIES} times while it was being opened (a "
        f"save over it after another, each done before its headers were read); open it "
        f"again, or once the saves pause."
    )


RETRIES = 20  # openings of a checkpoint that saves keep replacing before one gives up


class _Replaced(Exception):
    """The index being opened was replaced by a save: open the path again."""


# a shard's file name, Hugging Face's or with a save's own suffix (see `_save`): its stem
SHARD = re.compile(r"(.+)-\d{5}-of-\d{5}(?:-[0-9a-f]{8})?\.safetensors")
_INDEX = ".index.json"


def _resolve(path: Path | Url) -> Path | Url:
    """The file to read for `path`: the file itself; for the path of a sharded save, its
    index; for a folder, its one checkpoint (see :func:`open_safetensors`)."""
    if isinstance(path, Url):
        return _find_object(path)
    try:
        return _find(path)
    except (OSError, ValueError) as error:  # a name too long, a NUL byte, a loop of links
        if isinstance(error, SafetensorsError):
            raise
        shown = (
            str(path)
            if len(str(path)) <= 200
            else f"{str(path)[:100]}...({len(str(path))} characters)"
        )
        raise SafetensorsError(
            f"{shown!r}: cannot be opened ({type(error).__name__}: {str(error)[:200]}); name an "
            f"existing .safetensors file, index or folder."
        ) from None


def _find(path: Path) -> Path:
    if path.is_dir():
        files = [p for p in path.iterdir() if not p.name.startswith(".")]
        singles = {p.name for p in files if p.name.endswith(".safetensors")}
        stems = {p.name[: -len(_INDEX)] for p in files if p.name.endswith(f".safetensors{_INDEX}")}
        stems |= {name for name in singles if not SHARD.fullmatch(name)}
        if len(stems) == 1:
            (stem,) = stems
            single = path / stem
            return single if single.is_file() else path / f"{stem}{_INDEX}"
        raise SafetensorsError(
            f"{path}: a folder holding one checkpoint (one *.safetensors.index.json, one "
            f"*.safetensors file, or a file and an index of the same name) was expected; it "
            f"holds {len(stems)}: {sorted(stems)[:5]}. Name the file or index to read."
        )
    if path.name.endswith(".safetensors"):
        index = path.with_name(f"{path.name}{_INDEX}")
        for _ in range(RETRIES):  # (saves switching between the two: one is there each instant)
            if path.is_file():
                return path
            if index.is_file():
                return index  # the path a sharded checkpoint was saved to
    if not path.is_file():
        raise SafetensorsError(
            f"{str(path)!r}: no such file." if "\0" in str(path) else f"{path}: no such file."
        )
    return path


def _find_object(url: Url) -> Url:
    """`_find` for a URL: the object, the index of a sharded save, or a prefix's one
    checkpoint (a URL ending in ``/``, or naming a prefix without its ``/``, as a local
    folder may be named without one)."""
    try:
        if url.folder:
            return _in_prefix(url, listed(url))
        candidates = [url]
        if url.name.endswith(".safetensors"):
            candidates.append(url.with_name(f"{url.name}{_INDEX}"))
        for _ in range(RETRIES):
            for candidate in candidates:
                try:
                    open_storage(candidate)
                except NoSuchBucket:
                    raise
                except FileNotFoundError:
                    continue
                return candidate
            # neither was there when asked: one listing sees the folder at one instant
            around = listed(url.parent)
            if not {m["path"].rsplit("/", 1)[-1] for m in around["objects"]} & {
                c.name for c in candidates
            }:
                break  # (else a save switched between one object and shards meanwhile)
        else:
            raise SafetensorsError(
                f"{url}: saves kept switching it between one object and shards while it was "
                f"being opened ({RETRIES} times); open it again once the saves pause."
            )
        if url.key in around["common_prefixes"]:  # a prefix named without its slash
            prefix = Url(f"{url}/")
            return _in_prefix(prefix, listed(prefix))
    except NoSuchBucket as error:
        raise SafetensorsError(str(error)) from None
    raise SafetensorsError(f"{url}: no such object.")


def _in_prefix(url: Url, found: Any) -> Url:
    """The one checkpoint directly under the prefix `url`, whose listing is `found`."""
    names = {m["path"].rsplit("/", 1)[-1] for m in found["objects"]}
    files = [n for n in names if not n.startswith(".")]
    singles = {n for n in files if n.endswith(".safetensors") and not SHARD.fullmatch(n)}
    stems = singles | {n[: -len(_INDEX)] for n in files if n.endswith(f".safetensors{_INDEX}")}
    if len(stems) != 1:
        raise SafetensorsError(
            f"{url}: a prefix holding one checkpoint (one *.safetensors.index.json, one "
            f"*.safetensors object, or both of one name) was expected; it holds "
            f"{len(stems)}: {sorted(stems)[:5]}. Name the object or index to read."
        )
    (stem,) = stems
    return url / stem if stem in singles else url / f"{stem}{_INDEX}"


def _layouts(
    where: Path | Url,
    metadata: list[tuple[Path | Url, dict[str, str]]],
    tensors: Mapping[str, Tensor],
) -> dict[str, dict[str, Any]]:
    """The quantized layouts the files record (every file records them all), each checked
    against its parts."""
    out: dict[str, dict[str, Any]] = {}
    for file, meta in metadata:
        if QUANTIZED in meta:
            try:
                out.update(quantized_record(QUANTIZED, meta[QUANTIZED]))
            except ValueError as error:
                raise SafetensorsError(f"{file}: {error}; the header is corrupt.") from None
    for name, record in out.items():
        problem = check_quantized(name, record, tensors)
        if problem:
            raise SafetensorsError(
                f"{where}: the metadata {QUANTIZED!r} records {name!r} as quantized "
                f"{layout_text(record['bits'], record['axis'], record['group_size'])} of shape "
                f"{record['shape']}, but {problem}. The checkpoint is inconsistent; write it "
                f"again with taktiny.io.save_safetensors."
            )
    return out


def _open_index(index: Path | Url) -> Checkpoint:
    """The checkpoint an index names, its shards opened while the index is the file that
    was read. Raises `_Replaced` when a save renamed another index over it or removed it
    meanwhile (the shards opened, or found missing, may be another save's: a problem is
    the index's only while it stays), FileNotFoundError when it is gone already."""
    held = open_storage(index)  # (held open: its inode cannot become another file's meanwhile)
    try:
        try:
            checkpoint = _open_shards(index, held)
        except SafetensorsError:
            if held.replaced():
                raise _Replaced from None
            raise
        if held.replaced():
            raise _Replaced
        return checkpoint
    finally:
        held.close()


def _open_shards(index: Path | Url, held: Storage) -> Checkpoint:
    weight_map = read_weight_map(index, held)
    folder = index.parent if isinstance(index, Url) else index.parent.resolve()
    files: dict[str, Path | Url] = {}  # each shard's name, as the index gives it, and its file
    shards: dict[Path | Url, str] = {}
    for name, shard in weight_map.items():
        if shard in files:
            continue
        file = files[shard] = _shard(index, folder, name, shard)
        if shards.setdefault(file, shard) != shard:
            raise SafetensorsError(
                f"{index}: names one shard twice, as {shards[file]!r} and {shard!r}; give "
                f"each shard one name."
            )
    tensors: dict[str, Tensor] = {}
    metas: list[tuple[Path | Url, dict[str, str]]] = []
    for file, shard in sorted(shards.items(), key=lambda item: item[1]):
        try:
            found, meta = read_header(file)
        except FileNotFoundError:  # (removed since `_shard` found it; an object: not found)
            first = next(n for n, s in weight_map.items() if s == shard)
            raise SafetensorsError(
                f"{index}: the shard {short(shard)} (of {first!r}) is missing."
            ) from None
        metas.append((file, meta))
        for name, tensor in found.items():
            listed = weight_map.get(name)
            if listed is None or files[listed] != file:
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


def read_weight_map(index: Path | Url, held: Storage | None = None) -> dict[str, str]:
    """The index's ``weight_map``, checked: JSON of no more bytes than a header may have,
    a ``weight_map`` of names to strings, and ``metadata`` (when given) an object. Read
    through `held` (the index, opened), or the file opened here."""
    held = open_storage(index) if held is None else held
    size = held.size
    try:
        if size > HEADER_LIMIT:
            raise ValueError(f"{size} bytes, more than the {HEADER_LIMIT} a header may have")
        content = parse_json(read_range(held, 0, size), "its JSON")
        if type(content) is not dict:
            raise ValueError(f"a JSON {type(content).__name__}, not an object")
        if "weight_map" not in content:
            raise ValueError("no weight_map")
        weight_map, metadata = content["weight_map"], content.get("metadata")
        if type(weight_map) is not dict:
            raise ValueError(f"the weight_map is {short(weight_map)}, not an object")
        if metadata is not None and type(metadata) is not dict:
            raise ValueError(f"the metadata is {short(metadata)}, not an object")
    except ValueError as error:
        raise SafetensorsError(
            f"{index}: not a safetensors index ({error}); an index is JSON with "
            f'"weight_map": {{tensor name: shard file}}.'
        ) from None
    for name, shard in weight_map.items():
        if type(shard) is not str:
            raise SafetensorsError(
                f"{index}: the weight_map gives {name!r} the shard {short(shard)}, which is no "
                f"file name; it maps each tensor name to the file beside the index holding it."
            )
    if (unpaired := unpaired_surrogate([*weight_map, *weight_map.values()])) is not None:
        raise SafetensorsError(
            f"{index}: the weight_map holds the string {unpaired!r}, which has a lone surrogate "
            f"(a \\u escape of half a UTF-16 pair): it is no Unicode text."
        )
    return weight_map


def _shard(index: Path | Url, folder: Path | Url, name: str, shard: str) -> Path | Url:
    """The file of the shard `shard` (the first tensor it holds: `name`), resolved and
    checked to be a file inside `folder`, before anything opens it (an object: a name
    with no ``/``, checked to exist as it is opened)."""
    if not shard or "\x00" in shard:
        raise SafetensorsError(
            f"{index}: the weight_map gives {name!r} the shard {shard!r}, which is no file "
            f"name; it maps each tensor name to the file beside the index holding it."
        )
    if isinstance(folder, Url):
        if "/" in shard or "\\" in shard or shard in (".", ".."):
            raise SafetensorsError(
                f"{index}: the shard {short(shard)} of {name!r} is outside the index's folder "
                f"{folder}; an index may name only objects beside it."
            )
        return folder / shard
    try:
        file = (folder / shard).resolve()
    except (OSError, RuntimeError) as error:  # a symlink loop is a RuntimeError
        raise SafetensorsError(
            f"{index}: the shard {short(shard)} of {name!r} cannot be resolved ({error}); an "
            f"index may name only files beside it."
        ) from None
    if folder not in file.parents:
        raise SafetensorsError(
            f"{index}: the shard {short(shard)} of {name!r} is outside the index's folder "
            f"{folder}; an index may name only files beside it."
        )
    try:
        present = file.is_file()
    except OSError as error:  # a name too long for the file system, say
        raise SafetensorsError(
            f"{index}: the shard {short(shard)} of {name!r} cannot be opened ({error}); an "
            f"index may name only files beside it."
        ) from None
    if not present:
        raise SafetensorsError(f"{index}: the shard {short(shard)} (of {name!r}) is missing.")
    return file
