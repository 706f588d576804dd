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
    a ValueError naming the pattern when it is not one."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"a name pattern is a non-empty string, got {pattern!r}.")
    regex = "".join(
        r"(?:\.[^.]*)*" if part == "**" else r"\." + part_regex(pattern, part)
        for part in pattern.split(".")
    )
    try:
        return re.compile(regex)
    except re.error as error:
        raise ValueError(f"the pattern {pattern!r} is not valid: {error.msg}.") from None


class Match(NamedTuple):
    """What ordered rules give a list of names."""

    values: list[Any]  # for each name, the value of the first rule matching it (or default)
    unmatched: list[str]  # names no rule matched
    unused: list[str]  # patterns that matched no name


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
    for name in names:
        dotted = "." + name
        for i, (regex, value) in enumerate(compiled):
            if regex.fullmatch(dotted):
                used[i] = True
                values.append(value)
                break
        else:
            unmatched.append(name)
            values.append(default)
    unused = [rules[i][0] for i, hit in enumerate(used) if not hit]
    return Match(values, unmatched, unused)


def rule_problems(
    found: Match, rules: Sequence[tuple[str, Any]], names: Sequence[str], fix: str | None
) -> list[Any]:
    """The problems of what ordered `rules` `found` among `names`: each rule that matches
    no name, with the closest names (``unused_hint``), then, when every name must be
    reached (`fix`: how to reach it; None: need not be), each name no rule matches."""
    import taktiny.state._problems as err  # (see unused_hint)

    patterns = [pattern for pattern, _ in rules]
    out = [err.unmatched(p, "name", unused_hint(p, names, patterns)) for p in found.unused]
    if fix is not None:
        out += [err.unreached(name, fix) for name in found.unmatched]
    return out


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


def unused_hint(pattern: str, names: Sequence[str], patterns: Sequence[str] = ()) -> str:
    """Why `pattern` may have matched nothing, and what might have been meant; `patterns`
    are those of all the rules, in order (an earlier one may have taken its names)."""
    from .._problems import closest, groups_of  # (only errors need it: it imports NumPy)

    regex = compile_pattern(pattern)
    mine = [n for n in names if regex.fullmatch("." + n)]
    if mine:  # every one taken by an earlier rule
        first = mine[0]
        taker = next((p for p in patterns if compile_pattern(p).fullmatch("." + first)), pattern)
        more = f" and {len(mine) - 1} more" if len(mine) > 1 else ""
        if taker == pattern:
            return "an earlier rule has the same pattern; remove one of them"
        return (
            f"the names it would match ({first!r}{more}) go to the earlier rule {taker!r}; "
            f"put the more specific rule first"
        )
    group = next((g for g in sorted(groups_of(names)) if regex.fullmatch("." + g)), None)
    if group is not None:
        return (
            f"it matches the group {group!r}, not a parameter: '{pattern}.**' matches "
            f"everything in it"
        )
    parts = pattern.split(".")
    fixed = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts))
    prefix = ".".join(parts[:fixed])
    close = closest(prefix, names)  # None when the first part is wild
    if close is not None and close != prefix:
        return f"did you mean {'.'.join([close, *parts[fixed:]])!r}?"
    respelt = _respelt(parts, names)  # a wild pattern: its misspelt parts, respelt
    if respelt is not None:
        return f"did you mean {respelt!r}?"
    if close is None:
        return "no name is close to it"
    # (a wild part follows the prefix: a name or group would have matched)
    return f"the names in {prefix!r} do not match the rest, {'.'.join(parts[fixed:])!r}"


def _respelt(parts: Sequence[str], names: Sequence[str]) -> str | None:
    """The pattern of `parts` with each plain part that no name has replaced by the
    closest part that one has (``*.dwon.bias``: ``*.down.bias``), if that matches a name;
    None otherwise."""
    from .._problems import closest  # (see unused_hint)

    known = sorted({part for name in names for part in name.split(".")})
    have = set(known)
    respelt = [
        p if p == "**" or any(c in p for c in "*?[") or p in have else closest(p, known)
        for p in parts
    ]
    if respelt == list(parts) or None in respelt:
        return None
    pattern = ".".join(str(p) for p in respelt)
    regex = compile_pattern(pattern)
    return pattern if any(regex.fullmatch("." + name) for name in names) else None
