"""`taktiny inspect`, `taktiny diff`, `taktiny verify` and `taktiny plan`: what a
checkpoint holds (a local one, or one in object storage named by its s3://, gs://, az://
or https:// URL), read from its headers, whether its bytes are whole, and what loading it
into a model would take.

A safetensors file starts with a JSON header naming every tensor's dtype, shape and byte
range, so listing one reads kilobytes however large it is; a Hugging Face index names the
shard of each tensor; an Orbax checkpoint keeps a tree of array metadata. `diff` compares
two checkpoints of either kind tensor by tensor, holding two tensors at a time: a tensor of
a safetensors file is read from its byte range, an array of an Orbax checkpoint by a partial
restore of that one array. `verify` checks each header of a safetensors checkpoint (one
Taktiny wrote records a digest of itself, its schema and checksums included), then reads
every tensor through the checksum its header records.

A checkpoint that cannot be read (a missing path, a corrupt, damaged or truncated file, a
bad index, a damaged Orbax checkpoint) is one line on stderr, ``taktiny: <file>: <what is
wrong>``, and exit status 2, never a traceback; as for ``diff(1)``, status 1 means that the
checkpoints differ (``diff``), that a tensor's bytes are damaged (``verify``) or that the
load would fail (``plan``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _lazy
from ._messages import table
from .io import (
    OrbaxCheckpoint,
    OrbaxError,
    Url,
    is_orbax,
    locate,
    orbax_arrays,
    orbax_items,
    orbax_steps,
)
from .state import compile_pattern

if TYPE_CHECKING:
    import numpy as np

    from .state import Schema
else:
    np = _lazy.module("numpy")  # (a header needs no NumPy: imported when a tensor is read)


class Entry(NamedTuple):
    """One tensor of a checkpoint, as its header describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # NumPy's name, whatever the format
    nbytes: int
    file: Path | Url  # the safetensors file (or object) holding it, or the Orbax folder
    source: Any  # its :class:`taktiny.io.Tensor`, or its path in an Orbax checkpoint's tree


class Unreadable(Exception):
    """A checkpoint the command cannot read; the message names it and says why."""


def _orbax_entries(path: Path) -> Iterator[Entry]:
    for array in orbax_arrays(path):
        nbytes = math.prod(array.shape) * array.dtype.itemsize
        yield Entry(array.name, array.shape, array.dtype.name, nbytes, path, array.keys)


def _safetensors_entries(path: str | Path) -> Iterator[Entry]:
    from .io import open_safetensors

    checkpoint = open_safetensors(path)  # a SafetensorsError names the file and tensor
    for t in sorted(checkpoint.values(), key=lambda t: t.name):  # as safetensors lists them
        yield Entry(t.name, t.shape, t.dtype_name, t.nbytes, t.file, t)


def entries(path: str | Path) -> list[Entry]:
    """The tensors of a safetensors file, a safetensors index (or a folder holding one), or
    an Orbax checkpoint: a checkpoint's folder, a ``CheckpointManager``'s step folder (every
    item, each name prefixed by its item's: ``state.encoder.kernel``) or one item's folder
    in it; from their headers and metadata only. A folder's safetensors checkpoint is found
    as the loaders find it (:func:`taktiny.io.open_safetensors`); a URL names a safetensors
    checkpoint in object storage."""
    where = locate(path)
    if isinstance(where, Url):
        return list(_safetensors_entries(path))
    path = where
    if is_orbax(path):
        return [
            entry._replace(name=f"{item}.{entry.name}" if item else entry.name)
            for item, folder in orbax_items(path).items()
            for entry in _orbax_entries(folder)
        ]
    if path.is_dir() and (steps := orbax_steps(path)):
        raise Unreadable(
            f"{path} holds the steps of an Orbax CheckpointManager ({', '.join(steps)}): name "
            f"one, as in {path / steps[-1]}."
        )
    _present(path)
    return list(_safetensors_entries(path))


def _present(path: Path | Url) -> None:
    """Raises Unreadable when `path` names nothing a safetensors reader could open (a URL:
    opening it says)."""
    if isinstance(path, Url):
        return
    if path.is_dir() and not any(
        p.name.endswith(".safetensors") or p.name.endswith(".json") for p in path.iterdir()
    ):
        raise Unreadable(
            f"{path} holds no Orbax checkpoint and no safetensors file or index; name one."
        )
    if not path.exists() and not path.with_name(f"{path.name}.index.json").is_file():
        raise Unreadable(f"{path} does not exist.")


def inspect(path: str, pattern: str | None, as_json: bool) -> str:
    """The listing `taktiny inspect` prints."""
    found = entries(path)
    scheme = quantization(path, found)
    if pattern is not None:
        regex = compile_pattern(pattern)
        found = [e for e in found if regex.fullmatch("." + e.name)]
    count = sum(math.prod(e.shape) for e in found)
    total = sum(e.nbytes for e in found)
    stacks = _stacks(path)
    layers = {e.name: _stack_of(e.name, stacks) for e in found}
    if as_json:
        tensors = [
            {"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "bytes": e.nbytes}
            | ({"stack": layers[e.name]} if layers[e.name] else {})
            for e in found
        ]
        quantized = {"quantization": scheme} if scheme else {}
        return json.dumps({"tensors": tensors, "parameters": count, "bytes": total} | quantized)
    rows = [["name", "shape", "dtype", *(["layers"] if stacks else []), "bytes"]]
    for e in found:
        stack = layers[e.name]
        layer = [f"{stack['count']} of {stack['path']!r} (axis 0)" if stack else ""]
        rows.append([e.name, str(e.shape), e.dtype, *(layer if stacks else []), f"{e.nbytes:,}"])
    summary = f"{table(rows)}\n{len(found)} tensors, {count:,} parameters, {total:,} bytes"
    return summary if scheme is None else f"{summary}\nquantization: {scheme['text']}"


def quantization(path: str, found: Sequence[Entry]) -> dict[str, Any] | None:
    """How a checkpoint in another library's quantized format is quantized, from the
    ``quantization_config`` of the ``config.json`` beside a local one and from its tensors:
    FP8 block-scaled weights (``*.weight_scale_inv``), compressed-tensors' packed integers
    (``*.weight_packed``); None for neither. Its ``"text"`` is the line inspect prints."""
    names = {e.name: e for e in found}
    scaled = [n for n in names if n.endswith(".weight_scale_inv") and n[:-10] in names]
    packed = [n for n in names if n.endswith(".weight_packed")]
    where = locate(path)
    config: Any = None
    if isinstance(where, Path):
        file = (where if where.is_dir() else where.parent) / "config.json"
        try:
            config = json.loads(file.read_text()).get("quantization_config")
        except (OSError, ValueError, AttributeError):
            config = None
    config = config if isinstance(config, dict) else {}
    method = config.get("quant_method") or (
        "fp8" if scaled else "compressed-tensors" if packed else None
    )
    if method is None:
        return None
    source = " (config.json)" if config else " (from the tensors' names; no config.json)"
    if method == "fp8":
        dtypes = sorted({names[n[:-10]].dtype for n in scaled})
        block = "x".join(map(str, config.get("weight_block_size") or ["?", "?"]))
        text = (
            f"fp8, {'/'.join(dtypes) or 'float8'} weights in blocks of {block}, each with its "
            f"scales (*.weight_scale_inv): {len(scaled)} weights{source}"
        )
        return {
            "method": method,
            "block_size": config.get("weight_block_size"),
            "weights": len(scaled),
            "text": text,
        }
    groups = []
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        size = weights.get("group_size")
        how = (
            f"in groups of {size}"
            if weights.get("strategy") == "group"
            else f"per {weights.get('strategy')}"
        )
        groups.append(f"{name}: int{weights.get('num_bits')} {how}")
    layouts = f" ({'; '.join(groups)})" if groups else ""
    fmt = config.get("format", "pack-quantized" if packed else "?")
    text = f"{method} {fmt}{layouts}: {len(packed)} packed weights{source}"
    return {"method": method, "format": fmt, "weights": len(packed), "text": text}


def _stacks(path: str) -> dict[str, dict[str, Any]]:
    """The stacked leaves a Taktiny safetensors checkpoint's schema records (by the
    schema's names, each with its stack's path and layer count); none for another file."""
    where = locate(path)
    if isinstance(where, Path) and is_orbax(where):
        return {}
    from .io import SCHEMA_KEY, open_safetensors

    text = open_safetensors(path).metadata.get(SCHEMA_KEY)  # (read as JSON: no JAX import)
    try:
        tensors = json.loads(text)["tensors"] if text is not None else {}
        return {name: dict(e["stack"]) for name, e in tensors.items() if "stack" in e}
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}  # (a schema Taktiny did not write: listed without its stacks)


def _stack_of(tensor: str, stacks: Mapping[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The stack a tensor is a leaf of (a QArray's parts under the QArray's name)."""
    return stacks.get(tensor) or stacks.get(tensor.rpartition(".")[0])


def _read(entry: Entry, opened: Mapping[Path | Url, Any]) -> np.ndarray:
    """The values of one tensor, in its own dtype, from its open file or checkpoint."""
    if isinstance(entry.source, tuple):  # a path in an Orbax checkpoint
        return np.asarray(opened[entry.file].array(entry.source))
    return np.asarray(entry.source)  # a safetensors Tensor: reads its bytes


class Gap(NamedTuple):
    """How far one tensor of `a` is from the same tensor of `b`."""

    absolute: float  # max |a - b|
    relative: float  # max |a - b| / |b|: inf where b is 0 and a is not
    within: bool  # |a - b| <= atol + rtol * |b| everywhere, NaN where the other is NaN


def _gap(u: np.ndarray, v: np.ndarray, atol: float, rtol: float) -> Gap | None:
    """How far `u` is from `v` (of one shape, any dtypes), compared after casting both to
    float64 (complex128 for complex values); None when they are equal, value for value."""
    if u.dtype == v.dtype and np.array_equal(u, v, equal_nan=u.dtype.kind in "fc"):
        return None  # (exact: integers beyond 2**53 are not compared as floats)
    common = np.complex128 if "c" in (u.dtype.kind, v.dtype.kind) else np.float64
    x, y = u.astype(common), v.astype(common)
    nan = np.isnan(x) | np.isnan(y)
    # equal values, compared in their own dtype when both have it (float64 cannot tell
    # 2**62 from 2**62 + 1); inf == inf, so no inf - inf is counted
    equal = ((u == v) if u.dtype == v.dtype else (x == y)) | (np.isnan(x) & np.isnan(y))
    scale = np.abs(y)
    with np.errstate(divide="ignore", invalid="ignore"):  # inf - inf, x / 0: masked out
        error = np.where(equal, 0.0, np.abs(x - y))
        if u.dtype == v.dtype and u.dtype.kind in "iub":  # unequal integers: 1 apart at least
            error = np.where(equal, 0.0, np.maximum(error, 1.0))
        relative = np.where(equal, 0.0, error / scale)
        within = bool(np.all(equal | (~nan & (error <= atol + rtol * scale))))
    return Gap(
        float(np.nanmax(error, initial=0.0)), float(np.nanmax(relative, initial=0.0)), within
    )


def _number(value: float) -> str:
    return f"{value:.6g}"


_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # module:factory


class Side(NamedTuple):
    """One side of `taktiny diff` compared by schemas (see :func:`schema_of`)."""

    schema: Schema
    model: Any  # the abstract model of a ``module:factory``; None for the others
    saved: bool  # a schema a save recorded, with the state versions it was saved at


def schema_of(source: str, *, checkpoint: bool = True) -> Side | None:
    """The schema of one side of `taktiny diff`: a schema file (the JSON of
    :meth:`taktiny.Schema.to_json`), a model made by ``module:factory`` (a function of no
    arguments, from the current folder or the installed packages; called under
    :func:`taktiny.eval_shape`, so nothing is allocated), or a checkpoint: the schema a
    Taktiny safetensors file records, else one made from its tensors' names, shapes and
    dtypes. With `checkpoint` False, None for a checkpoint (compared tensor by tensor
    instead)."""
    from .state import FORMAT, Schema, schema

    path = locate(source)
    if isinstance(path, Path) and path.is_file() and path.suffix == ".json":
        text = path.read_text(errors="replace")
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            value = None  # (an index that does not parse is reported as a checkpoint)
        if isinstance(value, dict) and value.get("format") == FORMAT:
            try:
                return Side(Schema.from_json(text), None, True)
            except ValueError as error:
                raise Unreadable(f"{path}: {error}.") from None
    elif isinstance(path, Path) and not path.exists() and _FACTORY.fullmatch(source):
        model = abstract_model(source)
        return Side(schema(model), model, False)
    if not checkpoint:
        return None
    if isinstance(path, Url) or not is_orbax(path):
        from .io import open_safetensors

        _present(path)
        stored = open_safetensors(source).schema
        if stored is not None:
            return Side(stored, None, True)
    made = Schema(
        {
            e.name: {
                "shape": list(e.shape),
                "dtype": e.dtype,
                "sharding": None,
                "quantization": None,
            }
            for e in entries(source)
        }
    )
    return Side(made, None, False)


def _imported(source: str) -> tuple[Any, str, Any]:
    """The module of ``module:name``, the name, and what the module holds under it (None
    when nothing): the module found as ``python -c`` finds it, in the current folder or the
    installed packages, imported by an ordinary import."""
    import importlib

    module_name, name = source.split(":")
    with _current_folder() as folder:
        try:
            module = importlib.import_module(module_name)
        except (Exception, SystemExit) as error:  # noqa: BLE001  (whatever the import raises)
            why = _failure(error)
            if isinstance(error, SystemExit):
                why = (
                    f"it exited while being imported, {why}; keep what runs as a script "
                    f"under `if __name__ == '__main__':`"
                )
            elif isinstance(error, ModuleNotFoundError) and error.name == module_name:
                why += f" (looked in the current folder, {folder}, and the installed packages)"
            raise Unreadable(f"{source}: cannot import {module_name!r}: {why}") from None
    return module, name, getattr(module, name, None)


@contextlib.contextmanager
def _current_folder() -> Iterator[str]:
    """The current folder first on ``sys.path`` (as ``python -c`` and ``python -m`` put it
    there) while a model's module is imported and its factory called."""
    import os

    folder = os.getcwd()
    sys.path.insert(0, folder)
    try:
        yield folder
    finally:
        with contextlib.suppress(ValueError):  # (unless the module took it off itself)
            sys.path.remove(folder)


def _failure(error: BaseException) -> str:
    """An exception as a user needs it to find the cause: its type and message, then each
    error it was raised from (transformers' lazy import raises "Could not import module
    'LlamaForCausalLM'" from the real error), and the line that raised the first of them."""
    import importlib
    import os
    import traceback

    said, chain = [], [error]
    while True:  # down the chain of causes, to the first error
        e = chain[-1]
        said.append(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        if e.__cause__ is not None:
            link, cause = "raised from", e.__cause__
        elif e.__context__ is not None and not e.__suppress_context__:
            link, cause = "raised while handling", e.__context__
        else:
            break
        if cause in chain:
            break
        said.append(f"; {link} ")
        chain.append(cause)
    machinery = (__file__, os.path.dirname(importlib.__file__))  # (this file, the import system)
    frames = [
        f
        for e in chain  # the first error's frames last: the line that raised it, if it was
        for f in traceback.extract_tb(e.__traceback__)
        if not f.filename.startswith(machinery) and not f.filename.startswith("<")
    ]
    return "".join(said) + (f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else "")


def abstract_model(source: str) -> Any:
    """The model ``module:factory`` makes, a function of no arguments called under
    :func:`taktiny.eval_shape` (nothing is allocated; a mesh it shards the model on is
    kept); Unreadable, saying why, when it cannot be."""
    from .arrays import eval_shape

    if not _FACTORY.fullmatch(source):
        raise Unreadable(f"{source}: name the model's factory as module:function.")
    module, name, factory = _imported(source)
    if not callable(factory):
        raise Unreadable(
            f"{source}: {module.__name__!r} has no function {name!r}; name a function of no "
            f"arguments that returns the model."
        )
    try:
        with _current_folder():  # (a factory may import its own modules)
            return eval_shape(factory)
    except Exception as error:  # noqa: BLE001
        raise Unreadable(f"{source}: calling {name}() failed: {_failure(error)}") from None


def plan(
    path: str, model: str, rules: str | None, max_host_bytes: str | None = None
) -> tuple[str, bool]:
    """The report `taktiny plan` prints (:func:`taktiny.io.plan_load` of the model
    ``module:factory`` makes, with the rules ``module:RULES`` names, under the budget
    `max_host_bytes` when given: ``"2GiB"``), and whether the load would succeed. The
    model is made abstractly (:func:`abstract_model`, its shardings kept) but planned as
    the concrete one the factory makes: the parameters a migration adds keep that model's
    values."""
    from .io import byte_size
    from .loading import planned

    limit = byte_size(max_host_bytes, "taktiny plan --max-host-bytes")

    found = None
    if rules is not None:
        if not _FACTORY.fullmatch(rules):
            raise Unreadable(f"{rules}: name the rules as module:NAME.")
        module, name, found = _imported(rules)
        if not isinstance(found, list | tuple):
            raise Unreadable(
                f"{rules}: {module.__name__!r} has no list of rules named {name!r}; name a "
                f"list or tuple of taktiny.convert rules."
            )
    _present(locate(path))
    options = (found, None, True, True)
    result = planned(abstract_model(model), path, options, has_values=True, max_host_bytes=limit)
    return str(result), result.ok


def diff(
    a: str, b: str, *, atol: float = 0.0, rtol: float = 0.0, pattern: str | None = None
) -> tuple[str, bool]:
    """The report `taktiny diff` prints, and whether the two sides agree.

    When either side is a schema file or a model (``module:factory``), the two schemas are
    compared (see :func:`schema_of`): one line per name missing from `b`, added in it,
    reshaped, recast, resharded or requantized (:meth:`taktiny.Schema.changes`). A
    schema a save recorded (a schema file, a Taktiny checkpoint's) compared with a model
    is first migrated to the model's state versions, as a load would migrate it
    (:func:`taktiny.migrate`), and the report says which migrations it applied.
    Otherwise both are checkpoints, compared tensor by tensor:

    Either checkpoint may be safetensors (a file, an index, or a folder holding one) or
    Orbax (see :func:`entries`), whose names are its dotted tree paths. Tensors of equal
    shape are read two at a time, one from each side, and compared value for value; those
    of different dtypes after casting both to float64. The checkpoints agree when they name
    the same tensors (those matching `pattern`, when given), of the same shapes, and every
    value of `a` is within ``atol + rtol * |b|`` of `b`'s (NaN where `b` has NaN); the
    defaults ask for equal values. The report lists the tensors only one side has, those of
    other shapes, and those that differ beyond the tolerance, with the largest absolute and
    relative difference of each."""
    ours, theirs = schema_of(a, checkpoint=False), schema_of(b, checkpoint=False)
    if ours is not None or theirs is not None:
        return _schema_diff(a, b, ours or schema_of(a), theirs or schema_of(b), pattern)
    left = {e.name: e for e in entries(a)}
    right = {e.name: e for e in entries(b)}
    if pattern is not None:
        regex = compile_pattern(pattern)
        left = {n: e for n, e in left.items() if regex.fullmatch("." + n)}
        right = {n: e for n, e in right.items() if regex.fullmatch("." + n)}
    lines = [f"only in {a}: {name}" for name in left if name not in right]
    lines += [f"only in {b}: {name}" for name in right if name not in left]
    rows = [["name", "shape", "dtype", "max |a - b|", "max |a - b| / |b|"]]
    with contextlib.ExitStack() as stack:
        opened: dict[Path | Url, Any] = {}  # each Orbax checkpoint opened once
        for entry in {e.file: e for e in [*left.values(), *right.values()]}.values():
            if isinstance(entry.source, tuple) and isinstance(entry.file, Path):
                opened[entry.file] = stack.enter_context(OrbaxCheckpoint(entry.file))
        for name in (n for n in left if n in right):
            x, y = left[name], right[name]
            dtype = x.dtype if x.dtype == y.dtype else f"{x.dtype} vs {y.dtype}"
            if x.shape != y.shape:
                rows.append([name, f"{x.shape} vs {y.shape}", dtype, "-", "-"])
                continue
            gap = _gap(_read(x, opened), _read(y, opened), atol, rtol)  # two at a time
            if gap is not None and not gap.within:
                rows.append(
                    [name, str(x.shape), dtype, _number(gap.absolute), _number(gap.relative)]
                )
    same = not lines and len(rows) == 1
    body = "\n".join(lines + ([table(rows, numbers=2)] if len(rows) > 1 else []))
    common = sum(1 for n in left if n in right)
    beyond = f" beyond atol={atol:g}, rtol={rtol:g}" if atol or rtol else ""
    summary = f"{common} common tensors, {len(rows) - 1} differ{beyond}, {len(lines)} in one only"
    return (f"{body}\n{summary}" if body else summary), same


def _schema_diff(
    a: str, b: str, left: Side | None, right: Side | None, pattern: str | None
) -> tuple[str, bool]:
    """The report of two schemas compared (a saved one migrated to a model's state
    versions first), and whether they agree."""
    from .convert import migrated_schema, stages_text
    from .state import KINDS, Schema

    assert left is not None and right is not None
    ours, theirs = left.schema, right.schema
    migrated = []
    for saved, model, name, into in ((left, right, a, b), (right, left, b, a)):
        if saved.saved and model.model is not None:
            try:
                made, found = migrated_schema(model.model, saved.schema)
            except ValueError as error:  # a newer version, a migration's problems
                raise Unreadable(f"{name} into {into}: {error}") from None
            if found:
                migrated.append(f"migrated {name} to {into}'s state versions: {stages_text(found)}")
                ours, theirs = (made, theirs) if saved is left else (ours, made)
    if pattern is not None:
        regex = compile_pattern(pattern)
        ours, theirs = (
            Schema({n: e for n, e in s.items() if regex.fullmatch("." + n)}) for s in (ours, theirs)
        )
    changes = ours.changes(theirs)
    if not changes:
        agree = f"the schemas agree: {len(ours)} names, fingerprint {ours.fingerprint}"
        return "\n".join([*migrated, agree]), True
    counts = {kind: sum(c.kind == kind for c in changes) for kind in KINDS}
    said = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
    lines = [*migrated, *map(str, changes), f"{len(changes)} changes from {a} to {b}: {said}"]
    return "\n".join(lines), False


def verify(path: str) -> tuple[str, bool]:
    """The report `taktiny verify` prints, and whether nothing is damaged: one line per
    damaged tensor (or Orbax array that does not restore), then the counts. A safetensors
    checkpoint's headers are checked (a damaged one raises, naming what in it changed),
    then its tensors are read through the checksums in them; an Orbax checkpoint's arrays
    are each restored."""
    from .io import verify as check

    where = locate(path)
    if isinstance(where, Path) and is_orbax(where):
        return _verify_orbax(where)
    _present(where)
    result = check(path)
    summary = (
        f"{result.checked} tensors match their checksums, {len(result.damaged)} damaged, "
        f"{result.unchecked} without a checksum (their headers checked only)"
    )
    return "\n".join([*result.damaged, summary]), not result.damaged


def _verify_orbax(path: Path) -> tuple[str, bool]:
    """Restores each array of an Orbax checkpoint (each item of a step folder) on its own,
    holding one at a time."""
    found = entries(path)
    damaged = []
    for folder in dict.fromkeys(e.file for e in found if isinstance(e.file, Path)):
        with OrbaxCheckpoint(folder) as opened:
            for entry in (e for e in found if e.file == folder):
                try:
                    opened.array(entry.source)
                except OrbaxError as error:
                    damaged.append(str(error))
    summary = f"{len(found) - len(damaged)} arrays restore, {len(damaged)} do not"
    return "\n".join([*damaged, summary]), not damaged


# the checkpoint argument's help: where a path works, a URL does
_PATH = (
    "a .safetensors file, an index .json, or a folder; or an object-store URL (s3://bucket/"
    "run/model.safetensors, a prefix ending in /; gs://, az://, https://; pip install "
    "'taktiny[cloud]')"
)


def _command(commands: Any, name: str, does: str, exits: str) -> argparse.ArgumentParser:
    """The parser of the command `name`: what it `does` (a phrase) is its line in ``taktiny
    --help`` and, as a sentence, its own ``--help``, followed by its exit statuses."""
    return commands.add_parser(
        name, help=does, description=f"{does[0].upper()}{does[1:]}.", epilog=f"Exits with {exits}."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The ``taktiny`` command (also ``python -m taktiny``)."""
    from .io import MissingExtra, SafetensorsError

    # --help prints whole sentences: the first and last paragraphs of this file's docstring
    paragraphs = [" ".join(p.replace("`", "").split()) for p in (__doc__ or "").split("\n\n")]
    parser = argparse.ArgumentParser(
        prog="taktiny", description=paragraphs[0], epilog=paragraphs[-1]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    shown = _command(
        commands, "inspect", "list the tensors of a checkpoint", "0, or 2 if it cannot be read"
    )
    shown.add_argument("path", help=_PATH)
    shown.add_argument("--filter", help="only names matching this pattern ('encoder.**')")
    shown.add_argument("--json", action="store_true", help="print JSON")
    compared = _command(
        commands,
        "diff",
        "compare two checkpoints (safetensors or Orbax) tensor by tensor; or the schemas of "
        "any two of a checkpoint, a schema file (.json) and a model (module:factory), name by "
        "name",
        "0 if the two agree, 1 if they differ, 2 if one cannot be read",
    )
    compared.add_argument(
        "a",
        help="a checkpoint (a path, or an s3://, gs://, az:// or https:// URL), a schema file "
        "(.json), or module:factory",
    )
    compared.add_argument("b", help="the same, to compare with")
    for name, allowed in (
        ("--atol", "the absolute difference allowed (default 0)"),
        ("--rtol", "the difference allowed relative to b's value (default 0)"),
    ):
        compared.add_argument(name, type=float, default=0.0, help=allowed)
    compared.add_argument("--filter", help="only names matching this pattern ('encoder.**')")
    verified = _command(
        commands,
        "verify",
        "check the headers of a safetensors checkpoint (each one Taktiny wrote against the "
        "digest it records of itself), then read every tensor through the checksum its "
        "header records",
        "0 if nothing is damaged, 1 if a tensor's bytes are, 2 if the checkpoint cannot be "
        "read or a header is damaged",
    )
    verified.add_argument("path", help=_PATH)
    planned = _command(
        commands,
        "plan",
        "plan loading a safetensors checkpoint into a model, from its headers: each tensor's "
        "way, the bytes per device and process, the peak host memory, and every problem",
        "0 if the load would succeed, 1 if it would fail, 2 if the checkpoint or the model "
        "cannot be read",
    )
    planned.add_argument("path", help=_PATH)
    planned.add_argument("--model", required=True, help="module:factory making the model")
    planned.add_argument("--rules", help="module:NAME of a list of conversion rules")
    planned.add_argument(
        "--max-host-bytes",
        help="plan the load within this budget of host memory beyond the model's arrays "
        "(bytes, or 512MiB, 2GB: load_safetensors' max_host_bytes)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            print(inspect(args.path, args.filter, args.json))
            return 0
        if args.command == "verify":
            report, same = verify(args.path)
        elif args.command == "plan":
            report, same = plan(args.path, args.model, args.rules, args.max_host_bytes)
        else:
            report, same = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, pattern=args.filter)
    except (SafetensorsError, OrbaxError, Unreadable, OSError, ValueError, MissingExtra) as error:
        # a checkpoint that cannot be read (named, with why), a bad --filter pattern, or a
        # URL without the cloud extra installed (named, with the command that installs it)
        print(f"taktiny: {' '.join(str(error).splitlines())}", file=sys.stderr)
        return 2
    print(report)
    return 0 if same else 1
