"""What choosing leaves and layers by name finds wrong, and the one error that lists it:
a pattern that matches nothing (with what it matches instead, or the closest names), a
leaf no rule reaches where every leaf must be. `tt.by_name`, `tt.shard` and the layer
surgery (`tt.lora`, `tt.quantize` and their reverses) raise `SelectionError`; the
pattern language is `_patterns.py`'s."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .._problems import ProblemsError, StateProblem, closest, groups_of
from ._patterns import Match, compile_pattern


class SelectionError(ProblemsError):
    """Raised once, listing every problem with choosing leaves or layers by name; nothing
    was changed.

    :func:`~taktiny.by_name`, :func:`~taktiny.shard` and :func:`~taktiny.sharding_plan`
    raise it for their rules; :func:`~taktiny.lora`, :func:`~taktiny.merge_lora`,
    :func:`~taktiny.quantize` and :func:`~taktiny.dequantize` for their `where`. Each
    problem is a :class:`StateProblem`: ``"unmatched"`` for a pattern that matches nothing
    it could choose (with what it matches instead, or the closest names), ``"missing"``
    for a leaf no rule reaches where every leaf must be, ``"sharding"`` for a spec a leaf
    cannot take, ``"rule"`` for a rule that is not one. The message shows the first 20; all
    of them are in ``problems``. It is a ``ValueError``, as these calls raised before.

    Args:
        where: the call that failed, which starts the message (``"taktiny.lora on Net"``).
        problems: every problem found, in the order found.

    Attributes:
        problems: the problems, a tuple of :class:`StateProblem`.
    """

    def __init__(self, where: str, problems: Iterable[StateProblem]):
        super().__init__(where, problems, ":")


def unmatched(pattern: str, what: str, why: str) -> StateProblem:
    """A pattern that matches no `what` (``"name"``, ``"Linear or Embed layer"``), and
    `why`: what it matches instead, or the closest names (`unused_hint`)."""
    end = "" if why.endswith("?") else "."
    return StateProblem("unmatched", pattern, what, None, f"matches no {what}; {why}{end}")


def unreached(name: str, fix: str) -> StateProblem:
    """A leaf that no rule matches, where every leaf must be; `fix` says how to reach it."""
    return StateProblem("missing", name, "a rule", None, f"no rule matches it; {fix}.")


def rule_problems(
    found: Match, rules: Sequence[tuple[str, Any]], names: Sequence[str], fix: str | None
) -> list[StateProblem]:
    """The problems of what ordered `rules` `found` among `names`: each rule that matches
    no name, with the closest names (``unused_hint``), then, when every name must be
    reached (`fix`: how to reach it; None: need not be), each name no rule matches."""
    patterns = [pattern for pattern, _ in rules]
    out = [unmatched(p, "name", unused_hint(p, names, patterns)) for p in found.unused]
    if fix is not None:
        out += [unreached(name, fix) for name in found.unmatched]
    return out


def unused_hint(pattern: str, names: Sequence[str], patterns: Sequence[str] = ()) -> str:
    """Why `pattern` may have matched nothing, and what might have been meant; `patterns`
    are those of all the rules, in order (an earlier one may have taken its names)."""
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
