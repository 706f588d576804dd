"""Loading values held in another representation than the model's.

A float array where the model holds a `QArray` is quantized as that QArray is (its bits,
axis, group size and scale dtype); a QArray, or a dict of its parts, where the model holds
an array is dequantized into that array's dtype; a QArray quantized another way is
dequantized and quantized again. Each only with ``match_quantization=True``: without it,
each is a problem that says how to convert. The resolver and the check set such values
aside only where a plain load would fail, so an ordinary load does no work here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding

import taktiny.state._problems as err
import taktiny.state._values as _values

from .._problems import Problems, StateProblem
from ..arrays import SCALARS
from ..quant import PARTS, QArray, parts_layout, quantize_like
from ._names import tree_util
from ._problems import describe
from ._views import View

_CHECKED_KINDS = ("dtype", "shape", "value", "structure")  # problems told as a QArray's


class Other(NamedTuple):
    """A value of the state in another representation than the model's value it names."""

    name: str  # the flat name of the model's array or custom parameter
    old: Any  # the model's value there: an array, a QArray, another custom value
    wheres: tuple[Any, ...]  # where its leaves are in the view, in flatten order
    given: Any  # the state's value: an array, a QArray, or a dict of a QArray's parts
    flat: bool = False  # the parts came under flat names ("kernel.value", "kernel.scale")


def is_quantized(value: Any) -> bool:
    """Whether a value refused as an array is a quantized one: a QArray, or a dict of some
    of its parts (a QArray restored without a target)."""
    if isinstance(value, QArray):
        return True
    if not isinstance(value, Mapping):
        return False
    parts = cast("Mapping[Any, Any]", value)
    return 0 < len(parts) and all(k in PARTS for k in parts)


def settle(
    view: View[Any], others: list[Other], match: bool, problems: Problems
) -> list[tuple[Any, Any]]:
    """The leaves to load in place of `others`, converted to the model's representation
    (with `match`); each that cannot (or, without `match`, may not) be is a problem. All
    are checked before any is converted, and none is when anything is wrong."""
    plans = [_plan(other, match, problems) for other in others]
    if problems:
        return []
    return [leaf for plan in plans if plan is not None for leaf in plan()]


def _plan(other: Other, match: bool, problems: Problems) -> Any:
    """How to convert `other` (a function giving its leaves), once checked; None (and a
    problem recorded) when it can't be."""
    name, old, given = other.name, other.old, other.given
    if isinstance(old, QArray) and isinstance(given, QArray):
        if not match:
            problems.append(quantized_expected(name, old, given))
        elif given.shape != old.shape:
            problems.append(err.shape(name, old.shape, given.shape))
        else:
            return lambda: _quantized(other, given.dequantize(jnp.float32))
        return None
    if isinstance(old, QArray) and _array_like(given):
        if not match:
            problems.append(quantized_expected(name, old, given))
            return None
        if (
            isinstance(given, (jax.Array, np.ndarray))
            and _values.kind(cast("jax.Array | np.ndarray", given).dtype) != "floating"
        ):
            problems.append(not_float(name, old, given))
            return None
        # the shape checked; quantized from float32 (not the scale's narrower dtype)
        wide = jnp.dtype(old.dtype) if jnp.dtype(old.dtype).itemsize > 4 else jnp.float32
        logical = jax.ShapeDtypeStruct(old.shape, wide)
        array = _values.checked_value(name, given, logical, problems)
        return None if array is None else lambda: _quantized(other, array)
    if is_quantized(given) and tree_util.treedef_is_leaf(tree_util.tree_structure(old)):
        return _dequantized(other, match, problems)
    if isinstance(old, QArray):
        problems.append(not_quantized(name, old, given))
    else:  # a custom parameter given in another structure
        structure = tree_util.tree_structure
        problems.append(err.structure(name, structure(old), structure(given)))
    return None


def _array_like(value: Any) -> bool:
    """Whether a value that is no custom parameter is meant as one array."""
    kinds = (jax.Array, np.ndarray, list, tuple, *SCALARS)
    return isinstance(value, kinds) or hasattr(value, "__dlpack__")


def _quantized(other: Other, array: Any) -> list[tuple[Any, Any]]:
    """The leaves of `array` quantized as the model's QArray `other.old` is, computed on
    the devices of its value when it is split."""
    old = other.old
    target = None
    if not isinstance(array, Tracer) and not isinstance(old.value, Tracer):  # both concrete
        target = getattr(old.value, "sharding", None)
    if isinstance(target, NamedSharding):
        array = _values.placement.device_put(array, target)
    q = quantize_like(array, old, name=other.name)
    return list(zip(other.wheres, jax.tree_util.tree_leaves(q), strict=True))


def _dequantized(other: Other, match: bool, problems: Problems) -> Any:
    """A QArray, or a dict of its parts, where the model holds an array."""
    name, old, given = other.name, other.old, other.given
    made = given if isinstance(given, QArray) else _from_parts(given)
    if isinstance(made, str):  # parts that make no QArray
        parts: Mapping[str, Any] = other.given
        if match:
            problems.append(unfit_parts(name, parts, made))
        elif other.flat:  # told as they were given
            problems.extend(err.inside_array(f"{name}.{k}", name, v) for k, v in parts.items())
        else:
            problems.append(err.array_expected(name, parts, "this name is one array"))
        return None
    if not match:
        problems.append(float_expected(name, old, given, made))
        return None
    shape = tuple(np.shape(old))
    dtype = jnp.result_type(old) if getattr(old, "dtype", None) is None else old.dtype
    if made.shape != shape:
        problems.append(err.shape(name, shape, made.shape))
    elif not jnp.issubdtype(dtype, jnp.floating):
        kind = _values.kind(dtype) or str(dtype)
        problems.append(err.dtype_kind(name, dtype, made.dtype, kind, "floating"))
    else:
        return lambda: [(other.wheres[0], made.dequantize(dtype))]
    return None


def _from_parts(parts: Mapping[str, Any]) -> QArray | str:
    """The QArray that a dict of its parts makes, its layout read from them; or why not."""
    missing = [part for part in PARTS if part not in parts]
    if missing:
        return f"both the value and the scale are needed, got no {' or '.join(missing)}"
    value, scale = parts["value"], parts["scale"]
    if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in (value, scale)):
        return "the value and the scale must be arrays"
    layout = parts_layout(value, scale)
    if isinstance(layout, str):
        return layout
    bits, axis, group_size = layout
    try:
        return QArray(value, scale, bits=bits, axis=axis, group_size=group_size)
    except ValueError as error:
        return str(error).removeprefix("QArray: ").rstrip(".")


def in_quantized(
    view: View[Any], where: Any, problems: Iterable[StateProblem]
) -> list[StateProblem]:
    """The `problems` found with the leaf at `where`; when that leaf is a part of a QArray
    (``kernel.value`` of the wrong dtype, ``kernel.scale`` of the wrong shape), each told
    as a problem with that QArray."""
    found = view.quantized(where)
    if found is None:
        return list(problems)
    param, q = found
    told: Callable[[StateProblem], StateProblem]
    told = lambda p: quantized_problem(p, param, q) if p.kind in _CHECKED_KINDS else p
    return [told(p) for p in problems]


# --- The problems of another representation -------------------------------------

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
    given = (
        parts_text(cast("Mapping[str, Any]", got)) if isinstance(got, Mapping) else describe(got)
    )
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


def quantized_problem(problem: StateProblem, param: str, q: QArray) -> StateProblem:
    """`problem`, about a part of the QArray `q` at `param`, told as a problem with `q`."""
    part = problem.name[len(param) + 1 :]
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
