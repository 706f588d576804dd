"""Loading values held in another representation than the model's.

A float array where the model holds a quantized parameter (a `quant.Parameter`, a `QArray`)
is made into one as that parameter is (`Parameter.from_float`: its bits, axis, group size and
scale dtype); a parameter, or a dict of its parts, where the model holds an array is made
into that array's dtype (`Parameter.to_float`); one quantized another way is
dequantized and quantized again. Each only with ``match_quantization=True``: without it,
each is a problem that says how to convert. The resolver and the check set such values
aside only where a plain load would fail, so an ordinary load does no work here.
"""

from __future__ import annotations

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
from ..quant import PARTS, Parameter, from_parts, stored_for_float
from ._names import tree_util
from ._problems import describe
from ._views import Flat, View

_CHECKED_KINDS = ("dtype", "shape", "value", "structure")  # problems told as a parameter's


class Other(NamedTuple):
    """A value of the state in another representation than the model's value it names."""

    name: str  # the flat name of the model's array or custom parameter
    old: Any  # the model's value there: an array, a quantized parameter, another custom value
    wheres: tuple[Any, ...]  # where its leaves are in the view, in flatten order
    given: Any  # the state's value: an array, a parameter, or a dict of its parts
    flat: bool = False  # the parts came under flat names ("kernel.value", "kernel.scale")


def is_quantized(value: Any) -> bool:
    """Whether a value refused as an array is a quantized one: a parameter, or a dict of some
    of its parts (a QArray restored without a target)."""
    if isinstance(value, Parameter):
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
    if isinstance(old, Parameter) and isinstance(given, Parameter):
        if not match:
            problems.append(quantized_expected(name, old, given))
        elif given.shape != old.shape:
            problems.append(err.shape(name, old.shape, given.shape))
        else:
            return lambda: _quantized(other, given.to_float(jnp.float32))
        return None
    if isinstance(old, Parameter) and _array_like(given):
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
    if isinstance(old, Parameter):
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
    """The leaves of `array` quantized as the model's parameter `other.old` is, computed on
    the devices of its value when it is split."""
    old = other.old
    lead = old.part_values()[0]  # (its first part, split as the whole is)
    target = None
    if not isinstance(array, Tracer) and not isinstance(lead, Tracer):  # both concrete
        target = getattr(lead, "sharding", None)
    if isinstance(target, NamedSharding):
        array = _values.placement.device_put(array, target)
    q = old.from_float(array, name=other.name)
    return list(zip(other.wheres, jax.tree_util.tree_leaves(q), strict=True))


def _dequantized(other: Other, match: bool, problems: Problems) -> Any:
    """A quantized parameter, or a dict of its parts, where the model holds an array."""
    name, old, given = other.name, other.old, other.given
    made = given if isinstance(given, Parameter) else from_parts(given)
    if isinstance(made, str):  # parts that make no parameter
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
        return lambda: [(other.wheres[0], made.to_float(dtype))]
    return None


def settled_sources(
    view: Flat,
    supplied: Mapping[Any, Any],
    others: Iterable[Other],
    state: Mapping[str, Any],
    records: Mapping[str, Any],
    problems: Problems,
) -> Settled:
    """The leaves of a load of abstract values (`state`: shapes and dtypes, a checkpoint's
    tensors; `supplied` and `others`: what its names resolve to) that take an entry as it
    is, by leaf name, and the quantized parameters made from a float entry: each checked from its
    shape and dtype, the parts of a quantized parameter first against their layout (its
    `records`, or their dtypes) by the parameter itself, a float entry for a parameter by
    it too, quantized parts for a float leaf told. Problems go to `problems`."""
    taken: dict[str, str] = {}
    floats: dict[str, str] = {}
    covered: set[str] = set()  # the parts of a parameter refused whole: told, not missing
    unnamed: set[Any] = set()  # the leaves of the others that name nothing after all
    parts: dict[str, tuple[Parameter, dict[Any, Any]]] = {}  # each parameter's parts given
    for where, given in supplied.items():
        owner = view.quantized(where)
        if owner is None:
            _take(view, where, given, taken, problems)
        else:
            parts.setdefault(owner[0], (owner[1], {}))[1][where] = given
    for other in others:
        name, old = other.name, other.old
        if isinstance(old, Parameter):  # a float array under its name (with its parts?)
            both = {n: state[n] for n in old.part_names(name) if n in state}
            problem = old.stored_problem(name, {name: other.given, **both}, None)
            parts.pop(name, None)  # (its parts, if given too: told with it)
            if problem is not None:
                problems.append(problem)
            else:
                floats[name] = name
            continue
        if not other.flat:  # a custom parameter named whole, stored as one tensor
            structure = tree_util.tree_structure
            problems.append(err.structure(name, structure(old), structure(other.given)))
            continue
        shape = tuple(np.shape(old))
        dtype = jnp.result_type(old) if getattr(old, "dtype", None) is None else old.dtype
        names = [f"{name}.{part}" for part in other.given]
        problem = stored_for_float(name, names, records, shape, dtype)
        if problem is not None:
            problems.append(problem)
        else:  # (a part alone, unrecorded: a name inside an array, which fills nothing)
            problems.extend(err.inside_array(n, name, state[n]) for n in names)
            unnamed.update(other.wheres)
    for name, (like, given) in parts.items():
        stored = {view.name(where): value for where, value in given.items()}
        problem = like.stored_problem(name, stored, records.get(name))
        if problem is not None:
            problems.append(problem)
            covered.update(like.part_names(name))
            continue
        for where, value in given.items():
            _take(view, where, value, taken, problems)
    return Settled(taken, floats, frozenset(covered), frozenset(unnamed))


class Settled(NamedTuple):
    """What `settled_sources` finds: each leaf's entry and each parameter's float entry
    (by name), the parts of a parameter refused whole (not missing besides) and the
    leaves whose other entries name nothing after all (missing, when a load must fill
    them)."""

    taken: dict[str, str]
    floats: dict[str, str]
    covered: frozenset[str]
    unnamed: frozenset[Any]


def _take(view: Flat, where: int, given: Any, taken: dict[str, str], problems: Problems) -> None:
    """The leaf at `where` takes `given` (a shape and a dtype) as it is, once checked."""
    name = view.name(where)
    problem = _values.spec_problem(name, given, view.olds[where])
    if problem is None:
        taken[name] = name
    else:
        problems.extend(in_quantized(view, where, [problem]))


def in_quantized(
    view: View[Any], where: Any, problems: Iterable[StateProblem]
) -> list[StateProblem]:
    """The `problems` found with the leaf at `where`; when that leaf is a part of a parameter
    (``kernel.value`` of the wrong dtype, ``kernel.scale`` of the wrong shape), each told
    as a problem with that parameter."""
    found = view.quantized(where)
    if found is None:
        return list(problems)
    param, q = found
    told: Callable[[StateProblem], StateProblem]
    told = lambda p: q.part_problem(p, param) if p.kind in _CHECKED_KINDS else p
    return [told(p) for p in problems]


# --- The problems of another representation -------------------------------------

_MATCH = "match_quantization=True"  # the load option that converts representations


def parts_text(parts: Mapping[str, Any]) -> str:
    """A `{"value", "scale"}` dict of a quantized array's parts, as a message names it."""
    shown = ", ".join(
        f"{part} {np.dtype(v.dtype).name}{list(v.shape)}"
        if hasattr(v, "shape") and hasattr(v, "dtype")
        else f"{part} of type {type(v).__name__}"
        for part, v in parts.items()
    )
    return f"the parts of a quantized array ({shown})"


def quantized_expected(name: str, old: Parameter, got: Any) -> StateProblem:
    """A float array, or a parameter quantized another way, where the model holds `old`."""
    if isinstance(got, Parameter):
        hint = (
            f"the model holds {old!r} here and the state {got!r}: quantized another way. Pass "
            f"{_MATCH} to re-quantize it on load as the model's is (dequantized, then rounded "
            f"again), or load it into a model quantized as the state is ({got.made_by()})."
        )
    else:
        hint = (
            f"the model holds a quantized array here, {old!r}, and the state {describe(got)}: "
            f"the representations differ. Pass {_MATCH} to quantize it on load as the model's is, "
            f"or load it into the float model and quantize that (tt.quantize)."
        )
    return StateProblem("representation", name, repr(old), describe(got), hint)


def not_float(name: str, old: Parameter, got: Any) -> StateProblem:
    """A value of another kind than float, to be quantized as the model's `old` is."""
    hint = (
        f"cannot quantize {describe(got)} on load as the model's {old!r} is: quantizing "
        f"takes a float array."
    )
    return StateProblem("dtype", name, repr(old), describe(got), hint)


def not_quantized(name: str, old: Parameter, got: Any) -> StateProblem:
    """A value that is neither an array nor a quantized parameter where the model holds `old`."""
    hint = (
        f"expected a QArray like the model's {old!r} (or a dict of its parts, or a float "
        f"array to quantize with {_MATCH}), got {describe(got)}."
    )
    return StateProblem("structure", name, repr(old), describe(got), hint)


def float_expected(name: str, old: Any, got: Any, layout: Parameter) -> StateProblem:
    """A quantized parameter, or a dict of its parts, where the model holds the array
    `old`; `layout`: the parameter given, or the one its parts make."""
    given = (
        parts_text(cast("Mapping[str, Any]", got)) if isinstance(got, Mapping) else describe(got)
    )
    hint = (
        f"the model holds {describe(old)} here and the state {given}: the representations "
        f"differ. Pass {_MATCH} to dequantize it on load, or quantize the model first to keep "
        f"it quantized ({layout.made_by()})."
    )
    return StateProblem("representation", name, describe(old), given, hint)


def unfit_parts(name: str, got: Mapping[str, Any], why: str) -> StateProblem:
    """Parts of a quantized array that make no parameter, so cannot be dequantized."""
    given = parts_text(got)
    hint = f"cannot dequantize {given}: {why}."
    return StateProblem("representation", name, "a value and a scale", given, hint)
