"""The error a load raises and the record of each problem it lists: `StateProblem`,
`StateDictError`, and `describe`, which names a value in their messages."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .._quant import QArray


@dataclasses.dataclass(frozen=True)
class StateProblem:
    """One problem found while loading a state.

    Attributes:
        kind: ``"unknown"`` (no such name), ``"key"`` (a nested key that is not a
            string, or contains ``"."``), ``"structure"`` (a dict where one array
            belongs, or the reverse; a state that contains itself, or nests too deeply),
            ``"shape"``, ``"dtype"`` (a change of dtype kind, or a cast to a narrower
            dtype that would change values: an integer out of range, a float too large
            that would become inf, or NaN or its largest value in a dtype without inf),
            ``"value"`` (not an array, or one that holds no values: a deleted array, a
            tracer leaked out of a finished transformation; or a NumPy masked array),
            ``"representation"`` (a float array where the model holds a
            :class:`~taktiny.QArray`, or the reverse, or a QArray quantized another
            way), ``"sharding"`` (an array on devices outside the mesh of the leaf it
            replaces), ``"missing"`` (not supplied under ``strict=True``) or
            ``"abstract"`` (not supplied to an abstract model).
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


_ORDER = {"unknown": 0, "key": 0, "structure": 0, "missing": 2, "abstract": 2}  # values: 1
SHOWN = 20  # problems printed in the message; all of them stay in `problems`


class StateDictError(ValueError):
    """The one error type for state problems; raised once, listing every offending name.

    When it is raised nothing has been loaded: the module is unchanged and no new
    module is returned. Problems with names and structure come first (unknown names,
    bad keys, a dict where an array belongs), then problems with values (shape,
    dtype, not an array), then names that were not supplied; within each group, in
    the order of the state. The message shows the first 20; all of them are in
    :attr:`problems` (a tuple of :class:`StateProblem`), and by name in
    :attr:`missing_keys` and :attr:`unexpected_keys`.

    Args:
        where: the call that failed, which starts the message
            (``"MLP.load_state_dict"``).
        problems: every problem found, in any order.

    Attributes:
        problems: the problems, ordered as above.
    """

    def __init__(self, where: str, problems: Sequence[StateProblem]):
        self.problems = tuple(sorted(problems, key=lambda p: _ORDER.get(p.kind, 1)))
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        lines = [f"{where}: {count}; nothing was loaded."]
        lines += [f"  - {p}" for p in self.problems[:SHOWN]]
        if len(problems) > SHOWN:
            lines.append(f"  ... and {len(problems) - SHOWN} more (all in .problems)")
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
    """A value as a message names it: ``an array float32[2, 3]``, ``a dict with keys [...]``."""
    if isinstance(value, Mapping):
        return f"a dict with keys {list(value)[:6]}"
    if isinstance(value, QArray):
        return f"a {value!r}"
    if isinstance(value, jax.ShapeDtypeStruct):
        return f"an abstract array {np.dtype(value.dtype).name}{list(value.shape)}"
    if isinstance(value, (jax.Array, np.ndarray)):
        return f"an array {np.dtype(value.dtype).name}{list(value.shape)}"
    return f"a value of type {type(value).__name__}"
