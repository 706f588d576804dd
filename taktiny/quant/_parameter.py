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
        """A float array made into a parameter of this one's kind and layout (a QArray:
        quantized as this one is, its bits, axis, group size and scale dtype).

        Args:
            array: a float array of this parameter's `shape`.
            name: how errors name the array.

        Returns:
            The new parameter.
        """

    @abc.abstractmethod
    def to_float(self, dtype: Any = None) -> Any:
        """The float array this parameter stands for.

        Args:
            dtype: the dtype of the result; None for the parameter's own `dtype`.

        Returns:
            An array of `shape` (a ``jax.ShapeDtypeStruct`` for an abstract parameter).
        """

    @classmethod
    @abc.abstractmethod
    def from_parts(cls, parts: Mapping[str, Any]) -> Parameter | str:
        """The parameter a dict of its parts makes, its layout read from them (as a
        checkpoint restored without a target gives them).

        Args:
            parts: the parts by name (a QArray's ``{"value": ..., "scale": ...}``).

        Returns:
            The parameter; or, as a clause of a message, why the parts make none.
        """

    @abc.abstractmethod
    def layout(self) -> dict[str, Any]:
        """How this parameter is laid out, as a schema records it.

        Returns:
            A dict of plain values (a QArray's ``{"bits": 8, "axis": 0, "group_size": None}``).
        """

    def record(self) -> dict[str, Any]:
        """This parameter's record in a safetensors header, beside its parts.

        Returns:
            Its ``layout`` and its ``shape`` (a list).
        """
        return {**self.layout(), "shape": list(self.shape)}

    @abc.abstractmethod
    def made_by(self) -> str:
        """The call that makes a float model's parameter like this one, as hints show it.

        Returns:
            Python source (``"tt.quantize(model, bits=4, group_size=64)"``).
        """

    @abc.abstractmethod
    def stored_problem(
        self, name: str, stored: Mapping[str, Any], record: Mapping[str, Any] | None
    ) -> StateProblem | None:
        """What stops what a file stores for a parameter from loading into this one: its
        float array and its parts both, a float array that does not fit, parts laid out
        otherwise.

        Args:
            name: the parameter's flat name.
            stored: what the file stores for it, by flat name: its float array (under
                `name`) or its parts (under ``part_names``), each with a ``shape``
                and a ``dtype`` (a checkpoint's tensors).
            record: the layout the file records for it; None when none.

        Returns:
            The problem; None when nothing stops it.
        """

    @abc.abstractmethod
    def made_problem(self, name: str, made: Any, sources: Sequence[str]) -> StateProblem | None:
        """What stops a parameter a conversion makes from loading into this one.

        Args:
            name: the parameter's flat name.
            made: what the conversion makes (abstract); anything but a parameter passes.
            sources: the names the conversion reads, as the message names them.

        Returns:
            The problem (laid out otherwise); None when nothing stops it.
        """

    @abc.abstractmethod
    def part_problem(self, problem: StateProblem, name: str) -> StateProblem:
        """A problem found with one of this parameter's parts, told as one with the
        parameter (a value of another integer width, a scale of another layout).

        Args:
            problem: the problem with the part (its name the part's flat name).
            name: the parameter's flat name.

        Returns:
            The problem, its hint saying what the part is of and how to fix it.
        """
