"""Checking one loaded value against the leaf it replaces: that it is an array, its shape,
its dtype kind, and that casting it to the leaf's dtype keeps its values (integers are
never cast to or from a 4-bit dtype: those hold quantized values, whose scale a cast would
not change)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

import taktiny.state._problems as err

from .._problems import Problems, StateProblem
from ..arrays import SCALARS
from ._problems import array_text, describe


class _Devices(Protocol):
    """What the state walk calls of ``jax`` to place arrays, typed: JAX's signatures name
    jaxlib's Device, which has no type stubs, so pyright knows them only in part."""

    def device_put(self, x: Any, device: Any = None, /) -> Any: ...

    def devices(self) -> list[Any]: ...


# The module `jax` itself (pyright checks it against the Protocol): calls through it are JAX's.
placement: _Devices = jax
# jnp.finfo, typed: it is ml_dtypes' finfo, whose constructor pyright knows only in part.
_finfo: Callable[[Any], np.finfo[Any]] = jnp.finfo

_KINDS = (
    ("floating", jnp.floating),
    ("complex", jnp.complexfloating),
    ("signed integer", jnp.signedinteger),
    ("unsigned integer", jnp.unsignedinteger),
    ("bool", jnp.bool_),
)


@functools.cache
def array_type() -> type[jax.Array]:
    """The concrete class of JAX arrays, for exact-type fast paths (made concretely even
    when first asked for inside a jit trace)."""
    with jax.ensure_compile_time_eval():  # (a transfer: jnp.zeros would compile a program)
        array: jax.Array = placement.device_put(np.zeros((), np.float32))
        return type(array)


def kind(dtype: Any) -> str | None:
    """The kind a load may cast within, or None for a dtype that is not numeric or bool."""
    return next((name for name, kind in _KINDS if jnp.issubdtype(dtype, kind)), None)


def from_dlpack(value: Any) -> Any:
    """A JAX copy of a tensor of another framework (a torch tensor, also bfloat16, one that
    requires grad, an ``nn.Parameter``), through DLPack; None when that fails. A copy, so
    that the caller's later writes to its tensor cannot reach the loaded model."""
    detach = getattr(value, "detach", None)  # torch exports no tensor that requires grad
    try:
        return jnp.array(jax.dlpack.from_dlpack(detach() if callable(detach) else value))  # pyright: ignore[reportUnknownMemberType]  (their device: jaxlib's Device, which has no type stubs)
    except Exception:  # noqa: BLE001 - not importable this way: try NumPy's conversion
        return None


def host_array(value: Any) -> Any:
    """`value` (a tensor of another framework, a list, a number) as a NumPy array, bit for
    bit; through DLPack, as a JAX array, for the dtypes NumPy cannot take from it (a torch
    bfloat16 or float8 tensor). Raises NumPy's error when neither way reads it."""
    foreign = hasattr(value, "__dlpack__") and not isinstance(value, np.generic)
    value = cast(Any, value)  # (not the NumPy scalar the check above may narrow it to)
    detach = getattr(value, "detach", None) if foreign else None
    plain = detach() if callable(detach) else value  # (a tensor that requires grad)
    try:
        return np.asarray(plain)
    except (TypeError, RuntimeError):
        imported = from_dlpack(value) if foreign else None
        if imported is None:
            raise
        return imported


def dtype_of(dtype: Any) -> np.dtype[Any]:
    """A NumPy dtype for `dtype`, which may be another framework's: ``torch.bfloat16`` and
    the float8 kinds by their names, which are ml_dtypes' names too. Raises TypeError for
    a dtype that has no NumPy equivalent."""
    try:
        return np.dtype(dtype)
    except TypeError:
        name = str(dtype).rpartition(".")[2]  # "torch.bfloat16" -> "bfloat16"
        try:
            return jnp.dtype(name)
        except TypeError:
            raise TypeError(f"{dtype!r} is no dtype NumPy or ml_dtypes knows.") from None


def _as_array(name: str, value: Any, problems: Problems) -> tuple[Any, bool]:
    """`value` as a JAX or NumPy array, or None (and a problem recorded) if it is none; and
    whether it was made of Python numbers (a list, a scalar), which take the leaf's dtype
    as JAX's weakly typed numbers do."""
    if isinstance(value, (jax.Array, np.ndarray)):
        array = cast("jax.Array | np.ndarray", value)
        if type(array) is not np.ndarray:
            problem = _unusable(name, array)
            if problem is not None:
                problems.append(problem)
                return None, False
        return array, False
    if isinstance(value, Mapping):
        problems.append(err.array_expected(name, value, "this name is one array"))
        return None, False
    if isinstance(value, jax.ShapeDtypeStruct):
        problems.append(not_an_array(name, value))
        return None, False
    if hasattr(value, "__dlpack__") and not isinstance(value, np.generic):
        imported = from_dlpack(value)
        if imported is not None:
            return imported, False
    try:
        array = np.asarray(cast(Any, value))  # (not the NumPy scalar it may be narrowed to)
    except Exception:  # noqa: BLE001 - any failure means "not an array"
        array = None
    if array is None or kind(array.dtype) is None:  # not numeric
        problems.append(not_an_array(name, value))
        return None, False
    return array, isinstance(value, (list, tuple, *SCALARS))


def _unusable(name: str, value: Any) -> StateProblem | None:
    """A problem when an array cannot be loaded as it is: a NumPy masked array (a load
    would drop its mask), a tracer leaked out of a transformation that has finished, or a
    JAX array whose buffers are deleted (by ``.delete()``, or donated to a jitted call)."""
    if isinstance(value, np.ma.MaskedArray):
        return masked(name, value)
    if isinstance(value, Tracer):
        return None if _live(cast("Tracer[Any]", value)) else leaked(name, value)
    if isinstance(value, jax.Array) and value.is_deleted():
        return err.deleted(name, value)
    return None


def _live(tracer: Tracer[Any]) -> bool:
    """Whether `tracer` belongs to a transformation being traced now (the current one, or
    one enclosing it), asked with a broadcast: JAX refuses any operation on a tracer leaked
    out of a finished ``jit``, ``vmap``, ``grad`` or ``make_jaxpr`` outside of every
    transformation, and on one leaked out of a ``vmap`` or ``grad`` anywhere. Inside a
    trace the broadcast is one equation that nothing uses, which jit drops before
    compiling. (A tracer of a finished ``jit`` given inside another ``jit`` passes: JAX
    refuses it itself when that ``jit`` ends.)"""
    try:
        jax.lax.broadcast(tracer, (1,))  # pyright: ignore[reportUnknownMemberType]  (JAX leaves its out_sharding unannotated)
    except jax.errors.UnexpectedTracerError:
        return False
    return True


def _narrowing(name: str, value: Any, old_dtype: Any, traced: bool) -> StateProblem | None:
    """A problem when the integer `value` does not fit the narrower `old_dtype`."""
    if traced:
        return narrowing(name, old_dtype, value.dtype, traced=True)
    info = jnp.iinfo(old_dtype)
    if value.size and (int(value.min()) < info.min or int(value.max()) > info.max):
        return narrowing(name, old_dtype, value.dtype, traced=False)
    return None


@functools.cache
def _beyond(dtype: Any) -> str:
    """What a float dtype makes of values beyond its largest: ``"inf"`` (float16, bfloat16,
    float8_e5m2), ``"nan"`` (the float8 kinds without inf: float8_e4m3fn, ...) or
    ``"max"`` (kinds with neither, such as float4_e2m1fn, which clip to their largest)."""
    with np.errstate(all="ignore"):
        made = np.array(np.inf, np.float32).astype(dtype).astype(np.float32)
    return "inf" if np.isinf(made) else "nan" if np.isnan(made) else "max"


def _clip_limit(dtype: Any) -> float:
    """The magnitude past which a value of a clipping float dtype (`_beyond` is "max") is
    not its largest rounded but clipped: its largest plus half the step below it."""
    info = _finfo(dtype)
    largest = float(info.max)
    step = 2.0 ** (np.floor(np.log2(largest)) - info.nmant)
    return largest + step / 2


def _overflow(name: str, value: jax.Array | np.ndarray, cast: Any) -> StateProblem | None:
    """A problem when values of `value` too large for `cast`'s narrower float dtype lost
    their value in it: finite ones that became inf, or, in a dtype without inf, any but
    NaN that became NaN or were clipped to its largest. Checked on concrete values only:
    inside jit the cast happens as written. A JAX float value is first checked by its
    largest magnitude, in one pass that makes no array of its size (the check of each
    value makes masks of its size, which a load casting a large tensor would hold besides
    it); each value is checked only when that leaves it open."""
    into = _beyond(cast.dtype)
    limit = _clip_limit(cast.dtype)
    if not isinstance(value, np.ndarray) and jnp.issubdtype(value.dtype, jnp.floating):
        if bool(_below(value, limit=limit)):
            return None
    xp = np if isinstance(value, np.ndarray) else jnp
    if into == "inf":
        bad = xp.isinf(cast) & xp.isfinite(value)
    elif into == "nan":
        bad = xp.isnan(cast) & ~xp.isnan(value)
    else:  # compared in float32 (float64 for float64 values), which holds every value of
        # the source and the limit exactly: JAX compares no float8 with a typed float64
        wide = _wide(value)
        bad = (xp.abs(value.astype(wide)) > wide(limit)) & ~xp.isnan(value)
    if not bool(bad.any()):
        return None
    largest = float(np.max(np.abs(np.asarray(value)[np.asarray(bad)])))
    return overflow(name, cast.dtype, value.dtype, int(bad.sum()), largest, into)


def _wide(value: Any) -> type[np.floating[Any]]:
    """The dtype that holds every value of `value` and a clip limit exactly."""
    return np.float64 if value.dtype == np.float64 else np.float32


def _below_of(value: jax.Array, *, limit: float) -> jax.Array:
    """Whether every value of `value` is below `limit` (a clip limit: those round to at
    most the largest value of its dtype, losing none) in magnitude; False for a NaN. A
    reduction of magnitudes alone, which XLA fuses into one pass (no mask is made)."""
    largest = jnp.max(jnp.abs(value), initial=np.zeros((), value.dtype))
    return largest.astype(_wide(value)) < _wide(value)(limit)


_below: Callable[..., jax.Array] = jax.jit(_below_of, static_argnames="limit")  # pyright: ignore[reportUnknownMemberType]  (JAX leaves its parameters unannotated)


# The kinds Python numbers may load into besides their own: an int list into a float or an
# unsigned leaf, as JAX's weakly typed numbers take the other operand's dtype (when every
# value survives the cast exactly).
_WEAK = {"signed integer": ("floating", "complex", "unsigned integer"), "floating": ("complex",)}


def _exact(name: str, value: np.ndarray, dtype: Any, problems: Problems) -> Any:
    """Python numbers `value` in `dtype`, when that keeps every value exactly."""
    with np.errstate(all="ignore"):
        cast = value.astype(dtype)
        # back to the source's dtype to compare (a real cast: the values are real, and casting
        # a complex array to a real one warns); NaN stays NaN, so it counts as kept
        exact = np.array_equal(np.real(cast).astype(value.dtype), value, equal_nan=True)
    if not exact:
        problems.append(narrowing(name, dtype, value.dtype, traced=False))
        return None
    return cast


def _leaf(old: Any) -> Any:
    """The leaf `old`, a Python number (in a PyTree that is not a module) as JAX types it."""
    if type(old) in SCALARS:
        return jax.ShapeDtypeStruct((), jax.dtypes.canonicalize_dtype(type(old)))
    return old


def spec_problem(name: str, given: Any, old: Any) -> StateProblem | None:
    """What stops a value of `given`'s shape and dtype (an array, or only its description:
    a checkpoint's tensor, read from its header) from loading into the leaf `old`, before
    its values are seen: another shape, another dtype kind, or integers of another width
    than a 4-bit leaf's (or the reverse). None when nothing does (a cast may still lose
    values: `checked_value` checks those)."""
    old = _leaf(old)
    if tuple(given.shape) != tuple(old.shape):
        return err.shape(name, tuple(old.shape), tuple(given.shape))
    if given.dtype == old.dtype:
        return None
    source = kind(given.dtype) or str(given.dtype)
    target = kind(old.dtype) or str(old.dtype)
    if source != target:
        return err.dtype_kind(name, old.dtype, given.dtype, target, source)
    if "integer" in target and 4 in (jnp.iinfo(old.dtype).bits, jnp.iinfo(given.dtype).bits):
        return bits(name, old.dtype, given.dtype)  # quantized values: no cast
    return None


def checked_value(name: str, value: Any, old: Any, problems: Problems) -> Any:
    """`value` checked against the leaf `old` it replaces (`spec_problem`, then what a cast
    would lose) and cast to its dtype; None (and a problem recorded) when it can't be."""
    value, python_numbers = _as_array(name, value, problems)
    if value is None:
        return None
    old = _leaf(old)
    if python_numbers and value.shape == old.shape and value.dtype != old.dtype:
        source = kind(value.dtype) or str(value.dtype)
        if kind(old.dtype) in _WEAK.get(source, ()):
            return _exact(name, value, old.dtype, problems)
    problem = spec_problem(name, value, old)
    if problem is not None:
        problems.append(problem)
        return None
    if value.dtype == old.dtype:
        return value
    target = kind(old.dtype) or str(old.dtype)
    traced = isinstance(value, Tracer)
    if "integer" in target and jnp.iinfo(old.dtype).bits < jnp.iinfo(value.dtype).bits:
        problem = _narrowing(name, value, old.dtype, traced)
        if problem is not None:
            problems.append(problem)
            return None
    with np.errstate(over="ignore"):  # an overflow is reported below, as a problem
        cast = value.astype(old.dtype)
    if (
        target in ("floating", "complex")
        and not traced
        # compared as Python floats: ml_dtypes before 0.7 (JAX takes 0.5 on) finds float4_e2m1fn's
        # largest, 6, not below float8_e4m3fn's, 448, and a load would skip the check
        and float(_finfo(old.dtype).max) < float(_finfo(value.dtype).max)
    ):
        problem = _overflow(name, value, cast)
        if problem is not None:
            problems.append(problem)
            return None
    return cast


def shares_memory(value: Any, given: Any, target: Any) -> bool:
    """Whether placing NumPy `value` on `target` (None: the default device) could leave the
    loaded leaf sharing memory with an array the caller still holds (`given` itself, or what
    it views, like a torch tensor's `.numpy()`). On CPU, jax.device_put shares aligned host
    buffers, even with may_alias=False, so a later write to the caller's array would
    silently change the loaded model."""
    if not isinstance(value, np.ndarray) or (value is not given and value.flags.owndata):
        return False
    devices = target.device_set if target is not None else placement.devices()[:1]
    return any(device.platform == "cpu" for device in devices)


def placeable(value: Any) -> Any:
    """`value`, ready for ``jax.device_put`` onto any sharding: a zero-size array holds no
    data, so it is placed afresh (JAX 0.10's device_put of one from a mesh of another
    device order makes misshapen shards)."""
    return np.zeros(np.shape(value), value.dtype) if np.size(value) == 0 else value


# --- The problems these checks find -----------------------------------------------


def bits(name: str, expected: Any, got: Any) -> StateProblem:
    """An integer cast to or from a 4-bit dtype: quantized values of another width."""
    want, have = np.dtype(expected).name, np.dtype(got).name
    hint = (
        f"the model holds {want} here and the state {have}: integers of another width, as "
        f"quantized values of another number of bits are, which a cast would not re-scale. "
        f"Cast the value yourself (value.astype(jnp.{want})) if it really holds {want} values."
    )
    return StateProblem("dtype", name, want, have, hint)


def not_an_array(name: str, value: Any) -> StateProblem:
    if isinstance(value, jax.ShapeDtypeStruct):
        why = f"got {describe(value)} (from jax.eval_shape): restore real arrays first."
    elif value is None:  # (a dict is reported as array_expected before it gets here)
        why = "got a value of type NoneType."
    else:
        why = f"got a value that is not numeric ({value!r:.60})."
    return StateProblem(
        "value", name, "an array", type(value).__name__, f"expected an array, {why}"
    )


def narrowing(name: str, expected: Any, got: Any, traced: bool) -> StateProblem:
    want, have = np.dtype(expected).name, np.dtype(got).name
    why = "cannot be checked inside jit" if traced else "would change values"
    hint = f"narrowing {have} to {want} {why}; convert the value yourself."
    return StateProblem("dtype", name, want, have, hint)


def overflow(
    name: str, expected: Any, got: Any, count: int, largest: float, into: str = "inf"
) -> StateProblem:
    """Values too large for a narrower float dtype, which the cast would turn `into`
    ``"inf"``, ``"nan"`` (a dtype without inf) or ``"max"`` (clipped to its largest)."""
    want, have = np.dtype(expected).name, np.dtype(got).name
    limit = float(cast("np.finfo[Any]", jnp.finfo(expected)).max)
    values = "a value" if count == 1 else f"{count} values"
    if into == "inf":
        change, holds = "turn {} into inf", ""
    elif into == "nan":
        change, holds = "turn {} into nan", " and has no inf"
    else:
        change, holds = f"clip {{}} to its largest, {limit:.4g}", " and has no inf"
    return StateProblem(
        "dtype",
        name,
        want,
        have,
        f"casting {have} to {want} would {change.format(values)}: the largest is "
        f"{largest:.4g}, and {want} holds at most {limit:.4g}{holds}. Scale or clip the value, "
        f"or keep this parameter in a wider dtype.",
    )


def masked(name: str, value: Any) -> StateProblem:
    """A NumPy masked array, whose mask a load would drop."""
    hidden = int(np.ma.count_masked(value))  # pyright: ignore[reportUnknownMemberType, reportUnknownArgumentType]  (NumPy leaves it unannotated)
    hint = (
        f"expected a plain array, got a NumPy masked {array_text(value)} with {hidden} "
        f"masked of {value.size}: a load would drop the mask. Pass value.filled(fill) to "
        f"choose what the masked entries hold, or value.data to load the data under the mask."
    )
    return StateProblem("value", name, "an array", f"a masked {array_text(value)}", hint)


def leaked(name: str, value: Any) -> StateProblem:
    """A tracer that belongs to no transformation being traced now."""
    hint = (
        f"expected an array, got a {array_text(value, 'tracer')} ({type(value).__name__}) that "
        f"belongs to no transformation being traced now: it leaked out of a jax.jit, vmap, grad or "
        f"make_jaxpr that has finished, so it holds no value. Load what the transformed "
        f"function returns, or load inside the transformation that made it."
    )
    return StateProblem("value", name, "an array", f"a leaked {type(value).__name__}", hint)
