"""Problems with quantized arrays: a float array where the model holds a `QArray` or the
reverse, a QArray quantized another way, parts that make no QArray."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._quant import QArray
from ._errors_core import StateProblem, describe

_MATCH = "match_quantization=True"  # the load option that converts representations


def _quantize_call(q: QArray) -> str:
    """The `tt.quantize` call that quantizes a float model's layer as `q` is."""
    group = "" if q.group_size is None else f", group_size={q.group_size}"
    return f"tt.quantize(model, bits={q.bits}{group})"


def parts_text(parts: Mapping[str, Any]) -> str:
    """A `{"value", "scale"}` dict of a quantized array's parts, as a message names it."""
    shown = ", ".join(
        f"{part} {np.dtype(v.dtype).name}{list(v.shape)}"
        if hasattr(v, "shape") and hasattr(v, "dtype")
        else f"{part} of type {type(v).__name__}"
        for part, v in parts.items()
    )
    return f"the parts of a quantized array ({shown})"


def quantized_expected(name: str, old: QArray, got: Any) -> StateProblem:
    """A float array, or a QArray quantized another way, where the model holds `old`."""
    if isinstance(got, QArray):
        hint = (
            f"the model holds {old!r} here and the state {got!r}: quantized another way. Pass "
            f"{_MATCH} to re-quantize it on load as the model's is (dequantized, then rounded "
            f"again), or load it into a model quantized as the state is ({_quantize_call(got)})."
        )
    else:
        hint = (
            f"the model holds a quantized array here, {old!r}, and the state {describe(got)}: "
            f"the representations differ. Pass {_MATCH} to quantize it on load as the model's is, "
            f"or load it into the float model and quantize that (tt.quantize)."
        )
    return StateProblem("representation", name, repr(old), describe(got), hint)


def not_float(name: str, old: QArray, got: Any) -> StateProblem:
    """A value of another kind than float, to be quantized as the model's `old` is."""
    hint = (
        f"cannot quantize {describe(got)} on load as the model's {old!r} is: quantizing "
        f"takes a float array."
    )
    return StateProblem("dtype", name, repr(old), describe(got), hint)


def not_quantized(name: str, old: QArray, got: Any) -> StateProblem:
    """A value that is neither an array nor a QArray where the model holds `old`."""
    hint = (
        f"expected a QArray like the model's {old!r} (or a dict of its parts, or a float "
        f"array to quantize with {_MATCH}), got {describe(got)}."
    )
    return StateProblem("structure", name, repr(old), describe(got), hint)


def float_expected(name: str, old: Any, got: Any, layout: QArray) -> StateProblem:
    """A QArray, or a dict of its parts, where the model holds the array `old`; `layout`:
    the QArray given, or the one its parts make."""
    given = parts_text(got) if isinstance(got, Mapping) else describe(got)
    hint = (
        f"the model holds {describe(old)} here and the state {given}: the representations "
        f"differ. Pass {_MATCH} to dequantize it on load, or quantize the model first to keep "
        f"it quantized ({_quantize_call(layout)})."
    )
    return StateProblem("representation", name, describe(old), given, hint)


def unfit_parts(name: str, got: Mapping[str, Any], why: str) -> StateProblem:
    """Parts of a quantized array that make no QArray, so cannot be dequantized."""
    given = parts_text(got)
    hint = f"cannot dequantize {given}: {why}."
    return StateProblem("representation", name, "a value and a scale", given, hint)


def in_quantized(problem: StateProblem, param: str, q: QArray) -> StateProblem:
    """`problem`, about a part of the QArray `q` at `param`, told as a problem with `q`."""
    part = problem.key[len(param) + 1 :]
    how = (
        f"A checkpoint quantized another way loads whole, as tt.QArray(value, scale, bits=..., "
        f"axis=..., group_size=...), with {_MATCH}, which re-quantizes it as the model's is; "
        f"or quantize the float model as the checkpoint is."
    )
    got = _dtype(problem.got) if problem.kind == "dtype" and part == "value" else None
    if got is not None and jnp.issubdtype(got, jnp.integer):
        hint = (
            f"the value of {param!r}, {q!r}, holds {problem.expected} ({_a(q.bits)}-bit "
            f"quantization); got {got.name}, the integers of another one "
            f"({jnp.iinfo(got).bits}-bit), which a cast would not re-scale. {how}"
        )
    elif got is not None and jnp.issubdtype(got, jnp.floating):
        hint = (
            f"the value of {param!r}, {q!r}, holds {problem.expected} ({_a(q.bits)}-bit "
            f"quantization); got {got.name}, a float array where the quantized integers "
            f"belong. Give the float weight itself at {param!r}, with {_MATCH}, to quantize it "
            f"on load as the model's is."
        )
    elif problem.kind == "shape" and part == "scale":
        per = "one per channel" if q.group_size is None else f"one per group of {q.group_size}"
        hint = (
            f"the scale of {param!r}, {q!r}, has shape {problem.expected} ({per} along axis "
            f"{q.axis}), got {problem.got}: the scales of another layout. {how}"
        )
    else:
        hint = f"{problem.hint} (It is the {part} of {param!r}, {q!r}.)"
    return dataclasses.replace(problem, hint=hint)


def _a(bits: int) -> str:
    return f"an {bits}" if bits == 8 else f"a {bits}"


def _dtype(name: Any) -> Any:
    """The dtype of a name a problem holds (``"int4"`` too); None for another value."""
    try:
        return jnp.dtype(name)
    except TypeError:
        return None
