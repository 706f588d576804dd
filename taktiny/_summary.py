"""`tt.summary`: a table of a tree's parameters by name."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from .module import trainable
from .state import customs, flatten


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of a :class:`Summary`: a parameter, or a group of them."""

    name: str
    shape: tuple[int, ...] | None  # None for a group (but a quantized weight's: its shape)
    dtype: str  # the dtype's name; for a group, its dtypes joined by "/"
    sharding: str  # how it is placed; "" on a single device
    trainable: bool | None  # None for a group that mixes both
    size: int  # elements
    nbytes: int


def _placement(leaf: Any) -> tuple[str, bool]:
    """How `leaf` is placed, and whether that is sharded (more than one device)."""
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return "", False
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        return str(spec), len(sharding.device_set) > 1
    devices = sharding.device_set
    if len(devices) == 1:
        (device,) = devices
        return f"{device.platform}:{device.id}", False
    return type(sharding).__name__, True


def _row(name: str, leaf: Any, trained: bool) -> Row:
    shape = tuple(np.shape(leaf))
    dtype = np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
    size = math.prod(shape)
    nbytes = -(-size * jax.dtypes.itemsize_bits(dtype) // 8)  # int4 packs two to a byte
    return Row(name, shape, dtype.name, _placement(leaf)[0], trained, size, nbytes)


def _group(name: str, rows: list[Row], param: Any = None) -> Row:
    """The row of a group of `rows`. When they are the leaves of one custom parameter
    `param` (a QArray), the row is that parameter's: its logical shape, and the placement
    of its first leaf (a QArray's value, which its sharding rule splits)."""
    dtypes = "/".join(dict.fromkeys(r.dtype for r in rows))
    placements = {r.sharding for r in rows}
    flags = {r.trainable for r in rows}
    if param is not None:
        placements = {rows[0].sharding}
    return Row(
        name,
        None if param is None else tuple(param.shape),
        dtypes,
        placements.pop() if len(placements) == 1 else "mixed",
        flags.pop() if len(flags) == 1 else None,
        sum(r.size for r in rows),
        sum(r.nbytes for r in rows),
    )


@dataclasses.dataclass(frozen=True)
class Summary:
    """What :func:`summary` returns: the rows, the totals, and the table as its ``str``.

    Attributes:
        title: the first line of the table (``"MLP summary"``: the tree's type).
        rows: one row per parameter (or per group of them, with ``depth``), each with
            its ``name``, ``shape`` (None for a group, except the group of a quantized
            weight's value and scale, which has the weight's shape), ``dtype``, ``sharding``,
            ``trainable`` (None for a group that mixes both), ``size`` (elements) and
            ``nbytes``.
        params: the elements of every leaf.
        trainable_params: the elements of the trained leaves.
        nbytes: the bytes of every leaf (int4 packs two elements to a byte).
        sharded: whether any leaf is spread over several devices (the table then has a
            sharding column).
    """

    title: str
    rows: tuple[Row, ...]
    params: int  # elements of every leaf
    trainable_params: int  # elements of the trained leaves
    nbytes: int
    sharded: bool  # whether any leaf is spread over several devices

    def __str__(self) -> str:
        header = ["name", "shape", "dtype", *(["sharding"] if self.sharded else []), "train"]
        header += ["params", "bytes"]
        lines = [header]
        for row in self.rows:
            shape = "" if row.shape is None else str(row.shape)
            train = {True: "yes", False: "no", None: "mixed"}[row.trainable]
            cells = [row.name, shape, row.dtype, *([row.sharding] if self.sharded else [])]
            lines.append([*cells, train, f"{row.size:,}", _bytes(row.nbytes)])
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        right = {len(header) - 2, len(header) - 1}  # so no line ends in spaces
        cell = lambda i, c, w: c.rjust(w) if i in right else c.ljust(w)
        text = ["  ".join(map(cell, range(len(line)), line, widths)) for line in lines]
        rule = "-" * max(map(len, text))
        frozen = self.params - self.trainable_params
        total = (
            f"{self.params:,} parameters ({_bytes(self.nbytes)}): "
            f"{self.trainable_params:,} trainable, {frozen:,} not trained"
        )
        return "\n".join([self.title, rule, text[0], rule, *text[1:], rule, total])

    def __repr__(self) -> str:
        return str(self)


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def summary(tree: Any, *, depth: int | None = None) -> Summary:
    """A table of the parameters of `tree` (a module, or any PyTree of them): for each
    name, its shape, dtype, sharding (a column shown when some leaf spans several
    devices), whether it is trained (see :func:`trainable`), its element count and bytes;
    then the totals. Works on abstract models (``jax.eval_shape``) too. ``print`` it.

    Args:
        tree: the module or tree to describe.
        depth: if given, one row per group of parameters whose names share their first
            `depth` parts (``depth=1``: one row per top-level attribute), with the
            group's totals.

    Returns:
        A :class:`Summary`: its ``str`` is the table; its fields hold the rows and totals.

    Raises:
        ValueError: `depth` is less than 1.
    """
    leaves, _, spec = flatten(tree)
    flags = jax.tree_util.tree_leaves(trainable(tree))
    rows = [_row(n, leaf, t) for n, leaf, t in zip(spec.names, leaves, flags, strict=True)]
    sharded = any(_placement(leaf)[1] for leaf in leaves)
    if depth is not None:
        if depth < 1:
            raise ValueError(f"summary's depth counts name parts, so it is >= 1; got {depth}.")
        groups: dict[str, list[Row]] = {}
        for row in rows:
            groups.setdefault(".".join(row.name.split(".")[:depth]), []).append(row)
        single = lambda g, rs: len(rs) == 1 and rs[0].name == g  # a group of one leaf
        params = {  # a group of one custom parameter's leaves is that parameter
            name: custom.treedef.unflatten(leaves[custom.start : custom.stop])
            for name, custom in customs(spec.template)
        }
        rows = [
            rs[0] if single(g, rs) else _group(g, rs, params.get(g)) for g, rs in groups.items()
        ]
    return Summary(
        title=f"{type(tree).__name__} summary",
        rows=tuple(rows),
        params=sum(r.size for r in rows),
        trainable_params=sum(r.size for r in rows if r.trainable)
        + sum(_trained_in(g, spec.names, flags, leaves) for g in rows if g.trainable is None),
        nbytes=sum(r.nbytes for r in rows),
        sharded=sharded,
    )


def _trained_in(group: Row, names: Any, flags: list[bool], leaves: list[Any]) -> int:
    """The trained elements inside a mixed group."""
    prefix = group.name + "."
    return sum(
        math.prod(np.shape(leaf))
        for name, flag, leaf in zip(names, flags, leaves, strict=True)
        if flag and name.startswith(prefix)
    )
