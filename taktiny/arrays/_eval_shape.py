"""`tt.eval_shape`: abstract trees whose leaves keep the shardings the results would have."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from ._specs import ambient_mesh, mesh_text


def _meshes(leaves: list[Any]) -> list[Mesh]:
    found: list[Mesh] = []
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            if not any(sharding.mesh == m for m in found):
                found.append(sharding.mesh)
    return found


def eval_shape(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``jax.eval_shape(fn, *args, **kwargs)`` whose ``jax.ShapeDtypeStruct`` leaves carry
    the sharding each result would have.

    ``jax.eval_shape`` drops shardings on meshes with ``Auto`` axes, so an optimizer state
    built from an abstract model would be restored onto one device. Here the mesh of the
    arguments (or of the enclosing ``jax.set_mesh``) is traced with ``Explicit`` axes,
    under which every array's type holds its sharding, and the result's shardings are
    given back on the original mesh. Nothing is computed or allocated::

        with jax.set_mesh(mesh):
            abstract = tt.eval_shape(lambda: Model(rngs=nn.Rngs(0)))   # sharded layers
        opt_state = tt.eval_shape(optimizer.init, abstract)           # moments sharded too

    Every leaf has a sharding: a result that no computation places is replicated on the
    mesh (or, without a mesh, on the default device), so an Orbax restore with it as the
    target never guesses. A function that makes its own mesh and places its results on it
    (``tt.shard(Model(rngs=...), rules, jax.make_mesh(...))``) keeps that mesh, devices
    and all, where ``jax.eval_shape`` keeps only its axis sizes: such a function is
    lowered (not compiled, not run) to find them. (Only a mesh with ``Explicit`` axes,
    ``jax.make_mesh``'s default, leaves its shardings in the traced types; one with
    ``Auto`` axes made inside `fn` leaves none, so build under ``jax.set_mesh`` then.)
    Should `fn` do something that ``Explicit`` axes refuse as ambiguous (a contraction
    over two split axes, say), the shardings are those the compiler chooses for
    ``jax.jit(fn)`` on the original mesh instead (found by compiling it, still without
    running it).

    Args:
        fn: the function; its arguments may be arrays or ``jax.ShapeDtypeStruct``.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        The result's structure with a sharded ``jax.ShapeDtypeStruct`` at each leaf.

    Raises:
        ValueError: the arguments (with the enclosing ``jax.set_mesh``) are on more
            than one mesh.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    meshes = _meshes(leaves)
    ambient = ambient_mesh()  # of jax.set_mesh, or of the deprecated `with mesh:`
    if ambient is not None:
        ambient = ambient if isinstance(ambient, Mesh) else jax.sharding.get_mesh()
        meshes = [ambient, *(m for m in meshes if m != ambient)]
    if len(meshes) > 1:
        raise ValueError(
            f"taktiny.eval_shape: the arguments are on {len(meshes)} different meshes "
            f"({'; '.join(mesh_text(m) for m in meshes)}); place them on one first."
        )
    if not meshes:
        traced, out = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
        default = jax.sharding.SingleDeviceSharding(default_device())
        abstract = {s.sharding.mesh for s in jax.tree.leaves(out) if _on_abstract_mesh(s)}
        # arrays on a mesh whose devices tracing forgets: the mesh of the arrays `fn`
        # closes over (lambda: model), else the one it makes itself (tt.shard(model, rules,
        # jax.make_mesh(...))), which lowering it (not compiling) gives back
        known = {m.abstract_mesh: m for m in _meshes(list(traced.consts))}
        if abstract and abstract <= known.keys():
            return jax.tree.map(
                lambda s: (
                    _with(s, NamedSharding(known[s.sharding.mesh], s.sharding.spec))
                    if _on_abstract_mesh(s)
                    else _with(s, s.sharding or default)
                ),
                out,
            )
        if abstract:
            placed = jax.jit(fn).lower(*args, **kwargs).out_info

            def found(s: jax.ShapeDtypeStruct, p: Any) -> jax.ShapeDtypeStruct:
                if _on_abstract_mesh(s) and isinstance(p.sharding, NamedSharding):
                    return _with(s, NamedSharding(p.sharding.mesh, s.sharding.spec))
                return _with(s, p.sharding or default)

            return jax.tree.map(found, out, placed)
        return jax.tree.map(lambda s: _with(s, s.sharding or default), out)
    mesh = meshes[0]
    explicit = Mesh(
        mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(mesh.axis_names)
    )

    def typed(leaf: Any) -> Any:
        sharding = getattr(leaf, "sharding", None)
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            return leaf
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(explicit, spec))

    typed_args, typed_kwargs = treedef.unflatten([typed(leaf) for leaf in leaves])
    try:
        with jax.set_mesh(explicit):
            out = jax.eval_shape(fn, *typed_args, **typed_kwargs)
    except Exception:
        if explicit.axis_types == mesh.axis_types:
            raise
        # an operation that Explicit axes find ambiguous: what the compiler would place
        # instead (it places results that depend on no input, such as zeros, replicated)
        with jax.set_mesh(mesh):  # (fn may constrain by bare PartitionSpecs: both see the mesh)
            compiled = jax.jit(fn).lower(*args, **kwargs).compile()
            shapes = jax.eval_shape(fn, *args, **kwargs)
        return jax.tree.map(_with, shapes, compiled.output_shardings)

    def back(s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        spec = s.sharding.spec if isinstance(s.sharding, NamedSharding) else PartitionSpec()
        return _with(s, NamedSharding(mesh, spec))

    return jax.tree.map(back, out)


def default_device() -> Any:
    """Where arrays go by default: ``jax_default_device``, or this process's first device
    (in a multi-process run ``jax.devices()[0]`` belongs to process 0)."""
    default = jax.config.jax_default_device  # type: ignore[attr-defined]  # a device, a platform, None
    if isinstance(default, str):
        return jax.local_devices(backend=default)[0]
    return default or jax.local_devices()[0]


def _on_abstract_mesh(s: jax.ShapeDtypeStruct) -> bool:
    return isinstance(getattr(s.sharding, "mesh", None), AbstractMesh)


def _with(s: jax.ShapeDtypeStruct, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding, weak_type=s.weak_type)
