"""`tt.migrate`: a model's state version, and the migrations that carry a state saved at
an older version to the current one.

A model declares both in its class body, as class variables (not fields)::

    state_version: ClassVar[int] = 3
    state_migrations: ClassVar[Sequence[Sequence[Rule | Ignore | Init]]] = (to_2, to_3)

Versions count from 1: a model that declares none is at version 1 (its schema's version
is None, so the fingerprints of undeclared models stay as they were), and
``state_migrations[k - 1]`` takes version k to k + 1, so a model at version N lists N - 1
migrations. Two plain class variables, not a decorator: the schema walk reads
``state_version`` off the class without importing the module layer, and a reader sees
both where the fields are.

Any module of a model may declare them, not only the root: a ``Block`` held in
``Model.blocks`` is at its own version, which the schema records under its path
(``"blocks.0"``). Its rules name its own leaves (``"mlp.kernel"``) and are applied to each
instance under its path (``"blocks.0.mlp.kernel"``), from the version recorded there (1
when none is). Inner modules migrate first, each at the path the model holds it at, so the
migrations of a module see its parts' names as their classes make them now.

A migration lists only what changed: the rules (:class:`Rule`, :class:`Ignore`) apply
to the names they match, and every other name passes through unchanged; :class:`Init`
names the parameters it adds. Consecutive migrations compose: each is checked (a rule
matching no name, a name made twice, a transform failing on the shapes) against the
names the previous one made, from shapes alone; then the whole chain becomes one
conversion, one literal rule per group of saved names that end up in the same leaves,
which is checked against the model exactly as :func:`taktiny.convert.check` checks rules
and run as any conversion is (tensor by tensor by :func:`taktiny.io.load_safetensors`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ..quant import part_names
from ..state import Schema, declared_versions, flatten, schema_of
from ._convert import Converted
from ._coverage import ConversionError, ConversionProblem, plan, spec, transformed_specs
from ._rules import AnyRule, FirstMatch, Ignore, Init, Rule, Tie
from ._transforms import Transform, identity

PASS = Rule(r"(?P<name>.+)", "{name}", regex=True)  # a name no rule of a migration matches
PASS_ALLOWED = {"unmatched": [PASS.sources[0]]}  # (no name passing through is no problem)
_PLACEHOLDER = jax.ShapeDtypeStruct((), np.float32)  # the spec of a parameter Init added

Migration = Sequence[AnyRule | Init]
_Node = tuple[Any, ...]  # ("source", name) | ("init", k) | ("out", application, index)


def declared(cls: type) -> tuple[int, tuple[Migration, ...]]:
    """The state version `cls` declares (1 when none) and its migrations, checked.

    Raises:
        TypeError: a declaration of the wrong form, naming the class and the fix.
    """
    name = cls.__name__
    version = getattr(cls, "state_version", None)
    migrations: Any = getattr(cls, "state_migrations", ())
    if version is None:
        version = 1
    elif type(version) is not int or version < 1:
        raise TypeError(
            f"{name}.state_version must be an int >= 1 (versions count from 1), got {version!r}."
        )
    if isinstance(migrations, (str, Mapping)) or not isinstance(migrations, Sequence):
        raise TypeError(
            f"{name}.state_migrations must be a sequence of migrations (each a list of rules), "
            f"got {type(migrations).__name__}."
        )
    if len(migrations) != version - 1:
        raise TypeError(
            f"{name} is at state version {version}, so it lists {version - 1} migration"
            f"{'' if version == 2 else 's'} (state_migrations[k - 1] takes version k to k + 1), "
            f"but it lists {len(migrations)}: add the missing ones, or drop the extra."
        )
    for k, migration in enumerate(migrations, start=1):
        if isinstance(migration, str) or not isinstance(migration, Sequence):
            raise TypeError(
                f"{name}.state_migrations[{k - 1}] (version {k} -> {k + 1}) must be a list of "
                f"rules, got {type(migration).__name__}."
            )
        for rule in migration:
            if isinstance(rule, Tie) or not isinstance(rule, (Rule, Ignore, Init)):
                raise TypeError(
                    f"{name}.state_migrations[{k - 1}] (version {k} -> {k + 1}) holds {rule!r}; "
                    f"a migration takes Rule, Ignore and Init (a tied copy: Ignore it)."
                )
    return version, tuple(migrations)


class Stage(NamedTuple):
    """One module of a model whose state was saved at an older version of its class.

    Attributes:
        path: where the model holds it (``""``: the model itself; ``"blocks.0"``).
        cls: its class.
        start: the state version it was saved at.
        current: its class's state version.
    """

    path: str
    cls: type
    start: int
    current: int

    def label(self, k: int) -> str:
        """The name of its migration from version `k` to k + 1, in messages."""
        at = f" at {self.path!r}" if self.path else ""
        return f"{self.cls.__name__}.state_migrations[{k - 1}] (version {k} -> {k + 1}){at}"


def stages(
    modules: Mapping[str, type], version: int | None, versions: Mapping[str, int], where: str
) -> list[Stage]:
    """The modules of a model to migrate (of its `modules`: each module's class by its
    path, as its `Spec` lists them) from a state saved at `version` (the model's;
    None: 1) and nested `versions` (by path; a path not there: 1), inner modules first
    (a module's migrations then see its parts' names as their classes make them now), in
    the model's order at each depth; each declaration checked (:func:`declared`).

    Raises:
        ValueError: a state saved at a newer version than its class's, naming the module.
        TypeError: a malformed declaration.
    """
    out = []
    for path, cls in modules.items():
        saved = version if not path else versions.get(path)
        current, _ = declared(cls)
        start = _start(cls, current, saved, where, path)
        if start < current:
            if any(c in path for c in "*?[]{}"):
                raise ValueError(
                    f"{where}: {cls.__name__} at {path!r} has migrations to apply, whose "
                    f"names are written under its path, which holds a wildcard or a brace: "
                    f"rename the key that holds it."
                )
            out.append(Stage(path, cls, start, current))
    return sorted(out, key=lambda s: -len(s.path.split(".")) if s.path else 0)


def _start(cls: type, current: int, version: int | None, where: str, path: str = "") -> int:
    """The version a state saved at `version` (None: undeclared, so 1) starts from."""
    start = 1 if version is None else version
    if type(start) is not int or start < 1:
        raise ValueError(
            f"{where}: a state version is an int >= 1 (or None for a model that declared "
            f"none), got {version!r}."
        )
    if start > current:
        at = f" of {path!r}" if path else ""
        raise ValueError(
            f"{where}: the state{at} was saved at state version {start}; {cls.__name__} is at "
            f"version {current}: load it with the newer code that saved it (migrations only "
            f"go forward)."
        )
    return start


def migrate(
    model: Any,
    state: Mapping[str, Any],
    *,
    version: int | None,
    versions: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The flat state of `model` made from `state`, saved at state `version` of the
    model's class (and `versions` of the versioned modules inside it), by the migrations
    the classes declare (see the module's doc).

    The one way to load an older state: pass the versions its schema records
    (``saved.version``, None for a model that declared none, which is version 1; and
    ``saved.versions``), then load the result as any flat state, strict
    (``tt.load_flat_state_dict(model, flat, strict=True)``). Parameters a migration adds
    (:class:`~taktiny.convert.Init`) take `model`'s own values, so `model` must hold
    them (be concrete) then. A state of the model's own versions is returned as it is
    (its load checks it). :func:`taktiny.io.load_safetensors` migrates by itself, from
    the schema in the file.

    Args:
        model: the model (its class, or those of modules inside it, declare
            ``state_version`` and ``state_migrations``).
        state: the flat state as saved (``tt.flat_state_dict`` of a raw Orbax restore);
            its values may be arrays or anything with ``.shape`` and ``.dtype``.
        version: the state version `state` was saved at (the saved schema's
            ``version``).
        versions: the state versions of the modules inside, by path, that `state` was
            saved at (the saved schema's ``versions``; a path it lacks: version 1).
            Required when a module inside `model` declares a version.

    Returns:
        ``{flat name: value}`` for every leaf of `model`, in its order.

    Raises:
        ValueError: a version newer than its class's (or not a version), naming the
            module.
        TypeError: a class's declaration is malformed; `versions` not given for a model
            with versioned modules inside.
        taktiny.convert.ConversionError: listing every problem of the migrations (naming
            the migration and the module's path) or of the result against the model (an
            added parameter of an abstract model among them); nothing is converted.
    """
    where = f"taktiny.migrate({type(model).__name__})"
    values, _, spec = flatten(model)
    if versions is None:
        inside = [p for p in declared_versions(spec.modules) if p]
        if inside:
            raise TypeError(
                f"{where}: modules inside the model declare state versions of their own "
                f"({', '.join(map(repr, inside[:3]))}{', ...' if len(inside) > 3 else ''}): "
                f"pass versions= too, the saved schema's versions (saved.versions; {{}} when "
                f"the state was saved before they declared any)."
            )
    found = stages(spec.modules, version, versions or {}, where)
    if not found:
        return dict(state)
    leaves = dict(zip(spec.names, values, strict=True))
    rules, added = migration_rules(model, state, found, leaves, where)
    problems = without_values(added, leaves)
    if problems:
        raise ConversionError(where, problems)
    target = {n: leaf for n, leaf in leaves.items() if n not in added}
    try:
        report, _ = plan(rules, state, target, PASS_ALLOWED, where)
    except ConversionError as error:
        raise explained(error, found, where) from None
    converted = Converted(report.steps, state, target)
    return {n: leaves[n] if n in added else converted[n] for n in leaves}


def migration_rules(
    model: Any,
    source: Mapping[str, Any],
    found: Sequence[Stage],
    leaves: Mapping[str, Any],
    where: str,
) -> tuple[list[AnyRule], set[str]]:
    """The rules that convert `source`, saved before the migrations of `found`
    (:func:`stages`), to `model`'s current names in one step each (for :func:`plan`, with
    :data:`PASS_ALLOWED`), and the names the migrations add, each checked to be a leaf of
    `model` (whether it has a value to keep: :func:`without_values`).

    Raises:
        ConversionError: every problem of a migration, or of the names it adds.
    """
    nodes, _, applications = _walk(source, found)
    added = {n for n, node in nodes.items() if node[0] == "init"}
    _check_added(added, leaves, where)
    return _composed(source, nodes, applications), added


_Applications = list[tuple[Transform, int | None, tuple[_Node, ...]]]


def _walk(
    source: Mapping[str, Any], found: Sequence[Stage]
) -> tuple[dict[str, _Node], dict[_Node, Any], _Applications]:
    """Each final name's node (a saved name, an added one, or a transform's output), the
    spec of every node, and the transforms applied, through the migrations of `found`
    in order, each checked from shapes alone."""
    nodes: dict[str, _Node] = {name: ("source", name) for name in source}
    specs: dict[_Node, Any] = {("source", n): spec(v) for n, v in source.items()}
    applications: _Applications = []
    traced: dict[Any, Any] = {}  # (each equal transform traced once on equal shapes)
    for stage in found:
        migrations = declared(stage.cls)[1]
        prefix = f"{stage.path}." if stage.path else ""
        for k in range(stage.start, stage.current):
            here = f"{stage.label(k)}"
            migration = [_prefixed(r, stage.path) for r in migrations[k - 1]]
            rules = [r for r in migration if not isinstance(r, Init)]
            mine = {n: node for n, node in nodes.items() if n.startswith(prefix)}
            _check_added_kept(rules, mine, here)
            view = {
                n: _PLACEHOLDER if node[0] == "init" else specs[node] for n, node in mine.items()
            }
            report, _ = plan([*rules, PASS], view, {}, {"unknown": ["**"], **PASS_ALLOWED}, here)
            made: dict[str, _Node] = {}
            for step in report.steps:
                inputs = tuple(mine[n] for n in step.sources)
                if isinstance(step.rule.transform, identity):  # a rename (or no change)
                    outputs = inputs
                else:
                    count = None if step.rule.gathered else len(step.targets)
                    applications.append((step.rule.transform, count, inputs))
                    results = transformed_specs(
                        step.rule.transform, count, [specs[i] for i in inputs], traced
                    )
                    outputs = tuple(("out", len(applications) - 1, j) for j in range(len(results)))
                    specs.update(zip(outputs, results, strict=True))
                made.update(zip(step.targets, outputs, strict=True))
            inits = [n for r in migration if isinstance(r, Init) for n in r.names]
            twice = [n for n in inits if n in made]
            if twice:
                raise ConversionError(
                    here,
                    [
                        ConversionProblem(
                            "duplicate",
                            n,
                            hint="is added by an Init and also made from the saved state; drop "
                            "one.",
                        )
                        for n in twice
                    ],
                )
            made.update((n, ("init", k)) for n in inits)
            nodes = {**{n: node for n, node in nodes.items() if n not in mine}, **made}
    return nodes, specs, applications


def _prefixed(rule: AnyRule | Init, path: str) -> AnyRule | Init:
    """A nested module's rule, written for its own names, for its names under `path`."""
    if not path:
        return rule
    if isinstance(rule, Init):
        return Init(*(f"{path}.{n}" for n in rule.names))
    if isinstance(rule, Ignore):
        return Ignore(*(f"{path}.{p}" for p in rule.sources))
    if isinstance(rule, Tie):  # (declared() refuses it in a migration)
        return rule
    sources = (
        [re.escape(f"{path}.") + s.removeprefix("^") for s in rule.sources]
        if rule.regex
        else [f"{path}.{s}" for s in rule.sources]
    )
    targets = [f"{path}.{t}" for t in rule.targets]
    return Rule(sources, targets, rule.transform, regex=rule.regex)


def migrated_schema(model: Any, saved: Schema) -> tuple[Schema, list[Stage]]:
    """`saved`, the schema of a state saved at older versions of `model`'s classes, as the
    migrations make it: each name the migrations make from it with its shape and dtype
    (a renamed leaf keeps its whole entry; a transformed one, on no mesh and unquantized,
    keeps its source's sharding when its shape is its source's), each name they add with
    `model`'s entry (a load keeps the model's value), and `model`'s versions; and the
    modules migrated (:class:`Stage`), none when `saved` is at the model's versions.

    Raises:
        ValueError: a version newer than its class's, naming the module.
        ConversionError: every problem of a migration, naming it.
    """
    where = f"taktiny.migrate({type(model).__name__})"
    leaves, _, spec = flatten(model)
    found = stages(spec.modules, saved.version, saved.versions, where)
    if not found:
        return saved, []
    mine = schema_of(leaves, spec)
    source = {n: jax.ShapeDtypeStruct(e["shape"], _dtype(e["dtype"])) for n, e in saved.items()}
    nodes, specs, applications = _walk(source, found)
    entries: dict[str, Any] = {}
    for name, node in nodes.items():
        if node[0] == "init":
            if name in mine:
                entries[name] = mine[name]
        elif node[0] == "source":
            entries[name] = saved[node[1]]
        else:
            made = specs[node]
            first = applications[node[1]][2][0]
            like = saved[first[1]] if first[0] == "source" else None
            kept = like is not None and like["shape"] == list(made.shape)
            entries[name] = {
                "shape": list(made.shape),
                "dtype": np.dtype(made.dtype).name,
                "sharding": like["sharding"] if kept and like is not None else None,
                "quantization": None,
            }
    return Schema(entries, version=mine.version, versions=mine.versions), found


def _dtype(name: str) -> Any:
    """The dtype a schema names (a PRNG key's, which NumPy cannot name: as a float32, whose
    shape alone the migrations' checks use)."""
    try:
        return jax.numpy.dtype(name)
    except TypeError:
        return np.float32


def stages_text(found: Sequence[Stage]) -> str:
    """The migrations of `found` in words: ``Block's migrations from state version 1 to 2
    at 'blocks.0', 'blocks.1'; Model's migrations from state version 1 to 3``."""
    groups: dict[tuple[type, int, int], list[str]] = {}
    for s in found:
        groups.setdefault((s.cls, s.start, s.current), []).append(s.path)
    parts = []
    for (cls, start, current), paths in groups.items():
        shown = [repr(p) for p in paths if p]
        if len(shown) > 4:
            shown = [*shown[:2], "...", shown[-1], f"({len(shown)} modules)"]
        at = f" at {', '.join(shown)}" if shown else ""
        parts.append(f"{cls.__name__}'s migrations from state version {start} to {current}{at}")
    return "; ".join(parts)


def explained(
    error: ConversionError,
    found: Sequence[Stage],
    where: str,
    more: Sequence[ConversionProblem] = (),
) -> ConversionError:
    """`error` of the check of migrated names against the model, its missing and unknown
    names explained as the migrations' (the fix is in a migration, not in a load's
    options), with `more` problems after them."""
    one = found[0] if len(found) == 1 and not found[0].path else None
    saved = f"a state of version {one.start}" if one is not None else "the saved state"
    holder = one.cls.__name__ if one is not None else "the model"
    fixes = {
        "missing": f"no migration makes it from {saved}: add a Rule for it to the migration "
        f"that renamed it, or an Init to the one that added it.",
        "unknown": f"{saved} still holds it after the migrations, but {holder} has no such "
        f"leaf: add a Rule to the migration that renamed it, or an Ignore to the one that "
        f"removed it.",
    }
    problems = [
        dataclasses.replace(p, hint=fixes[p.kind]) if p.kind in fixes else p for p in error.problems
    ]
    return ConversionError(f"{where}: after {stages_text(found)}", [*problems, *more])


def _check_added_kept(rules: Sequence[AnyRule], nodes: Mapping[str, _Node], here: str) -> None:
    """A parameter an earlier migration added has no saved value: a later one may rename
    or ignore it, not transform it."""
    problems, first_match = [], FirstMatch(rules)
    for name, node in nodes.items():
        found = first_match(name) if node[0] == "init" else None
        rule = None if found is None else rules[found[0]]
        if isinstance(rule, Rule) and (
            not isinstance(rule.transform, identity) or len(rule.sources) > 1
        ):
            problems.append(
                ConversionProblem(
                    "transform",
                    name,
                    hint=f"{rule!r} transforms it, but migration {node[1]} -> {node[1] + 1} added "
                    f"it (Init), so an older state has no value for it: only rename it here, "
                    f"or Init the new name instead.",
                )
            )
    if problems:
        raise ConversionError(here, problems)


def _check_added(added: set[str], leaves: Mapping[str, Any], where: str) -> None:
    problems = [
        ConversionProblem(
            "unknown",
            name,
            hint="an Init adds it, but the model has no such leaf: fix the name, or "
            "rename it in the migration that renamed the parameter.",
        )
        for name in sorted(added)
        if name not in leaves and part_names(name)[0] not in leaves  # (a quantized one: parts)
    ]
    if problems:
        raise ConversionError(where, problems)


def without_values(added: set[str], leaves: Mapping[str, Any]) -> list[ConversionProblem]:
    """A problem for each name in `added` (the parameters the migrations add, which keep
    the model's values) whose leaf the model holds no value for (an abstract model's), in
    the model's order."""
    names = {part_names(n)[0]: n for n in added} | {n: n for n in added}
    return [
        ConversionProblem(
            "missing",
            names[name],
            hint="an Init adds it, so it keeps the model's own value, but the model is abstract "
            "(jax.eval_shape) and has none: load into a concrete model (made by its class), "
            "or give this leaf of the abstract model a value first (equinox.tree_at).",
        )
        for name, leaf in leaves.items()
        if name in names and isinstance(leaf, jax.ShapeDtypeStruct)
    ]


def _composed(
    source: Mapping[str, Any],
    nodes: Mapping[str, _Node],
    applications: Sequence[tuple[Transform, int | None, tuple[_Node, ...]]],
) -> list[AnyRule]:
    """One literal rule per group of source names that make the same final names (a
    rename, a single transform, or a chain of them), an Ignore of the names dropped, and
    :data:`PASS` for the names no migration changed."""
    order = {name: i for i, name in enumerate(source)}

    def sources_of(node: _Node) -> set[str]:
        if node[0] == "source":
            return {node[1]}
        return set().union(*(sources_of(i) for i in applications[node[1]][2]))

    groups: list[tuple[set[str], list[str]]] = []  # (source names, final names) apart
    used: set[str] = set()
    rules: list[AnyRule] = []
    for name, node in nodes.items():
        if node[0] == "init":
            continue
        if node[0] == "source":
            used.add(node[1])
            if node[1] != name:
                rules.append(Rule(node[1], name))
            continue
        mine = sources_of(node)
        used |= mine
        joined = [g for g in groups if g[0] & mine]
        groups = [g for g in groups if not g[0] & mine]
        groups.append(
            (mine.union(*(g[0] for g in joined)), [*(n for g in joined for n in g[1]), name])
        )
    for names, targets in groups:
        wanted = tuple(nodes[t] for t in targets)
        transform, count, inputs = applications[wanted[0][1]]
        if count is not None and wanted == tuple(("out", wanted[0][1], j) for j in range(count)):
            if all(i[0] == "source" for i in inputs):  # one transform of saved arrays: as it
                # is, so a load reads it as the rule would (a transpose piece by piece)
                rules.append(Rule(tuple(i[1] for i in inputs), tuple(targets), transform))
                continue
        read = tuple(sorted(names, key=order.__getitem__))
        rules.append(Rule(read, tuple(targets), _Chain(applications, read, wanted)))
    dropped = [n for n in source if n not in used]
    if dropped:
        rules.append(Ignore(*dropped))
    return [*rules, PASS]


class _Chain(Transform):
    """The transforms of consecutive migrations that make some final names from some
    saved ones, run as one (each application once per call)."""

    def __init__(
        self,
        applications: Sequence[tuple[Transform, int | None, tuple[_Node, ...]]],
        inputs: tuple[str, ...],
        wanted: tuple[_Node, ...],
    ):
        self.applications, self.inputs, self.wanted = applications, inputs, wanted

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        values: dict[_Node, Any] = {
            ("source", n): a for n, a in zip(self.inputs, arrays, strict=True)
        }

        def value(node: _Node) -> Any:
            if node not in values:
                transform, count, inputs = self.applications[node[1]]
                results = transform(tuple(value(i) for i in inputs), count)
                values.update(((("out", node[1], j), r) for j, r in enumerate(results)))
            return values[node]

        return tuple(value(n) for n in self.wanted)

    def _args(self) -> str:
        seen: list[int] = []

        def walk(node: _Node) -> None:
            if node[0] == "out" and node[1] not in seen:
                for i in self.applications[node[1]][2]:
                    walk(i)
                seen.append(node[1])

        for node in self.wanted:
            walk(node)
        return " then ".join(repr(self.applications[a][0]) for a in seen)
