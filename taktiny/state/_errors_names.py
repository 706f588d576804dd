"""Problems with names and structure: unknown names (with the closest valid name as a
suggestion), bad keys, a dict where an array belongs or the reverse, names not supplied."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import numpy as np

from .._quant import PARTS
from ._errors_core import StateProblem, describe

_SUGGESTED = 100  # unknown names that get a suggestion; later ones are only listed
_SHORTLIST = 64  # candidates whose similarity to an unknown name is measured (see _Suggester)


def groups_of(names: Iterable[str]) -> set[str]:
    """Every group above the names: ``a.b.c`` is in ``a.b`` and ``a``."""
    return {n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1)}


class _Suggester:
    """Finds the closest valid name for unknown ones: among the names (and groups) the
    state does not already supply, those with the same last part first, preferring one
    whose parts include all the given ones in order (``fc.2.bias`` in
    ``fc.layers.2.bias``), then by string similarity.

    String similarity (difflib's) costs tens of microseconds a pair, too much to measure
    between a name and every one of a large model's. So it is measured against a shortlist:
    the `_SHORTLIST` candidates that share the most character pairs with the name, counted
    for all candidates at once from an index of their pairs (and of their parts, to find
    those that hold every part of the name). Up to `_SHORTLIST` candidates, every one is
    measured."""

    def __init__(self, names: Sequence[str], given: Collection[str]):
        groups = groups_of(names)
        self.names, self.known, self.groups = names, set(names), groups
        self.candidates = [n for n in (*names, *sorted(groups)) if n not in given]
        by_part: dict[str, list[int]] = {}
        by_last: dict[str, list[int]] = {}
        by_pair: dict[str, list[int]] = {}
        pairs = []
        for i, candidate in enumerate(self.candidates):
            parts = candidate.split(".")
            for part in set(parts):
                by_part.setdefault(part, []).append(i)
            by_last.setdefault(parts[-1], []).append(i)
            own = _pairs(candidate)
            pairs.append(len(own))
            for pair in own:
                by_pair.setdefault(pair, []).append(i)
        self._by_part = {part: np.array(ids) for part, ids in by_part.items()}
        self._by_last = {last: np.array(ids) for last, ids in by_last.items()}
        self._by_pair = {pair: np.array(ids) for pair, ids in by_pair.items()}
        self._pairs = np.array(pairs, np.float64)

    def __call__(self, name: str) -> str | None:
        parts = name.split(".")
        pool = self._by_last.get(parts[-1])  # the candidates with the same last part
        alike: list[Any] = []  # the pairs in common with each candidate, once counted
        if pool is not None:
            # of the candidates that hold every part of the name, those that hold them in order
            distinct = set(parts)
            held = np.bincount(
                np.concatenate([self._by_part[p] for p in distinct if p in self._by_part]),
                minlength=len(self.candidates),
            )
            whole = pool[held[pool] == len(distinct)]
            contained = [i for i in whole if _in_order(parts, self.candidates[i])]
            if contained:
                short = self._shortlist(name, np.array(contained), alike)
                return max(
                    (self.candidates[i] for i in np.sort(short)),  # the first of equals
                    key=lambda c: difflib.SequenceMatcher(None, name, c).ratio(),
                )
        for among in (pool, None):  # the same last part first, then every candidate
            short = self._shortlist(name, among, alike)
            close = difflib.get_close_matches(name, [self.candidates[i] for i in short], n=1)
            if close:  # (the most alike, if at least 0.6 alike)
                return close[0]
        return None

    def _shortlist(self, name: str, among: Any, alike: list[Any]) -> Any:
        """The indices of the `_SHORTLIST` candidates of `among` (indices; None: all) that
        share the most character pairs with `name` (for their length); all of them when
        there are no more. `alike` caches the count, the first time it is needed."""
        ids = np.arange(len(self.candidates)) if among is None else among
        if len(ids) <= _SHORTLIST:
            return ids
        if not alike:
            own = _pairs(name)
            found = [self._by_pair[p] for p in own if p in self._by_pair]
            common = np.bincount(
                np.concatenate(found) if found else np.zeros(0, np.int64),
                minlength=len(self.candidates),
            )
            alike.append(2 * common / (len(own) + self._pairs))  # Dice's coefficient
        order = np.argsort(-alike[0][ids], kind="stable")
        return ids[order[:_SHORTLIST]]


def _pairs(name: str) -> set[str]:
    """The pairs of adjacent characters of `name`, its ends included (" a", "a.", ...)."""
    padded = f" {name} "
    return {padded[i : i + 2] for i in range(len(padded) - 1)}


def _in_order(parts: Sequence[str], candidate: str) -> bool:
    """Whether the parts of `candidate` include all of `parts`, in order."""
    rest = iter(candidate.split("."))
    return all(part in rest for part in parts)


def closest(name: str, candidates: Sequence[str]) -> str | None:
    """The candidate closest to `name`, as a suggestion; None when none is close."""
    return _Suggester(candidates, ())(name)


def unknown(
    items: Sequence[tuple[str, Any]], names: Sequence[str], flat: bool, given: Collection[str]
) -> list[StateProblem]:
    """A problem for each (name, value) whose name has no leaf: a group of parameters, a
    child of an array, or simply unknown. Suggestions leave out the names in `given`
    (what the same state already supplies)."""
    suggest = _Suggester(names, given)
    return [
        _unknown(name, value, flat, suggest, i < _SUGGESTED)
        for i, (name, value) in enumerate(items)
    ]


def _unknown(name: str, value: Any, flat: bool, names: _Suggester, suggest: bool) -> StateProblem:
    if name in names.groups:
        inside = [n for n in names.names if n.startswith(name + ".")]
        listed = ", ".join(inside[:4]) + (", ..." if len(inside) > 4 else "")
        how = f"by name (e.g. {inside[0]!r})" if flat else "as a nested dict"
        return StateProblem(
            "structure",
            name,
            "a dict of parameters",
            describe(value),
            f"names a group of parameters ({listed}), not one array; got {describe(value)}. "
            f"Supply its parameters {how}.",
        )
    prefixes = (name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1))
    parent = next((p for p in prefixes if p in names.known), None)
    if parent is not None:
        return inside_array(name, parent, value)
    close = names(name) if suggest else None
    if close is not None:
        return StateProblem("unknown", name, close, name, f"unknown key; did you mean {close!r}?")
    return StateProblem(
        "unknown",
        name,
        None,
        name,
        f"unknown key; the model has no parameter of that name (it has "
        f"{list(names.names[:3])}, ...).",
    )


def inside_array(name: str, parent: str, value: Any) -> StateProblem:
    """A flat name below the name of an array (``kernel.x`` where ``kernel`` is one)."""
    entry = name[len(parent) + 1 :]
    return StateProblem(
        "structure",
        name,
        f"an array at {parent!r}",
        describe(value),
        f"{parent!r} is an array, so it has no entry {entry!r}; give the array itself at "
        f"{parent!r}"
        + (
            ", or pass match_quantization=True to dequantize a quantized array's parts on load."
            if entry in PARTS
            else "."
        ),
    )


def unknown_part(name: str, parts: Sequence[str]) -> StateProblem:
    return StateProblem(
        "unknown",
        name,
        list(parts),
        name,
        f"unknown key; this parameter's parts are {list(parts)}.",
    )


def dotted_key(name: str) -> StateProblem:
    return StateProblem(
        "key",
        name,
        "a key without '.'",
        name.rsplit(".", 1)[-1],
        "nested state keys must not contain '.'; nest it as a dict, or pass dotted names to "
        "load_flat_state_dict().",
    )


def non_string_key(name: str, key: Any, as_string_exists: bool, flat: bool) -> StateProblem:
    same = f"; did you mean {str(key)!r}?" if as_string_exists else "."
    return StateProblem(
        "key",
        name,
        "a str key",
        key,
        f"{'flat' if flat else 'nested'} state keys must be strings, got "
        f"{type(key).__name__} {key!r}{same}",
    )


def contains_itself(name: str, outer: str) -> StateProblem:
    """A nested state that contains itself: the dict at `name` is the one at `outer`."""
    got = f"the dict at {outer!r}" if outer else "the whole state"
    return StateProblem(
        "structure",
        name,
        "a dict of this submodule's parameters",
        got,
        f"its value is {got}, which contains it: a state that contains itself never ends. "
        f"Give this name a dict of its own parameters.",
    )


def too_deep(name: str, value: Any) -> StateProblem:
    """A value that nests too deeply to be read (a list that contains itself, say)."""
    return StateProblem(
        "structure",
        name,
        "a value of this parameter's structure",
        describe(value),
        f"got {describe(value)} nested too deeply to be read (it may contain itself); give "
        f"this parameter as the model holds it, or a dict of its parts.",
    )


def array_expected(name: str, value: Any, why: str) -> StateProblem:
    return StateProblem(
        "structure",
        name,
        "an array",
        describe(value),
        f"expected an array, got {describe(value)}; {why}.",
    )


def group_expected(name: str, keys: list[str], value: Any) -> StateProblem:
    return StateProblem(
        "structure",
        name,
        f"a dict with keys {keys[:6]}",
        describe(value),
        f"expected a dict of this submodule's parameters (keys {keys[:6]}), got {describe(value)}.",
    )


def structure(name: str, expected: Any, got: Any) -> StateProblem:
    return StateProblem(
        "structure",
        name,
        str(expected),
        str(got),
        f"expected a value structured as {expected}, got {got}.",
    )


def missing(name: str) -> StateProblem:
    return StateProblem(
        "missing",
        name,
        "a value",
        None,
        "missing: strict=True requires every parameter; supply it, or pass strict=False to keep "
        "its current value.",
    )


def abstract(name: str) -> StateProblem:
    return StateProblem(
        "abstract",
        name,
        "a value",
        None,
        "not supplied, and the model is abstract (from jax.eval_shape): a load into an abstract "
        "model must supply every parameter, or it would stay unfilled.",
    )
