"""Sharding specs: the ambient mesh, PartitionSpecs checked against a shape and a mesh, and
where a layer creates a parameter. `tt.shard` (`_plan.py`) and `tt.eval_shape`
(`_eval_shape.py`) build on them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, PartitionSpec

# A sharding as layers take it: a PartitionSpec, or a tuple of its entries (a mesh axis
# name, a tuple of names, or None) with one entry per leading axis of the array.
Spec = PartitionSpec | Sequence[str | Sequence[str] | None]


def as_spec(sharding: Any, where: str) -> PartitionSpec:
    """`sharding` (a PartitionSpec or a tuple of its entries) as a PartitionSpec."""
    if isinstance(sharding, PartitionSpec):
        return sharding
    if isinstance(sharding, str) or not isinstance(sharding, Sequence):
        raise TypeError(
            f"{where}: a sharding is a PartitionSpec or a tuple of mesh axis names (None "
            f"for an axis that is not split), one entry per axis, got {sharding!r}; for "
            f"example ({sharding!r},) or (None, 'model')."
        )
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in sharding))


def ambient_mesh() -> Any:
    """The mesh of the enclosing ``with jax.set_mesh(mesh):`` (an AbstractMesh) or
    ``with mesh:`` (a Mesh: JAX 0.10 still accepts it, deprecated); None without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    # `with mesh:` sets no abstract mesh, but a constraint by PartitionSpec still finds it
    # (without a mesh it raises at once, in microseconds); evaluated now, even inside a
    # trace, whose tracer would not tell its sharding
    try:
        with jax.ensure_compile_time_eval():
            placed = jax.lax.with_sharding_constraint(np.zeros((), np.int8), PartitionSpec())
    except RuntimeError:
        return None
    return placed.sharding.mesh


def mesh_text(mesh: Any) -> str:
    return "{" + ", ".join(f"{a!r}: {n}" for a, n in mesh.shape.items()) + "}"


def spec_problems(shape: tuple[int, ...], spec: PartitionSpec, mesh: Any) -> list[str]:
    """What is wrong with placing an array of `shape` by `spec` on `mesh` (nothing: [])."""
    problems = []
    if len(spec) > len(shape):
        problems.append(f"the spec has {len(spec)} entries, the array {len(shape)} axes")
    seen: set[str] = set()
    for axis, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if entry is PartitionSpec.UNCONSTRAINED or names == (None,):
            continue
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            problems.append(f"entry {axis} ({entry!r}) is not a mesh axis name")
            continue
        missing = [n for n in names if n not in mesh.shape]
        if missing:
            have = ", ".join(repr(a) for a in mesh.axis_names)
            problems.append(f"the mesh has no axis {missing[0]!r} (its axes: {have})")
            continue
        twice = [n for n in names if n in seen]
        if twice:
            problems.append(f"the mesh axis {twice[0]!r} splits two axes")
        seen.update(names)
        size = math.prod(mesh.shape[n] for n in names)
        if size == 0:  # (a mesh of no devices: `jax.devices()[8:]` on a host of fewer, say)
            empty = ", ".join(repr(n) for n in names if mesh.shape[n] == 0)
            problems.append(
                f"the mesh axis {empty} holds no devices; build it of devices that exist"
            )
        elif axis < len(shape) and shape[axis] % size:
            problems.append(
                f"axis {axis} of size {shape[axis]} does not divide into {size} parts "
                f"(mesh axes {', '.join(map(repr, names))})"
            )
    return problems


def check(where: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Any) -> None:
    """Raises a ValueError naming `where`, its shape, the spec and the mesh when `spec`
    cannot place an array of `shape` on `mesh`."""
    problems = spec_problems(shape, spec, mesh)
    if problems:
        raise ValueError(
            f"{where} of shape {shape} cannot be placed by {spec} on the mesh "
            f"{mesh_text(mesh)}: {'; '.join(problems)}. Change the sharding, or the mesh."
        )


def part(spec: PartitionSpec, mesh: Any, explicit: bool) -> PartitionSpec | None:
    """`spec` with only the mesh's Explicit axes kept (what a computation that creates the
    array must be told), or only its other axes (what a constraint then places); None
    when no entry is left."""
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))

    def keep(entry: Any) -> Any:
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(
            n for n in names if n is not None and (types.get(n) == AxisType.Explicit) == explicit
        )
        return None if not kept else kept[0] if len(kept) == 1 else kept

    entries = [keep(e) for e in spec]
    return PartitionSpec(*entries) if any(e is not None for e in entries) else None


def placement(sharding: Spec | None, shape: tuple[int, ...], where: str) -> Any:
    """For a layer creating a parameter: None when it is created as without a mesh (no
    sharding given, or no mesh around); otherwise the checked PartitionSpec and the mesh."""
    if sharding is None:
        return None
    spec = as_spec(sharding, where)
    mesh = ambient_mesh()
    if mesh is None:
        return None
    check(where, tuple(shape), spec, mesh)
    return spec, mesh
