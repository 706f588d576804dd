"""Coverage: what the rules make of a source, checked from names, shapes and dtypes alone,
before any array is converted or loaded; every problem in one `ConversionError`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._problems import ProblemsError, closest
from .._problems import StateProblem as ConversionProblem
from ..state import StateDictError, compile_pattern, dtype_of, host_array, unused_hint
from ..state import kind as values_kind
from ._rules import CAPTURE, AnyRule, FirstMatch, Ignore, Rule, Tie
from ._transforms import Transform

KINDS = ("unused", "missing", "unknown", "unmatched")  # those `allow` may allow; besides:
# "duplicate", "shape", "dtype", "transform", "incomplete", "gather", "tie", "irreversible",
# "round_trip"


class ConversionError(StateDictError):
    """Raised once, listing every problem of a conversion; nothing was converted.

    Each problem is a :class:`ConversionProblem`, the record every problem of a state is
    (:class:`taktiny.StateProblem`: the same class, under the name this module has always
    used), read as ``'name': what is wrong; the fix``. Its ``kind`` is one of
    ``"unused"`` (a source name no rule consumed or ignored), ``"missing"`` (a target leaf
    no rule produced), ``"unknown"`` (a produced name the target does not have),
    ``"unmatched"`` (a rule that matched no name), ``"duplicate"`` (a name produced twice),
    ``"shape"``, ``"dtype"`` (a change of dtype kind; these two with ``expected`` and
    ``got``), ``"transform"`` (the transform failed on these arrays), ``"incomplete"`` (a
    rule found some of its sources only), ``"gather"`` (gathered captures not 0..n-1),
    ``"tie"``, ``"irreversible"`` and ``"representation"`` (export: a rule that cannot
    run backwards; a quantized weight the rules write as a float array) or
    ``"round_trip"``; its ``name`` is the name
    (or the rule's sources) it is about. The first four are those ``allow`` may allow.

    It is a :class:`taktiny.StateDictError`, as a load raises one with rules or without:
    ``except StateDictError`` catches a load's problems either way, and
    :attr:`~taktiny.StateDictError.missing_keys` and
    :attr:`~taktiny.StateDictError.unexpected_keys` (here the ``"unused"`` and ``"unknown"``
    names) read the same. A load with rules raises it under this name for one release more;
    catch ``StateDictError``.

    Args:
        where: the call that failed, which starts the message.
        problems: every problem found.

    Attributes:
        problems: the problems, as a tuple of :class:`ConversionProblem`.
    """

    _unexpected = ("unused", "unknown")

    def __init__(self, where: str, problems: Sequence[ConversionProblem]):
        # (its own message: every problem, in the order found)
        ProblemsError.__init__(self, where, problems, "; nothing was converted.", shown=None)


class Report(NamedTuple):
    """What a conversion will do: its steps, the source names an :class:`Ignore` dropped
    on purpose, and the problems `allow` let through.

    Attributes:
        allowed: the problems that `allow` let through.
        steps: one :class:`Step` per application of a rule, in the order of the source.
        ignored: the source names an :class:`Ignore` dropped on purpose (buffers such as
            ``embeddings.position_ids``), in the order of the source.
    """

    allowed: tuple[ConversionProblem, ...]
    steps: tuple[Step, ...]  # in the order of the source
    ignored: tuple[str, ...] = ()  # in the order of the source


class Step(NamedTuple):
    """One application of a rule: the source names it reads and target names it makes.

    Attributes:
        rule: the rule.
        sources: the source names it reads, in the order its transform takes them.
        targets: the target names it makes, in the order its transform makes them.
    """

    rule: Rule
    sources: tuple[str, ...]
    targets: tuple[str, ...]


def spec(value: Any) -> jax.ShapeDtypeStruct:
    """Shape and dtype of a value, read without its data where it has ``.shape``/``.dtype``."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(value.shape, jax.dtypes.canonicalize_dtype(value.dtype))
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    try:
        if shape is None or dtype is None:
            raise TypeError
        shape, dtype = tuple(shape), dtype_of(dtype)
    except TypeError:  # a list, a number: read it
        array = host_array(value)
        shape, dtype = array.shape, array.dtype
    return jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(dtype))


def runner(transform: Transform, count: int | None) -> Any:
    """``transform`` as a function of the arrays, for ``jax.eval_shape``."""
    return lambda *arrays: transform(arrays, count)


def transformed_specs(
    transform: Transform, count: int | None, specs: Any, traced: dict[Any, Any] | None = None
) -> Any:
    """What `transform` makes of arrays of `specs`, abstract (``jax.eval_shape``, which
    traces it). With `traced` (a dict kept across calls), an equal transform traced on the
    same inputs is looked up there instead (a per-layer rule's steps: one trace, not one a
    layer, each about a millisecond), for transforms whose repr says all they do: Taktiny's
    own, of Taktiny's own inside (a transform of the user's class may hold what its repr
    does not show)."""
    if traced is None or not _described(transform):
        return jax.eval_shape(runner(transform, count), *specs)
    key = (transform, count, tuple((s.shape, np.dtype(s.dtype)) for s in specs))
    if key not in traced:
        traced[key] = jax.eval_shape(runner(transform, count), *specs)
    return traced[key]


def _described(transform: Transform) -> bool:
    inner = [*getattr(transform, "transforms", ()), getattr(transform, "layout", None)]
    return type(transform).__module__.startswith("taktiny.") and all(
        _described(t) for t in inner if t is not None
    )


def _show(s: Any) -> str:
    return f"{np.dtype(s.dtype).name}{list(s.shape)}"


class Allowance:
    """Whether `allow` (``{kind: [patterns]}``) lets a problem of a kind about a name pass:
    ``Allowance(allow)(kind, name)``. Made once for a plan's many problems: a kind's
    patterns without wildcards (which match a name only when equal to it) are kept in a
    set, the others compiled, when the kind is first asked about. A quantized load lets
    each of its parameters' names and parts be missing, three names a parameter, and
    checks every part it makes: pattern by pattern, 600 layers took a second of
    planning."""

    def __init__(self, allow: Mapping[str, Sequence[str]]):
        self.allow = allow
        self.made: dict[str, tuple[set[str], list[Any]]] = {}

    def __call__(self, kind: str, name: str) -> bool:
        made = self.made.get(kind)
        if made is None:
            patterns = self.allow.get(kind, ())
            names = {p for p in patterns if _plain_name(p)}
            wild = [compile_pattern(p) for p in patterns if p not in names]
            made = self.made[kind] = (names, wild)
        names, wild = made
        return name in names or any(w.fullmatch("." + name) for w in wild)


def _plain_name(pattern: Any) -> bool:
    """Whether `pattern` is a name with no wildcard, matching that name alone (a pattern
    that is not valid is compiled, which says why)."""
    return (
        isinstance(pattern, str)
        and not any(c in pattern for c in "*?[")
        and "" not in pattern.split(".")
    )


def check_allow(allow: Mapping[str, Sequence[str]] | None) -> dict[str, Sequence[str]]:
    allow = dict(allow or {})
    for kind, patterns in allow.items():
        if kind not in KINDS or isinstance(patterns, str):
            raise ValueError(
                f"allow takes {{kind: [patterns]}} with kinds {list(KINDS)}, got {kind!r}: "
                f"{patterns!r}. Shapes, dtypes and duplicates are never allowed: fix the rule."
            )
    return allow


def plan(
    rules: Sequence[AnyRule],
    source: Mapping[str, Any],
    leaves: Mapping[str, Any],
    allow: Mapping[str, Sequence[str]],
    where: str,
    *,
    loading: bool = False,
    unmatched: bool = True,
) -> tuple[Report, list[tuple[str, str]]]:
    """The steps that convert `source` into `leaves` (the target's flat leaves), and the
    tied (name, same_as) pairs; raises one ConversionError with every problem not allowed.
    `loading`: for a load, whose `strict` decides on missing leaves (the hint says so).
    `unmatched`: whether a Rule that matched no source name is a problem."""
    problems: list[ConversionProblem] = []

    def add(kind: str, name: str, hint: str, expected: Any = None, got: Any = None) -> None:
        problems.append(ConversionProblem(kind, name, expected, got, hint))

    hits, groups, ties, ignored = [0] * len(rules), {}, [], []
    first_match = FirstMatch(rules)
    for name in source:
        found = first_match(name)
        if found is None:
            add(
                "unused",
                name,
                "no rule consumes or ignores this source name; add a Rule for it, or an Ignore.",
            )
            continue
        i, j, captures = found
        hits[i] += 1
        rule = rules[i]
        if isinstance(rule, Tie):
            ties.append((name, rule.same_as.format(**captures)))
        elif isinstance(rule, Ignore):
            ignored.append(name)
        else:
            key = (i, tuple((k, captures[k]) for k in rule.kept))
            groups.setdefault(key, {}).setdefault(j, []).append((captures, name))
    for rule, hit in zip(rules, hits, strict=True):
        # (an Ignore or a Tie names what a source may hold: a buffer, a tied copy; what one
        # with a typo fails to take is reported as unused)
        if unmatched and not hit and isinstance(rule, Rule):
            why = _why(rule, source)
            add(
                "unmatched",
                ", ".join(rule.sources),
                f"{rule!r} matched no source name; {why}{'' if why.endswith('?') else '.'}",
            )
    produced: dict[str, list[tuple[tuple[str, ...], Any]]] = {}
    steps = []
    traced: dict[Any, Any] = {}  # (transform, count, inputs) -> outputs: each traced once
    for (i, key), found in groups.items():
        rule = rules[i]
        assert isinstance(rule, Rule)
        step = _step(rule, dict(key), found, add)
        if step is None:
            continue
        count = None if rule.gathered else len(step.targets)
        try:
            specs = [spec(source[n]) for n in step.sources]
            out = transformed_specs(step.rule.transform, count, specs, traced)
            if len(out) != len(step.targets):
                raise ValueError(f"it made {len(out)} arrays for {len(step.targets)} targets")
        except Exception as error:  # noqa: BLE001  (any failure is reported with its rule)
            add("transform", step.sources[0], f"{rule!r} failed on {list(step.sources)}: {error}")
            continue
        steps.append(step)
        for target, result in zip(step.targets, out, strict=True):
            produced.setdefault(target, []).append((step.sources, result))
    for name, other in ties:
        if other not in source:
            add(
                "tie",
                name,
                f"is tied to {other!r}, which the source lacks, so it holds the array under "
                f"this name alone: replace the Tie by a Rule that reads {name!r} where "
                f"{other!r} would go.",
            )
        elif (a := spec(source[name])) != (b := spec(source[other])):
            add("tie", name, f"is tied to {other!r} but holds {_show(a)}, not {_show(b)}.")
    for target, made in produced.items():
        got = made[0][1]
        if len(made) > 1:
            add(
                "duplicate",
                target,
                f"produced {len(made)} times, from "
                f"{[list(s) for s, _ in made]}; make the patterns disjoint.",
            )
        elif target not in leaves:
            close = closest(target, list(leaves))
            hint = f"did you mean {close!r}?" if close else "fix the rule's target template."
            add(
                "unknown",
                target,
                f"produced from {list(made[0][0])}, but the target has no such leaf; {hint}",
            )
        elif tuple(got.shape) != tuple(leaves[target].shape):
            want, have = _show(leaves[target]), _show(got)
            add(
                "shape",
                target,
                f"shape mismatch: the target holds {want}, the rule makes {have} from "
                f"{list(made[0][0])}; fix its transform.",
                want,
                have,
            )
        elif values_kind(got.dtype) != values_kind(leaves[target].dtype):
            want, have = _show(leaves[target]), _show(got)
            add(
                "dtype",
                target,
                f"dtype kind changes: the target holds {want}, the rule makes {have}; add "
                f"a cast, or fix the rule.",
                want,
                have,
            )
    keep = (
        "load with strict=False to keep the model's value"
        if loading
        else "allow it (allow={'missing': [...]}) and load with strict=False"
    )
    for leaf in leaves:
        if leaf not in produced:  # (an abstract model's leaf has no value to keep)
            abstract = loading and isinstance(leaves[leaf], jax.ShapeDtypeStruct)
            fix = (
                "; the model is abstract, so it has no value to keep"
                if abstract
                else f", or {keep}"
            )
            add("missing", leaf, f"no rule produces this target leaf; add a Rule{fix}.")
    allows = Allowance(allow)
    allowed = [p for p in problems if allows(p.kind, p.name)]
    if len(allowed) < len(problems):
        raise ConversionError(where, [p for p in problems if p not in allowed])
    return Report(tuple(allowed), tuple(steps), tuple(ignored)), ties


def _step(
    rule: Rule, binding: dict[str, str], found: dict[int, list[Any]], add: Any
) -> Step | None:
    names = {j: [n for _, n in found.get(j, [])] for j in range(len(rule.sources))}
    targets = rule.target_names(binding)
    lacking = [s for j, s in enumerate(rule.sources) if not names[j]]
    if lacking:
        have = [n for ns in names.values() for n in ns]
        add(
            "incomplete",
            have[0],
            f"{rule!r} found {have} but no name for "
            f"{lacking}; it needs all its sources to make {list(targets)}.",
        )
        return None
    if rule.gathered:
        items = sorted(found[0], key=lambda c: (len(c[0][rule.gathered]), c[0][rule.gathered]))
        values = [c[rule.gathered] for c, _ in items]
        if values != [str(k) for k in range(len(values))]:
            add(
                "gather",
                items[0][1],
                f"{rule!r} gathers {{{rule.gathered}}} "
                f"over {values}, which must be 0, 1, ..., n-1.",
            )
            return None
        return Step(rule, tuple(n for _, n in items), targets)
    twice = [ns for ns in names.values() if len(ns) > 1]
    if twice:
        add(
            "duplicate",
            targets[0],
            f"{rule!r} makes it from each of {twice[0]}; make the source pattern name one source.",
        )
        return None
    return Step(rule, tuple(names[j][0] for j in range(len(rule.sources))), targets)


def _why(rule: AnyRule, names: Iterable[str]) -> str:
    if isinstance(rule, Rule) and rule.regex:
        return "check the regular expression against the names"
    try:
        return unused_hint(CAPTURE.sub("*", rule.sources[0]), list(names))
    except ValueError:
        return "check the pattern against the names"
