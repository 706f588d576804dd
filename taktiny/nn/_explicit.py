"""How the layers split their outputs on Explicit mesh axes.

On Explicit mesh axes each array's type holds its sharding, and an operation whose output
sharding is ambiguous (a contraction over split axes, a gather from a split table, a
reshape that moves a split) raises unless told the output's sharding. These helpers,
shared by the layers, work it out from the types; without Explicit axes they do nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


def explicit_axes() -> frozenset[str]:
    """The Explicit axes of the mesh of the enclosing ``jax.set_mesh`` (none without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return frozenset()
    pairs = zip(mesh.axis_names, mesh.axis_types, strict=True)
    return frozenset(name for name, kind in pairs if kind == AxisType.Explicit)


def typed_spec(x: jax.Array) -> tuple[Any, ...]:
    """The entries of `x`'s sharding as its type holds it (Explicit axes only), one per axis."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def free(entry: Any, *taken: Any) -> Any:
    """`entry` if it names no mesh axis that an entry of `taken` names; None otherwise."""
    used = {n for e in taken for n in (e if isinstance(e, tuple) else (e,)) if n is not None}
    names = entry if isinstance(entry, tuple) else (entry,)
    return None if any(n in used for n in names) else entry


def merged(entries: Sequence[Any]) -> Any:
    """The entry of the axis that merging axes split by `entries` gives: all their mesh
    axes, in order (no data moves when only the first of the merged axes is split)."""
    names = tuple(n for e in entries for n in (e if isinstance(e, tuple) else (e,)) if n)
    return None if not names else names[0] if len(names) == 1 else names


def follow(vector: jax.Array, x: jax.Array) -> jax.Array:
    """A parameter vector split as the last axis of `x` (the features it acts on) under
    Explicit axes, so that the result keeps `x`'s sharding; as it is otherwise."""
    if not explicit_axes():
        return vector
    entry = typed_spec(x)[-1]
    return vector if typed_spec(vector)[0] == entry else jax.sharding.reshard(vector, P(entry))


def project(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """``x @ kernel + bias`` on the last axis of `x` (already in the kernel's dtype), the
    product at `precision` (and in `preferred_element_type`, when given; else in the
    kernel's dtype).

    Under Explicit mesh axes the output is split as the input on its batch axes and as the
    kernel's output axis on its last axis (unsplit where that would split two axes over one
    mesh axis); a contraction over split features is summed across the devices.
    """
    kind = preferred_element_type
    if not explicit_axes():
        y = jnp.matmul(x, kernel, precision=precision, preferred_element_type=kind)
        return y if bias is None else y + bias
    batch = typed_spec(x)[:-1]
    out = free(typed_spec(kernel)[-1], *batch)
    y = jnp.matmul(
        x, kernel, precision=precision, preferred_element_type=kind, out_sharding=P(*batch, out)
    )
    return y if bias is None else y + follow(bias, y)
