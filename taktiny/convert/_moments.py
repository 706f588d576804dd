"""Optimizer state that follows the model: the rules written for the parameters' names,
applied to every moment of an optimizer state.

An optax state names its leaves ``<prefix>.<parameter name>`` where it keeps one array
per parameter (``0.mu.layers.0.kernel``: Adam's first moment; ``0.trace...``: SGD's
momentum; ``inner_state.0.nu...`` under ``inject_hyperparams``; ``inner_states.<label>.
inner_state.0.mu...`` under ``multi_transform``, for the parameters of that label only),
and ``<name>`` for the rest (``0.count``, ``hyperparams.learning_rate``).

How the moments are found, and why it is done so. Nothing but names is needed, so an
abstract state (``jax.eval_shape(optimizer.init, model)``) or a flat one does:

1. A target leaf *ends in a parameter name* when the last parts of its name are a name the
   rules make (a rule's target template matches them); the longest such end is taken,
   and the parts before it are the leaf's prefix (``0.mu``).
2. If some leaf is a parameter name as a whole, the target is a model, and the
   conversion is the ordinary one. Otherwise the prefixes found are the *moment
   prefixes*, and every leaf under one of them (the longest that fits) is the moment of
   the parameter named by the rest, whether a rule makes that name or not (a new head's
   moments are reported as missing, under their full names).
3. Source names are split by the same prefixes. Each prefix gets the rules with the
   prefix put in front of their templates, so the moments are renamed, transposed,
   split, stacked and concatenated as their parameters are, and coverage is checked on
   the full names (``0.mu.head.kernel`` is missing; ``0.nu.fc.weight`` is unused).
   A rule that matches nothing under one prefix is no problem: a ``multi_transform``
   keeps each label's moments under its own prefix, and a masked optimizer none at all.
4. The other leaves (step counts, injected hyperparameters) pass through unchanged: each
   must be in the source under the same name, with the same shape and kind of dtype.

``allow`` patterns are matched against the full name, and for a moment also against its
parameter's name, so the patterns that let a model's conversion through let its moments
through too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..state import kind as values_kind
from ._coverage import Allowance, ConversionError, ConversionProblem, Report, Step, plan, spec
from ._rules import AnyRule, Ignore, Rule, Tie, compile_template

_GLOB = set("*?[]{}")  # what a literal name in a template must not hold


def rule_targets(rules: Sequence[AnyRule]) -> Callable[[str], bool]:
    """Whether a name is one the rules make: a Rule's target template matches it."""
    patterns = [
        compile_template(t, repr(r)) for r in rules if isinstance(r, Rule) for t in r.targets
    ]
    seen: dict[str, bool] = {}

    def made(name: str) -> bool:
        if name not in seen:
            seen[name] = any(p.fullmatch("." + name) for p in patterns)
        return seen[name]

    return made


def prefixes(leaves: Sequence[str], is_param: Callable[[str], bool]) -> list[str]:
    """The moment prefixes of an optimizer state's leaf names, longest first."""
    found = set()
    for name in leaves:
        parts = name.split(".")
        k = next((k for k in range(1, len(parts)) if is_param(".".join(parts[k:]))), None)
        if k is not None:
            found.add(".".join(parts[:k]))
    return sorted(found, key=len, reverse=True)


def split(name: str, moments: Sequence[str]) -> tuple[str, str] | None:
    """(prefix, parameter name) of a moment's name; None for a name under no prefix."""
    prefix = next((p for p in moments if name.startswith(p + ".")), None)
    return None if prefix is None else (prefix, name[len(prefix) + 1 :])


def owners(leaves: Sequence[str], is_param: Callable[[str], bool]) -> dict[str, str]:
    """The parameter name of each moment among an optimizer state's leaf names."""
    moments = prefixes(leaves, is_param)
    return {name: found[1] for name in leaves if (found := split(name, moments)) is not None}


def _prefixed(rule: AnyRule, prefix: str) -> AnyRule:
    """`rule`, for the moments under `prefix`."""
    if isinstance(rule, Ignore):
        return Ignore(*(f"{prefix}.{s}" for s in rule.sources))
    if isinstance(rule, Tie):
        return Tie(f"{prefix}.{rule.sources[0]}", same_as=f"{prefix}.{rule.same_as}")
    escaped = "".join("\\" + c if not (c.isalnum() or c == "_") else c for c in prefix)
    sources = [
        escaped + r"\.(?:" + s.removeprefix("^") + ")" if rule.regex else f"{prefix}.{s}"
        for s in rule.sources
    ]
    targets = [f"{prefix}.{t}" for t in rule.targets]
    return Rule(sources, targets, rule.transform, regex=rule.regex)


def _allow(allow: Mapping[str, Sequence[str]], moments: Sequence[str]) -> dict[str, list[str]]:
    """`allow` with each pattern also put under every moment prefix."""
    return {
        kind: [*patterns, *(f"{p}.{pattern}" for p in moments for pattern in patterns)]
        for kind, patterns in allow.items()
    }


def plan_state(
    rules: Sequence[AnyRule],
    source: Mapping[str, Any],
    leaves: Mapping[str, Any],
    allow: Mapping[str, Sequence[str]],
    where: str,
    *,
    is_param: Callable[[str], bool] | None = None,
    missing: Callable[[str, str], bool] | None = None,
) -> tuple[Report, list[tuple[str, str]]]:
    """:func:`plan` for a model, or for an optimizer state (see the module's doc).

    `is_param`: what a parameter name is; given, `leaves` are an optimizer state's. By
    default, the rules' targets, and `leaves` are a model's when one of them is such a
    name, or when none ends in one. `missing`: for a moment (prefix, parameter name) the
    source may lack; by default, the one whose name `allow` lets through.
    """
    if is_param is None:
        is_param = rule_targets(rules)
        moments = [] if any(map(is_param, leaves)) else prefixes(list(leaves), is_param)
        if not moments:
            return plan(rules, source, leaves, allow, where)
    else:
        moments = prefixes(list(leaves), is_param)
    odd = [p for p in moments if _GLOB & set(p)]
    if odd:
        raise ValueError(
            f"{where}: the optimizer state's names {odd} hold one of '*?[]{{}}', which "
            f"name templates give a meaning to; rename the labels or keys that hold them."
        )
    expanded = [_prefixed(rule, p) for p in moments for rule in rules]
    allowed = _allow(allow, moments)
    if missing is not None:
        allowed["missing"] = [
            name
            for name in leaves
            if (found := split(name, moments)) is not None and missing(*found)
        ]
    kept = {n: v for n, v in source.items() if split(n, moments) is not None}
    targets = {n: v for n, v in leaves.items() if split(n, moments) is not None}
    problems: list[ConversionProblem] = []
    report, ties = Report((), ()), []
    try:
        report, ties = plan(expanded, kept, targets, allowed, where, unmatched=False)
    except ConversionError as error:
        problems += (_named(p, moments, loaded=missing is not None) for p in error.problems)
    steps = list(report.steps)
    scalars = {n: v for n, v in leaves.items() if n not in targets}
    for name in (n for n in source if n not in kept and n not in scalars):
        problems.append(
            ConversionProblem(
                "unused",
                name,
                hint=f"is under none of the moment prefixes {list(moments)} and the target has no "
                f"such name; convert a state of the same optimizer, or allow it "
                f"(allow={{'unused': [{name!r}]}}).",
            )
        )
    for name, leaf in scalars.items():
        problem = _scalar(name, source, leaf)
        if problem is None:
            steps.append(Step(Rule(name, name), (name,), (name,)))
        else:
            problems.append(problem)
    allows = Allowance(allowed)
    let = [p for p in problems if allows(p.kind, p.name)]
    if len(let) < len(problems):
        raise ConversionError(where, [p for p in problems if p not in let])
    return report._replace(allowed=(*report.allowed, *let), steps=tuple(steps)), ties


def _named(problem: ConversionProblem, moments: Sequence[str], loaded: bool) -> ConversionProblem:
    """A missing moment's problem, with a hint that names its parameter. `loaded`: the
    parameter is loaded, so its moments must be."""
    found = split(problem.name, moments)
    if problem.kind != "missing" or found is None:
        return problem
    prefix, name = found
    fix = (
        "the parameter is loaded, so its moments must be too: convert a state of the same "
        "optimizer, or leave the parameter out as well"
        if loaded
        else f"convert a state of the same optimizer, or allow it (allow={{'missing': "
        f"[{name!r}]}}) and load with strict=False to keep the target's value"
    )
    hint = (
        f"no rule makes this {prefix!r} moment of the parameter {name!r}, as the source "
        f"lacks the moment its rule reads; {fix}."
    )
    return dataclasses.replace(problem, hint=hint)


def _scalar(name: str, source: Mapping[str, Any], leaf: Any) -> ConversionProblem | None:
    """The problem with an optimizer state's leaf that is no moment, passed through."""
    if name not in source:
        return ConversionProblem(
            "missing",
            name,
            hint="this leaf of the optimizer state is no moment of a parameter (a step count, a "
            "hyperparameter), so it passes through by name, but the source lacks it; "
            "convert a state of the same optimizer.",
        )
    got, want = spec(source[name]), spec(leaf)
    if got.shape != want.shape or values_kind(got.dtype) != values_kind(want.dtype):
        return ConversionProblem(
            "shape" if got.shape != want.shape else "dtype",
            name,
            hint=f"passes through unchanged, but the source holds {got.dtype.name}"
            f"{list(got.shape)} where the target holds {want.dtype.name}{list(want.shape)}.",
        )
    return None
