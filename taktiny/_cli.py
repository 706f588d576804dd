"""`taktiny inspect` and `taktiny diff`: what a checkpoint holds, read from its headers.

A safetensors file starts with a JSON header naming every tensor's dtype, shape and byte
range, so listing one reads kilobytes however large it is; a Hugging Face index names the
shard of each tensor; an Orbax checkpoint keeps a tree of array metadata. `diff` compares
two safetensors checkpoints tensor by tensor, holding two tensors at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import _patterns

_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
          "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip


class Entry(NamedTuple):
    """One tensor of a checkpoint, as its header describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    file: Path | None  # the safetensors file holding it (None: an Orbax checkpoint)


def _safe_open(path: Path) -> Any:
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:  # pragma: no cover - safetensors is an extra
        raise SystemExit(
            "taktiny: reading safetensors files needs the safetensors package: "
            "pip install 'taktiny[safetensors]'."
        ) from None
    try:
        return safe_open(str(path), framework="flax")
    except (SafetensorError, OSError, ValueError) as error:  # the library's message says why
        raise SystemExit(f"taktiny: {path} is not a readable safetensors file: {error}") from None


def _file_entries(path: Path) -> Iterator[Entry]:
    with _safe_open(path) as f:
        for name in f.keys():
            piece = f.get_slice(name)
            shape, dtype = tuple(piece.get_shape()), str(piece.get_dtype())
            size = math.prod(shape) * _SIZES.get(dtype, 0)
            yield Entry(name, shape, dtype, size, path)


def _index_entries(index: Path) -> Iterator[Entry]:
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise SystemExit(f"taktiny: {index} has no 'weight_map': not a safetensors index.")
    wanted = set(weight_map)
    for shard in sorted(set(weight_map.values())):
        file = (index.parent / shard).resolve()
        if index.parent.resolve() not in file.parents:
            raise SystemExit(f"taktiny: {index} names the shard {shard!r}, outside its folder.")
        if not file.is_file():
            raise SystemExit(f"taktiny: {index} names the shard {shard!r}, which is missing.")
        yield from (e for e in _file_entries(file) if e.name in wanted)


def _orbax_entries(path: Path) -> Iterator[Entry]:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.metadata(path.absolute()).item_metadata.tree

    def walk(node: Any, prefix: str) -> Iterator[Entry]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{prefix}{key}.")
            return
        shape, dtype = tuple(node.shape), np.dtype(node.dtype)
        yield Entry(prefix[:-1], shape, dtype.name, math.prod(shape) * dtype.itemsize, None)

    yield from walk(tree, "")


def entries(path: str | Path) -> list[Entry]:
    """The tensors of a safetensors file, a safetensors index (or a folder holding one), or
    an Orbax checkpoint folder, from their headers and metadata only."""
    path = Path(path)
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        files = sorted(path.glob("*.safetensors"))
        if len(indexes) == 1:
            path = indexes[0]
        elif len(files) == 1 and not indexes:
            path = files[0]
        elif (path / "_CHECKPOINT_METADATA").exists() or (path / "_METADATA").exists():
            return list(_orbax_entries(path))
        else:
            raise SystemExit(
                f"taktiny: {path} holds no Orbax checkpoint and not exactly one safetensors "
                f"file or index ({len(files)} files, {len(indexes)} indexes); name one."
            )
    if not path.exists():
        raise SystemExit(f"taktiny: {path} does not exist.")
    if path.name.endswith(".json"):
        return list(_index_entries(path))
    return list(_file_entries(path))


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


def diff(a: str, b: str) -> tuple[str, bool]:
    """The report `taktiny diff` prints, and whether the checkpoints hold equal tensors."""
    left = {e.name: e for e in entries(a)}
    right = {e.name: e for e in entries(b)}
    if any(e.file is None for e in [*left.values(), *right.values()]):
        raise SystemExit("taktiny diff compares safetensors checkpoints (files or indexes).")
    lines = [f"only in {a}: {name}" for name in left if name not in right]
    lines += [f"only in {b}: {name}" for name in right if name not in left]
    rows = [["name", "shape", "dtype", "max |a - b|"]]
    with contextlib.ExitStack() as stack:
        opened: dict[Path, Any] = {}  # each file opened once; two tensors read at a time

        def read(entry: Entry) -> np.ndarray:
            assert entry.file is not None  # (checked above)
            if entry.file not in opened:
                opened[entry.file] = stack.enter_context(_safe_open(entry.file))
            return np.asarray(opened[entry.file].get_tensor(entry.name), np.float64)

        for name in (n for n in left if n in right):
            x, y = left[name], right[name]
            if (x.shape, x.dtype) != (y.shape, y.dtype):
                rows.append([name, f"{x.shape} vs {y.shape}", f"{x.dtype} vs {y.dtype}", "-"])
                continue
            u, v = read(x), read(y)
            gap = float(np.max(np.abs(u - v), initial=0.0)) if u.size else 0.0
            if gap or np.isnan(u).any() != np.isnan(v).any():
                rows.append([name, str(x.shape), x.dtype, f"{gap:.6g}"])
    same = not lines and len(rows) == 1
    body = "\n".join(lines + ([_table(rows)] if len(rows) > 1 else []))
    common = sum(1 for n in left if n in right)
    summary = f"{common} common tensors, {len(rows) - 1} differ, {len(lines)} in one only"
    return (f"{body}\n{summary}" if body else summary), same


def main(argv: Sequence[str] | None = None) -> int:
    """The ``taktiny`` command (also ``python -m taktiny``)."""
    parser = argparse.ArgumentParser(prog="taktiny", description=(__doc__ or "").split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    shown = commands.add_parser("inspect", help="list the tensors of a checkpoint")
    shown.add_argument("path", help="a .safetensors file, an index .json, or a folder")
    shown.add_argument("--filter", help="only names matching this pattern ('encoder.**')")
    shown.add_argument("--json", action="store_true", help="print JSON")
    compared = commands.add_parser("diff", help="compare two safetensors checkpoints")
    compared.add_argument("a")
    compared.add_argument("b")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            print(inspect(args.path, args.filter, args.json))
            return 0
        report, same = diff(args.a, args.b)
    except ValueError as error:  # a bad --filter pattern
        print(f"taktiny: {error}", file=sys.stderr)
        return 2
    print(report)
    return 0 if same else 1
