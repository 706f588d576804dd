"""Problems with values: not an array, a shape or dtype kind that differs, a cast that
would change values, an array on devices outside its leaf's mesh."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._errors_core import StateProblem, describe
from ._sharding import mesh_text


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


def overflow(name: str, expected: Any, got: Any, count: int, largest: float) -> StateProblem:
    want, have = np.dtype(expected).name, np.dtype(got).name
    limit = float(jnp.finfo(expected).max)
    values = "a value" if count == 1 else f"{count} values"
    return StateProblem(
        "dtype",
        name,
        want,
        have,
        f"casting {have} to {want} would turn {values} into inf: the largest is {largest:.4g}, "
        f"and {want} holds at most {limit:.4g}. Scale or clip the value, or keep this "
        f"parameter in a wider dtype.",
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
