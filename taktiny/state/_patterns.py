"""Name patterns: ordered rules that pick flat state names by glob.

A pattern is matched against a whole flat name (``"encoder.layers.3.attn.kernel"``),
part by part: ``*`` matches within one part (``layers.*.kernel``, ``*_proj``), ``?`` one
character, ``[...]`` one of a set, and a part that is exactly ``**`` matches any number
of parts, none included (``encoder.**``, ``**.bias``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

Rules = Mapping[str, Any] | Sequence[tuple[str, Any]]


def part_regex(pattern: str, part: str) -> str:
    """The regex of one part of `pattern` (no dots): `*`, `?` and `[...]` as in globs."""
    if not part:
        raise ValueError(
            f"the pattern {pattern!r} has an empty part: names have no empty parts, so it "
            f"would match nothing. Remove the extra '.'."
        )
    if "**" in part:
        raise ValueError(
            f"the pattern {pattern!r} uses '**' inside the part {part!r}: '**' matches whole "
            f"parts, so it must stand between dots ('encoder.**', '**.bias'); use '*' to "
            f"match within a part."
        )
    out: list[str] = []
    i = 0
    while i < len(part):
        char = part[i]
        if char == "*":
            out.append("[^.]*")
        elif char == "?":
            out.append("[^.]")
        elif char == "[":
            negate = part[i + 1 : i + 2] == "!"
            first = i + 1 + negate  # a ']' here is a member, not the end
            end = part.find("]", first + (part[first : first + 1] == "]"))
            if end < 0:
                raise ValueError(f"the pattern {pattern!r} has a '[' without its ']'.")
            # every member literal ('^', '\\', '[' too), but '-' still makes ranges
            inside = "".join(c if c == "-" else re.escape(c) for c in part[first:end])
            out.append(f"(?!\\.)[^{inside}]" if negate else f"[{inside}]")  # never a dot
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def compile_pattern(pattern: Any) -> re.Pattern[str]:
    """The regex matching the flat names that `pattern` matches (see the module's doc);
    a ValueError naming the pattern when it is not one. Kept once made (`_COMPILED`): a
    load's plan matches each allowed pattern against every name."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"a name pattern is a non-empty string, got {pattern!r}.")
    compiled = _COMPILED.get(pattern)
    if compiled is not None:
        return compiled
    regex = "".join(
        r"(?:\.[^.]*)*" if part == "**" else r"\." + part_regex(pattern, part)
        for part in pattern.split(".")
    )
    try:
        compiled = re.compile(regex)
    except re.error as error:
        raise ValueError(f"the pattern {pattern!r} is not valid: {error.msg}.") from None
    if len(_COMPILED) >= COMPILED_BOUND:  # (a process that makes patterns without end)
        _COMPILED.clear()
    _COMPILED[pattern] = compiled
    return compiled


COMPILED_BOUND = 4096  # the patterns kept compiled before the store starts again
_COMPILED: dict[str, re.Pattern[str]] = {}


class Match(NamedTuple):
    """What ordered rules give a list of names."""

    values: list[Any]  # for each name, the value of the first rule matching it (or default)
    unmatched: list[str]  # names no rule matched
    unused: list[str]  # patterns that matched no name
    firsts: tuple[int | None, ...] = ()  # (rules:) each name's first rule's index, or None


def rule_list(rules: Any, what: str) -> list[tuple[str, Any]]:
    """`rules` (whatever was passed for them) as a list of (pattern, value) pairs, checked."""
    pairs: list[Any] = (
        list(cast("Mapping[Any, Any]", rules).items())
        if isinstance(rules, Mapping)
        else list(rules)
    )
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(cast("tuple[Any, ...]", pair)) == 2):
            raise TypeError(
                f"{what} takes its rules as a dict {{pattern: value}} or a list of "
                f"(pattern, value) pairs, got the entry {pair!r}."
            )
    return pairs


def match(rules: list[tuple[str, Any]], names: Sequence[str], default: Any) -> Match:
    """Gives each name the value of the first rule whose pattern matches it; names that
    none matches get `default`."""
    compiled = [(compile_pattern(pattern), value) for pattern, value in rules]
    used = [False] * len(compiled)
    values: list[Any] = []
    unmatched: list[str] = []
    firsts: list[int | None] = []
    for name in names:
        dotted = "." + name
        for i, (regex, value) in enumerate(compiled):
            if regex.fullmatch(dotted):
                used[i] = True
                values.append(value)
                firsts.append(i)
                break
        else:
            unmatched.append(name)
            values.append(default)
            firsts.append(None)
    unused = [rules[i][0] for i, hit in enumerate(used) if not hit]
    return Match(values, unmatched, unused, tuple(firsts))


def select(patterns: Sequence[str], names: Sequence[str]) -> Match:
    """Which of `names` any of `patterns` matches (values True or False), and the patterns
    that match none. Unlike rules, each pattern is tried on its own: one whose names an
    earlier one matched too still counts as used."""
    compiled = [compile_pattern(pattern) for pattern in patterns]
    used = [False] * len(compiled)
    values: list[Any] = []
    unmatched: list[str] = []
    for name in names:
        dotted = "." + name
        hit = False
        for i, regex in enumerate(compiled):
            if regex.fullmatch(dotted):
                used[i] = hit = True
        values.append(hit)
        if not hit:
            unmatched.append(name)
    unused = [pattern for pattern, hit in zip(patterns, used, strict=True) if not hit]
    return Match(values, unmatched, unused)
