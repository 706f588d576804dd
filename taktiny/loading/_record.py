"""One load, as one record: what :func:`load_safetensors` and :func:`plan_load` start
from, built once before any data is read and handed whole to each stage (the steps, the
ways they are read, the placing, the writing of the new model).

The model is flattened once, into the state walk's `Flat` view: its leaves by position,
their names, and the quantized parameters among them. The steps resolve the checkpoint's
names against those names, once, and check each shape and dtype kind from the headers,
once; the values the load places are written into the view by position
(:func:`taktiny.state._state.load_resolved`), without resolving or checking them again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from jax.sharding import AbstractMesh

from ..arrays import mesh_text
from ..convert import (
    AnyRule,
    ConversionError,
    ConversionProblem,
    Stage,
    migration_rules,
    per_layer,
    stages,
    stages_text,
    without_values,
)
from ..io import Checkpoint, open_safetensors, schema_part
from ..quant import Parameter
from ..state import (
    KEY,
    Flat,
    Stacked,
    Stacker,
    is_flat,
    load_resolved,
    params,
    recorded_versions,
)
from ._layers import Layered


class Migrated(NamedTuple):
    """How a checkpoint saved at older state versions of the model's classes loads: by
    the rules their migrations compose into (see :func:`taktiny.migrate`), the leaves they
    add keeping the model's values.

    Attributes:
        stages: the modules migrated, inner first (the model itself at path ``""``).
        rules: the composed rules, from the checkpoint's names to the model's.
        added: the leaves the migrations add (a quantized parameter's two parts).
        problems: one for each added leaf the model has no value for (an abstract
            model's); a load raises them once its steps are planned.
    """

    stages: list[Stage]
    rules: list[AnyRule]
    added: set[str]
    problems: list[ConversionProblem]


@dataclasses.dataclass(frozen=True)
class Load:
    """A load of a safetensors checkpoint into a model, as :func:`load_safetensors` and
    :func:`plan_load` take it (:func:`open_load` builds it, checked; :func:`migrated`
    adds the migrations an older checkpoint needs).

    Attributes:
        where: how the load names itself in errors (``taktiny.io.load_safetensors(MLP)``).
        checkpoint: the checkpoint, opened: its headers read and checked.
        tree: the model (for a flat ``{name: array}`` target, the nested dicts its names
            make).
        view: `tree` flattened once: its leaves by position, and their names.
        leaves: the model's leaves by flat name, in its order (the view's).
        quantized: each quantized parameter (a :class:`~taktiny.QArray`) by flat name;
            its parts ``<name>.value`` and ``<name>.scale`` are leaves.
        keys: a flat target's own keys, in its order (the load returns a flat dict of
            them); None for a tree.
        rules: conversion rules from the checkpoint's names to the model's, or None.
        allow: with `rules`, the problems to let through.
        strict: whether every leaf must be loaded.
        verify: whether every tensor's bytes are checked against their checksum.
        migration: how an older checkpoint is migrated; None when it needs no migration
            (or before :func:`migrated` has asked).
        layers: for a checkpoint that names the model's stacks of layers per layer
            (``layers.3.attention.query.kernel``), the model's per-layer form (state's
            `Layers`: the model itself, and where each per-layer leaf goes); `tree`,
            `view` and `leaves` are then its per-layer twin. None for any other load.
    """

    where: str
    checkpoint: Checkpoint
    tree: Any
    view: Flat
    leaves: Mapping[str, Any]
    quantized: Mapping[str, Parameter]
    keys: tuple[str, ...] | None
    rules: Sequence[AnyRule] | None
    allow: Mapping[str, Sequence[str]] | None
    strict: bool
    verify: bool
    migration: Migrated | None = None
    layers: Layered | None = None

    @property
    def stacks(self) -> tuple[Stacked, ...]:
        """The model's stacks of layers (the model's own, when `view` is its twin): those
        whose other form a checkpoint's name may give."""
        return (self.view if self.layers is None else self.layers.view).spec.stacks


def open_load(
    model: Any,
    path: Any,
    *,
    rules: Sequence[AnyRule] | None,
    allow: Mapping[str, Sequence[str]] | None,
    strict: bool,
    verify: bool,
) -> Load:
    """The record of a load of `path` into `model`: the checkpoint opened (its headers),
    the model flattened once. Raises ValueError for `allow` without `rules` and for leaves
    on an abstract mesh; TypeError for a flat target naming both ``"a"`` and ``"a.b"``;
    SafetensorsError for a checkpoint that cannot be opened."""
    tree = as_tree(model)
    where = f"taktiny.io.load_safetensors({type(tree).__name__})"
    if rules is None and allow is not None:
        raise ValueError(f"{where}: allow= applies to rules; pass rules= with it.")
    checkpoint = path if isinstance(path, Checkpoint) else open_safetensors(path)
    view = Flat(tree)
    layers = None
    if per_layer(view.spec, checkpoint, rules):  # written per layer: the model's twin
        layers = Layered(tree, view)
        tree = layers.twin
        view = Flat(tree)
    leaves = dict(zip(view.spec.names, view.olds, strict=True))
    abstract = [
        (n, leaf.sharding.mesh)
        for n, leaf in leaves.items()
        if isinstance(getattr(getattr(leaf, "sharding", None), "mesh", None), AbstractMesh)
    ]
    if abstract:
        names = ", ".join(repr(n) for n, _ in abstract[:3]) + (", ..." if len(abstract) > 3 else "")
        raise ValueError(
            f"{where}: loading {checkpoint.path}: {len(abstract)} leaves of the model ({names}) "
            f"are sharded on an abstract mesh ({mesh_text(abstract[0][1])}), which names no "
            f"devices to place them on (jax.eval_shape keeps only a mesh's axis sizes): make "
            f"the abstract model with taktiny.eval_shape, which keeps the mesh, or place it "
            f"with taktiny.shard(model, rules, mesh)."
        )
    quantized = {n: q for n, q in params(view.olds, view.spec).items() if isinstance(q, Parameter)}
    keys = None if tree is model or layers is not None else tuple(model)
    return Load(
        where, checkpoint, tree, view, leaves, quantized, keys, rules, allow, strict, verify,
        layers=layers,
    )  # fmt: skip


def as_tree(model: Any) -> Any:
    """The tree a load walks: `model`, or for a flat ``{"a.b": array}`` dict (as
    `save_safetensors` saves one under its own keys) the nested dicts its names make,
    ``{"a": {"b": array}}``, whose flat names are its keys. Raises TypeError for a name
    that also begins another (``"a"`` and ``"a.b"``): no tree has both."""
    if not (is_flat(model) and all(type(k) is str for k in model) and any("." in k for k in model)):
        return model
    out: dict[str, Any] = {}
    for name, value in model.items():
        *groups, last = name.split(".")
        node = out
        for depth, key in enumerate(groups):
            node = node.setdefault(key, {})
            if type(node) is not dict:
                _clash(".".join(groups[: depth + 1]), name)
        if last in node:
            _clash(name, next(n for n in model if n.startswith(f"{name}.")))
        node[last] = value
    return out


def _clash(leaf: str, longer: str) -> None:
    raise TypeError(
        f"taktiny.io.load_safetensors(dict): the flat target names both {leaf!r} and "
        f"{longer!r}; a load names a tree's leaves by their paths, and no path ends at a "
        f"leaf and goes on. Read such a checkpoint without a target: "
        f"{{n: np.asarray(t) for n, t in open_safetensors(path).items()}}."
    )


def parts_of(name: str, quantized: Mapping[str, Parameter]) -> tuple[str, ...]:
    """The leaves a step's target fills: a quantized parameter's parts, or itself."""
    like = quantized.get(name)
    return (name,) if like is None else like.part_names(name)


def migrated(load: Load, *, has_values: bool = False) -> Load:
    """`load` with the migration its checkpoint needs, when the schema in the file records
    an older state version of the model's class, or of a module inside it, than the
    class's own (a file with no schema is not Taktiny's and has no version). Raises
    ValueError for a newer version, and for rules with an older one (user rules convert
    files that are not Taktiny's; the migrations convert this one); ConversionError for a
    migration's problems. With `has_values`, the model's leaves stand for the values of
    the concrete model (as :func:`taktiny.eval_shape` of its factory describes it): an
    added leaf keeps its value, whatever the leaf is."""
    checkpoint, where = load.checkpoint, load.where
    if checkpoint.metadata.get(KEY) is None:  # not Taktiny's: no version
        return load
    version, versions = schema_part(checkpoint, recorded_versions)  # (entries unread)
    found = stages(load.view.spec.modules, version, versions, where)  # (newer: raises)
    if not found:
        return load
    if load.rules is not None:
        raise ValueError(
            f"{where}: {checkpoint.path} was saved at older state versions, which "
            f"{stages_text(found)} convert; rules= converts a checkpoint that is not "
            f"Taktiny's into the model's names: drop rules=."
        )
    made, names = migration_rules(load.tree, checkpoint, found, load.leaves, where)
    added = {p for n in names for p in parts_of(n, load.quantized)}
    problems = [] if has_values else without_values(names, load.leaves)
    return dataclasses.replace(load, migration=Migrated(found, made, added, problems))


def unkept(load: Load) -> ConversionError | None:
    """The error for the leaves a migration adds that the model has no value for."""
    migration = load.migration
    if migration is None or not migration.problems:
        return None
    return ConversionError(
        f"{load.where}: after {stages_text(migration.stages)}", migration.problems
    )


def loaded(load: Load, placed: Mapping[str, Any] | Stacker) -> Any:
    """The new model: the values the load placed (by leaf name, each checked against its
    leaf and placed as it is) written in by position, the other leaves kept; for a flat
    target, a flat dict of its own keys."""
    if isinstance(placed, Stacker):
        return load_resolved(placed.layers.view, placed.leaves())
    if load.keys is not None:
        return {name: placed.get(name, load.leaves[name]) for name in load.keys}
    index = load.view.spec.index
    return load_resolved(load.view, [(index[n], value) for n, value in placed.items()])
