"""The one record of a problem (`StateProblem`) and the one error base that lists them
(`ProblemsError`: a load's ``StateDictError``, a conversion's ``convert.ConversionError``,
a selection's ``SelectionError``); each package builds its records beside the check that
finds them. Also the name suggester their messages share: the closest valid name for an
unknown one. Imports nothing of Taktiny's, nor JAX."""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any, cast

import numpy as np


@dataclasses.dataclass(frozen=True, init=False)
class StateProblem:
    """One problem with a model's state, or with choosing from it by name: found while
    loading it (:class:`StateDictError`), converting it (``convert.ConversionError``, whose
    ``convert.ConversionProblem`` is this class) or choosing leaves and layers by name
    (:class:`SelectionError`). Every one has the same fields, and reads as
    ``'name': what is wrong; the fix``.

    Attributes:
        kind: what is wrong. A load's: ``"unknown"`` (no such name), ``"key"`` (a nested
            key that is not a string, or contains ``"."``), ``"structure"`` (a dict where
            one array belongs, or the reverse; a state that contains itself, or nests too
            deeply), ``"shape"``, ``"dtype"`` (a change of dtype kind, or a cast to a
            narrower dtype that would change values: an integer out of range, a float too
            large that would become inf, or NaN or its largest value in a dtype without
            inf), ``"value"`` (not an array, or one that holds no values: a deleted array, a
            tracer leaked out of a finished transformation; or a NumPy masked array),
            ``"representation"`` (a float array where the model holds a
            :class:`~taktiny.QArray`, or the reverse, or a QArray quantized another way),
            ``"sharding"`` (an array on devices outside the mesh of the leaf it replaces),
            ``"missing"`` (not supplied under ``strict=True``) or ``"abstract"`` (not
            supplied to an abstract model). A conversion's are listed by
            ``convert.ConversionError``. A selection's: ``"unmatched"`` (a pattern that
            matches nothing it could choose), ``"missing"`` (a leaf no rule reaches, where
            every leaf must be), ``"sharding"`` (a spec a leaf cannot take) and ``"rule"``
            (a rule whose pattern or value is not one).
        name: the flat name (``"layers.1.kernel"``) the problem is about; for a pattern
            that matches nothing, the pattern.
        expected: what belongs there (a shape, a dtype name, a description); None when
            the hint alone says it.
        got: what was given or found there; None when nothing was.
        hint: the full explanation, with the fix.

    Args:
        kind: as above.
        name: as above.
        expected: as above.
        got: as above.
        hint: as above.
        key: the name, under its old keyword (deprecated: pass `name`).

    ``ConversionProblem(kind, name, hint)``, the form of earlier releases, still makes the
    record, with a ``FutureWarning``: pass ``hint=`` by keyword.

    Raises:
        TypeError: `name` or `hint` is not given, or both `name` and `key` are.
    """

    kind: str
    name: str
    expected: Any
    got: Any
    hint: str

    def __init__(
        self,
        kind: str,
        name: str | None = None,
        expected: Any = None,
        got: Any = None,
        hint: str | None = None,
        *,
        key: str | None = None,
    ) -> None:
        if key is not None:
            if name is not None:
                raise TypeError("StateProblem takes the name once: pass name=, not also key=.")
            warnings.warn(_KEY_RENAMED, FutureWarning, stacklevel=2)
            name = key
        if hint is None and got is None and isinstance(expected, str):
            warnings.warn(_HINT_MOVED, FutureWarning, stacklevel=2)
            expected, hint = None, expected  # ConversionProblem(kind, name, hint), as it was
        if name is None or hint is None:
            raise TypeError(
                f"StateProblem(kind, name, expected=None, got=None, hint) needs a name and a "
                f"hint, got name={name!r}, hint={hint!r}."
            )
        values = (kind, name, expected, got, hint)
        for field, value in zip(("kind", "name", "expected", "got", "hint"), values, strict=True):
            object.__setattr__(self, field, value)  # (frozen: set once, here)

    @property
    def key(self) -> str:
        """The name, under its old attribute (deprecated: read ``name``)."""
        warnings.warn(_KEY_RENAMED, FutureWarning, stacklevel=2)
        return self.name

    def __str__(self) -> str:
        return f"{self.name!r}: {self.hint}"


_HINT_MOVED = (
    "ConversionProblem(kind, name, hint) is now the record of every problem, "
    "StateProblem(kind, name, expected=None, got=None, hint): pass hint= by keyword. The "
    "three-argument form goes in the next release."
)
_KEY_RENAMED = (
    "StateProblem.key is now StateProblem.name (the same flat name, as ConversionProblem "
    "calls it); read and pass name. key goes in the next release."
)


class Problems:
    """The problems one load has found, in the order found. Records are only added: none
    is removed or changed afterwards (a step that learns more about a problem builds a
    new record before adding it), so what a step has added is what the error lists."""

    __slots__ = ("_records",)

    def __init__(self, records: Iterable[StateProblem] = ()) -> None:
        self._records = list(records)

    def append(self, problem: StateProblem) -> None:
        self._records.append(problem)

    def extend(self, problems: Iterable[StateProblem]) -> None:
        self._records.extend(problems)

    def __iadd__(self, problems: Iterable[StateProblem]) -> Problems:
        self._records.extend(problems)
        return self

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[StateProblem]:
        return iter(self._records)

    def __repr__(self) -> str:
        return f"Problems({self._records!r})"


SHOWN = 20  # problems printed in the message; all of them stay in `problems`


class ProblemsError(ValueError):
    """An error that lists every problem found, one a line, after a first line that names
    the call that failed: the base of :class:`~taktiny.StateDictError` (and
    ``convert.ConversionError``, one of them) and :class:`~taktiny.SelectionError`.

    Args:
        where: the call that failed, which starts the message.
        problems: every problem found, in the order to list them.
        ending: what follows the count on the first line (``"; nothing was loaded."``).
        shown: how many problems the message lists (None: all of them).
        tail: lines after the problems.

    Attributes:
        problems: the problems, a tuple of :class:`StateProblem`.
    """

    def __init__(
        self,
        where: str,
        problems: Iterable[StateProblem],
        ending: str,
        *,
        shown: int | None = SHOWN,
        tail: Sequence[str] = (),
    ) -> None:
        self.problems = tuple(problems)
        n = len(self.problems)
        lines = [f"{where}: {n} problem{'s' if n > 1 else ''}{ending}"]
        lines += [f"  - {p}" for p in self.problems[:shown]]
        if shown is not None and n > shown:
            lines.append(f"  ... and {n - shown} more (all in .problems)")
        super().__init__("\n".join([*lines, *tail]))


# --- The name suggester ---------------------------------------------------------

_Indices = Iterable[np.intp]  # an array of indices, as it is iterated
_SHORTLIST = 64  # candidates whose similarity to an unknown name is measured (see Suggester)


def groups_of(names: Iterable[str]) -> set[str]:
    """Every group above the names: ``a.b.c`` is in ``a.b`` and ``a``."""
    return {n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1)}


class Suggester:
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
        pairs: list[int] = []
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
            contained = [i for i in cast(_Indices, whole) if _in_order(parts, self.candidates[i])]
            if contained:
                short = self._shortlist(name, np.array(contained), alike)
                return max(
                    # the first of equals
                    (self.candidates[i] for i in cast(_Indices, np.sort(short))),
                    key=lambda c: difflib.SequenceMatcher(None, name, c).ratio(),
                )
        for among in (pool, None):  # the same last part first, then every candidate
            short = self._shortlist(name, among, alike)
            close = difflib.get_close_matches(
                name, [self.candidates[i] for i in cast(_Indices, short)], n=1
            )
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
    return Suggester(candidates, ())(name)
