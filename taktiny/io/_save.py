"""Writing safetensors files: one file, or Hugging Face style shards with an index, each
with a checksum of every tensor's bytes in its header (see `_checksum`).

A save over an existing checkpoint commits in one atomic step (`_Commit`), so that at every
instant the path holds the previous checkpoint or the new one, whole. Quantized parameters
are saved as their parts, 4-bit tensors packed two per byte, with their layout in the
header (see `quant/_format.py`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, overload

import jax
import numpy as np

from .._version import __version__
from ..quant import FOUR_BIT, PACKED, QUANTIZED, Parameter, pack
from ..state import KEY, Schema, flatten, is_flat, leaf_entry, params, schema_of
from . import _background, _checksum
from ._background import BackgroundSave, Commit, Files, T
from ._checkpoint import SHARD, read_weight_map
from ._errors import SafetensorsError
from ._object_commit import ObjectCommit
from ._object_store import MissingExtra, Url, locate
from ._write import layout, write_error, write_sealed

_SUFFIX = ".safetensors"
_RESERVED = (
    "format",
    "taktiny_version",
    PACKED,
    QUANTIZED,
    _checksum.KEY,
    _checksum.TILES_KEY,
    _checksum.HEADER_KEY,
    KEY,
)
# numpy dtype names safetensors stores (its own names: F32, BF16, F8_E4M3, ...)
_STORED = frozenset(
    "bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 float32 float64 "
    "bfloat16 float8_e4m3fn float8_e5m2 complex64".split()
)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@overload
def save_safetensors(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    wait: Literal[True] = True,
) -> list[Path] | list[Url]: ...


@overload
def save_safetensors(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    wait: Literal[False],
) -> BackgroundSave[Path] | BackgroundSave[Url]: ...


@overload
def save_safetensors(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    wait: bool = True,
) -> list[Path] | list[Url] | BackgroundSave[Path] | BackgroundSave[Url]: ...


def save_safetensors(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    wait: bool = True,
) -> list[Path] | list[Url] | BackgroundSave[Path] | BackgroundSave[Url]:
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
        path: the ``.safetensors`` file to write (its directory must exist), or an
            object-store URL (``s3://bucket/run/model.safetensors``; ``gs://``, ``az://``;
            the ``taktiny[cloud]`` extra), committed without rename as docs/storage.md
            describes.
        tree: a module or a container of arrays, saved under the names
            :func:`taktiny.flat_state_dict` gives; or a dict of string names to arrays
            (values that are all arrays), saved under its own keys.
        max_shard_size: the most bytes of tensor data per shard: an int, or a string such as
            ``"500MB"`` or ``"2GiB"``.
        metadata: strings to add to each file's header, besides ``"format": "taktiny"``,
            ``"taktiny_version"`` and the tree's :func:`~taktiny.schema`
            (``"taktiny_schema"``, which ``open_safetensors(path).schema`` reads).
        wait: True (the default) returns once the checkpoint is saved. False returns as
            soon as the arrays' bytes are copied to host memory (copies the save owns:
            the model's buffers may be donated or overwritten at once), with a
            :class:`BackgroundSave`; a thread of the save's own then computes the
            checksums, writes the files and commits them, with the same guarantees. What
            can be checked before (the path, its folder, the names, dtypes, metadata and
            `max_shard_size`) is still raised by this call.

    Each file's header also records a checksum (XXH3-128) of every tensor's bytes, which
    every read verifies, and for each tensor of 128 KiB or more the checksums of its tiles
    (up to 8 equal parts of an axis), so that a read of part of it checks only the tiles it
    reads. A save over an existing checkpoint is all or nothing: whenever it
    is stopped, `path` holds exactly the previous checkpoint or exactly the new one; once
    this returns, the new one is on disk (files and directory flushed). Shards take names
    that the checkpoint being replaced does not use (Hugging Face's, or those with a suffix
    of the save's own), and the files of the previous checkpoint, or of a killed save, are
    removed. docs/safetensors.md describes the steps.

    Saves to one path take turns: a save (waiting or not) to a path that a save of this
    process is still writing waits for that one to end. A background save's error is
    never lost: :meth:`BackgroundSave.result` raises it; if nobody has called it when the
    next save to the same path begins, that save raises it (and does not start); if
    nobody ever does, the interpreter's exit waits for the save, writes its error to stderr
    and exits with status 1.

    Returns:
        With `wait` True: the files written (the shards, then the index; or the one
        file; for a URL, the objects, whose ``str()`` is their URL). With `wait` False: a
        :class:`BackgroundSave`, whose :meth:`~BackgroundSave.result` gives those files
        once the save has ended.

    Raises:
        TypeError: a name or metadata entry that is not a string, or a tensor whose dtype
            safetensors cannot store (PRNG keys, say), named in the message.
        ValueError: a path not ending in ``.safetensors``, a URL of a scheme Taktiny does
            not write, a bad `max_shard_size`, an array spread over several processes.
        FileNotFoundError: the folder `path` names does not exist.
        OSError: a file operation that failed (the previous checkpoint is left as it was);
            a failed write names the file (``filename``) and keeps the system's ``errno``
            (``errno.ENOSPC`` for a full disk), its error chained as the cause.
        PermissionError: for a URL, a request the store refused, naming the URL and the
            credentials to check (the previous checkpoint is left as it was).
        ConnectionError: for a URL, a store that kept failing after the retries.
        ImportError: the safetensors package is not installed
            (``pip install 'taktiny[safetensors]'``, or for a URL ``taktiny[cloud]``, which
            brings it too); for a URL, obstore is not (``pip install 'taktiny[cloud]'``);
            both named by the message, before anything is done.
        BaseException: the error of an earlier background save to `path` whose
            :meth:`~BackgroundSave.result` nobody called (an ``OSError`` for a full disk,
            say), as it was raised, with a note naming that save; this save did not start.

    With `wait` False, the errors of the writes and the commit (the ``OSError`` above) are
    raised by :meth:`BackgroundSave.result` instead.
    """
    target = locate(path)  # (for a URL without obstore: MissingExtra, naming taktiny[cloud])
    _need_safetensors(target)

    if target.name == _SUFFIX or not target.name.endswith(_SUFFIX):
        raise ValueError(f"save_safetensors: the path must name a '*.safetensors' file: {path}")
    if isinstance(target, Path) and not target.parent.is_dir():
        raise FileNotFoundError(
            f"save_safetensors: the folder {target.parent} does not exist; create it first "
            f"(os.makedirs(..., exist_ok=True))"
        )
    _background.settle(target)  # (an earlier background save's error, before this starts)
    header = {"format": "taktiny", "taktiny_version": __version__, **_metadata(metadata)}
    flat, layouts, described = _flat(tree)
    if layouts:
        header[QUANTIZED] = json.dumps(layouts)
    tensors: dict[str, Any] = {}  # (host arrays, and for a save that waits JAX arrays)
    packed: dict[str, dict[str, Any]] = {}
    if not wait:  # (the call waits for every copy below)
        _start_copies(flat.values())
    for name, value in flat.items():
        array = _host(name, value, wait)
        if array.dtype.name in FOUR_BIT:
            packed[name] = {"dtype": array.dtype.name, "shape": list(array.shape)}
            array = pack(np.asarray(array))
        tensors[name] = array
    header[KEY] = described().to_json()  # (after the values' checks: they are named first)
    shards = _split(tensors, byte_size(max_shard_size, "save_safetensors: max_shard_size"))
    if wait:  # (in the order the files are written, each the order of its bytes)
        _start_copies(shard[n] for shard in shards for n in layout(shard))
    files = functools.partial(_files, shards, header, packed)
    if isinstance(target, Url):
        done, said = _committed(target, files, ObjectCommit(target, write_sealed), wait)
    else:
        done, said = _committed(target, files, _Commit(target), wait)
    for message in said:  # (warned here, so that they point at the caller)
        warnings.warn(message, stacklevel=2)
    return done


def _need_safetensors(target: Path | Url) -> None:
    """Raises `MissingExtra` naming the extra that brings the safetensors package (only
    saving needs it) when it is not installed: ``taktiny[cloud]`` for a URL (it brings
    it too), else ``taktiny[safetensors]``."""
    try:
        import safetensors.numpy  # noqa: F401
    except ImportError:
        extra = "taktiny[cloud]" if isinstance(target, Url) else "taktiny[safetensors]"
        raise MissingExtra(
            f"taktiny.io.save_safetensors needs the safetensors package: pip install '{extra}'.",
            name="safetensors",
        ) from None


def _committed(
    target: Path | Url, files: Callable[[], Files], commit: Commit[T], wait: bool
) -> tuple[list[T] | BackgroundSave[T], list[str]]:
    """The save of `files` by `commit`, done here (with the warnings it gave), or started
    in the background (whose warnings its result gives)."""
    if not wait:  # the checksums, the writes and the commit: on the save's own thread
        return _background.start(target, files, commit), []
    with _background.waiting(target):
        written = commit.save(files())
    return written, commit.warnings


def _files(
    shards: list[dict[str, Any]], header: dict[str, str], packed: dict[str, dict[str, Any]]
) -> Files:
    """Each shard with its header metadata: `header` and its packed tensors' records (the
    writer adds the checksums, `_write.write_file`)."""
    files: Files = []
    for shard in shards:
        own = dict(header)
        records = {n: packed[n] for n in shard if n in packed}
        if records:
            own[PACKED] = json.dumps(records)
        files.append((shard, own))
    return files


class _Commit:
    """One save of the checkpoint at `target`, committed in one atomic step.

    What `target` holds is decided as Hugging Face's loaders decide it: the file itself
    when it exists, else its index (``<target>.index.json``) and the shards the index
    names. Every new file is written under a temporary name (``.<name>.<hex>.tmp``),
    flushed with ``fsync``, then renamed to a name no file of the committed checkpoint
    has: the one file renames its temporary over `target`; shards take Hugging Face's
    names (``model-00001-of-00003.safetensors``) when no file has them, or those names
    with a suffix unique to the save (``model-00001-of-00003-1a2b3c4d.safetensors``) while
    the checkpoint being replaced uses them. The directory is flushed, and then one atomic
    step commits the save: the rename of the one file over `target`; for shards, the rename
    of the index over the old one, or, when `target` was one file, that file's removal
    (the new index is in place by then). Only after it are the previous checkpoint's files
    removed.

    Before it writes anything, a save removes what earlier saves to `target` left when
    they were killed: temporaries, shard files that no committed index names, an index
    that a committed single file shadows. Nothing else in the directory is touched.
    """

    def __init__(self, target: Path):
        self.target, self.folder = target, target.parent
        self.index = target.with_name(f"{target.name}.index.json")
        self.stem = target.name[: -len(_SUFFIX)]
        # new files are written into a hidden folder beside `target`, which safetensors'
        # own temporary files go into too, and renamed out of it
        self.staging = self.folder / f".{target.name}.{uuid.uuid4().hex[:12]}.tmp"
        self.created: list[Path] = []  # new files renamed into place, before the commit
        self.shards: list[str] = []  # the new shards' names
        self.warnings: list[str] = []  # what went wrong after the commit, for the caller

    def save(self, files: Files) -> list[Path]:
        with _locked(self.folder):  # one save at a time in a folder, from any process
            return self._save(files)

    def _save(self, files: Files) -> list[Path]:
        old = self._tidy()
        names = self._names(len(files))
        try:
            self.staging.mkdir()
            temps = [self._write(name, *file) for name, file in zip(names, files, strict=True)]
            self._sync(self.staging)
            if len(files) == 1:
                os.replace(temps[0], self.target)  # the commit
                stale = [self.index] if self.index.exists() else []
                return self._finish([self.target], stale + old)
            self.shards = names
            for temp, name in zip(temps, names, strict=True):
                self.created.append(self.folder / name)  # (before: an interrupt may follow it)
                os.replace(temp, self.folder / name)
            weight_map = {k: n for n, (shard, _) in zip(names, files, strict=True) for k in shard}
            total = sum(a.nbytes for shard, _ in files for a in shard.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            text = json.dumps(index, indent=2)
            temp = self.staging / self.index.name
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    data = memoryview((text + "\n").encode())
                    while data:
                        data = data[os.write(fd, data) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as error:
                raise write_error(error, self.index) from error
            self._sync(self.folder)  # the shards' new names, before an index names them
            os.replace(temp, self.index)  # the commit, unless `target` is one file
            if self.target.exists():
                self._sync(self.folder)
                os.unlink(self.target)  # the commit: the one file no longer shadows the index
            written = [self.folder / n for n in names] + [self.index]
            return self._finish(written, old)
        except BaseException:
            self._undo()
            raise

    def _tidy(self) -> list[Path]:
        """Removes what killed saves left behind; returns the files of the committed
        checkpoint (the one file, or the shards its index names)."""
        entries = _entries(self.folder)
        leftovers = [p for p in entries if self._temporary(p.name)]
        entries = [p for p in entries if p.is_symlink() or p.is_file()]
        if self.target.exists():  # the committed checkpoint: an index beside it is stale
            old = [self.target]
            stale = [self.index] if self.index.exists() else []
            leftovers += stale + [p for p in entries if self._shard(p.name)]
        elif self.index.exists():
            named = _weight_map(self.index)
            old = [p for p in entries if named is not None and p.name in named]
            if named is not None:  # (an unreadable index: the shards are left as they are)
                leftovers += [p for p in entries if self._shard(p.name) and p.name not in named]
        else:
            old = []
            leftovers += [p for p in entries if self._shard(p.name)]
        for path in leftovers:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)  # a killed save's staging folder
            else:
                path.unlink(missing_ok=True)
        return old

    def _names(self, count: int) -> list[str]:
        if count == 1:
            return [self.target.name]
        plain = [f"{self.stem}-{i:05d}-of-{count:05d}{_SUFFIX}" for i in range(1, count + 1)]
        if not any((self.folder / n).exists() for n in plain):
            return plain
        token = uuid.uuid4().hex[:8]
        return [f"{n[: -len(_SUFFIX)]}-{token}{_SUFFIX}" for n in plain]

    def _write(self, name: str, shard: dict[str, Any], metadata: dict[str, str]) -> Path:
        temp = self.staging / name
        write_sealed(temp, shard, metadata, self.folder / name)
        # a checkpoint's files are 0o644 less the umask, as the index and torch.save's files
        # are (not 0o666 less it, as open() makes them): the staging folder, made 0o777
        # less the umask, has those bits
        os.chmod(temp, self.staging.stat().st_mode & 0o644)
        _fsync(temp)
        return temp

    def _finish(self, written: list[Path], old: list[Path]) -> list[Path]:
        """After the commit: flushes it, then removes the previous checkpoint's files. A
        failure here leaves the new checkpoint in place and is a warning: what is left,
        the next save removes."""
        try:
            self._sync(self.folder)
        except OSError as error:
            self._warn(
                f"flushing its directory to disk failed ({error}): it may not survive a power loss"
            )
        try:
            shutil.rmtree(self.staging)
            for path in old:
                if path not in written:
                    path.unlink(missing_ok=True)
            self._sync(self.folder)
        except OSError as error:
            self._warn(
                f"removing the previous checkpoint's files failed ({error}); the next save "
                f"to it removes them"
            )
        return written

    def _warn(self, what: str) -> None:
        self.warnings.append(f"save_safetensors: {self.target} is saved, but {what}.")

    def _undo(self) -> None:
        """After a failure, unless the commit has happened: removes every new file,
        leaving the previous checkpoint as it was. Whether the commit happened is read from
        the folder, not from a flag set after it, since an interrupt may fall in between."""
        named = _weight_map(self.index) if self.shards else None
        if named is not None and set(self.shards) <= named:  # the new index is in place
            if not self.target.exists():
                return  # committed: the new checkpoint stays, the old files stay behind
            self.created.insert(0, self.index)  # the one file still shadows it
        for path in self.created:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        shutil.rmtree(self.staging, ignore_errors=True)

    def _temporary(self, name: str) -> bool:
        return _TEMPORARY.fullmatch(name) is not None and self._ours(name[1:].rsplit(".", 2)[0])

    def _shard(self, name: str) -> bool:
        return (found := SHARD.fullmatch(name)) is not None and found.group(1) == self.stem

    def _ours(self, final: str) -> bool:
        return final in (self.target.name, self.index.name) or self._shard(final)

    @staticmethod
    def _sync(folder: Path) -> None:
        """Flushes `folder`'s entries (the renames and removals in it) to disk."""
        if os.name == "posix":  # (Windows cannot open a directory)
            _fsync(folder)


_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Holds an exclusive ``flock`` on `folder` itself (no lock file is made): a save that
    started while another was under way in the same folder would take the other's new
    files for a killed save's leftovers. The kernel releases it when a process dies."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Windows
        yield
        return
    with _opening:
        fd = os.open(folder, os.O_RDONLY)
        _held.add(fd)
    try:
        with contextlib.suppress(OSError):  # a filesystem without locks: saves as before
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with _opening:
            _held.discard(fd)
            os.close(fd)  # (closing releases the lock)


# The descriptors this process holds a folder's lock through. A lock belongs to the open
# file, which a forked child shares through its copy of the descriptor: the lock would
# stay held until the child too closed it (a data loader's worker forked while a save
# runs in the background lives on), and the parent's next save in that folder would wait
# for the child to exit. So the child closes its copies at once (closing one copy leaves
# the parent's lock as it is); `_opening` keeps a fork from falling between a descriptor's
# opening and its listing.
_held: set[int] = set()
_opening = threading.Lock()


def _closed_in_child() -> None:
    global _opening
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()
    _opening = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=lambda: _opening.acquire(),
        after_in_parent=lambda: _opening.release(),
        after_in_child=_closed_in_child,
    )


def _fsync(path: Path) -> None:
    """Flushes a file's bytes, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _entries(folder: Path) -> list[Path]:
    """The entries of `folder`."""
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _weight_map(index: Path) -> set[str] | None:
    """The shard files an index names, or None when it is missing or unreadable."""
    try:
        return set(read_weight_map(index).values())
    except (OSError, SafetensorsError):
        return None


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


def _flat(tree: Any) -> tuple[Mapping[str, Any], dict[str, Any], Callable[[], Schema]]:
    """Names and values, the layout of each quantized parameter by name, and what makes
    the schema: a mapping whose values are all leaves keeps its own keys (and is returned
    as it is); any other tree is flattened once, for all three."""
    if is_flat(tree):
        for key in tree:
            if not isinstance(key, str):
                raise TypeError(f"save_safetensors: tensor names must be strings, got {key!r}")
        return tree, {}, lambda: Schema({n: leaf_entry(v) for n, v in tree.items()})
    leaves, _, spec = flatten(tree)
    layouts = {n: q.record() for n, q in params(leaves, spec).items() if isinstance(q, Parameter)}
    flat = dict(zip(spec.names, leaves, strict=True))
    return flat, layouts, functools.partial(schema_of, leaves, spec)


def _start_copies(values: Iterable[Any]) -> None:
    """Starts the copy to host memory of every array in an accelerator's memory, all at
    once and in the order given, before the save waits for the first
    (``jax.Array.copy_to_host_async``): the transfers overlap one another, and a save that
    waits writes the first arrays to arrive while the others come (`_write`)."""
    for value in values:
        if (
            isinstance(value, jax.Array)
            and not value.is_deleted()  # (`_host` raises its error)
            and value.is_fully_addressable
            and _in_device_memory(value)
            and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
        ):
            value.copy_to_host_async()


def _in_device_memory(value: jax.Array) -> bool:
    """Whether `value` lives in an accelerator's own memory: ``np.asarray`` of it is then a
    transfer into host memory that JAX makes for it alone (and keeps read-only), never a
    view of its buffer, whatever becomes of the array afterwards."""
    if value.sharding.memory_kind not in (None, "device"):
        return False
    return all(device.platform != "cpu" for device in value.sharding.device_set)


def _host(name: str, value: Any, wait: bool) -> np.ndarray | jax.Array:
    """`value` as the save keeps it, checked: a JAX array as it is for a save that waits
    (the writer reads it when its turn comes, its copy to host under way: `_start_copies`);
    else a contiguous host array, for a background save one of its own (``np.asarray`` of
    an array on JAX's CPU device may be a view of its buffer, and of a NumPy array is that
    array; of an array in an accelerator's memory it is a copy already, not copied again)."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"save_safetensors: {name!r} is an array of PRNG keys, which safetensors cannot "
            f"store; save jax.random.key_data() of it instead"
        )
    if isinstance(value, jax.Array):
        if not value.is_fully_addressable:
            raise ValueError(
                f"save_safetensors: {name!r} is spread over several processes and this "
                f"process holds only part of it; gather it first (for example with "
                f"jax.experimental.multihost_utils.process_allgather), or save from each "
                f"process"
            )
        _storable(name, np.dtype(value.dtype))
        if value.is_deleted():
            raise RuntimeError(
                f"save_safetensors: {name!r} is an array that has been deleted (donated to a "
                f"jitted function, say); save the arrays that replaced it"
            )
        if wait:
            return value
        if _in_device_memory(value):  # (the transfer's own memory: the save's)
            return np.asarray(value, order="C")
        return np.array(value, order="C", copy=True)
    # (np.ascontiguousarray makes a 0-d array 1-d)
    array = np.asarray(value, order="C") if wait else np.array(value, order="C", copy=True)
    _storable(name, array.dtype)
    return array


def _storable(name: str, dtype: np.dtype) -> None:
    """Raises TypeError for a dtype safetensors cannot store (4-bit ones are packed)."""
    if dtype.name not in _STORED and dtype.name not in FOUR_BIT:
        raise TypeError(
            f"save_safetensors: {name!r} has dtype {dtype.name}, which safetensors cannot "
            f"store; it stores {', '.join(sorted(_STORED))}, and {', '.join(FOUR_BIT)} "
            f"packed two per byte"
        )


def byte_size(value: int | str | None, where: str) -> int | None:
    """`value` in bytes: an int, or a string such as ``"500MB"`` or ``"2GiB"`` (units of
    1000 and of 1024); None stays None. For `save_safetensors`' ``max_shard_size`` and the
    load's ``max_host_bytes``.

    Args:
        value: the size given.
        where: the function and keyword, for messages (``"save_safetensors:
            max_shard_size"``).

    Returns:
        The bytes, or None.

    Raises:
        TypeError: neither an int, a string nor None.
        ValueError: a string that is not a size, or a size that is not positive.
    """
    if isinstance(value, bool) or not isinstance(value, int | str | None):
        raise TypeError(
            f"{where} takes a number of bytes (an int) or a string such as '500MB' or "
            f"'2GiB', got {value!r} ({type(value).__name__})"
        )
    if value is None or isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = match and _UNITS.get(match.group(2).upper())
        if not match or unit is None:
            raise ValueError(
                f"{where} {value!r} is not a size such as '500MB', '2GiB' or a number of bytes"
            )
        size = int(float(match.group(1)) * unit)
    if size is not None and size <= 0:
        raise ValueError(f"{where} must be positive, got {value!r}")
    return size


def _split(tensors: dict[str, Any], limit: int | None) -> list[dict[str, Any]]:
    """The tensors in order, in shards of at most `limit` bytes (a larger tensor alone)."""
    shards: list[dict[str, Any]] = [{}]
    used = 0
    for name, array in tensors.items():
        if limit is not None and shards[-1] and used + array.nbytes > limit:
            shards.append({})
            used = 0
        shards[-1][name] = array
        used += array.nbytes
    return shards
