"""The steps of a load, planned from the checkpoint's headers before any data is read: one
renaming step per tensor when the checkpoint uses the model's own names, or the steps of
the conversion rules; every problem with the names found at once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import AbstractMesh

from .._qarray import QArray
from ..convert._convert import check_ties
from ..convert._coverage import (
    ConversionError,
    ConversionProblem,
    Step,
    allowed_by,
    check_allow,
    plan,
)
from ..convert._migrate import (
    PASS_ALLOWED,
    Stage,
    explained,
    migration_rules,
    stages,
    stages_text,
    without_values,
)
from ..convert._rules import AnyRule, Rule
from ..sharding._specs import mesh_text
from ..state import _names, _schema, _tree, _values
from ..state import _problems as err
from . import _quantized_format as qz
from ._checkpoint import Checkpoint, open_safetensors, schema_part
from ._header_checks import (
    absent_leaves,
    check_packed_listed,
    other_representation,
    quantized_into_float,
    spec_of,
    unquantizable,
)
from ._read import Tensor


def parts_of(name: str, quantized: Mapping[str, QArray]) -> tuple[str, ...]:
    """The leaves a step's target fills: a quantized parameter's two parts, or itself."""
    return (f"{name}.value", f"{name}.scale") if name in quantized else (name,)


def as_tree(model: Any) -> Any:
    """The tree a load walks: `model`, or for a flat ``{"a.b": array}`` dict (as
    `save_safetensors` saves one under its own keys) the nested dicts its names make,
    ``{"a": {"b": array}}``, whose flat names are its keys. Raises TypeError for a name
    that also begins another (``"a"`` and ``"a.b"``): no tree has both."""
    if not (
        _names.is_flat(model)
        and all(type(k) is str for k in model)
        and any("." in k for k in model)
    ):
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


def opened(
    model: Any, path: Any, rules: Any, allow: Any
) -> tuple[str, Checkpoint, dict[str, Any], dict[str, QArray]]:
    """What a load (or its plan) starts from: the name it gives itself in messages, the
    checkpoint opened (its headers), the model's flat leaves and its quantized arrays.
    Raises ValueError for `allow` without `rules`, and for leaves on an abstract mesh."""
    where = f"taktiny.io.load_safetensors({type(model).__name__})"
    if rules is None and allow is not None:
        raise ValueError(f"{where}: allow= applies to rules; pass rules= with it.")
    checkpoint = path if isinstance(path, Checkpoint) else open_safetensors(path)
    leaves = _tree.flat_state_dict(model)
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
    return where, checkpoint, leaves, qz.quantized_arrays(model)


def unkept(where: str, migration: Migration | None) -> ConversionError | None:
    """The error for the leaves a migration adds that the model has no value for."""
    if migration is None or not migration.problems:
        return None
    return ConversionError(f"{where}: after {stages_text(migration.stages)}", migration.problems)


class Migration(NamedTuple):
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


def migration_of(
    where: str,
    model: Any,
    checkpoint: Checkpoint,
    leaves: Mapping[str, Any],
    quantized: Mapping[str, QArray],
    rules: Sequence[AnyRule] | None,
    *,
    has_values: bool = False,
) -> Migration | None:
    """The migration a load of `checkpoint` into `model` needs, when the schema in the
    file records an older state version of the model's class, or of a module inside it,
    than the class's own (a file with no schema is not Taktiny's and has no version);
    None when it needs none. Raises ValueError for a newer version, and for `rules` with
    an older one (user rules convert files that are not Taktiny's; the migrations convert
    this one); ConversionError for a migration's problems. With `has_values`, the model's
    leaves stand for the values of the concrete model (as :func:`taktiny.eval_shape` of
    its factory describes it): an added leaf keeps its value, whatever the leaf is."""
    if checkpoint.metadata.get(_schema.KEY) is None:  # not Taktiny's: no version
        return None
    version, versions = schema_part(checkpoint, _schema.recorded_versions)  # (entries unread)
    found = stages(model, version, versions, where)  # (newer: raises)
    if not found:
        return None
    if rules is not None:
        raise ValueError(
            f"{where}: {checkpoint.path} was saved at older state versions, which "
            f"{stages_text(found)} convert; rules= converts a checkpoint that is not "
            f"Taktiny's into the model's names: drop rules=."
        )
    made, names = migration_rules(model, checkpoint, found, leaves, where)
    added = {p for n in names for p in parts_of(n, quantized)}
    problems = [] if has_values else without_values(names, leaves)
    return Migration(found, made, added, problems)


def steps_of(
    where: str,
    rules: Sequence[AnyRule] | None,
    allow: Mapping[str, Sequence[str]] | None,
    checkpoint: Checkpoint,
    leaves: Mapping[str, Any],
    quantized: Mapping[str, QArray],
    strict: bool,
    *,
    ties: list[tuple[str, str]] | None = None,
    migration: Migration | None = None,
) -> list[Step]:
    """The steps of a load, in the file's order, every problem the headers show raised
    first (a StateDictError or ConversionError). With `ties` (a list), the rules' tied
    pairs are put in it instead of being read and compared (a plan reads no data). With a
    `migration`, its rules replace `rules`, and the leaves it adds need not be made; the
    problems of those the model has no value for come with a ConversionError of the
    rules', else are the caller's to raise (a plan keeps the steps)."""
    added: set[str] = set()
    if migration is not None:
        rules, added = migration.rules, migration.added
        allow = {**PASS_ALLOWED, "missing": sorted(added)}
    if rules is None:
        steps = plain_steps(where, checkpoint, leaves, quantized, strict)
    elif migration is None:
        steps = ruled_steps(where, rules, allow, checkpoint, leaves, quantized, strict, ties)
    else:
        try:
            steps = ruled_steps(where, rules, allow, checkpoint, leaves, quantized, strict, ties)
        except ConversionError as error:
            raise explained(error, migration.stages, where, migration.problems) from None
    made = {p for s in steps for t in s.targets for p in parts_of(t, quantized)}
    problems = absent_leaves(leaves, made | added, strict)
    if problems:
        raise err.StateDictError(where, problems)
    steps.sort(key=lambda s: min((str(t.file), t.offset) for t in tensors_of(checkpoint, s)))
    return steps


def tensors_of(checkpoint: Checkpoint, step: Step) -> list[Tensor]:
    """The tensors a step reads, in the order its transform takes them."""
    return [checkpoint[name] for name in step.sources]


def plain_steps(
    where: str,
    checkpoint: Checkpoint,
    leaves: Mapping[str, Any],
    quantized: Mapping[str, QArray],
    strict: bool,
) -> list[Step]:
    """One renaming step per tensor, when the checkpoint uses the model's own names (or a
    quantized parameter's own name for its float array); every problem with the names,
    shapes and dtype kinds in one StateDictError."""
    steps, problems = plain_plan(checkpoint, leaves, quantized, strict)
    if problems:
        matched = len(checkpoint) - sum(p.kind == "unknown" for p in problems)
        raise err.StateDictError(where, problems, matched=matched)
    return steps


def plain_plan(
    checkpoint: Checkpoint,
    leaves: Mapping[str, Any],
    quantized: Mapping[str, QArray],
    strict: bool,
) -> tuple[list[Step], err.Problems]:
    """:func:`plain_steps`'s steps and problems, not raised: the steps of the tensors that
    load, which a plan shows beside the problems of the others."""
    problems = err.Problems()
    steps = []
    done: set[str] = set()  # checkpoint names checked here, as quantized parameters
    covered: set[str] = set()  # the parts of those (loaded, or refused with a problem)
    for name, like in quantized.items():
        parts = [p for p in (f"{name}.value", f"{name}.scale") if p in checkpoint]
        tensor = checkpoint.get(name)
        if tensor is not None:  # a float array, quantized as it is loaded
            done.update([name, *parts])
            covered.update(parts_of(name, quantized))
            problem = err.stored_both(name, parts) if parts else unquantizable(name, tensor, like)
            if problem is not None:
                problems.append(problem)
            else:
                steps.append(Step(IDENTITY, (name,), (name,)))
        elif parts:
            problem = other_representation(name, like, checkpoint)
            if problem is not None:
                problems.append(problem)
                done.update(parts)
                covered.update(parts_of(name, quantized))
    unknown = [(n, checkpoint[n]) for n in checkpoint if n not in leaves and n not in done]
    floats = quantized_into_float(checkpoint, leaves, [n for n, _ in unknown])
    problems += floats.values()
    unknown = [(n, t) for n, t in unknown if n.rpartition(".")[0] not in floats]
    problems += err.unknown(unknown, list(leaves), True, set(checkpoint))
    for name, tensor in checkpoint.items():
        leaf = leaves.get(name)
        if leaf is None or name in done:
            continue
        shape, dtype = spec_of(leaf)
        check_packed_listed(tensor, shape, dtype)
        if tuple(tensor.shape) != shape:
            problems.append(err.shape(name, shape, tuple(tensor.shape)))
        elif _values.kind(tensor.dtype) != _values.kind(dtype):
            want, have = _values.kind(dtype), _values.kind(tensor.dtype)
            problems.append(err.dtype_kind(name, dtype, tensor.dtype, str(want), str(have)))
        else:
            steps.append(Step(IDENTITY, (name,), (name,)))
    made = {p for s in steps for t in s.targets for p in parts_of(t, quantized)}
    problems += absent_leaves(leaves, set(checkpoint) | made | covered | set(floats), strict)
    return steps, problems


def ruled_steps(
    where: str,
    rules: Sequence[AnyRule],
    allow: Mapping[str, Sequence[str]] | None,
    checkpoint: Checkpoint,
    leaves: Mapping[str, Any],
    quantized: Mapping[str, QArray],
    strict: bool,
    ties: list[tuple[str, str]] | None = None,
) -> list[Step]:
    """The steps of the rules, checked from the headers (the tied pairs read and compared,
    or with `ties`, put in it). A leaf no rule makes is `strict`'s
    to decide (the load checks it), not `allow`'s. A quantized parameter may be made from
    its parts or from a float array (quantized on load): the plan sees both names, lets
    either be missing, and the pair is checked here."""
    allowed = check_allow(allow)
    if not strict:
        allowed = {**allowed, "missing": ["**"]}
    if not quantized:
        report, tied = plan(rules, checkpoint, leaves, allowed, where, loading=True)
        _tied(tied, checkpoint, where, ties)
        return list(report.steps)
    logical = {n: jax.ShapeDtypeStruct(q.shape, q.dtype) for n, q in quantized.items()}
    either = [p for n in quantized for p in (n, *parts_of(n, quantized))]
    lenient = {**allowed, "missing": [*allowed.get("missing", ()), *either]}
    report, tied = plan(rules, checkpoint, {**leaves, **logical}, lenient, where, loading=True)
    _tied(tied, checkpoint, where, ties)
    made = {t for s in report.steps for t in s.targets}
    problems = []
    for name in quantized:
        parts = [p for p in parts_of(name, quantized) if p in made]
        if name in made and parts:
            problems.append(
                ConversionProblem(
                    "duplicate",
                    name,
                    hint=f"made both as a float array (quantized on load) and as its quantized "
                    f"parts {parts}; make the rules produce one of them.",
                )
            )
        elif name not in made:
            problems += [
                ConversionProblem(
                    "missing",
                    part,
                    hint=f"no rule produces this target leaf, nor the float array {name!r} its "
                    f"quantized parameter is made from on load; add a Rule, or load with "
                    f"strict=False to keep the model's value.",
                )
                for part in parts_of(name, quantized)
                if part not in made and not allowed_by("missing", part, allowed)
            ]
    if problems:
        raise ConversionError(where, problems)
    return list(report.steps)


def _tied(
    tied: list[tuple[str, str]],
    checkpoint: Checkpoint,
    where: str,
    ties: list[tuple[str, str]] | None,
) -> None:
    if ties is None:
        check_ties(tied, checkpoint, where)
    else:
        ties += tied


IDENTITY = Rule("{name}", "{name}")
"""The rule of a plain load: each tensor to the leaf of its own name."""
