"""Conversion rules: which source names make which target names.

A name template is a glob over dotted names (``*`` within one part, ``**`` any parts, as
in ``tt.by_name``) in which ``{name}`` captures one part: ``layers.{i}.attn.weight``.
The captures fill the target templates (``blocks.{i}.attention.kernel``); a capture the
targets do not use is gathered over: the rule reads every name it matches, in the order
0, 1, ..., n-1 of that capture, as one group (``stack`` them into one array).

A ``**`` part in the targets is a capture too: it stands for the parts the one ``**`` of
each source matched, none included (``model.**.weight`` -> ``**.kernel`` makes
``a.b.kernel`` of ``model.a.b.weight`` and ``kernel`` of ``model.weight``). With one
``**`` a template's other parts each match one part, so a name's match, and the name
its target gives back on export, are unique.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..state import part_regex
from ._transforms import Transform, identity

CAPTURE = re.compile(r"\{([A-Za-z_]\w*)\}")
DEEP = "__deep__"  # the capture of a '**' part that the targets use: the parts, '.'-joined


def compile_template(template: str, where: str, *, deep: bool = False) -> re.Pattern[str]:
    """The regex (matched against ``"." + name``) of a name template; with `deep`, its one
    ``**`` part is the capture `DEEP` (the parts it matched, or "" for none)."""
    if not isinstance(template, str) or not template:
        raise ValueError(f"{where}: a name template is a non-empty string, got {template!r}.")
    out, seen = [], set()
    for part in template.split("."):
        if part == "**":
            out.append(rf"(?:\.(?P<{DEEP}>[^.]+(?:\.[^.]+)*))?" if deep else r"(?:\.[^.]+)*")
            continue
        pieces, at = [], 0
        for found in [*CAPTURE.finditer(part), None]:
            end = len(part) if found is None else found.start()
            if end > at:
                try:
                    pieces.append(part_regex(template, part[at:end]))
                except ValueError as error:
                    raise ValueError(f"{where}: {error}") from None
            if found is not None:
                name = found.group(1)
                pieces.append(f"(?P={name})" if name in seen else f"(?P<{name}>[^.]+)")
                seen.add(name)
                at = found.end()
        if not pieces:
            raise ValueError(f"{where}: the template {template!r} has an empty part.")
        out.append(r"\." + "".join(pieces))
    return re.compile("".join(out))


def _literal(template: str, deep: bool = False) -> bool:
    """Whether the template names one name once its captures (with `deep`, its ``**``
    part too) are filled: no wildcards."""
    parts = [p for p in template.split(".") if not (deep and p == "**")]
    return not any(c in CAPTURE.sub("", ".".join(parts)) for c in "*?[]{}")


def capture_names(template: str) -> set[str]:
    return set(CAPTURE.findall(template))


def _deep_parts(template: str) -> int:
    return template.split(".").count("**")


def fill(template: str, captures: Mapping[str, str]) -> str:
    """The name `template` gives for one match's `captures`: each ``{name}`` filled, and a
    ``**`` part replaced by the parts it stands for (with none, the part and its dot go)."""
    parts = [
        captures[DEEP] if part == "**" else CAPTURE.sub(lambda m: captures[m.group(1)], part)
        for part in template.split(".")
        if part != "**" or captures[DEEP]
    ]
    return ".".join(parts)


def _tuple(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


class Rule:
    """Makes the ``target`` names from the ``source`` names through ``transform``.

    Args:
        source: a name template, or several (their arrays go to the transform in
            order: ``concatenate`` them). With ``regex=True``, regular expressions
            matched against the whole name, whose named groups are the captures.
        target: a name template, or several (the transform makes one array for each:
            ``split``). Captures only, no wildcards; a ``**`` part stands for the parts
            the ``**`` of the source matched (none included), and then every source and
            every target has exactly one ``**`` part.
        transform: what to do to the arrays; ``identity()`` (a rename) by default.
        regex: whether ``source`` holds regular expressions (such a rule converts, but
            cannot export: it has no template to name the source).

    Attributes:
        sources: the source templates (or regular expressions), as a tuple.
        targets: the target templates, as a tuple.
        transform: the transform.
        patterns: one compiled regular expression per source, matched against
            ``"." + name``.
        kept: the captures the targets use, sorted (``"__deep__"`` for a ``**``).
        gathered: the one capture of the source that the targets do not use (its matches
            are gathered into one target, in order: ``stack``), or None.
        deep: whether the targets' ``**`` carries the parts the sources' ``**`` matched.

    Raises:
        ValueError: a rule without sources or targets; a source that is not a valid
            template (or regular expression); a target with wildcards, or with captures
            a source lacks; a ``**`` in a target without exactly one in every source and
            target (or with ``regex=True``); or more than one capture to gather.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        target: str | Sequence[str],
        transform: Transform | None = None,
        *,
        regex: bool = False,
    ):
        self.sources, self.targets = _tuple(source), _tuple(target)
        self.transform = identity() if transform is None else transform
        self.regex = regex
        if not self.sources or not self.targets:
            raise ValueError(f"{self!r}: a rule needs at least one source and one target.")
        self.deep = any(isinstance(t, str) and _deep_parts(t) for t in self.targets)
        if self.deep and regex:
            raise ValueError(
                f"{self!r}: a target's '**' stands for the parts a template's '**' matched; "
                f"with regex=True, capture the parts in a named group ((?P<rest>.+)) and "
                f"write {{rest}} in the target."
            )
        wrong = [
            t for t in (*self.sources, *self.targets) if isinstance(t, str) and _deep_parts(t) != 1
        ]
        if self.deep and wrong:
            n = _deep_parts(wrong[0])
            raise ValueError(
                f"{self!r}: a target's '**' stands for the parts the source's '**' matched, "
                f"so every source and every target needs exactly one '**' part, and "
                f"{wrong[0]!r} has {n}"
                + (
                    "; with two, which parts each stands for would be ambiguous: capture "
                    "single parts with {name} instead."
                    if n > 1
                    else "."
                )
            )
        if regex:
            try:
                self.patterns = [
                    # a leading '^' would never match after the '.'; a trailing '$' (or a
                    # literal '\$') is kept: the whole name is matched anyway
                    re.compile(r"\.(?:" + s.removeprefix("^") + ")")
                    for s in self.sources
                ]
            except re.error as error:
                raise ValueError(
                    f"{self!r}: the source is not a valid regular expression: {error}. Escape "
                    f"the dots in names (r'layers\\.0'), or pass a template without regex=True."
                ) from None
            captures = [set(p.groupindex) for p in self.patterns]
        else:
            self.patterns = [compile_template(s, repr(self), deep=self.deep) for s in self.sources]
            deep = {DEEP} if self.deep else set()
            captures = [capture_names(s) | deep for s in self.sources]
        for target in self.targets:
            if not _literal(target, self.deep):
                raise ValueError(
                    f"{self!r}: the target {target!r} has a wildcard; a target names one "
                    f"parameter, with {{name}} captures from the source only (and a '**' "
                    f"part for the parts the source's '**' matched)."
                )
            compile_template(target, repr(self))  # (an empty part, a '**' inside a part)
        kept = set().union(*map(capture_names, self.targets)) | ({DEEP} if self.deep else set())
        for source, names in zip(self.sources, captures, strict=True):
            if not kept <= names:
                raise ValueError(
                    f"{self!r}: the target uses {sorted(kept - names)}, which the source "
                    f"{source!r} does not capture."
                )
        self.kept = tuple(sorted(kept))
        gathered = sorted(set().union(*captures) - kept)
        if len(gathered) > 1 or (gathered and len(self.sources) > 1):
            raise ValueError(
                f"{self!r}: the captures {gathered} are not in the target; a rule gathers over "
                f"at most one capture, from a single source template."
            )
        self.gathered = gathered[0] if gathered else None

    def target_names(self, captures: dict[str, str]) -> tuple[str, ...]:
        """The target names for one match of the sources.

        Args:
            captures: the value of each capture of the match (``{"i": "0"}``).

        Returns:
            The target templates filled with `captures`, in order.
        """
        return tuple(fill(t, captures) for t in self.targets)

    def irreversible(self) -> str | None:
        """Says whether this rule can export (run backwards).

        Returns:
            Why this rule cannot export, or None when it can.
        """
        if self.regex:
            return "its source is a regular expression, not a template that names one source"
        if not all(_literal(s, self.deep) for s in self.sources):
            return "its source has a wildcard, so it does not name one source"
        if self.transform.inverse is None:
            return f"its transform {self.transform!r} has no inverse"
        return None

    def __repr__(self) -> str:
        def show(names: tuple[str, ...]) -> str:
            return repr(names[0]) if len(names) == 1 else repr(list(names))

        return f"Rule({show(self.sources or ('?',))} -> {show(self.targets)}, {self.transform!r})"


class Ignore:
    """Source names that are consumed and dropped (``*.num_batches_tracked``).

    With ``export=value``, :func:`export` writes `value` (an array, such as BatchNorm's
    step count ``0``) under each pattern, once per exported group of parameters of the
    same prefix (``"{p}.num_batches_tracked"`` beside ``"{p}.running_mean"``), so that a
    strict reader finds every name it expects; the patterns must then be templates
    without wildcards. Without it, export makes none of these names.

    Args:
        *patterns: the name patterns of the sources to drop (``*`` and ``**`` wildcards
            and ``{name}`` captures, as a rule's sources).
        export: the value :func:`export` writes under each pattern; None for none.

    Attributes:
        sources: the patterns, as given.
        patterns: one compiled regular expression per pattern, matched against
            ``"." + name``.

    Raises:
        ValueError: no pattern, a pattern that is not valid, or `export` with a pattern
            that has wildcards.
    """

    def __init__(self, *patterns: str, export: Any = None):
        self.sources = patterns  # (first: the errors of compile_template name the Ignore by them)
        self.export = None if export is None else np.asarray(export)
        self.patterns = [compile_template(p, repr(self)) for p in patterns]
        if not patterns:
            raise ValueError("Ignore() needs at least one name pattern.")
        if export is not None and not all(_literal(p) for p in patterns):
            raise ValueError(
                f"{self!r}: with export=, each pattern must be a template without wildcards, "
                f"so that export can name what it writes."
            )

    def __repr__(self) -> str:
        written = "" if self.export is None else f", export={self.export!r}"
        return f"Ignore({', '.join(map(repr, self.sources))}{written})"


class Tie:
    """A source name that holds the same array as another (``lm_head.weight`` tied to
    ``embed.weight``). Converting reads the array once, from `same_as`; where the source
    holds both names it checks that they are equal, and a source that leaves the tied copy
    out (as Hugging Face's ``save_pretrained`` writes a tied model) is fine. Exporting
    writes the copy too only with ``export=True`` (what a PyTorch ``state_dict()`` holds);
    by default it leaves it out, as ``save_pretrained`` does. Both templates capture the
    same names.

    Args:
        source: the template of the tied copy's name (``"lm_head.weight"``).
        same_as: the template of the name the array is read from
            (``"embed.weight"``).
        export: whether :func:`export` writes the copy too.

    Attributes:
        patterns: the compiled regular expression of `source`, matched against
            ``"." + name``, in a list.

    Raises:
        ValueError: a template that is not valid, has wildcards, or captures other names
            than the other one.
    """

    def __init__(self, source: str, same_as: str, *, export: bool = False):
        self.sources, self.same_as, self.export = (source,), same_as, export
        self.patterns = [compile_template(source, repr(self))]
        compile_template(same_as, repr(self))
        if not (_literal(source) and _literal(same_as)) or capture_names(source) != capture_names(
            same_as
        ):
            raise ValueError(
                f"{self!r}: both names must be templates with the same captures and no "
                f"wildcards, so each tied name has exactly one partner."
            )

    def __repr__(self) -> str:
        written = ", export=True" if self.export else ""
        return f"Tie({self.sources[0]!r}, same_as={self.same_as!r}{written})"


class Init:
    """Parameters a migration adds: a model's ``migrations`` (see :func:`taktiny.migrate`)
    list it with their rules, and a checkpoint of an older version, which lacks them,
    loads with the model's own initial values for them (its values are kept, as a load
    with ``strict=False`` keeps them, for these names only). Only migrations take it:
    converting from another framework has no version to say what is new.

    Args:
        *names: the added parameters' flat names at the version the migration makes
            (``"norm.scale"``); a later migration may rename them.

    Attributes:
        names: the names, as a tuple.

    Raises:
        ValueError: no name, or a name that is not a dotted name without wildcards.
    """

    def __init__(self, *names: str):
        self.names = names
        if not names:
            raise ValueError("Init() needs at least one parameter name.")
        for name in names:
            if not isinstance(name, str) or not name or not _literal(name) or "{" in name:
                raise ValueError(
                    f"{self!r}: {name!r} is not a parameter's flat name; Init names each "
                    f'added parameter in full ("blocks.0.norm.scale"), without wildcards.'
                )

    def __repr__(self) -> str:
        return f"Init({', '.join(map(repr, self.names))})"


AnyRule = Rule | Ignore | Tie


class FirstMatch:
    """The first of `rules` whose source matches a name, looked up once per name: a
    source without wildcards, captures or regex (a rule written for one layer) is found
    by its name in a dict, and only the other sources before it are tried, in the rules'
    order. Rules written per layer (as ``cv.linear`` of each makes them) so plan in time
    linear in the names, not names x rules.

    Args:
        rules: the rules, in their order.
    """

    def __init__(self, rules: Sequence[AnyRule]):
        self.named: dict[str, tuple[int, int]] = {}  # a literal source -> its first (i, j)
        self.patterned: list[tuple[int, int, re.Pattern[str]]] = []
        for i, rule in enumerate(rules):
            regex = getattr(rule, "regex", False)
            for j, (source, pattern) in enumerate(zip(rule.sources, rule.patterns, strict=True)):
                if not regex and _literal(source) and not CAPTURE.search(source):
                    self.named.setdefault(source, (i, j))
                else:
                    self.patterned.append((i, j, pattern))

    def __call__(self, name: str) -> tuple[int, int, dict[str, Any]] | None:
        """(rule index, source template index, captures) of the first rule matching
        `name`, or None."""
        named, dotted = self.named.get(name), "." + name
        for i, j, pattern in self.patterned:
            if named is not None and (i, j) > named:
                break
            found = pattern.fullmatch(dotted)
            if found is not None:
                return i, j, found.groupdict("")  # (a '**' that matched no part: "")
        return None if named is None else (*named, {})
