"""A load's host memory kept within a budget (``max_host_bytes``): what counts, how much
each step holds while it is in flight, the refusal of a budget too small for one step,
and the order of starts that keeps the rest within it.

**What counts** is the host memory the load holds beyond the model's own arrays (those
are the load's result, whatever the budget): its scratch buffers, as mapped (kept from
their first read to the load's end), and what each step holds from the start of its read
until it is placed:

- a tensor read straight into its leaf's buffer holds nothing more when that buffer is
  the leaf (one CPU device, which adopts it); otherwise the buffer is staging on its way
  to the leaf's devices, and counts whole;
- a tensor read in blocks (each device's own) or transposed piece by piece holds its
  piece buffer (4 MiB of rows, or one row when a row is larger), and the whole tensor
  when what it reads is then copied onto other devices;
- small tensors read together hold their staging (their bytes) and, off one CPU device,
  the buffer they are read into;
- a transforming step reads into a scratch buffer (counted once, above) and holds the
  arrays its transform makes on the default device that are not the leaves themselves:
  a chain's intermediate results, results cast or quantized afterwards (and the cast),
  results placed on other devices, and 64-bit sources cast to what JAX holds;
- into a stack of layers (``nn.Stack``) named per layer, a slice placed on its devices is
  not the model's array but waits, holding its memory, until the load's thread writes it
  into the stacked leaf (:func:`waiting`): on CPU devices that memory is the host's and
  counts (whole, beside the pieces its read holds), unless the slice was read straight
  into the stacked leaf's host buffer (one CPU device).

Not counted: the model's arrays; the page cache, which the read-ahead fills (the kernel's,
reclaimed under pressure, not the process's; the read-ahead is nonetheless capped to
what the budget leaves, for storages that would fetch into the process); Python's and
XLA's own working memory inside one operation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..arrays import default_device
from ..convert import Step, Transform, chain, dequantize_blocks, identity, runner
from ..io import BOX_PIECE, Tensor
from ..quant import QArray
from ._checks import spec_of
from ._place import Scratch, sharding_of
from ._readers import Readers
from ._record import Load, parts_of

if TYPE_CHECKING:
    from ._load import Ways


class Budget:
    """The host memory a load may hold beyond the model's arrays (see the module's
    docstring for what counts), and the bookkeeping that keeps it there.

    Built from the headers before any read: the bytes each unit holds (``held``: while it
    is read and placed, or, for a transforming step, while the load's thread transforms
    it, one step at a time), the scratch buffers (two when they fit beside the step that
    holds the most, else one: ``ways.use_buffers(1)``), and ``error``, the refusal when
    one step alone cannot fit (None when every one fits). While the load runs,
    :meth:`fits` says whether the next unit may start beside those in flight, and
    :meth:`take` and :meth:`release` count them.

    At any moment the load holds its scratch buffers, what the units in flight hold while
    they are read and placed, and the temporaries of one transform: the most of those of
    the transforming units in flight (:meth:`count`).

    Args:
        limit: the budget, in bytes; None: none (the load's schedule is unchanged).
        load: the load.
        steps: its steps.
        ways: how each step is read (its buffers changed to one when two do not fit).
    """

    def __init__(self, limit: int | None, load: Load, steps: list[Step], ways: Ways) -> None:
        self.limit, self.ways, self.layers = limit, ways, load.layers
        shapes: dict[Any, Any] = {}  # (a transform, its inputs) -> its outputs' shapes
        self.held = [_held(load, steps, ways, unit, shapes) for unit in ways.units]
        self.making = [unit[0] in ways.buffer_of for unit in ways.units]  # (transformed)
        most = max(self.held, default=0)
        if limit is not None and ways.buffers > 1 and sum(ways.sizes) + most > limit:
            ways.use_buffers(1)
        self.scratch = sum(ways.sizes)
        self.flying: list[int] = []  # the units taken and not yet released
        self.peak = self.scratch  # the most counted at once
        self.error = None if limit is None else _refusal(load, steps, self, limit)

    def count(self, units: list[int]) -> int:
        """The host bytes counted while `units` are in flight: the scratch buffers, what
        each holds while it is read and placed, and the most one transform makes."""
        reading = sum(self.held[u] for u in units if not self.making[u])
        making = max((self.held[u] for u in units if self.making[u]), default=0)
        return self.scratch + reading + making

    def room(self) -> int | None:
        """The bytes the budget leaves beside the scratch and the units in flight; None
        without a budget."""
        if self.limit is None:
            return None
        return max(0, self.limit - self.count(self.flying))

    def fits(self, unit: int) -> bool:
        """Whether `unit` may start beside the units in flight."""
        return self.limit is None or self.count([*self.flying, unit]) <= self.limit

    def take(self, unit: int) -> None:
        """Counts `unit` as in flight (its read starts)."""
        self.flying.append(unit)
        self.peak = max(self.peak, self.count(self.flying))

    def release(self, unit: int) -> None:
        """Counts `unit` as placed: what it held is free."""
        self.flying.remove(unit)

    def planned_peak(self, width: int | None = None) -> int:
        """The most the load counts at once, worked out from the headers by the load's own
        order of starts (:func:`~taktiny.io.load_safetensors`: in file order, while the
        readers, a free scratch buffer and the budget allow) with `width` readers (None:
        the most a load uses, `Readers`' ``most``; into stacks whose slices wait on their
        devices, the few units such a load keeps in flight). The load starts with two and
        doubles them while that pays, up to that most: a narrower load starts no unit
        earlier, so this bounds its peak, and never exceeds the budget. (A budget that is
        refused: the peak without it.)"""
        width = Readers().most if width is None else width
        if self.layers is not None:
            width = self.layers.widest(width)
        sim = Budget.__new__(Budget)
        sim.__dict__.update(self.__dict__)
        sim.flying, sim.peak = [], self.scratch
        if self.error is not None:
            sim.limit = None
        units, buffer_of = self.ways.units, self.ways.buffer_of
        holder: set[int] = set()  # the buffers holding a step's sources
        state = {"submitted": 0, "running": 0}

        def start() -> None:  # as the load's start_more
            while state["submitted"] < len(units) and state["running"] < width:
                u = state["submitted"]
                buffer = buffer_of.get(units[u][0])
                if buffer is not None and buffer in holder:
                    return
                if sim.limit is not None:
                    if not sim.fits(u):
                        return
                if buffer is not None:
                    holder.add(buffer)
                sim.take(u)
                state["running"] += 1
                state["submitted"] += 1

        start()
        for u, unit in enumerate(units):
            state["running"] -= 1  # (its result taken)
            start()
            buffer = buffer_of.get(unit[0])
            holder.discard(-1 if buffer is None else buffer)
            sim.release(u)
            if buffer is not None or sim.limit is not None:
                start()
        return sim.peak


def _refusal(load: Load, steps: list[Step], budget: Budget, limit: int) -> ValueError | None:
    """The error for a budget that one unit cannot fit in beside the scratch buffer the
    load keeps; None when every one fits."""
    ways, held = budget.ways, budget.held
    if not ways.units or budget.scratch + max(held) <= limit:  # (each unit alone)
        return None
    own = [
        sum(Scratch.bytes_for(ways.sources[k]) for k in unit if k in ways.buffer_of)
        for unit in ways.units
    ]
    u = max(range(len(ways.units)), key=lambda j: (held[j], own[j]))
    needed = budget.scratch + held[u]
    unit = ways.units[u]
    sources = [n for k in unit for n in steps[k].sources]
    targets = [n for k in unit for n in steps[k].targets]
    named, into = _names(sources), _names(targets)
    parts = []
    if own[u]:
        parts.append(f"a scratch buffer of {own[u]:,} bytes for its sources")
    elif budget.scratch:
        biggest = max(ways.buffer_of, key=lambda k: Scratch.bytes_for(ways.sources[k]))
        parts.append(
            f"beside the scratch buffer of {budget.scratch:,} bytes the load keeps for "
            f"{', '.join(map(repr, steps[biggest].sources))}"
        )
    if held[u] and budget.making[u]:
        parts.append(f"{held[u]:,} bytes of arrays its transform makes that are not leaves")
    elif held[u]:
        parts.append(f"{held[u]:,} bytes in flight, not its leaf's, while it is read and placed")
    return ValueError(
        f"{load.where}: max_host_bytes={limit:,} ({_mib(limit)}) is too small for {named} "
        f"(into {into}): loading it needs {needed:,} bytes ({_mib(needed)}) of host memory "
        f"beyond the model's arrays ({'; '.join(parts)}). Nothing was read. Raise "
        f"max_host_bytes to at least {needed:,} ({_mib(needed)}), or pass None for no budget."
    )


def _names(names: list[str]) -> str:
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(map(repr, names[:3])) + more


def _mib(n: int) -> str:
    """`n` bytes in the unit that reads best: ``16.0 MiB``, ``192.0 KiB``, ``1 byte``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} byte" + ("" if n == 1 else "s")


def _held(
    load: Load, steps: list[Step], ways: Ways, unit: tuple[int, ...], shapes: dict[Any, Any]
) -> int:
    """The host bytes `unit` holds from the start of its read until it is placed, beyond
    the model's arrays and the scratch buffers (see the module's docstring); `shapes`
    keeps the shapes transforms make, worked out once for each transform and inputs."""
    k = unit[0]
    if len(unit) > 1:  # small tensors read together: staging, then their buffer
        tensors = [ways.sources[j][0] for j in unit]
        staging = sum(t.nbytes for t in tensors)
        adopted = all(_adopting(ways.direct[j]) for j in unit)
        if not adopted:  # (their buffer, which the devices placed from it share)
            return staging + sum(-(-t.nbytes // 64) * 64 for t in tensors)
        return staging + sum(waiting(load, steps[j], None, shared=True) for j in unit)
    if ways.direct[k] is not None:
        tensor, leaf = ways.sources[k][0], ways.direct[k]
        sharding = sharding_of(leaf)
        on_cpu = all(d.platform == "cpu" for d in sharding.device_set)
        slices = waiting(load, steps[k], tensor, shared=True)  # (placed from host buffers)
        if len(sharding.device_set) == 1 or sharding.is_fully_replicated:  # read whole
            return max(0 if _adopting(leaf) else tensor.nbytes, slices)
        return _piece(tensor) + (0 if on_cpu else tensor.nbytes) + slices  # each device's block
    if ways.permuted[k] is not None:
        tensor, leaf = ways.sources[k][0], ways.permuted[k]
        whole = 0 if _adopting(leaf) else tensor.nbytes
        if tensor.packed:  # unpacked whole, then transposed into a copy
            pieces = 2 * math.prod(tensor.shape)
        else:
            pieces = 0 if tensor.ndim < 2 else _piece(tensor)
        sharding = sharding_of(leaf)
        if len(sharding.device_set) == 1 or sharding.is_fully_replicated:  # one host array
            return pieces + max(whole, waiting(load, steps[k], tensor, shared=True))
        return pieces + whole + waiting(load, steps[k], tensor, shared=False)  # (cut: copies)
    held = _transformed(load, steps[k], ways.sources[k], shapes)
    return held + waiting(load, steps[k], None, shared=False)  # (moved onto devices: copies)


def waiting(load: Load, step: Step, tensor: Tensor | None, shared: bool) -> int:
    """The host bytes that the placed slices of `step`'s targets hold until the load's
    thread writes them into their stacked leaves (`Layered.waiting`; `shared`: as it
    says): 0 for a load of no per-layer names, for targets that are no stack's layers, and
    for a `tensor` read straight into its stacked leaf's host buffer."""
    layers = load.layers
    if layers is None or (tensor is not None and layers.in_place(step.targets[0], tensor)):
        return 0
    parts = [p for t in step.targets for p in parts_of(t, load.quantized)]
    return sum(layers.waiting(part, shared) for part in parts)


def _adopting(leaf: Any) -> bool:
    """Whether a buffer read for `leaf` becomes the leaf itself: one CPU device, which
    adopts it without a copy."""
    devices = sharding_of(leaf).device_set
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _piece(tensor: Tensor) -> int:
    """The most a piecewise read of `tensor` holds at once: its rows, 4 MiB at a time (one
    row when a row is larger)."""
    row = tensor.nbytes // tensor.shape[0] if tensor.ndim and tensor.shape[0] else tensor.nbytes
    return min(tensor.nbytes, max(BOX_PIECE, row))


def _transformed(load: Load, step: Step, sources: list[Tensor], shapes: dict[Any, Any]) -> int:
    """The host bytes a transforming step's transform makes besides its leaves (see the
    module's docstring), worked out from the shapes: for an unknown transform, what it
    makes (its own working memory is not counted)."""
    leaves, quantized = load.leaves, load.quantized
    here = default_device()
    held = 0
    specs = []
    for t in sources:
        dtype = jax.dtypes.canonicalize_dtype(t.dtype)
        if dtype != t.dtype:  # a 64-bit tensor, cast to what JAX holds
            held += math.prod(t.shape) * np.dtype(dtype).itemsize
        specs.append(jax.ShapeDtypeStruct(t.shape, dtype))
    count = None if step.rule.gathered else len(step.targets)
    made = tuple(specs)
    stages = _stages(step.rule.transform)
    for k, stage in enumerate(stages):
        key = (stage, count, tuple((m.shape, np.dtype(m.dtype)) for m in made))
        if key not in shapes:
            shapes[key] = jax.eval_shape(runner(stage, count), *made)
        made = shapes[key]
        if k < len(stages) - 1:  # a chain's intermediate results
            held += sum(_nbytes(m) for m in made)
    kept = not stages  # the results are the sources, in scratch
    blocks = step.rule.transform
    fp8 = isinstance(blocks, dequantize_blocks)  # (its product: the leaf's dtype)
    for name, out in zip(step.targets, made, strict=True):
        like, leaf = quantized.get(name), leaves.get(name)
        if fp8 and like is not None:  # quantized in the one program that places it
            held += blocks.held_bytes(sources[0], like.dtype, like)
            continue
        if fp8 and leaf is not None:
            out = jax.ShapeDtypeStruct(out.shape, spec_of(leaf)[1])
        if like is not None:  # made, cast to its logical dtype, then quantized
            held += 0 if kept else _nbytes(out)
            if np.dtype(out.dtype) != np.dtype(like.dtype):
                held += math.prod(like.shape) * np.dtype(like.dtype).itemsize
            continue
        if leaf is None:  # made, and dropped
            held += 0 if kept else _nbytes(out)
            continue
        shape, dtype = spec_of(leaf)
        there = sharding_of(leaf).device_set == {here} and here.platform == "cpu"
        cast = np.dtype(out.dtype) != dtype
        if not kept and (cast or not there):  # the result is not the leaf
            held += _nbytes(out)
        if cast and not there:  # the cast, then moved
            held += math.prod(shape) * dtype.itemsize
    return held


def _stages(transform: Transform) -> list[Transform]:
    """The transforms one after the other that `transform` runs (a chain's, flattened)."""
    if isinstance(transform, identity):
        return []
    if isinstance(transform, chain):
        return [s for t in transform.transforms for s in _stages(t)]
    return [transform]


def _nbytes(spec: Any) -> int:
    if isinstance(spec, QArray):  # (unpacked parts: their own bytes)
        return spec.nbytes
    return math.prod(spec.shape) * np.dtype(spec.dtype).itemsize
