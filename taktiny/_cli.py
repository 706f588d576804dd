"""`taktiny inspect`, `taktiny diff` and `taktiny verify`: what a checkpoint holds, read
from its headers, and whether its bytes are whole.

A safetensors file starts with a JSON header naming every tensor's dtype, shape and byte
range, so listing one reads kilobytes however large it is; a Hugging Face index names the
shard of each tensor; an Orbax checkpoint keeps a tree of array metadata. `diff` compares
two checkpoints of either kind tensor by tensor, holding two tensors at a time: a tensor of
a safetensors file is read from its byte range, an array of an Orbax checkpoint by a partial
restore of that one array. `verify` reads every tensor of a safetensors checkpoint through
the checksum its header records.

A checkpoint that cannot be read (a corrupt or truncated file, a bad index, a damaged Orbax
checkpoint) is one line on stderr, ``taktiny: <file>: <what is wrong>``, and exit status 1;
never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import _patterns


class Entry(NamedTuple):
    """One tensor of a checkpoint, as its header describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # NumPy's name, whatever the format
    nbytes: int
    file: Path  # the safetensors file holding it, or the Orbax checkpoint folder
    source: Any  # its :class:`taktiny.io.Tensor`, or its path in an Orbax checkpoint's tree


class Unreadable(Exception):
    """A checkpoint the command cannot read; the message names it and says why."""


def _safetensors_entries(path: Path) -> Iterator[Entry]:
    from .io import open_safetensors

    checkpoint = open_safetensors(path)  # a SafetensorsError names the file and tensor
    for t in sorted(checkpoint.values(), key=lambda t: t.name):  # as safetensors lists them
        yield Entry(t.name, t.shape, t.dtype.name, t.nbytes, t.file, t)


class _Orbax:
    """An Orbax checkpoint open for reading, one array at a time: each read is a partial
    restore (``partial_restore=True``) of a tree that holds that array alone."""

    def __init__(self, path: Path) -> None:
        import orbax.checkpoint as ocp

        self.path = path.absolute()  # Orbax takes absolute paths only
        self.checkpointer = ocp.PyTreeCheckpointer()
        try:
            with _quiet():
                metadata = self.checkpointer.metadata(self.path).item_metadata
        except Exception as error:  # noqa: BLE001 - whatever Orbax raises for a damaged one
            self.checkpointer.close()
            raise Unreadable(f"{path}: not a readable Orbax checkpoint ({_why(error)}).") from None
        if metadata is None:
            self.checkpointer.close()
            raise Unreadable(
                f"{path}: an Orbax checkpoint without a readable tree of arrays (its metadata "
                f"is missing or damaged)."
            )
        self.tree = metadata.tree

    def __enter__(self) -> _Orbax:
        return self

    def __exit__(self, *exc: object) -> None:
        self.checkpointer.close()

    def array(self, keys: tuple[str | int, ...]) -> np.ndarray:
        """The array at `keys`, restored alone, as a NumPy array."""
        import orbax.checkpoint as ocp

        def alone(node: Any, keys: tuple[str | int, ...], leaf: Any) -> Any:
            # `node`'s containers down `keys` with `leaf` at the end and nothing beside it
            # (a list keeps its length: Orbax matches lists by length)
            if not keys:
                return leaf
            inner = alone(node[keys[0]], keys[1:], leaf)
            if isinstance(node, dict):
                return {keys[0]: inner}
            return [inner if i == keys[0] else None for i in range(len(node))]

        args = ocp.args.PyTreeRestore(
            item=alone(self.tree, keys, 0),  # any leaf: restore_args says what to make of it
            restore_args=alone(self.tree, keys, ocp.RestoreArgs(restore_type=np.ndarray)),
            partial_restore=True,
        )
        try:
            with _quiet():
                value = self.checkpointer.restore(self.path, args=args)
            for key in keys:
                value = value[key]
            return np.asarray(value)
        except Exception as error:  # noqa: BLE001 - whatever Orbax raises for a damaged one
            name = ".".join(map(str, keys))
            raise Unreadable(
                f"{self.path}: the array {name!r} cannot be restored ({_why(error)})."
            ) from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Orbax's log lines off: a damaged checkpoint is the command's one line of its own."""
    logger = logging.getLogger("absl")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _why(error: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _orbax_entries(path: Path) -> Iterator[Entry]:
    with _Orbax(path) as checkpoint:
        tree = checkpoint.tree

    def walk(node: Any, keys: tuple[str | int, ...]) -> Iterator[Entry]:
        if isinstance(node, dict | list):
            pairs = node.items() if isinstance(node, dict) else enumerate(node)
            for key, value in pairs:
                yield from walk(value, (*keys, key))
            return
        name = ".".join(map(str, keys))
        try:
            shape, dtype = tuple(map(int, node.shape)), np.dtype(node.dtype)
        except (AttributeError, TypeError, ValueError) as error:
            raise Unreadable(
                f"{path}: the Orbax metadata of {name!r} gives no array shape and dtype "
                f"({_why(error)}); the checkpoint is damaged."
            ) from None
        yield Entry(name, shape, dtype.name, math.prod(shape) * dtype.itemsize, path, keys)

    yield from walk(tree, ())


def _is_orbax(path: Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in ("_CHECKPOINT_METADATA", "_METADATA"))


def entries(path: str | Path) -> list[Entry]:
    """The tensors of a safetensors file, a safetensors index (or a folder holding one), or
    an Orbax checkpoint folder, from their headers and metadata only. A folder's checkpoint
    is found as the loaders find it (:func:`taktiny.io.open_safetensors`)."""
    path = Path(path)
    if _is_orbax(path):
        return list(_orbax_entries(path))
    _present(path)
    return list(_safetensors_entries(path))


def _present(path: Path) -> None:
    """Raises Unreadable when `path` names nothing a safetensors reader could open."""
    if path.is_dir() and not any(
        p.name.endswith(".safetensors") or p.name.endswith(".json") for p in path.iterdir()
    ):
        raise Unreadable(
            f"{path} holds no Orbax checkpoint and no safetensors file or index; name one."
        )
    if not path.exists() and not path.with_name(f"{path.name}.index.json").is_file():
        raise Unreadable(f"{path} does not exist.")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) if i == len(row) - 1 else c.ljust(w)
                  for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        .rstrip()
        for row in rows
    )  # fmt: skip


def inspect(path: str, pattern: str | None, as_json: bool) -> str:
    """The listing `taktiny inspect` prints."""
    found = entries(path)
    if pattern is not None:
        regex = _patterns.compile_pattern(pattern)
        found = [e for e in found if regex.fullmatch("." + e.name)]
    count = sum(math.prod(e.shape) for e in found)
    total = sum(e.nbytes for e in found)
    if as_json:
        tensors = [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "bytes": e.nbytes}
                   for e in found]  # fmt: skip
        return json.dumps({"tensors": tensors, "parameters": count, "bytes": total})
    rows = [["name", "shape", "dtype", "bytes"]]
    rows += [[e.name, str(e.shape), e.dtype, f"{e.nbytes:,}"] for e in found]
    return f"{_table(rows)}\n{len(found)} tensors, {count:,} parameters, {total:,} bytes"


def _read(entry: Entry, opened: Mapping[Path, Any]) -> np.ndarray:
    """The values of one tensor, as float64, from its open file or checkpoint."""
    if isinstance(entry.source, tuple):  # a path in an Orbax checkpoint
        return np.asarray(opened[entry.file].array(entry.source), np.float64)
    return np.asarray(entry.source, np.float64)  # a safetensors Tensor: reads its bytes


def _gap(u: np.ndarray, v: np.ndarray) -> float | None:
    """max |u - v| (nan where one side is nan), or None when the values are equal."""
    gap = float(np.max(np.abs(u - v), initial=0.0)) if u.size else 0.0
    return gap if gap or np.isnan(u).any() != np.isnan(v).any() else None


def diff(a: str, b: str) -> tuple[str, bool]:
    """The report `taktiny diff` prints, and whether the checkpoints hold equal tensors.

    Either checkpoint may be safetensors (a file, an index, or a folder holding one) or an
    Orbax checkpoint folder, whose names are its dotted tree paths. Tensors of equal shape
    and dtype are read two at a time, one from each side, and compared in float64."""
    left = {e.name: e for e in entries(a)}
    right = {e.name: e for e in entries(b)}
    lines = [f"only in {a}: {name}" for name in left if name not in right]
    lines += [f"only in {b}: {name}" for name in right if name not in left]
    rows = [["name", "shape", "dtype", "max |a - b|"]]
    with contextlib.ExitStack() as stack:
        opened: dict[Path, Any] = {}  # each Orbax checkpoint opened once
        for entry in {e.file: e for e in [*left.values(), *right.values()]}.values():
            if isinstance(entry.source, tuple):
                opened[entry.file] = stack.enter_context(_Orbax(entry.file))
        for name in (n for n in left if n in right):
            x, y = left[name], right[name]
            if (x.shape, x.dtype) != (y.shape, y.dtype):
                rows.append([name, f"{x.shape} vs {y.shape}", f"{x.dtype} vs {y.dtype}", "-"])
                continue
            gap = _gap(_read(x, opened), _read(y, opened))  # two tensors held at a time
            if gap is not None:
                rows.append([name, str(x.shape), x.dtype, f"{gap:.6g}"])
    same = not lines and len(rows) == 1
    body = "\n".join(lines + ([_table(rows)] if len(rows) > 1 else []))
    common = sum(1 for n in left if n in right)
    summary = f"{common} common tensors, {len(rows) - 1} differ, {len(lines)} in one only"
    return (f"{body}\n{summary}" if body else summary), same


def verify(path: str) -> tuple[str, bool]:
    """The report `taktiny verify` prints, and whether nothing is damaged: one line per
    damaged tensor (or Orbax array that does not restore), then the counts. A safetensors
    checkpoint's tensors are read through the checksums in its headers; an Orbax
    checkpoint's arrays are each restored."""
    from .io._verify import verify as check

    if _is_orbax(Path(path)):
        return _verify_orbax(Path(path))
    _present(Path(path))
    result = check(path)
    summary = (
        f"{result.checked} tensors match their checksums, {len(result.damaged)} damaged, "
        f"{result.unchecked} without a checksum (their headers checked only)"
    )
    return "\n".join([*result.damaged, summary]), not result.damaged


def _verify_orbax(path: Path) -> tuple[str, bool]:
    """Restores each array of an Orbax checkpoint on its own (holding one at a time)."""
    found = list(_orbax_entries(path))
    damaged = []
    with _Orbax(path) as opened:
        for entry in found:
            try:
                opened.array(entry.source)
            except Unreadable as error:
                damaged.append(str(error))
    summary = f"{len(found) - len(damaged)} arrays restore, {len(damaged)} do not"
    return "\n".join([*damaged, summary]), not damaged


def main(argv: Sequence[str] | None = None) -> int:
    """The ``taktiny`` command (also ``python -m taktiny``)."""
    from .io import SafetensorsError

    parser = argparse.ArgumentParser(prog="taktiny", description=(__doc__ or "").split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    shown = commands.add_parser("inspect", help="list the tensors of a checkpoint")
    shown.add_argument("path", help="a .safetensors file, an index .json, or a folder")
    shown.add_argument("--filter", help="only names matching this pattern ('encoder.**')")
    shown.add_argument("--json", action="store_true", help="print JSON")
    compared = commands.add_parser(
        "diff", help="compare two checkpoints (safetensors or Orbax) tensor by tensor"
    )
    compared.add_argument("a")
    compared.add_argument("b")
    verified = commands.add_parser(
        "verify",
        help="read every tensor of a safetensors checkpoint through the checksum its header "
        "records; exits with 1 if any is damaged",
    )
    verified.add_argument("path", help="a .safetensors file, an index .json, or a folder")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            print(inspect(args.path, args.filter, args.json))
            return 0
        if args.command == "verify":
            report, same = verify(args.path)
        else:
            report, same = diff(args.a, args.b)
    except (SafetensorsError, Unreadable, OSError) as error:  # names the file, says why
        print(f"taktiny: {' '.join(str(error).splitlines())}", file=sys.stderr)
        return 1
    except ValueError as error:  # a bad --filter pattern
        print(f"taktiny: {error}", file=sys.stderr)
        return 2
    print(report)
    return 0 if same else 1
