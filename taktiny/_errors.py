"""`StateDictError` and the problems it lists: each kind is built here, in one place."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class StateProblem:
    """One problem found while loading a state.

    Attributes:
        kind: ``"unknown"`` (no such name), ``"missing"`` (not supplied under
            ``strict=True``), ``"abstract"`` (not supplied to an abstract model),
            ``"shape"``, ``"dtype"`` (a change of dtype kind, or a narrowing integer
            cast that would change values), ``"value"`` (not an array),
            ``"structure"`` (a dict where one array belongs, or the reverse) or
            ``"key"`` (a nested key containing ``"."``).
        key: the flat name (``"layers.1.kernel"``) the problem is about.
        expected: what the model holds there (a shape, a dtype name, a suggestion).
        got: what the state supplied.
        hint: the full explanation, with the fix.
    """

    kind: str
    key: str
    expected: Any
    got: Any
    hint: str

    def __str__(self) -> str:
        return f"{self.key!r}: {self.hint}"


class StateDictError(ValueError):
    """The one error type for state problems; raised once, listing every offending name.

    When it is raised nothing has been loaded: the module is unchanged and no new
    module is returned. Structural problems come first, then problems with values,
    then names that were not supplied. The problems are also available as
    :attr:`problems` (a tuple of :class:`StateProblem`), :attr:`missing_keys` and
    :attr:`unexpected_keys`.
    """

    def __init__(self, where: str, problems: Sequence[StateProblem]):
        self.problems = tuple(problems)
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        lines = [f"{where}: {count}; nothing was loaded.", *(f"  - {p}" for p in problems)]
        super().__init__("\n".join(lines))

    @property
    def missing_keys(self) -> tuple[str, ...]:
        """Names the load needed but the state did not supply."""
        return tuple(p.key for p in self.problems if p.kind in ("missing", "abstract"))

    @property
    def unexpected_keys(self) -> tuple[str, ...]:
        """Names in the state that the module does not have."""
        return tuple(p.key for p in self.problems if p.kind in ("unknown", "key"))


def describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a dict with keys {list(value)[:6]}"
    if isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return f"an array {np.dtype(value.dtype).name}{list(value.shape)}"
    return f"a value of type {type(value).__name__}"


def unknown(name: str, names: Sequence[str], value: Any, flat: bool) -> StateProblem:
    """A name with no leaf: a group of parameters, a child of an array, or simply unknown."""
    inside = [n for n in names if n.startswith(name + ".")]
    if inside:
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
    parent = next((n for n in names if name.startswith(n + ".")), None)
    if parent is not None:
        return StateProblem(
            "structure",
            name,
            f"an array at {parent!r}",
            describe(value),
            f"{parent!r} is an array, so it has no entry {name[len(parent) + 1 :]!r}; give the "
            f"array itself at {parent!r}.",
        )
    groups = {n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1)}
    close = difflib.get_close_matches(name, [*names, *sorted(groups)], n=1, cutoff=0.6)
    if close:
        return StateProblem(
            "unknown", name, close[0], name, f"unknown key; did you mean {close[0]!r}?"
        )
    return StateProblem(
        "unknown",
        name,
        None,
        name,
        f"unknown key; the model has no parameter of that name (it has {list(names[:3])}, ...).",
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


def non_string_key(name: str, key: Any, as_string_exists: bool) -> StateProblem:
    same = f"; did you mean {str(key)!r}?" if as_string_exists else "."
    return StateProblem(
        "key",
        name,
        "a str key",
        key,
        f"nested state keys must be strings, got {type(key).__name__} {key!r}{same}",
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


def not_an_array(name: str, value: Any) -> StateProblem:
    if isinstance(value, jax.ShapeDtypeStruct):
        why = f"got {describe(value)}, an abstract value: restore real arrays first."
    elif value is None or isinstance(value, Mapping):
        why = f"got {describe(value)}."
    else:
        why = f"got a value that is not numeric ({value!r:.60})."
    return StateProblem(
        "value", name, "an array", type(value).__name__, f"expected an array, {why}"
    )


def shape(name: str, expected: tuple[int, ...], got: tuple[int, ...]) -> StateProblem:
    return StateProblem(
        "shape", name, expected, got, f"shape mismatch: expected {expected}, got {got}."
    )


def dtype_kind(
    name: str, expected: Any, got: Any, expected_kind: str, got_kind: str
) -> StateProblem:
    want, have = np.dtype(expected).name, np.dtype(got).name
    return StateProblem(
        "dtype",
        name,
        want,
        have,
        f"dtype kind changes: the model holds {want} ({expected_kind}), got {have} ({got_kind}). "
        f"Loads only cast within a kind; convert the value yourself if this is really intended.",
    )


def narrowing(name: str, expected: Any, got: Any, traced: bool) -> StateProblem:
    want, have = np.dtype(expected).name, np.dtype(got).name
    why = "cannot be checked inside jit" if traced else "would change values"
    hint = f"narrowing {have} to {want} {why}; convert the value yourself."
    return StateProblem("dtype", name, want, have, hint)


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
