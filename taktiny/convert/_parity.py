"""Parity: run a converted model and its source on the same inputs and compare every
output. A conversion that passes coverage can still be wrong (a square matrix left
untransposed has the right shape); only the outputs prove it."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np


class ParityOutput(NamedTuple):
    """One output compared.

    Attributes:
        name: its path in the reference's output (``"last_hidden_state"``, ``"0"``,
            ``"1.logits"``; ``"output"`` for a lone array), or in ours where the
            reference gives positions only.
        ours: its shape from ``ours``.
        theirs: its shape from ``theirs``.
        max_error: ``max |ours - theirs|`` computed in float64; ``nan`` when the shapes
            differ or either side holds NaN (no tolerance passes ``nan``); 0 when empty.
    """

    name: str
    ours: tuple[int, ...]
    theirs: tuple[int, ...]
    max_error: float

    def _columns(self) -> tuple[str, str, str]:
        if self.ours != self.theirs:
            shapes = f"ours {list(self.ours)}, theirs {list(self.theirs)}"
            return self.name, shapes, "shapes differ"
        return self.name, str(list(self.ours)), f"max abs error {self.max_error:.2e}"

    def __str__(self) -> str:
        return "  ".join(self._columns())


class Parity(NamedTuple):
    """What :func:`parity` found: one :class:`ParityOutput` per output, in order.

    Attributes:
        outputs: the comparison of each output, in the order the functions return them.
    """

    outputs: tuple[ParityOutput, ...]

    @property
    def max_error(self) -> float:
        """The largest error over all outputs (``nan`` if any is ``nan``; 0 if none)."""
        errors = [o.max_error for o in self.outputs]
        return math.nan if any(map(math.isnan, errors)) else max(errors, default=0.0)

    def __repr__(self) -> str:
        rows = [o._columns() for o in self.outputs]
        widths = [max((len(row[i]) for row in rows), default=0) for i in range(2)]
        count = f"{len(rows)} output{'' if len(rows) == 1 else 's'}"
        lines = [f"  {a:{widths[0]}}  {b:{widths[1]}}  {c}" for a, b, c in rows]
        return "\n".join([f"Parity of {count}:", *lines])


def parity(
    ours: Callable[..., Any],
    theirs: Callable[..., Any],
    *inputs: Any,
    tolerance: float | None = None,
) -> Parity:
    """Runs ``ours(*inputs)`` and ``theirs(*inputs)`` and compares their outputs.

    A conversion is only proven by outputs: use this after :func:`convert`, and again
    after :func:`export` and loading back into the source framework.

    Args:
        ours: the converted model, as a function of the inputs (a jitted forward, or a
            lambda around the model; JAX takes NumPy inputs as they are).
        theirs: the reference, as a function of the same inputs; wrap a torch model in
            a lambda, ``lambda ids: reference(torch.from_numpy(ids)).logits``.
        *inputs: the inputs both get, unchanged: NumPy arrays, say ``[batch, length]``
            token ids.
        tolerance: when given, the largest ``max |ours - theirs|`` any output may have;
            an ``AssertionError`` names every output over it, every output whose shapes
            differ, and every output holding NaN.

    Each side may return an array, or tuples, lists and mappings of them, nested
    (Hugging Face's ``ModelOutput`` is a mapping); mappings keep their order, ``None``
    entries are dropped. Arrays are anything ``np.asarray`` takes, and torch tensors
    (read with ``.detach().cpu()``, without importing torch). The outputs are flattened
    in order and paired by position: both sides must give the same number of arrays,
    or a ``ValueError`` names both lists.

    Returns:
        A :class:`Parity` report: name, both shapes and the max abs error per output.

    Raises:
        ValueError: the two sides give different numbers of arrays.
        AssertionError: with `tolerance`, some output is over it, has other shapes on
            each side, or holds NaN.
    """
    mine, reference = _flatten(ours(*inputs), ""), _flatten(theirs(*inputs), "")
    if len(mine) != len(reference):
        raise ValueError(
            f"convert.parity: ours gave {len(mine)} outputs {[n for n, _ in mine]}, theirs "
            f"{len(reference)} {[n for n, _ in reference]}; pair them by returning the same "
            f"outputs in the same order (select them in the functions you pass)."
        )
    outputs = tuple(_compare(a, b) for a, b in zip(mine, reference, strict=True))
    report = Parity(outputs)
    if tolerance is not None:
        bad = [o for o in outputs if math.isnan(o.max_error) or o.max_error > tolerance]
        if bad:
            lines = [
                f"convert.parity: {len(bad)} of {len(outputs)} outputs are not within the "
                f"tolerance {tolerance:g}:",
                *(f"  - {o.name!r}: {_why(o)}" for o in bad),
                "A missing transpose, a split in the wrong order or a wrong epsilon in the "
                "layers behind these outputs is the usual cause; compare layer by layer.",
            ]
            raise AssertionError("\n".join(lines))
    return report


def _why(output: ParityOutput) -> str:
    if output.ours != output.theirs:
        return output._columns()[1] + ": shapes differ"
    if math.isnan(output.max_error):
        return "an output holds NaN"
    return f"max abs error {output.max_error:.3g}"


def _flatten(value: Any, path: str) -> list[tuple[str, np.ndarray]]:
    if value is None:
        return []
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (tuple, list)):
        items = list(zip(getattr(value, "_fields", range(len(value))), value, strict=True))
    else:
        return [(path or "output", _numpy(value))]
    return [out for key, v in items for out in _flatten(v, f"{path}.{key}" if path else str(key))]


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":  # NumPy has no bfloat16 of its own
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _compare(ours: tuple[str, np.ndarray], theirs: tuple[str, np.ndarray]) -> ParityOutput:
    (name, a), (their_name, b) = ours, theirs
    if their_name.replace(".", "").isdigit() and not name.replace(".", "").isdigit():
        their_name = name  # the reference gives positions only: our name says more
    if a.shape != b.shape:
        error = math.nan
    elif a.size == 0:
        error = 0.0
    else:
        error = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
    return ParityOutput(their_name, tuple(a.shape), tuple(b.shape), error)
