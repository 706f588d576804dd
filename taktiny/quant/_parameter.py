"""`Parameter`: the one interface of a parameter held as several arrays (a `QArray`), as
the state walk, sharding, saving and the loaders ask it: its parts and their names, how it
is made from its parts and from a float array, its record in a file, and its problems.

Outside `quant` (and the layers of `nn`), code asks a value whether it is a `Parameter`
and then asks the parameter; it never tests for `QArray` nor builds the names of its parts
(`tests/package/test_layout.py` holds it to that).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from .._problems import StateProblem


class Parameter(abc.ABC):
    """A parameter held as several arrays, its *parts* (a `QArray`: integers and scales),
    read as the one float array it stands for (`shape`, `dtype`).

    In a flat state its parts are named under the parameter's name, one dot deeper
    (``dense.kernel.value``); a tree flatten gives them in the order of `parts`.
    """

    parts: ClassVar[tuple[str, ...]]
    """The names of its parts, in flatten order (``("value", "scale")``)."""

    trained: ClassVar[bool] = False
    """Whether a gradient step trains its parts (a QArray's integers cannot take one)."""

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, ...]:
        """The shape of the float array it stands for."""

    @property
    @abc.abstractmethod
    def dtype(self) -> Any:
        """The dtype of the float array it stands for."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """The bytes its parts hold."""

    @classmethod
    def part_names(cls, name: str) -> tuple[str, ...]:
        """The flat names of the parts of the parameter named `name`."""
        return tuple(f"{name}.{part}" for part in cls.parts)

    def part_values(self) -> tuple[Any, ...]:
        """Its parts, in flatten order (the first is split as the whole is)."""
        return tuple(getattr(self, part) for part in self.parts)

    def named_parts(self, name: str) -> list[tuple[str, Any]]:
        """``(flat name, part)`` of each part, in flatten order, under the name `name`."""
        return list(zip(self.part_names(name), self.part_values(), strict=True))

    @abc.abstractmethod
    def from_float(self, array: Any, name: str = "the array") -> Parameter:
        """`array` (float, of `shape`) made into a parameter of this one's kind and layout;
        `name` names it in errors."""

    @abc.abstractmethod
    def to_float(self, dtype: Any = None) -> Any:
        """The float array it stands for, in `dtype` (None: its own)."""

    @classmethod
    @abc.abstractmethod
    def from_parts(cls, parts: Mapping[str, Any]) -> Parameter | str:
        """The parameter that a dict of its parts (``{"value": ..., "scale": ...}``) makes,
        its layout read from them; or, as a message's clause, why they make none."""

    @abc.abstractmethod
    def layout(self) -> dict[str, Any]:
        """Its layout, as a schema records it (``{"bits": 8, "axis": 0, "group_size": None}``)."""

    def record(self) -> dict[str, Any]:
        """Its record in a file's header, beside its parts: its layout and its shape."""
        return {**self.layout(), "shape": list(self.shape)}

    @abc.abstractmethod
    def same_layout(self, other: Parameter) -> bool:
        """Whether `other` is laid out as this one is (its parts load into it as they are)."""

    @abc.abstractmethod
    def made_by(self) -> str:
        """The call that makes a float model's parameter like this one, as a hint shows it."""

    # Its problems: each None when nothing is wrong.

    @abc.abstractmethod
    def stored_problem(
        self, name: str, stored: Mapping[str, Any], record: Mapping[str, Any] | None
    ) -> StateProblem | None:
        """What stops what a file stores for the parameter `name` from loading into this
        one: `stored` holds, by flat name, its float array (under `name`) or its parts
        (under :meth:`part_names`), each with a shape and a dtype, and `record` their
        recorded layout (None: not recorded)."""

    @abc.abstractmethod
    def made_problem(self, name: str, made: Any, sources: Sequence[str]) -> StateProblem | None:
        """What stops `made`, a parameter a conversion makes from `sources`, from loading
        into this one (laid out otherwise)."""

    @abc.abstractmethod
    def part_problem(self, problem: StateProblem, name: str) -> StateProblem:
        """`problem`, found with one of its parts, told as a problem with the parameter
        at `name`."""
