"""Running the rules: `check`, `convert` (source -> Taktiny), `export` (Taktiny -> source)
and `round_trip_check`."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..quant import PARTS
from ..state import Spec, flat_state_dict, flatten, host_array, load_flat_state_dict
from ._coverage import (
    ConversionError,
    ConversionProblem,
    Report,
    Step,
    check_allow,
    plan,
    spec,
    transformed_specs,
)
from ._moments import owners, plan_state
from ._rules import AnyRule, Ignore, Rule, Tie, capture_names, compile_template, fill


def _leaves(target: Any, rules: Sequence[AnyRule], like: Any = None) -> dict[str, Any]:
    """The flat state of a model, or the flat state given. A model's stacks of layers
    (``nn.Stack``) read per layer when the rules name them so (those of the model `like`,
    for its optimizer state)."""
    if isinstance(target, Mapping):
        return dict(target)
    model = target if like is None else like
    unstacked = not isinstance(model, Mapping) and per_layer(flatten(model)[2], None, rules)
    return flat_state_dict(target, unstacked=unstacked)


_CAPTURE = re.compile(r"\{[^{}]*\}")


def per_layer(spec: Spec, names: Iterable[str] | None, rules: Sequence[AnyRule] | None) -> bool:
    """Whether a conversion names a stack of layers (``nn.Stack``) of the model `spec`
    describes per layer (``layers.3.attention.query.kernel``): the targets of `rules` (a
    capture read as layer 0), or without rules the source's own `names`."""
    if not spec.stacks:
        return False
    if rules is None:
        return any(spec.split_layer(n) is not None for n in names or ())
    targets = (t for r in rules if isinstance(r, Rule) for t in r.targets)
    return any(spec.split_layer(_CAPTURE.sub("0", t)) is not None for t in targets)


def check(
    rules: Sequence[AnyRule],
    source: Mapping[str, Any],
    *,
    target: Any,
    allow: Mapping[str, Sequence[str]] | None = None,
) -> Report:
    """Checks, from names, shapes and dtypes alone, that `rules` turn `source` into
    exactly the leaves of `target`. Values with ``.shape`` and ``.dtype`` are not read.

    Args:
        rules: the rules (:class:`Rule`, :class:`Ignore`, :class:`Tie`), in order; each
            source name goes to the first that matches it.
        source: a flat mapping from source names to arrays (or anything with ``.shape``
            and ``.dtype``).
        target: a model, or its flat state; or an optimizer state (as :func:`convert`
            takes one); abstract leaves do.
        allow: problems to let through, by kind and name pattern: ``{"missing":
            ["head.*"], "unused": ["**.num_batches_tracked"], "unknown": [...],
            "unmatched": [...]}`` (a rule is matched by its source template).

    Returns:
        A :class:`Report` of the steps, the names ignored and the problems `allow` let
        through.

    Raises:
        ConversionError: listing every problem not allowed.
        ValueError: `allow` names a kind it cannot allow.
    """
    leaves = _leaves(target, rules)
    report, _ = plan_state(rules, source, leaves, check_allow(allow), "convert.check")
    return report


def convert(
    rules: Sequence[AnyRule],
    source: Mapping[str, Any],
    *,
    target: Any,
    allow: Mapping[str, Sequence[str]] | None = None,
) -> Converted:
    """The flat state `target` needs, made from `source` by `rules`, for
    ``target.load_flat_state_dict(flat, strict=True)``: a :class:`Converted` mapping.

    Rules are tried in order; each source name goes to the first that matches it. The
    whole conversion is checked first (see :func:`check`), from shapes and dtypes only:
    nothing is converted unless every problem is allowed. Each value is then made when it
    is looked up, from its own source names, so a lazy source is read tensor by tensor
    (tied names are read once here, to check that they are equal). Values may be NumPy or
    JAX arrays, PyTorch CPU tensors of any dtype (bfloat16 and float8 too, bit for bit),
    safetensors :class:`~taktiny.io.Tensor` handles, or anything ``np.asarray`` takes.

    The target may also be an optimizer state (``optimizer.init(model)``, its
    ``jax.eval_shape``, or its flat state), with `source` the flat state of the old one:
    when no leaf of `target` is a name the rules make but some end in one
    (``0.mu.layers.0.kernel`` ends in ``layers.0.kernel``), the parts before that end are
    moment prefixes (``0.mu``, ``0.nu``), every leaf under one is the moment of the
    parameter named by the rest, and each moment is converted by its parameter's rule,
    with the prefix put in front of the rule's templates: renamed, transposed, split,
    stacked or concatenated as the parameter is. A rule that matches nothing under a
    prefix is no problem there (a ``multi_transform`` keeps each label's moments apart).
    The leaves that are no moment (``0.count``, ``hyperparams.learning_rate``) pass
    through by name, and the source must hold each. Problems name moments in full
    (``0.nu.layers.0.kernel``); `allow` patterns are matched against a moment's full name
    and its parameter's name. To load parameters and moments together, keeping the
    moments of the parameters loaded only, see :func:`resume`.

    Args:
        rules: the rules (:class:`Rule`, :class:`Ignore`, :class:`Tie`), in order.
        source: a flat mapping from source names to values.
        target: a model, or its flat state; or an optimizer state, or its flat state;
            abstract leaves do.
        allow: problems to let through, by kind and name pattern: ``{"missing":
            ["head.*"], "unused": ["**.num_batches_tracked"], "unknown": [...],
            "unmatched": [...]}`` (a rule is matched by its source template).

    Returns:
        A :class:`Converted` mapping from the target's flat names to their values, made
        when looked up.

    Raises:
        ConversionError: listing every problem not allowed, or tied names whose arrays
            differ; nothing is converted.
        ValueError: `allow` names a kind it cannot allow, or an optimizer state's moment
            prefix holds a character of the name templates (``*?[]{}``).
    """
    leaves = _leaves(target, rules)
    report, ties = plan_state(rules, source, leaves, check_allow(allow), "convert.convert")
    check_ties(ties, source, "convert.convert")
    return Converted(report.steps, source, leaves)


def resume(
    rules: Sequence[AnyRule],
    source: Mapping[str, Any],
    optimizer_source: Mapping[str, Any],
    *,
    model: Any,
    opt_state: Any,
    allow: Mapping[str, Sequence[str]] | None = None,
) -> tuple[Any, Any]:
    """Loads a model and its optimizer state together, both converted by the same rules:
    the way to resume training after a rename, a new layout, a replaced head, or a move
    from PyTorch (:func:`torch_adam`).

    The parameters are converted as :func:`convert` converts them. Each moment of the
    optimizer state (``0.mu.<parameter>``, ``0.nu...``, ``0.trace...``: any leaf whose
    name ends in a name of `model`'s flat state) is converted by the rule of its
    parameter; leaves that are no moment (``0.count``, injected hyperparameters) are
    taken from `optimizer_source` by name. A parameter the conversion makes gets its
    moments from `optimizer_source`, and lacking one is a problem; a parameter it does not
    make (allowed missing: a replaced head) keeps its value in `model`, and its moments
    keep theirs in `opt_state`, so pass ``optimizer.init(model)``: zeros for Adam. Such
    a parameter's moments are not loaded even where `optimizer_source` holds them: a
    moment belongs with the value it was computed for.

    optax keeps one step count for all parameters, so a new head's first Adam steps use
    the bias corrections of the resumed count, not those of step 1.

    Args:
        rules: the rules written for the parameters' names, in order.
        source: the flat parameters to convert (a state dict, a safetensors file).
        optimizer_source: the flat optimizer state to convert
            (``tt.flat_state_dict(old_opt_state)``, or what :func:`torch_adam` makes),
            of the same optax optimizer as `opt_state`.
        model: the model to load into; it keeps the parameters that are not made.
        opt_state: its optimizer state (``optimizer.init(model)``); it keeps the moments
            of the parameters that are not made.
        allow: as for :func:`convert`; for moments, its patterns also match the
            parameter's name (``{"unused": ["head.*"]}`` lets ``0.mu.head.weight`` through).

    Returns:
        The new ``(model, opt_state)``.

    Raises:
        ConversionError: listing every problem of either conversion not allowed (a
            moment's problems name it in full: ``0.mu.layers.0.kernel``); nothing is
            loaded.
        ValueError: `allow` names a kind it cannot allow.
    """
    allow = check_allow(allow)
    leaves, moments = _leaves(model, rules), _leaves(opt_state, rules, like=model)
    problems: list[ConversionProblem] = []
    try:
        report, ties = plan(rules, source, leaves, allow, "convert.resume")
        unmade = report.allowed
    except ConversionError as error:
        problems += error.problems
        report, ties, unmade = Report((), ()), [], error.problems
    unloaded = {p.name for p in unmade if p.kind == "missing"}
    try:
        optimizer, optimizer_ties = plan_state(
            rules,
            optimizer_source,
            moments,
            allow,
            "convert.resume",
            is_param=leaves.__contains__,
            missing=lambda _, name: name in unloaded,
        )
    except ConversionError as error:
        problems += error.problems
        optimizer, optimizer_ties = Report((), ()), []
    if problems:
        raise ConversionError("convert.resume", problems)
    check_ties(ties, source, "convert.resume")
    check_ties(optimizer_ties, optimizer_source, "convert.resume")
    owner = owners(list(moments), leaves.__contains__)
    kept = {n: v for n, v in moments.items() if owner.get(n) not in unloaded}
    return (
        load_flat_state_dict(model, Converted(report.steps, source, leaves)),
        load_flat_state_dict(opt_state, Converted(optimizer.steps, optimizer_source, kept)),
    )


def check_ties(ties: Sequence[tuple[str, str]], source: Mapping[str, Any], where: str) -> None:
    """Raises when a tied pair of source names holds different values (reads both)."""
    unequal = [
        ConversionProblem("tie", name, hint=f"is tied to {other!r}, but their values differ.")
        for name, other in ties
        if not np.array_equal(_read(source[name]), _read(source[other]))
    ]
    if unequal:
        raise ConversionError(where, unequal)


class Converted(Mapping[str, Any]):
    """The flat state a conversion makes, in the target's leaf order, each value made
    when it is looked up: reading it reads only its own source names, so a lazy source
    (:func:`taktiny.io.open_safetensors`) is read tensor by tensor. Every lookup converts
    again (the other outputs of a ``split`` wait for their first lookup); ``dict(...)``
    keeps the results. :attr:`steps` is what each output is made from.

    Made by :func:`convert`, which checks what it is built from.

    Args:
        steps: the applications of the rules.
        source: the flat source mapping.
        leaves: the target's flat state, whose names (and order) the mapping has.

    Attributes:
        steps: the applications of the rules, as a tuple of :class:`Step`.
    """

    def __init__(self, steps: Sequence[Step], source: Mapping[str, Any], leaves: Mapping[str, Any]):
        made = {target: step for step in steps for target in step.targets if target in leaves}
        self.steps = tuple(steps)
        self._made = {name: made[name] for name in leaves if name in made}
        self._source, self._waiting = source, {}
        self._traced: dict[Any, Any] = {}  # (abstract sources: each equal transform traced once)

    def __getitem__(self, name: str) -> Any:
        if name in self._waiting:
            return self._waiting.pop(name)
        step = self._made[name]
        arrays = tuple(_read(self._source[n]) for n in step.sources)
        count = None if step.rule.gathered else len(step.targets)
        if any(isinstance(a, jax.ShapeDtypeStruct) for a in arrays):
            results = transformed_specs(step.rule.transform, count, arrays, self._traced)
        else:
            results = step.rule.transform(arrays, count)
        out = dict(zip(step.targets, results, strict=True))
        self._waiting.update((n, v) for n, v in out.items() if n != name and n in self._made)
        return out[name]

    def __contains__(self, name: object) -> bool:
        return name in self._made  # (Mapping's own would convert the value to find out)

    def __iter__(self) -> Iterator[str]:
        return iter(self._made)

    def __len__(self) -> int:
        return len(self._made)

    def __repr__(self) -> str:
        return f"Converted({len(self)} names from {len(self.steps)} steps)"


def _read(value: Any) -> Any:
    if isinstance(value, (jax.Array, np.ndarray)):
        return value
    if isinstance(value, jax.ShapeDtypeStruct):
        return spec(value)
    return host_array(value)


def export(rules: Sequence[AnyRule], model: Any) -> dict[str, Any]:
    """The parameters of `model` (or of its flat state) in the source's names and
    layouts: `rules` run backwards, each through its transform's inverse; a tied name
    (:class:`Tie`) gets the same array when its Tie says ``export=True``, and an
    :class:`Ignore` with ``export=value`` writes its value beside the parameters of its
    prefix; other names the rules ignore are not made.

    Args:
        rules: the rules that convert from the source.
        model: a model, or its flat state.

    Returns:
        A flat ``{source name: array}`` dict.

    Raises:
        ConversionError: naming every leaf that cannot be exported (a rule that is not
            invertible, or no rule).
    """
    leaves = _leaves(model, rules)
    inverse = [_compile_targets(r) if isinstance(r, Rule) else [] for r in rules]
    problems: list[ConversionProblem] = []
    groups: dict[tuple[int, tuple[tuple[str, str], ...]], dict[int, str]] = {}
    for leaf in leaves:
        found = next(
            (
                (i, j, m.groupdict(""))
                for i, ps in enumerate(inverse)
                for j, p in enumerate(ps)
                if (m := p.fullmatch("." + leaf)) is not None
            ),
            None,
        )
        if found is None:
            param, _, part = leaf.rpartition(".")
            if part in PARTS and any(p.fullmatch("." + param) for ps in inverse for p in ps):
                if part == PARTS[0]:  # (one problem for the two parts)
                    problems.append(_quantized(param))
                continue
            problems.append(
                ConversionProblem(
                    "missing",
                    leaf,
                    hint="no rule produces this leaf, so export cannot name it; add a Rule.",
                )
            )
            continue
        i, j, captures = found
        groups.setdefault((i, tuple(sorted(captures.items()))), {})[j] = leaf
    out: dict[str, Any] = {}
    for (i, key), by_target in groups.items():
        rule = rules[i]
        assert isinstance(rule, Rule)
        names = [by_target.get(j) for j in range(len(rule.targets))]
        why = rule.irreversible()
        if why is None and None in names:
            lacking = [t for t, n in zip(rule.targets, names, strict=True) if n is None]
            why = f"the model lacks {lacking}"
        if why is not None:
            problems.extend(
                ConversionProblem("irreversible", n, hint=f"{rule!r} cannot export it: {why}.")
                for n in names
                if n is not None
            )
            continue
        binding = dict(key)
        transform = rule.transform.inverse
        assert transform is not None
        count = None if rule.gathered else len(rule.sources)
        arrays = transform(tuple(leaves[n] for n in names if n is not None), count)
        if rule.gathered:
            made = [
                fill(rule.sources[0], {**binding, rule.gathered: str(k)})
                for k in range(len(arrays))
            ]
        else:
            made = [fill(s, binding) for s in rule.sources]
        out.update(zip(made, arrays, strict=True))
    for ignore in (r for r in rules if isinstance(r, Ignore) and r.export is not None):
        for pattern in ignore.sources:
            prefix, wanted = pattern.rpartition(".")[0], capture_names(pattern)
            for i, key in groups:
                sources, binding = rules[i].sources, dict(key)
                if wanted <= binding.keys() and any(
                    s.rpartition(".")[0] == prefix for s in sources
                ):
                    out[pattern.format(**binding)] = ignore.export
    for tie in (r for r in rules if isinstance(r, Tie) and r.export):
        partner = compile_template(tie.same_as, repr(tie))
        for name, value in list(out.items()):
            if (m := partner.fullmatch("." + name)) is not None:
                out[tie.sources[0].format(**m.groupdict())] = value
    if problems:
        raise ConversionError("convert.export", problems)
    return out


def _quantized(name: str) -> ConversionProblem:
    """The problem of exporting the quantized weight `name` (its parts ``value`` and
    ``scale``) with rules that write it as a float array."""
    return ConversionProblem(
        "representation",
        name,
        "a float array",
        "a QArray",
        "a quantized weight, which these rules export as a float array; dequantize the "
        "model first (taktiny.dequantize), or write it quantized with "
        "convert.export_compressed_tensors.",
    )


def _compile_targets(rule: Rule) -> list[Any]:
    return [compile_template(t, repr(rule), deep=rule.deep) for t in rule.targets]


def round_trip_check(rules: Sequence[AnyRule], model: Any) -> None:
    """Proves that `rules` export `model` and convert it back bit for bit: every leaf
    comes back with its shape, dtype and bits.

    Args:
        rules: the rules that convert from the source.
        model: a model, or its flat state.

    Raises:
        ConversionError: naming every leaf that cannot be exported, or that comes back
            different.
    """
    leaves = _leaves(model, rules)
    back = convert(rules, export(rules, model), target=leaves)
    problems = []
    for name, leaf in leaves.items():
        a, b = np.asarray(leaf), np.asarray(back[name])
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            why = (
                f"export then convert gives {b.dtype.name}{list(b.shape)} with other values "
                f"than the model's {a.dtype.name}{list(a.shape)}; a transform and its inverse "
                f"disagree."
            )
            problems.append(ConversionProblem("round_trip", name, hint=why))
    if problems:
        raise ConversionError("convert.round_trip_check", problems)
