"""Reading an Orbax checkpoint one array at a time, from its metadata: the arrays it holds
(their tree paths, shapes and dtypes) without reading them, and each array restored alone
(a partial restore of a tree holding only it), so that ``taktiny inspect``, ``diff`` and
``verify`` hold one array at a time. A checkpoint's folder, a ``CheckpointManager``'s step
folder (each item a tree of its own) and its steps are told apart here.

Orbax is imported when a checkpoint is opened, NumPy when an array's dtype is read: a
process that only lists safetensors headers imports neither."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import _lazy

if TYPE_CHECKING:
    import numpy as np
else:
    np = _lazy.module("numpy")  # (imported when an array's dtype is read)


class OrbaxError(Exception):
    """An Orbax checkpoint that cannot be read: the message names it and says why."""


class Array(NamedTuple):
    """One array of an Orbax checkpoint, as its metadata describes it."""

    name: str  # its tree path, dotted ("encoder.kernel", "layers.0.bias")
    keys: tuple[str | int, ...]  # its tree path, as keys and list positions
    shape: tuple[int, ...]
    dtype: np.dtype


class OrbaxCheckpoint:
    """An Orbax checkpoint open for reading, one array at a time: each read is a partial
    restore (``partial_restore=True``) of a tree that holds that array alone."""

    def __init__(self, path: Path) -> None:
        import orbax.checkpoint as ocp

        self.path = path.absolute()  # Orbax takes absolute paths only
        self.checkpointer = ocp.PyTreeCheckpointer()
        try:
            with quiet():
                metadata = self.checkpointer.metadata(self.path).item_metadata
        except Exception as error:  # noqa: BLE001 - whatever Orbax raises for a damaged one
            self.checkpointer.close()
            raise OrbaxError(f"{path}: not a readable Orbax checkpoint ({_why(error)}).") from None
        if metadata is None:
            self.checkpointer.close()
            raise OrbaxError(
                f"{path}: an Orbax checkpoint without a readable tree of arrays (its metadata "
                f"is missing or damaged)."
            )
        self.tree = metadata.tree

    def __enter__(self) -> OrbaxCheckpoint:
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
            with quiet():
                value = self.checkpointer.restore(self.path, args=args)
            for key in keys:
                value = value[key]
            return np.asarray(value)
        except Exception as error:  # noqa: BLE001 - whatever Orbax raises for a damaged one
            name = ".".join(map(str, keys))
            raise OrbaxError(
                f"{self.path}: the array {name!r} cannot be restored ({_why(error)})."
            ) from None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
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


def orbax_arrays(path: Path) -> Iterator[Array]:
    """The arrays of the Orbax checkpoint (one tree) at `path`, from its metadata, in the
    order of its tree. Raises OrbaxError for a checkpoint whose metadata is unreadable or
    gives an array no shape and dtype."""
    with OrbaxCheckpoint(path) as checkpoint:
        tree = checkpoint.tree

    def walk(node: Any, keys: tuple[str | int, ...]) -> Iterator[Array]:
        if isinstance(node, dict | list):
            pairs = node.items() if isinstance(node, dict) else enumerate(node)
            for key, value in pairs:
                yield from walk(value, (*keys, key))
            return
        name = ".".join(map(str, keys))
        try:
            shape, dtype = tuple(map(int, node.shape)), np.dtype(node.dtype)
        except (AttributeError, TypeError, ValueError) as error:
            raise OrbaxError(
                f"{path}: the Orbax metadata of {name!r} gives no array shape and dtype "
                f"({_why(error)}); the checkpoint is damaged."
            ) from None
        yield Array(name, keys, shape, dtype)

    yield from walk(tree, ())


def is_orbax(path: Path) -> bool:
    """Whether `path` is a folder Orbax wrote: a checkpoint, or a manager's step folder."""
    return path.is_dir() and any((path / n).exists() for n in ("_CHECKPOINT_METADATA", "_METADATA"))


def orbax_items(path: Path) -> dict[str, Path]:
    """The trees of arrays an Orbax folder holds, by the prefix their names take: ``{"":
    path}`` for a checkpoint of one tree; for a step folder of a ``CheckpointManager``, each
    item's folder under its item name (``""`` for a manager's one unnamed item,
    ``default``, so that its names are those of a plain checkpoint)."""
    if (path / "_METADATA").exists() or not (path / "_CHECKPOINT_METADATA").exists():
        return {"": path}
    items = {p.name: p for p in sorted(path.iterdir()) if p.is_dir() and is_orbax(p)}
    if not items:
        raise OrbaxError(
            f"{path}: an Orbax step folder without an item holding a tree of arrays; its "
            f"save is incomplete or damaged."
        )
    return {"": items["default"]} if list(items) == ["default"] else items


def orbax_steps(path: Path) -> list[str]:
    """The step folders of a ``CheckpointManager``'s folder, in step order."""
    steps = [p.name for p in path.iterdir() if p.name.isdigit() and is_orbax(p)]
    return sorted(steps, key=int)
