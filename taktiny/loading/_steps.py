"""The steps of a load, planned from the checkpoint's headers before any data is read: one
renaming step per tensor when the checkpoint uses the model's own names, or the steps of
the conversion rules (or of an older checkpoint's migrations); every problem with the
names, shapes and dtype kinds found at once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from .._problems import Problems
from ..convert import (
    PASS_ALLOWED,
    Allowance,
    AnyRule,
    ConversionError,
    ConversionProblem,
    Rule,
    Step,
    check_allow,
    check_ties,
    dequantize_blocks,
    explained,
    identity,
    plan,
    transformed_specs,
    transpose,
    unstack,
)
from ..io import Checkpoint, Tensor
from ..state import problems as err
from ..state import resolve_sources, unfilled
from ._checks import check_packed_listed, spec_of
from ._record import Load, parts_of


def steps_of(
    load: Load,
    *,
    ties: list[tuple[str, str]] | None = None,
    found: list[Step] | None = None,
) -> list[Step]:
    """The steps of a load, in the file's order, every problem the headers show raised
    first (a StateDictError or ConversionError): each name of the checkpoint resolved
    against the model's leaves, each shape and dtype kind checked, once. With `ties` (a
    list), the rules' tied pairs are put in it instead of being read and compared (a plan
    reads no data). With a migration, its rules replace the load's, and the leaves it adds
    need not be made; the problems of those the model has no value for come with a
    ConversionError of the rules', else are the caller's to raise (a plan keeps the
    steps). With `found` (a list), the steps of the tensors that load by their own names
    are put in it before the problems of the others are raised (a plan shows both)."""
    migration, checkpoint = load.migration, load.checkpoint
    if load.rules is None and migration is None:
        steps, problems = plain_plan(load)  # (the leaves not loaded checked too)
        if found is not None:
            found += steps
        if problems:
            matched = len(checkpoint) - sum(p.kind == "unknown" for p in problems)
            raise err.StateDictError(load.where, problems, matched=matched)
    else:
        rules, allow, added = load.rules or [], load.allow, set[str]()
        if migration is not None:
            rules, added = migration.rules, migration.added
            allow = {**PASS_ALLOWED, "missing": sorted(added)}
        try:
            steps = ruled_steps(load, rules, allow, ties)
        except ConversionError as error:
            if migration is None:
                raise
            raise explained(error, migration.stages, load.where, migration.problems) from None
        made = {p for s in steps for t in s.targets for p in parts_of(t, load.quantized)}
        problems = unfilled(load.leaves.items(), made | added, load.strict, load.stacks)
        if problems:
            raise err.StateDictError(load.where, problems)
    files = {file: str(file) for file in {t.file for t in checkpoint.values()}}
    steps.sort(key=lambda s: min((files[t.file], t.offset) for t in tensors_of(checkpoint, s)))
    return steps


def results_of(step: Step, sources: Sequence[Tensor]) -> tuple[Any, ...]:
    """What a step's transform makes of its `sources`, abstract: read from their headers."""
    specs = [jax.ShapeDtypeStruct(t.shape, jax.dtypes.canonicalize_dtype(t.dtype)) for t in sources]
    count = None if step.rule.gathered else len(step.targets)
    return transformed_specs(step.rule.transform, count, specs)


def tensors_of(checkpoint: Checkpoint, step: Step) -> list[Tensor]:
    """The tensors a step reads, in the order its transform takes them."""
    return [checkpoint[name] for name in step.sources]


def plain_plan(load: Load) -> tuple[list[Step], Problems]:
    """One renaming step per tensor, when the checkpoint uses the model's own names (or a
    quantized parameter's own name for its float array), and every problem with the
    names, shapes and dtype kinds, and with the leaves not loaded: the checkpoint's
    headers resolved against the model by the state walk's one resolve
    (:func:`taktiny.state.resolve_sources`), as a load of values is; the steps of the
    tensors that load, beside the problems of the others."""
    checkpoint, leaves = load.checkpoint, load.leaves
    for name, tensor in checkpoint.items():
        leaf = leaves.get(name)
        if leaf is not None:
            check_packed_listed(tensor, *spec_of(leaf))
    sources = resolve_sources(
        load.view, checkpoint, strict=load.strict, records=checkpoint.quantized, stacks=load.stacks
    )
    steps = [Step(IDENTITY, (entry,), (leaf,)) for leaf, entry in sources.leaves.items()]
    steps += [Step(IDENTITY, (entry,), (name,)) for name, entry in sources.floats.items()]
    steps += [Step(UNSTACK, (entry,), layers) for entry, layers in sources.whole.items()]
    return steps, Problems(sources.problems)


def ruled_steps(
    load: Load,
    rules: Sequence[AnyRule],
    allow: Mapping[str, Sequence[str]] | None,
    ties: list[tuple[str, str]] | None = None,
) -> list[Step]:
    """The steps of the rules, checked from the headers (the tied pairs read and compared,
    or with `ties`, put in it). A leaf no rule makes is `strict`'s
    to decide (the load checks it), not `allow`'s. A quantized parameter may be made from
    its parts or from a float array (quantized on load): the plan sees both names, lets
    either be missing, and the pair is checked here."""
    checkpoint, leaves, quantized, where = load.checkpoint, load.leaves, load.quantized, load.where
    allowed = check_allow(allow)
    if not load.strict:
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
    problems, allows = [], Allowance(allowed)
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
                if part not in made and not allows("missing", part)
            ]
    if problems:
        raise ConversionError(where, problems)
    others = Problems()
    for step in report.steps:  # a QArray a transform makes: in the model's layout
        if isinstance(step.rule.transform, identity | transpose | dequantize_blocks):
            continue  # (these make arrays)
        targets = [t for t in step.targets if t in quantized]
        if not targets:
            continue
        made_by = dict(
            zip(step.targets, results_of(step, tensors_of(checkpoint, step)), strict=True)
        )
        for name in targets:
            like, got = quantized[name], made_by[name]
            problem = like.made_problem(name, got, step.sources)
            if problem is not None:
                others.append(problem)
    if others:
        raise err.StateDictError(where, others)
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
UNSTACK = Rule("{name}", "{name}", unstack())
"""The rule of a stacked tensor given whole to a load into a stack through its per-layer
twin: cut into its layers, each the leaf of its per-layer name."""
