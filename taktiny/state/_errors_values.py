"""Problems with values: not an array, a shape or dtype kind that differs, a cast that
would change values, an array on devices outside its leaf's mesh."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._sharding import mesh_text
from ._errors_core import StateProblem, describe


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


def overflow(
    name: str, expected: Any, got: Any, count: int, largest: float, into: str = "inf"
) -> StateProblem:
    """Values too large for a narrower float dtype, which the cast would turn `into`
    ``"inf"``, ``"nan"`` (a dtype without inf) or ``"max"`` (clipped to its largest)."""
    want, have = np.dtype(expected).name, np.dtype(got).name
    limit = float(jnp.finfo(expected).max)
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


def _array(value: Any, noun: str = "array") -> str:
    """An array as a message names it: ``array float32[2, 3]``."""
    return f"{noun} {np.dtype(value.dtype).name}{list(value.shape)}"


def masked(name: str, value: Any) -> StateProblem:
    """A NumPy masked array, whose mask a load would drop."""
    hidden = int(np.ma.count_masked(value))
    return StateProblem(
        "value",
        name,
        "an array",
        f"a masked {_array(value)}",
        f"expected a plain array, got a NumPy masked {_array(value)} with {hidden} "
        f"masked of {value.size}: a load would drop the mask. Pass value.filled(fill) to "
        f"choose what the masked entries hold, or value.data to load the data under the mask.",
    )


def leaked(name: str, value: Any) -> StateProblem:
    """A tracer that belongs to no transformation being traced now."""
    return StateProblem(
        "value",
        name,
        "an array",
        f"a leaked {type(value).__name__}",
        f"expected an array, got a {_array(value, 'tracer')} ({type(value).__name__}) that "
        f"belongs to no transformation being traced now: it leaked out of a jax.jit, vmap, grad or "
        f"make_jaxpr that has finished, so it holds no value. Load what the transformed "
        f"function returns, or load inside the transformation that made it.",
    )


def deleted(name: str, value: Any) -> StateProblem:
    """A JAX array whose buffers are deleted."""
    return StateProblem(
        "value",
        name,
        "an array",
        f"a deleted {_array(value)}",
        f"expected an array, got a deleted {_array(value)}: its buffers were freed, by "
        f"value.delete() or by donating it to a jitted function (donate_argnums), so it holds "
        f"no values. Load the array before it is deleted, or the result of the call it was "
        f"donated to.",
    )


def devices(name: str, shape: tuple[int, ...], got: Any, target: Any) -> StateProblem:
    """A value on devices outside the mesh of the leaf it replaces."""
    mesh = target.mesh
    axes = mesh_text(mesh)
    have = sorted(d.id for d in got.device_set)
    want = sorted(d.id for d in mesh.devices.flat)
    return StateProblem(
        "sharding",
        name,
        f"devices {want}",
        f"devices {have}",
        f"the value of shape {shape} sits on devices {have}, outside the leaf's mesh {axes} "
        f"(devices {want}, spec {target.spec}). Load host data (NumPy) or arrays on the "
        f"model's mesh: jax.device_put(value, leaf.sharding) first.",
    )
