"""Sharding: the ambient mesh, checked PartitionSpecs, rules by flat name (`tt.shard`), and
abstract trees whose leaves keep their shardings (`tt.eval_shape`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from . import _names, _patterns
from ._module import NODES

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
    # (without a mesh it raises at once, in microseconds)
    try:
        placed = jax.lax.with_sharding_constraint(np.zeros((), np.int8), PartitionSpec())
    except RuntimeError:
        return None
    return placed.sharding.mesh


def _mesh_text(mesh: Any) -> str:
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
        if axis < len(shape) and shape[axis] % size:
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
            f"{_mesh_text(mesh)}: {'; '.join(problems)}. Change the sharding, or the mesh."
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


class ShardingPlan(NamedTuple):
    """What ordered sharding rules give a tree; see :func:`sharding_plan`.

    Attributes:
        shardings: the tree's structure with a ``NamedSharding`` at each leaf (the leaves
            no rule matched are replicated), for ``jax.jit``'s ``in_shardings`` and
            ``out_shardings`` or ``jax.device_put``.
        specs: each flat state name with its PartitionSpec, in leaf order.
        unmatched: the names no rule matched (replicated).
        unused: the patterns that matched no name.
    """

    shardings: Any
    specs: dict[str, PartitionSpec]
    unmatched: tuple[str, ...]
    unused: tuple[str, ...]

    def __repr__(self) -> str:
        rows = "".join(f"\n  {name}: {spec}" for name, spec in self.specs.items())
        return (
            f"ShardingPlan({len(self.specs)} leaves, {len(self.unmatched)} unmatched, "
            f"unused rules {list(self.unused)}){rows}"
        )


def _concrete_mesh(mesh: Mesh | None, caller: str) -> Mesh:
    if mesh is not None:
        return mesh
    found = ambient_mesh()
    if found is None:
        raise ValueError(
            f"{caller} needs a mesh: pass mesh=..., or call it inside `with jax.set_mesh(mesh):`."
        )
    return found if isinstance(found, Mesh) else jax.sharding.get_mesh()


def sharding_plan(
    tree: Any, rules: _patterns.Rules, mesh: Mesh | None = None, *, strict: bool = False
) -> ShardingPlan:
    """The sharding of each leaf of `tree` by ordered rules over its flat state names.

    Each rule is ``(pattern, spec)``: the first rule whose pattern matches a leaf's name
    (the names of :meth:`~taktiny.nn.Module.flat_state_dict`, such as
    ``"encoder.layers.*.kernel"``; ``*`` matches within one part, a ``**`` part any number
    of parts) gives its spec, a ``PartitionSpec`` or a tuple of mesh axis names. A leaf
    no rule matches is replicated.

    Args:
        tree: a module or any PyTree of arrays (or of ``jax.ShapeDtypeStruct``).
        rules: a dict ``{pattern: spec}`` or a list of ``(pattern, spec)`` pairs.
        mesh: the mesh; by default the one of the enclosing ``jax.set_mesh``.
        strict: also raise when some leaf is matched by no rule, or some rule matches no
            leaf (both are reported in the plan otherwise).

    Returns:
        A :class:`ShardingPlan`.

    Raises:
        ValueError: listing every leaf whose spec names an axis the mesh lacks, has more
            entries than the leaf has axes, or splits an axis that does not divide evenly,
            with the leaf's shape, the spec and the mesh; and every pattern that is not
            valid.
    """
    caller = "taktiny.sharding_plan" if not strict else "taktiny.sharding_plan(strict=True)"
    pairs = _patterns.rule_list(rules, "taktiny.sharding_plan")
    problems = []
    checked = []
    for pattern, spec in pairs:
        try:
            _patterns.compile_pattern(pattern)
            checked.append((pattern, as_spec(spec, f"the rule {pattern!r}")))
        except (ValueError, TypeError) as error:
            problems.append(str(error))
    if problems:
        raise ValueError(_listing(caller, tree, problems))
    mesh = _concrete_mesh(mesh, caller)
    leaves, treedef, names = _names.flatten(tree, NODES)
    found = _patterns.match(checked, names.names, PartitionSpec())
    # models repeat a few shapes and specs: each pair is checked, and each spec made into a
    # sharding, once (PartitionSpecs are hashable; the rules hold the same few objects)
    checks: dict[tuple[Any, ...], list[str]] = {}
    for name, leaf, spec in zip(names.names, leaves, found.values, strict=True):
        shape = tuple(np.shape(leaf))
        key = (shape, spec)
        if key not in checks:
            checks[key] = spec_problems(shape, spec, mesh)
        for problem in checks[key]:
            problems.append(
                f"{name} of shape {shape} by {spec} on the mesh {_mesh_text(mesh)}: {problem}"
            )
    if strict:
        if found.unmatched:
            problems.append(f"no rule matches {', '.join(map(repr, found.unmatched))}")
        for pattern in found.unused:
            hint = _patterns.unused_hint(pattern, names.names)
            problems.append(f"the rule {pattern!r} matches no name; {hint}")
    if problems:
        raise ValueError(_listing(caller, tree, problems))
    made: dict[PartitionSpec, NamedSharding] = {}
    shardings = [made.get(spec) or made.setdefault(spec, NamedSharding(mesh, spec))
                 for spec in found.values]  # fmt: skip
    return ShardingPlan(
        shardings=treedef.unflatten(shardings),
        specs=dict(zip(names.names, found.values, strict=True)),
        unmatched=tuple(found.unmatched),
        unused=tuple(found.unused),
    )


def _listing(caller: str, tree: Any, problems: list[str]) -> str:
    lines = "\n".join(f"  - {p}" for p in problems)
    return f"{caller} on {type(tree).__name__}: {len(problems)} problem(s):\n{lines}"


def shard(
    tree: Any, rules: _patterns.Rules, mesh: Mesh | None = None, *, strict: bool = False
) -> Any:
    """Returns `tree` with every leaf placed by ordered rules over its flat state names.

    The rules are those of :func:`sharding_plan`; leaves no rule matches are replicated.
    Arrays move in one batched ``jax.device_put``; ``jax.ShapeDtypeStruct`` leaves (an
    abstract model) come back as ``ShapeDtypeStruct`` carrying their sharding, ready as
    an Orbax restore target. Any problem raises before anything moves; `tree` is never
    changed.

    Args:
        tree: a module or any PyTree of arrays.
        rules: a dict ``{pattern: spec}`` or a list of ``(pattern, spec)`` pairs.
        mesh: the mesh; by default the one of the enclosing ``jax.set_mesh``.
        strict: raise when some leaf is matched by no rule, or some rule matches no leaf.

    Returns:
        A new tree of the same structure.
    """
    plan = sharding_plan(tree, rules, mesh, strict=strict)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shardings = treedef.flatten_up_to(plan.shardings)
    moving = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, jax.ShapeDtypeStruct)]
    moved = jax.device_put([leaves[i] for i in moving], [shardings[i] for i in moving])
    out: list[Any] = list(leaves)
    for i, array in zip(moving, moved, strict=True):
        out[i] = array
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            out[i] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=shardings[i])
    return treedef.unflatten(out)


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
    target never guesses. Should `fn` do something that ``Explicit`` axes refuse as
    ambiguous (a contraction over two split axes, say), the shardings are those the
    compiler chooses for ``jax.jit(fn)`` on the original mesh instead (found by compiling
    it, still without running it).

    Args:
        fn: the function; its arguments may be arrays or ``jax.ShapeDtypeStruct``.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        The result's structure with a sharded ``jax.ShapeDtypeStruct`` at each leaf.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    meshes = _meshes(leaves)
    ambient = jax.sharding.get_abstract_mesh()
    if not ambient.empty:
        meshes = [jax.sharding.get_mesh(), *(m for m in meshes if m != jax.sharding.get_mesh())]
    if len(meshes) > 1:
        raise ValueError(
            f"taktiny.eval_shape: the arguments are on {len(meshes)} different meshes "
            f"({'; '.join(_mesh_text(m) for m in meshes)}); place them on one first."
        )
    if not meshes:
        out = jax.eval_shape(fn, *args, **kwargs)
        default = jax.sharding.SingleDeviceSharding(_default_device())
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
        with jax.set_mesh(mesh):
            compiled = jax.jit(fn).lower(*args, **kwargs).compile()
        shapes = jax.eval_shape(fn, *args, **kwargs)
        return jax.tree.map(_with, shapes, compiled.output_shardings)

    def back(s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        spec = s.sharding.spec if isinstance(s.sharding, NamedSharding) else PartitionSpec()
        return _with(s, NamedSharding(mesh, spec))

    return jax.tree.map(back, out)


def _default_device() -> Any:
    """Where arrays go by default: ``jax_default_device``, or this process's first device
    (in a multi-process run ``jax.devices()[0]`` belongs to process 0)."""
    default = jax.config.jax_default_device  # type: ignore[attr-defined]  # a device, a platform, None
    if isinstance(default, str):
        return jax.local_devices(backend=default)[0]
    return default or jax.local_devices()[0]


def _with(s: jax.ShapeDtypeStruct, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding, weak_type=s.weak_type)
