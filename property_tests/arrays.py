"""Hypothesis strategies for arrays and where they live: dtypes, shapes, values, meshes, specs.

A :class:`Placement` is where all arrays of one model live: the platform's first device with
arrays left uncommitted (as ``jnp.asarray`` makes them), one chosen device (committed), or a
mesh. (Each property runs per platform, so "default" means the platform's own first device even
where JAX's default device is on another platform.) On a mesh every array gets its own random
valid PartitionSpec: each dimension is unsharded or sharded over unused mesh axes (one or two)
whose sizes divide it, and trailing unsharded entries may be left out.

On an accelerator (`on_accelerator`) arrays take one of a few fixed shapes and dtypes: each
program an example runs (a cast, a reshard, a jitted load) is compiled for the shapes, dtypes
and shardings of its arrays, in 0.1 to 10 s on a TPU against milliseconds on the CPU, and a
few shapes let an example run mostly the programs earlier examples compiled. The CPU's draws
are free (and the ``ci`` profile's examples those they always were).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.int32, jnp.uint8, jnp.bool_)
SIZES = (1, 2, 4, 3, 8)
MESH_SHAPES = ((8,), (2, 4), (4, 2))
SPECIALS = (np.nan, np.inf, -np.inf, -0.0)
# An accelerator's few: ranks 0 to 3, a dimension of 1, an odd size, sizes that meshes of 2,
# 4 and 8 devices split; one zero-size shape; a dtype of each kind (two floating).
ACCELERATOR_SHAPES = ((), (3,), (8,), (2, 4), (4, 1, 2))
ACCELERATOR_EMPTY = (4, 0)
ACCELERATOR_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint8, jnp.bool_)


def on_accelerator(devices: list[Any]) -> bool:
    """Whether arrays on `devices` (of one platform) draw from the accelerator's few shapes and
    dtypes: they do on any platform but the CPU, and on the CPU too with
    ``TAKTINY_ACCELERATOR_DRAW=1`` in the environment (to see there what an accelerator's
    examples draw, and how many programs they compile)."""
    return devices[0].platform != "cpu" or os.environ.get("TAKTINY_ACCELERATOR_DRAW") == "1"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a model's arrays live: ``kind`` is "default" (uncommitted on `device`), "device"
    (committed to `device`) or "mesh"."""

    kind: str
    device: Any = None
    mesh: Mesh | None = None

    @property
    def on_accelerator(self) -> bool:
        """Whether its arrays draw from the accelerator's few shapes and dtypes."""
        device = self.device if self.mesh is None else self.mesh.devices.flat[0]
        return on_accelerator([device])

    def shardings(self, shape: tuple[int, ...]) -> st.SearchStrategy[Any]:
        """The sharding of one array of `shape`: None means uncommitted, on the default device."""
        if self.kind == "default":
            return st.none()
        if self.kind == "device":
            return st.just(jax.sharding.SingleDeviceSharding(self.device))
        assert self.mesh is not None
        return partition_specs(self.mesh, shape).map(lambda spec: NamedSharding(self.mesh, spec))

    def ambient(self) -> contextlib.AbstractContextManager[Any]:
        """``jax.set_mesh`` of the mesh, if any: computations on arrays sharded over explicit
        axes (``jax.grad`` included) must run inside it."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """How Hypothesis prints a drawn placement: as its repr, device order included (its
        printer would otherwise show the dataclass's fields, and a Mesh hides its devices)."""
        printer.text(repr(self))

    def __repr__(self) -> str:
        if self.kind == "mesh":
            assert self.mesh is not None
            ids = [d.id for d in self.mesh.devices.flat]
            return f"mesh {dict(self.mesh.shape)} {self.mesh.axis_types} devices {ids}"
        where = "uncommitted on" if self.kind == "default" else "committed to"
        return f"{where} {self.device}"


@st.composite
def meshes(draw: Any, devices: list[Any]) -> Mesh:
    """A mesh over some of `devices`: shape (8,), (2, 4) or (4, 2) where there are 8 devices
    (a 1-d mesh over all of them where there are fewer), explicit or auto axes, devices in
    order, reversed or shuffled."""
    shapes = [s for s in MESH_SHAPES if math.prod(s) <= len(devices)] or [(len(devices),)]
    shape = draw(st.sampled_from(shapes))
    chosen = list(devices[: math.prod(shape)])
    order = draw(st.sampled_from(("in order", "reversed", "shuffled")))
    if order == "reversed":
        chosen.reverse()
    elif order == "shuffled":
        chosen = draw(st.permutations(chosen))
    axis_type = draw(st.sampled_from((AxisType.Explicit, AxisType.Auto)))
    names = ("x", "y")[: len(shape)]
    return Mesh(np.array(chosen).reshape(shape), names, axis_types=(axis_type,) * len(shape))


def mesh_placements(devices: list[Any]) -> st.SearchStrategy[Placement]:
    """A mesh as `meshes` draws it, as a :class:`Placement`: a failing example then shows its
    device order, which a Mesh's own repr leaves out."""
    return meshes(devices).map(lambda mesh: Placement("mesh", mesh=mesh))


@st.composite
def partition_specs(draw: Any, mesh: Mesh, shape: tuple[int, ...]) -> PartitionSpec:
    """A valid PartitionSpec for an array of `shape` on `mesh`."""
    free = list(mesh.axis_names)
    entries: list[Any] = []
    for dim in shape:
        options: list[Any] = [None]
        options += [a for a in free if dim % mesh.shape[a] == 0]
        options += [
            (a, b)
            for a in free
            for b in free
            if a != b and dim % (mesh.shape[a] * mesh.shape[b]) == 0
        ]
        entry = draw(st.sampled_from(options))
        entries.append(entry)
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if axis is not None:
                free.remove(axis)
    while entries and entries[-1] is None and draw(st.booleans()):
        entries.pop()
    return PartitionSpec(*entries)


@st.composite
def placements(draw: Any, devices: list[Any]) -> Placement:
    """Where a model's arrays live: mostly a mesh, sometimes one device or the default one."""
    kind = draw(st.sampled_from(("mesh", "mesh", "default", "device")))
    if kind == "mesh":
        return Placement("mesh", mesh=draw(meshes(devices)))
    if kind == "device":
        return Placement("device", device=draw(st.sampled_from(devices)))
    return Placement("default", device=devices[0])


def host_values(
    seed: int, shape: tuple[int, ...], dtype: Any, special: bool, bits: bool = False
) -> np.ndarray:
    """Random NumPy values of `dtype`; with `special`, floats include NaN, ±inf and -0.0;
    with `bits` too, subnormals and NaNs with payloads of their own (`_odd_bits`)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)
    values = (rng.standard_normal(shape) * 4).astype(np.float32)
    if special and values.size:
        flat = values.reshape(-1)
        where = rng.integers(0, flat.size, size=min(flat.size, 4))
        flat[where] = rng.choice(np.array(SPECIALS, np.float32), size=where.size)
    values = values.astype(dtype)
    if special and bits and values.size:
        values = _odd_bits(values, rng)
    return values


def _odd_bits(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`values` with up to four entries set to bit patterns that only a path moving floats
    as they are keeps: subnormals (exponent zero) and NaNs with payloads, quiet or
    signalling, of either sign. A computation may flush the first and make the second
    canonical (XLA's CPU backend once did, in bfloat16's concatenations); a load, a save,
    a stack or a transpose must not."""
    width = values.dtype.itemsize * 8
    uint = {16: np.uint16, 32: np.uint32}.get(width)
    if uint is None:
        return values
    mantissa = int(np.finfo(values.dtype).nmant)
    exponent = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    flat = values.reshape(-1).view(uint)
    where = rng.integers(0, flat.size, size=min(flat.size, 4))
    for k, at in enumerate(where):
        low = int(rng.integers(1, 1 << mantissa))  # (nonzero: not zero, not infinity)
        sign = int(rng.integers(0, 2)) << (width - 1)
        flat[at] = uint(sign | low | (exponent if k % 2 else 0))
    return values


@st.composite
def shapes(draw: Any, allow_empty: bool = True, accelerator: bool = False) -> tuple[int, ...]:
    """A shape of 0 to 3 dimensions; with `allow_empty`, one in eight has a dimension of 0.
    With `accelerator`, one of `ACCELERATOR_SHAPES` (or `ACCELERATOR_EMPTY`)."""
    if accelerator:
        return draw(st.sampled_from(ACCELERATOR_SHAPES + (ACCELERATOR_EMPTY,) * allow_empty))
    shape = [draw(st.sampled_from(SIZES)) for _ in range(draw(st.integers(0, 3)))]
    if allow_empty and shape and draw(st.integers(0, 7)) == 0:
        shape[draw(st.integers(0, len(shape) - 1))] = 0
    return tuple(shape)


@st.composite
def arrays(
    draw: Any,
    placement: Placement | None,
    *,
    shape: tuple[int, ...] | None = None,
    dtype: Any = None,
    allow_empty: bool = True,
    accelerator: bool | None = None,
    odd_bits: bool | None = None,
) -> Any:
    """A JAX array placed by `placement` (a NumPy array when it is None), of the given shape
    and dtype or drawn ones: the accelerator's few where `accelerator` is true (by default,
    where the placement's devices are an accelerator's). Floats may hold subnormals and NaN
    payloads where `odd_bits` is true (by default, off an accelerator: a TPU's programs
    flush the one and make the other canonical, bench/FINDINGS.md section 14)."""
    if accelerator is None:
        accelerator = placement is not None and placement.on_accelerator
    if dtype is None:
        dtype = draw(st.sampled_from(ACCELERATOR_DTYPES if accelerator else DTYPES))
    shape = draw(shapes(allow_empty, accelerator)) if shape is None else tuple(shape)
    special = jnp.issubdtype(dtype, jnp.floating) and draw(st.booleans())
    odd_bits = not accelerator if odd_bits is None else odd_bits
    host = host_values(draw(st.integers(0, 2**16)), shape, dtype, special, odd_bits)
    if placement is None:
        return host
    return place(host, draw(placement.shardings(shape)), placement.device)


def place(host: np.ndarray, sharding: Any, device: Any) -> Any:
    """`host` as a JAX array with `sharding`, or uncommitted on `device` when it is None."""
    if sharding is not None:
        return jax.device_put(host, sharding)
    with jax.default_device(device):
        return jnp.asarray(host)


def describe(x: Any) -> str:
    """A short description of an array with its placement: ``bfloat16[2,4]@P('x', None)``."""
    if not isinstance(x, jax.Array):
        return repr(x)
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        where = str(sharding.spec)
    else:
        where = f"device {next(iter(sharding.device_set)).id}" if x.committed else "default"
    return f"{x.dtype}[{','.join(map(str, x.shape))}]@{where}"
