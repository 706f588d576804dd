"""Problems with names and structure: unknown names (with the closest valid name as a
suggestion), bad keys, a dict where an array belongs or the reverse, names not supplied."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from ._errors_core import StateProblem, describe
from ._quant import PARTS

_SUGGESTED = 100  # unknown names that get a suggestion; later ones are only listed


def groups_of(names: Iterable[str]) -> set[str]:
    """Every group above the names: ``a.b.c`` is in ``a.b`` and ``a``."""
    return {n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1)}


class _Suggester:
    """Finds the closest valid name for unknown ones: among the names (and groups) the
    state does not already supply, those with the same last part first, preferring one
    whose parts include all the given ones in order (``fc.2.bias`` in
    ``fc.layers.2.bias``), then by string similarity."""

    def __init__(self, names: Sequence[str], given: Collection[str]):
        groups = groups_of(names)
        self.names, self.known, self.groups = names, set(names), groups
        self.candidates = [n for n in (*names, *sorted(groups)) if n not in given]
        self.by_last: dict[str, list[str]] = {}
        for candidate in self.candidates:
            self.by_last.setdefault(candidate.rsplit(".", 1)[-1], []).append(candidate)

    def __call__(self, name: str) -> str | None:
        parts = name.split(".")
        pool = self.by_last.get(parts[-1], [])

        def contains(candidate: str) -> bool:
            rest = iter(candidate.split("."))
            return all(part in rest for part in parts)

        contained = [c for c in pool if contains(c)]
        if contained:
            return max(contained, key=lambda c: difflib.SequenceMatcher(None, name, c).ratio())
        for among in (pool, self.candidates):
            close = difflib.get_close_matches(name, among)  # best first; only those >= 0.6 alike
            if close:
                return close[0]
        return None


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
