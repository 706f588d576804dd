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

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..state._tree import flat_state_dict
from ._convert import Converted
from ._coverage import ConversionError, ConversionProblem, plan, runner, spec
from ._rules import AnyRule, Ignore, Init, Rule, Tie, first_match
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


def _start(cls: type, current: int, version: int | None, where: str) -> int:
    """The version a state saved at `version` (None: undeclared, so 1) starts from."""
    start = 1 if version is None else version
    if type(start) is not int or start < 1:
        raise ValueError(
            f"{where}: a state version is an int >= 1 (or None for a model that declared "
            f"none), got {version!r}."
        )
    if start > current:
        raise ValueError(
            f"{where}: the state was saved at state version {start}; {cls.__name__} is at "
            f"version {current}: load it with the newer code that saved it (migrations only "
            f"go forward)."
        )
    return start


def migrate(model: Any, state: Mapping[str, Any], *, version: int | None) -> dict[str, Any]:
    """The flat state of `model` made from `state`, saved at state `version` of the
    model's class, by the migrations the class declares (see the module's doc).

    The one way to load an older state: pass the version its schema records
    (``saved.version``; None for a model that declared none, which is version 1), then
    load the result as any flat state, strict (``tt.load_flat_state_dict(model, flat,
    strict=True)``). Parameters a migration adds (:class:`~taktiny.convert.Init`) take
    `model`'s own values, so `model` must be concrete then. A state of the model's own
    version is returned as it is (its load checks it).
    :func:`taktiny.io.load_safetensors` migrates by itself, from the schema in the file.

    Args:
        model: the model (its class declares ``state_version`` and ``state_migrations``).
        state: the flat state as saved (``tt.flat_state_dict`` of a raw Orbax restore);
            its values may be arrays or anything with ``.shape`` and ``.dtype``.
        version: the state version `state` was saved at.

    Returns:
        ``{flat name: value}`` for every leaf of `model`, in its order.

    Raises:
        ValueError: `version` is newer than the model's (or not a version).
        TypeError: the class's declaration is malformed.
        taktiny.convert.ConversionError: listing every problem of the migrations (naming
            the migration) or of the result against the model; nothing is converted.
    """
    where = f"taktiny.migrate({type(model).__name__})"
    current, _ = declared(type(model))
    if _start(type(model), current, version, where) == current:
        return dict(state)
    leaves = flat_state_dict(model)
    rules, added = migration_rules(model, state, version, leaves, where)
    target = {n: leaf for n, leaf in leaves.items() if n not in added}
    try:
        report, _ = plan(rules, state, target, PASS_ALLOWED, where)
    except ConversionError as error:
        raise explained(error, type(model), version, where) from None
    converted = Converted(report.steps, state, target)
    return {n: leaves[n] if n in added else converted[n] for n in leaves}


def migration_rules(
    model: Any,
    source: Mapping[str, Any],
    version: int | None,
    leaves: Mapping[str, Any],
    where: str,
) -> tuple[list[AnyRule], set[str]]:
    """The rules that convert `source`, saved at `version`, to `model`'s current names in
    one step each (for :func:`plan`, with :data:`PASS_ALLOWED`), and the names the
    migrations add, each checked to be a leaf of `model` with a value to keep.

    Raises:
        ConversionError: every problem of a migration, or of the names it adds.
    """
    cls = type(model)
    current, migrations = declared(cls)
    nodes: dict[str, _Node] = {name: ("source", name) for name in source}
    specs: dict[_Node, Any] = {("source", n): spec(v) for n, v in source.items()}
    applications: list[tuple[Transform, int | None, tuple[_Node, ...]]] = []
    for k in range(_start(cls, current, version, where), current):
        here = f"{where}: {cls.__name__}.state_migrations[{k - 1}] (version {k} -> {k + 1})"
        migration = migrations[k - 1]
        rules = [r for r in migration if not isinstance(r, Init)]
        _check_added_kept(rules, nodes, here)
        view = {n: _PLACEHOLDER if node[0] == "init" else specs[node] for n, node in nodes.items()}
        report, _ = plan([*rules, PASS], view, {}, {"unknown": ["**"], **PASS_ALLOWED}, here)
        made: dict[str, _Node] = {}
        for step in report.steps:
            inputs = tuple(nodes[n] for n in step.sources)
            if isinstance(step.rule.transform, identity):  # a rename (or no change)
                outputs = inputs
            else:
                count = None if step.rule.gathered else len(step.targets)
                applications.append((step.rule.transform, count, inputs))
                results = jax.eval_shape(
                    runner(step.rule.transform, count), *(specs[i] for i in inputs)
                )
                outputs = tuple(("out", len(applications) - 1, j) for j in range(len(results)))
                specs.update(zip(outputs, results, strict=True))
            made.update(zip(step.targets, outputs, strict=True))
        twice = [n for r in migration if isinstance(r, Init) for n in r.names if n in made]
        if twice:
            raise ConversionError(
                here,
                [
                    ConversionProblem(
                        "duplicate",
                        n,
                        "is added by an Init and also made from the saved state; drop one.",
                    )
                    for n in twice
                ],
            )
        made.update((n, ("init", k)) for r in migration if isinstance(r, Init) for n in r.names)
        nodes = made
    added = {n for n, node in nodes.items() if node[0] == "init"}
    _check_added(added, leaves, where)
    return _composed(source, nodes, applications), added


def explained(
    error: ConversionError, cls: type, version: int | None, where: str
) -> ConversionError:
    """`error` of the check of migrated names against the model, its missing and unknown
    names explained as the migrations' (the fix is in a migration, not in a load's
    options)."""
    current, _ = declared(cls)
    start = 1 if version is None else version
    fixes = {
        "missing": f"no migration makes it from a state of version {start}: add a Rule for "
        f"it to the migration that renamed it, or an Init to the one that added it.",
        "unknown": f"a state of version {start} still holds it after the migrations, but "
        f"{cls.__name__} has no such leaf: add a Rule to the migration that renamed it, or "
        f"an Ignore to the one that removed it.",
    }
    problems = [
        ConversionProblem(p.kind, p.name, fixes[p.kind]) if p.kind in fixes else p
        for p in error.problems
    ]
    return ConversionError(
        f"{where}: after {cls.__name__}'s migrations from state version {start} to {current}",
        problems,
    )


def _check_added_kept(rules: Sequence[AnyRule], nodes: Mapping[str, _Node], here: str) -> None:
    """A parameter an earlier migration added has no saved value: a later one may rename
    or ignore it, not transform it."""
    problems = []
    for name, node in nodes.items():
        found = first_match(rules, name) if node[0] == "init" else None
        rule = None if found is None else rules[found[0]]
        if isinstance(rule, Rule) and (
            not isinstance(rule.transform, identity) or len(rule.sources) > 1
        ):
            problems.append(
                ConversionProblem(
                    "transform",
                    name,
                    f"{rule!r} transforms it, but migration {node[1]} -> {node[1] + 1} added "
                    f"it (Init), so an older state has no value for it: only rename it here, "
                    f"or Init the new name instead.",
                )
            )
    if problems:
        raise ConversionError(here, problems)


def _check_added(added: set[str], leaves: Mapping[str, Any], where: str) -> None:
    problems = []
    for name in sorted(added):
        leaf = leaves.get(name, leaves.get(f"{name}.value"))  # (a quantized one: its parts)
        if leaf is None:
            problems.append(
                ConversionProblem(
                    "unknown",
                    name,
                    "an Init adds it, but the model has no such leaf: fix the name, or "
                    "rename it in the migration that renamed the parameter.",
                )
            )
        elif isinstance(leaf, jax.ShapeDtypeStruct):
            problems.append(
                ConversionProblem(
                    "missing",
                    name,
                    "an Init adds it, so it keeps the model's initial value, but the model "
                    "is abstract and has none: migrate into a concrete model.",
                )
            )
    if problems:
        raise ConversionError(where, problems)


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
