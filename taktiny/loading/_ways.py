"""The ways a load reads its steps, one type each: whole into its leaf's buffer (`Whole`),
renamed or transposed onto devices that copy host memory, from a local file's mapped
pages (`Mapped`) or else through a ring of staging buffers, a few MiB of rows at a time
(`Staged`, `StagedTransposed`, `Ring`),
each device's block (`Blocks`), transposed piece by piece (`Transposed`), straight into its
layer's slice of a stacked leaf (`InStack`), small tensors read together (`Batch`), through a
scratch buffer to be transformed (`Transformed`), FP8 blocks laid out as they are read
(`Fp8Blocks`). Each says what it holds (what ``max_host_bytes`` counts, and what the plan's
peak counts), reads (in a reader thread), places (in the load's thread) and how the plan
names it; `Ways` builds them once per load, from the headers."""

from __future__ import annotations

import functools
import math
import queue
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from ..arrays import CACHE_BOUND, as_bits, bits_kept, default_device, from_bits
from ..convert import (
    Step,
    Transform,
    chain,
    dequantize_blocks,
    identity,
    transformed_specs,
    transpose,
)
from ..io import BOX_PIECE, Tensor, read_together
from ..quant import Parameter
from ..state import Stacker, zeros_on
from ._checks import spec_of
from ._place import (
    Scratch,
    adopted,
    placed,
    placed_by_device,
    placed_together,
    placed_transposed,
    sharding_of,
    transformed,
)
from ._readers import START
from ._record import Load, parts_of
from ._steps import results_of, tensors_of


class Way:
    """How a load reads one step (the ways below are its kinds).

    Attributes:
        step: the step.
        sources: the tensors it reads, in the order its transform takes them.
        leaf: the leaf it is read straight into; None for a step that is transformed.
        word: how :class:`~taktiny.io.PlannedStep` names it (its ``way``).
        transforms: whether the load's own thread transforms it, one step at a time.
        scratch: the buffer it is read into, for a step that is transformed.
        maps: whether it copies its sources from their files' mapped pages.
        parts: its steps, each as a way of its own (a batch's several, in order).
    """

    word = "direct"
    transforms = False
    maps = False
    scratch: Scratch | None = None

    def __init__(self, step: Step, sources: list[Tensor], leaf: Any = None) -> None:
        self.step, self.sources, self.leaf = step, sources, leaf

    @property
    def parts(self) -> tuple[Way, ...]:
        """Itself alone (a batch's several, in order): made when asked, so that a way does
        not refer to itself (a cycle, which only the garbage collector frees, keeps the
        load's mapped files open until it runs)."""
        return (self,)

    def held(self, load: Load, shapes: dict[Any, Any]) -> int:
        """The host bytes it holds from the start of its read until it is placed, beyond
        the model's arrays and the scratch buffers, as ``max_host_bytes`` counts them
        (`shapes` keeps the shapes transforms make, worked out once each)."""
        raise NotImplementedError

    def temporary(self, load: Load) -> int:
        """The host bytes it holds for a while besides its leaves and the scratch buffers,
        as `LoadPlan.scratch_bytes` counts them."""
        raise NotImplementedError

    def own(self) -> int:
        """The bytes of the load's buffer it reads into (a scratch buffer's, a staging
        buffer's), as large as it needs; 0: none."""
        return 0

    def read(self, verify: bool, stacker: Stacker | None) -> Any:
        """Reads it, in a reader thread: its leaves placed (``{name: array}``), or what
        :meth:`place` takes."""
        raise NotImplementedError

    def place(self, load: Load, data: Any) -> Iterable[tuple[str, Any]]:
        """Its ``(leaf name, placed value)`` pairs from what :meth:`read` returned, in the
        load's thread."""
        return data.items()

    def reads(self, verify: bool) -> dict[int, int]:
        """The bytes each process reads of it: every source whole."""
        return dict.fromkeys(range(jax.process_count()), sum(t.nbytes for t in self.sources))


class Whole(Way):
    """A tensor the rules only rename, of its leaf's dtype, read whole into its own buffer:
    the leaf itself on one CPU device (adopted: it holds nothing more), else staging on
    its way to the leaf's devices (held whole)."""

    def held(self, load: Load, shapes: dict[Any, Any]) -> int:
        tensor = self.sources[0]
        slices = waiting(load, self.step, tensor, shared=True)  # (placed from host buffers)
        return max(0 if _adopting(self.leaf) else tensor.nbytes, slices)

    def temporary(self, load: Load) -> int:
        return waiting(load, self.step, self.sources[0], shared=True)  # (into stacks)

    def read(self, verify: bool, stacker: Stacker | None) -> Any:
        sharding = sharding_of(self.leaf)
        return {self.step.targets[0]: placed_by_device(self.sources[0], sharding, verify)}

    def reads(self, verify: bool) -> dict[int, int]:
        """Each process's own devices' blocks of the leaf."""
        tensor, sharding = self.sources[0], sharding_of(self.leaf)
        by_process: dict[int, list[tuple[tuple[int, int], ...]]] = {}
        for device, index in sharding.devices_indices_map(tensor.shape).items():
            block = tuple(s.indices(n)[:2] for s, n in zip(index, tensor.shape, strict=True))
            blocks = by_process.setdefault(device.process_index, [])
            if block not in blocks:
                blocks.append(block)
        if tensor.nbytes == 0 or sharding.is_fully_replicated:
            return dict.fromkeys(by_process, tensor.nbytes)
        return {p: tensor.bytes_read(b, verify=verify) for p, b in by_process.items()}


class Mapped(Whole):
    """A tensor the rules only rename or transpose, in a local file, for a leaf on devices
    that copy host memory (a TPU, a GPU), all of them this process's: its bytes mapped
    from the file (:meth:`Tensor.mapped`: the page cache's own pages, with no copy made on
    the host and no memory of the load's own) and copied onto the devices whole, hashed
    while the copy reads them; a transposed one permuted there (its devices hold the
    tensor as stored and the leaf for a moment). Where the file system cannot map the
    file, read whole into fresh memory instead. Copying from the page cache runs at
    twice the speed of the staging ring's reads on a TPU v5e (bench/FINDINGS.md
    section 14), which a tensor in object storage still takes (`Staged`).

    Args:
        step: the step it reads (a rename or a transpose).
        sources: its one tensor.
        leaf: the model's leaf it fills.
        perm: the axes its devices permute the tensor by; None: as it is.
    """

    word = "mapped"
    maps = True

    def __init__(
        self, step: Step, sources: list[Tensor], leaf: Any, perm: tuple[int, ...] | None
    ) -> None:
        super().__init__(step, sources, leaf)
        self.perm = perm

    def held(self, load: Load, shapes: dict[Any, Any]) -> int:
        return waiting(load, self.step, self.sources[0], shared=True)  # (into stacks)

    def read(self, verify: bool, stacker: Stacker | None) -> Any:
        sharding = sharding_of(self.leaf)
        array = _from_file(self.sources[0], sharding, verify)
        perm = self.perm
        return {self.step.targets[0]: array if perm is None else _turned(perm, sharding)(array)}


class Staged(Whole):
    """A renamed tensor for a leaf on devices that copy host memory instead of adopting it
    (a TPU, a GPU), read through the load's staging ring (`Ring`: a few buffers taken in
    turns and reused, whose pages fault once for the load, where a fresh buffer for each
    tensor would fault every page of the checkpoint, the most such a load pays for) and
    copied onto its devices a few MiB of rows at a time (`STAGE_PIECE`): each piece copied
    as soon as it is read and written into its place in the leaf on the devices, while the
    next is read. A leaf whose devices span processes is staged whole, in one piece
    (`_joined`). A buffer is free for the next read once the copy made from it has read
    it. It holds nothing of its own: the ring is counted once, for the load, as the scratch
    buffers are.

    Args:
        step: the step it reads (a rename).
        sources: its one tensor.
        leaf: the model's leaf it fills.
        piece: the most bytes of a piece (whole rows, at least one).
    """

    word = "staged"
    ring: Ring | None = None

    def __init__(self, step: Step, sources: list[Tensor], leaf: Any, piece: int) -> None:
        super().__init__(step, sources, leaf)
        tensor = sources[0]
        self.joined = _joined(sharding_of(leaf))
        self.rows = _rows(tensor, piece) if self.joined else max(_count(tensor), 1)

    def held(self, load: Load, shapes: dict[Any, Any]) -> int:
        return waiting(load, self.step, self.sources[0], shared=True)

    def own(self) -> int:
        """The bytes of a ring buffer its pieces take (at a multiple of 64)."""
        return -(-self.rows * _row(self.sources[0]) // 64) * 64

    def pieces(self) -> int:
        """The pieces its tensor is read and copied in."""
        return max(1, -(-_count(self.sources[0]) // self.rows))

    def _axes(self) -> tuple[int, ...] | None:
        """The axes the rules permute the tensor by; None: as it is."""
        return None

    def _perm(self) -> tuple[int, ...] | None:
        """The axes the devices permute the tensor by as it is placed; None: as it is."""
        return None

    def _host(self, into: Callable[[int], memoryview], verify: bool) -> Iterator[np.ndarray]:
        """The tensor's pieces of `rows` rows on the host, each read into the memory
        `into(nbytes)` gives it."""
        return self.sources[0].read_rows(self.rows, into, verify=verify)

    def read(self, verify: bool, stacker: Stacker | None) -> Any:
        tensor, sharding = self.sources[0], sharding_of(self.leaf)
        ring, perm = cast(Ring, self.ring), self._perm()
        if tensor.nbytes == 0:
            host, axes = tensor.read(verify=verify), self._axes()
            host = host if axes is None else np.transpose(host, axes)
            return {self.step.targets[0]: placed(host, sharding)}
        whole: jax.Array | None = None  # (the leaf, on its devices, begun at the first piece)
        if self.pieces() > 1 or perm is not None:
            shape = tuple(tensor.shape[p] for p in perm) if perm else tuple(tensor.shape)
            whole = zeros_on(shape, np.dtype(tensor.dtype), sharding)()
        write = _writer(perm, sharding)
        for k, piece in enumerate(self._pieces(ring, sharding, verify)):
            whole = piece if whole is None else write(whole, piece, np.int32(k * self.rows))
        return {self.step.targets[0]: whole}

    def _pieces(self, ring: Ring, sharding: Any, verify: bool) -> Iterator[jax.Array]:
        """The tensor's pieces, each read into a buffer of the ring and copied onto
        `sharding`, the buffer given back with its copy (the next to take it waits for
        that copy to have read it): yielded one by one, so that each is written into
        place while the next is read."""
        taken: list[Scratch] = []

        def into(nbytes: int) -> memoryview:
            taken.append(ring.take())  # (a reader waits here while the others hold all)
            return taken[-1].view(nbytes)

        try:
            for host in self._host(into, verify):
                copy = _copied(host, sharding)
                ring.give(taken.pop(), copy)
                yield copy
        finally:
            for buffer in taken:  # (a read that failed: nothing copied from it)
                ring.give(buffer)


class StagedTransposed(Staged):
    """A tensor the rules only transpose, for a leaf on devices that copy host memory,
    staged as `Staged` stages a renamed one and permuted by its devices as each piece is
    written into place; for a leaf whose devices span processes (staged whole), read with
    its axes permuted into a buffer of the ring, a piece of rows at a time
    (:meth:`Tensor.read_transposed`), which then holds a piece of rows besides the ring."""

    def held(self, load: Load, shapes: dict[Any, Any]) -> int:
        return (0 if self.joined else _piece(self.sources[0])) + super().held(load, shapes)

    def temporary(self, load: Load) -> int:
        return (0 if self.joined else BOX_PIECE) + super().temporary(load)

    def _axes(self) -> tuple[int, ...] | None:
        return _axes(self.step, self.sources[0])

    def _perm(self) -> tuple[int, ...] | None:
        return self._axes() if self.joined else None

    def _host(self, into: Callable[[int], memoryview], verify: bool) -> Iterator[np.ndarray]:
        if self.joined:
            yield from super()._host(into, verify)
            return
        tensor, axes = self.sources[0], cast(tuple[int, ...], self._axes())
        shape = tuple(tensor.shape[p] for p in axes)
        out = np.frombuffer(into(tensor.nbytes), tensor.dtype, math.prod(shape))
        yield tensor.read_transposed(axes, verify=verify, out=out.reshape(shape))


def _axes(step: Step, tensor: Tensor) -> tuple[int, ...]:
    """The axes `step`'s transpose permutes `tensor` by."""
    perm, ndim = cast(transpose, step.rule.transform).perm, tensor.ndim
    return tuple(range(ndim))[::-1] if perm is None else tuple(p % ndim for p in perm)


def _copied(host: np.ndarray, sharding: Any) -> jax.Array:
    """`host` (a staging buffer's, reused; or a file's mapped pages) copied onto
    `sharding`; a device that adopted it after all (a CPU's) gets its own copy."""
    array = placed(host, sharding)
    return jnp.copy(array) if adopted(array, host.ctypes.data, host.nbytes) else array


def _from_file(tensor: Tensor, sharding: Any, verify: bool) -> Any:
    """`tensor` (in a local file) on `sharding`: its mapped pages copied there, with
    `verify` hashed while the copy reads the same pages, and checked; read whole into
    fresh memory where there are none to map (a tensor of no bytes; a file system that
    cannot map files). With `sharding` None, those pages (or that memory) themselves,
    checked, for a program that takes them as its arguments (`Fp8Blocks`)."""
    host = tensor.mapped()
    if host is None:
        read = tensor.read(verify=verify)
        return read if sharding is None else placed(read, sharding)
    array = host if sharding is None else _copied(host, sharding)
    if verify:
        tensor.check(host.reshape(-1).view(np.uint8))  # (its bytes: a 0-d array's too)
    return array


@functools.lru_cache(maxsize=CACHE_BOUND)
def _turned(perm: tuple[int, ...], sharding: Any) -> Any:
    """``turn(array)``: `array`'s axes permuted by `perm`, on `sharding` (one program per
    axes and sharding for the process)."""

    bits = bits_kept(sharding)

    # moved as bits, so that every bit arrives (float8 as its bytes everywhere, as before)
    def turn(array: Any) -> Any:
        if bits or array.dtype.itemsize == 1:
            return from_bits(jnp.transpose(as_bits(array), perm), array.dtype)
        return jnp.transpose(array, perm)

    return jax.jit(turn, out_shardings=sharding)  # pyright: ignore[reportUnknownMemberType]  (JAX leaves its parameters unannotated)


class Ring:
    """The staging buffers of a load onto devices that copy host memory (`Staged`), taken
    in turns by its readers: `count` buffers of `size` bytes (the most that one piece of
    a staged tensor takes), each mapped at its first use (in huge pages, where the kernel
    gives them) and reused to the load's end.

    A reader takes a buffer (:meth:`take`), reads into it, starts its copy onto the
    devices and gives it back with that copy (:meth:`give`) without waiting for it: the
    next reader to take the buffer waits until the copy has read it.

    Args:
        count: the buffers.
        size: the bytes of each.
    """

    def __init__(self, count: int, size: int) -> None:
        self.buffers = [Scratch(size, huge=True) for _ in range(count)]
        self._free: queue.SimpleQueue[tuple[Scratch, Any]] = queue.SimpleQueue()
        self.close()

    def take(self) -> Scratch:
        """A free buffer: waits while the other readers hold every one, then until the
        copy last made from it has read it."""
        buffer, copy = self._free.get()
        if copy is not None:
            jax.block_until_ready(copy)
        return buffer

    def give(self, buffer: Scratch, copy: Any = None) -> None:
        """Gives `buffer` back, with the `copy` (an array) that still reads it, if any."""
        self._free.put((buffer, copy))

    def close(self) -> None:
        """Lets go of the copies the buffers kept (once the load's readers are done; the
        copies still reading a buffer keep it mapped): every buffer free."""
        while not self._free.empty():
            self._free.get_nowait()
        for buffer in self.buffers:
            self._free.put((buffer, None))


def _count(tensor: Tensor) -> int:
    """The rows of `tensor`, along its first axis (a 0-d tensor: one)."""
    return tensor.shape[0] if tensor.ndim else 1


def _row(tensor: Tensor) -> int:
    """The bytes of one row of `tensor` (0 for a tensor of no rows)."""
    count = _count(tensor)
    return tensor.nbytes // count if count else 0


def _rows(tensor: Tensor, piece: int) -> int:
    """The rows of `tensor` read and copied at a time in pieces of at most `piece` bytes:
    the most that fit (at least one), or fewer, down to half as many, that divide its rows
    (pieces of one shape: one program writes them all, where a last piece of its own shape
    would be compiled for again)."""
    count, row = _count(tensor), _row(tensor)
    if not row:
        return max(count, 1)
    most = max(1, min(count, piece // row))
    for rows in range(most, max(most // 2, most - DIVISORS), -1):
        if count % rows == 0:
            return rows
    return most


# The jitted writes of pieces into the leaves they make, one per axes and sharding for the
# process (one made per load would be traced and compiled again by every load)
@functools.lru_cache(maxsize=CACHE_BOUND)
def _writer(perm: tuple[int, ...] | None, sharding: Any) -> Any:
    """``write(whole, piece, at)``: `whole` (taken: donated) with `piece`, rows ``at`` on of
    a tensor, written in its place (permuted by `perm`: into the axis its rows go)."""
    axis = 0 if perm is None else perm.index(0)

    bits = bits_kept(sharding)

    def write(whole: Any, piece: Any, at: Any) -> Any:
        dtype = whole.dtype
        if bits:  # (moved as bits, so that every bit arrives)
            whole, piece = as_bits(whole), as_bits(piece)
        piece = piece if perm is None else jnp.transpose(piece, perm)
        if not whole.ndim:
            return from_bits(piece, dtype)
        return from_bits(jax.lax.dynamic_update_slice_in_dim(whole, piece, at, axis), dtype)

    return jax.jit(write, donate_argnums=0, out_shardings=sharding)  # pyright: ignore[reportUnknownMemberType]  (JAX leaves its parameters unannotated)


class Blocks(Whole):
    """A renamed tensor for a leaf split across devices: the distinct blocks of this
    process's devices read together, each into its own buffer, and made one array. It
    holds a piece of rows (4 MiB, or one row when a row is larger), and the whole tensor
    when the blocks are copied onto devices that are not the host's."""

    word = "blocks"

    def held(self, load: Load, shapes: dict[Any, Any]) -> int:
        tensor = self.sources[0]
        on_cpu = all(d.platform == "cpu" for d in sharding_of(self.leaf).device_set)
        slices = waiting(load, self.step, tensor, shared=True)
        return _piece(tensor) + (0 if on_cpu else tensor.nbytes) + slices  # each device's block

    def temporary(self, load: Load) -> int:
        return BOX_PIECE + super().temporary(load)


class Transposed(Way):
    """A tensor the rules only transpose, of its leaf's dtype, read piece by piece with its
    axes permuted into its leaf's buffer (:meth:`Tensor.read_transposed`), then placed. It
    holds a piece of rows, and the whole array when it is not the leaf (copied onto other
    devices, or cut into their blocks)."""

    word = "transposed"

    def held(self, load: Load, shapes: dict[Any, Any]) -> int:
        tensor, leaf = self.sources[0], self.leaf
        whole = 0 if _adopting(leaf) else tensor.nbytes
        if tensor.packed:  # unpacked whole, then transposed into a copy
            pieces = 2 * math.prod(tensor.shape)
        else:
            pieces = 0 if tensor.ndim < 2 else _piece(tensor)
        sharding = sharding_of(leaf)
        if len(sharding.device_set) == 1 or sharding.is_fully_replicated:  # one host array
            return pieces + max(whole, waiting(load, self.step, tensor, shared=True))
        return pieces + whole + waiting(load, self.step, tensor, shared=False)  # (cut: copies)

    def temporary(self, load: Load) -> int:  # one piece; the whole array, when it is then cut
        single = len(sharding_of(self.leaf).device_set) == 1
        tensor = self.sources[0]
        return (BOX_PIECE if single else tensor.nbytes) + waiting(load, self.step, tensor, False)

    def read(self, verify: bool, stacker: Stacker | None) -> Any:
        placed = placed_transposed(self.step, self.sources[0], self.leaf, verify)
        return {self.step.targets[0]: placed}


class InStack(Way):
    """A tensor renamed or transposed into a layer of a stacked leaf filled on the host:
    read straight into its layer's slice of the leaf's buffer (`Stacker.buffer`), which JAX
    adopts whole at the end, so it places nothing. It holds what `way`, the way it
    replaces, holds (no slice waits)."""

    def __init__(self, way: Whole | Transposed) -> None:
        super().__init__(way.step, way.sources, way.leaf)
        self.way, self.word = way, way.word

    def held(self, load: Load, shapes: dict[Any, Any]) -> int:
        return self.way.held(load, shapes)

    def temporary(self, load: Load) -> int:
        return self.way.temporary(load)

    def read(self, verify: bool, stacker: Stacker | None) -> Any:
        stacker = cast(Stacker, stacker)
        stacked, index = cast("tuple[str, int]", stacker.layers.slice_of(self.step.targets[0]))
        part, tensor = stacker.buffer(stacked)[index], self.sources[0]
        permuted = self.step.rule.transform
        if isinstance(permuted, transpose):
            tensor.read_transposed(permuted.perm, verify=verify, out=part)
        else:
            tensor.read_into(part.reshape(-1).view(np.uint8).data, verify=verify)
        return {}

    def reads(self, verify: bool) -> dict[int, int]:
        return self.way.reads(verify)


class Batch(Way):
    """Small renamed tensors placed whole, next to each other in the file (`SMALL` bytes
    each at most, `BATCH` bytes in all): read into one buffer by one read
    (`read_together`) and placed by the load's thread with one transfer (for tensors of a
    few KiB, a mapping, a transfer and a handoff to a reader each would cost far more than
    their bytes; transfers made from two threads at once only queue for each other). They
    hold their staging (their bytes) and, off one CPU device, the buffer read into."""

    def __init__(self, parts: list[Way]) -> None:
        super().__init__(parts[0].step, [part.sources[0] for part in parts])
        self._parts = tuple(parts)

    @property
    def parts(self) -> tuple[Way, ...]:
        return self._parts

    def held(self, load: Load, shapes: dict[Any, Any]) -> int:  # staging, then their buffer
        staging = sum(t.nbytes for t in self.sources)
        if not all(_adopting(part.leaf) for part in self.parts):  # (one the devices share)
            return staging + Scratch.bytes_for(self.sources)
        return staging + sum(waiting(load, part.step, None, shared=True) for part in self.parts)

    def read(self, verify: bool, stacker: Stacker | None) -> Any:
        return read_together(self.sources, verify=verify)

    def place(self, load: Load, data: Any) -> Iterable[tuple[str, Any]]:
        arrays = placed_together(data, [part.leaf for part in self.parts])
        return zip([part.step.targets[0] for part in self.parts], arrays, strict=True)


class Transformed(Way):
    """A step whose transform does more than rename or transpose (or whose leaf's dtype is
    not its tensor's): its sources read into a scratch buffer (`scratch`, taking turns
    with the load's other such steps), transformed by XLA in the load's thread, one step
    at a time, and placed (a float array for a quantized parameter quantized as it is);
    `word` is ``"quantized"`` or ``"scratch"``. Onto a default device that copies host
    memory (a TPU, a GPU), sources in local files, of dtypes JAX holds as they are, are
    copied onto it from their files' mapped pages instead (`maps`, as `Mapped` copies, as
    they are stored: the transform permutes them there, where a scratch buffer's read
    permutes the first by `perm`): such a step takes no buffer and is transformed by its
    reader too, as `Mapped` places its tensor, so several run at once (the load's own
    thread, transforming one such step after another, was the slower half of an FP8 load
    on a TPU v5e: bench/FINDINGS.md section 14). Besides the buffer (counted once, for the
    load), it holds the arrays its transform makes on the default device that are not the
    leaves: a chain's intermediate results, results cast or quantized afterwards (and the
    cast), results placed on other devices, and 64-bit sources cast to what JAX holds."""

    perm: tuple[int, ...] | None = None  # the first source's axes, as a scratch buffer reads it

    def __init__(self, step: Step, sources: list[Tensor], word: str, load: Load) -> None:
        super().__init__(step, sources)
        self.word, self.load = word, load

    @property
    def transforms(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride]  (a class attribute of the others)
        """Whether the load's own thread transforms it: not when it `maps` (its reader
        does)."""
        return not self.maps

    def held(self, load: Load, shapes: dict[Any, Any]) -> int:
        """Worked out from the shapes (for an unknown transform, what it makes: its own
        working memory is not counted), with its slices waiting to be written into stacks."""
        held = 0
        specs = []
        for t in self.sources:
            dtype = jax.dtypes.canonicalize_dtype(t.dtype)
            if dtype != t.dtype:  # a 64-bit tensor, cast to what JAX holds
                held += math.prod(t.shape) * np.dtype(dtype).itemsize
            specs.append(jax.ShapeDtypeStruct(t.shape, dtype))
        count = None if self.step.rule.gathered else len(self.step.targets)
        made = tuple(specs)
        stages = _stages(self.step.rule.transform)
        for k, stage in enumerate(stages):
            made = transformed_specs(stage, count, made, shapes)
            if k < len(stages) - 1:  # a chain's intermediate results
                held += sum(_nbytes(m) for m in made)
        kept = not stages  # the results are the sources, in scratch
        for name, out in zip(self.step.targets, made, strict=True):
            held += self._result_held(load, name, out, kept)
        return held + waiting(load, self.step, None, shared=False)  # (moved onto devices)

    def _result_held(self, load: Load, name: str, out: Any, kept: bool) -> int:
        """What the result `out` made for the target `name` holds besides its leaf."""
        like, leaf = load.quantized.get(name), load.leaves.get(name)
        made = 0 if kept else _nbytes(out)
        if like is not None:  # made, cast to its logical dtype, then quantized
            cast = np.dtype(out.dtype) != np.dtype(like.dtype)
            return made + (math.prod(like.shape) * np.dtype(like.dtype).itemsize if cast else 0)
        if leaf is None:  # made, and dropped
            return made
        shape, dtype = spec_of(leaf)
        here = default_device()
        there = sharding_of(leaf).device_set == {here} and here.platform == "cpu"
        cast = np.dtype(out.dtype) != dtype
        held = made if cast or not there else 0  # the result is not the leaf
        return held + (math.prod(shape) * dtype.itemsize if cast and not there else 0)  # moved

    def temporary(self, load: Load) -> int:
        waits = waiting(load, self.step, None, shared=True)
        if isinstance(self.step.rule.transform, identity):  # its result: its sources, in scratch
            return waits
        outs = zip(self.step.targets, results_of(self.step, self.sources), strict=True)
        return waits + sum(self._result_temporary(load, name, out) for name, out in outs)

    def _result_temporary(self, load: Load, name: str, out: Any) -> int:
        """What the plan counts of the result `out` made for the target `name`: unpacked
        parts, a result quantized or cast."""
        leaf = load.leaves.get(name)
        if isinstance(out, Parameter):  # unpacked parts: placed as they are, or dequantized
            return out.nbytes
        if name in load.quantized or (leaf is not None and np.dtype(out.dtype) != spec_of(leaf)[1]):
            return math.prod(out.shape) * np.dtype(out.dtype).itemsize
        return 0

    @functools.cached_property
    def maps(self) -> bool:
        """Whether its sources are copied onto the default device from their files' mapped
        pages: a default device that copies host memory, sources in local files, of dtypes
        JAX holds as they are. Then it takes no scratch buffer (`Ways` gives it none) and
        runs beside the load's other steps, as many at once as the readers."""
        here = jax.sharding.SingleDeviceSharding(default_device())
        return _staging(here) and all(_plain(t) and not t.packed for t in self.sources)

    def own(self) -> int:
        return 0 if self.maps else Scratch.bytes_for(self.sources)

    def read(self, verify: bool, stacker: Stacker | None) -> Any:
        if self.scratch is not None:
            return self.scratch.read(self.sources, verify, self.perm)
        here = jax.sharding.SingleDeviceSharding(default_device())  # (`maps`: as stored)
        copied = [self._source(t, here, verify) for t in self.sources]
        return transformed(self.load, self.step, copied, None)

    def _source(self, tensor: Tensor, sharding: Any, verify: bool) -> Any:
        """`tensor` for its reader's transform (`maps`): copied onto `sharding` from its
        mapped pages, checked with `verify` (`_from_file`)."""
        return _from_file(tensor, sharding, verify)

    def place(self, load: Load, data: Any) -> Iterable[tuple[str, Any]]:
        if self.scratch is None:  # (`maps`: transformed by its reader)
            return data.items()
        return transformed(load, self.step, data, self.scratch).items()


class Fp8Blocks(Transformed):
    """FP8 blocks (``convert.dequantize_blocks``): the weights read into the scratch buffer
    already transposed when the transform lays them out (a byte a weight, `perm`), then
    multiplied by their scales, rounded into the leaf's dtype and, for a quantized
    parameter, quantized, by one XLA program: no float32 product is held
    (``dequantize_blocks.held_bytes`` says what is)."""

    def __init__(self, step: Step, sources: list[Tensor], word: str, load: Load) -> None:
        super().__init__(step, sources, word, load)
        self.blocks = cast(dequantize_blocks, step.rule.transform)
        if len(sources) == 2:  # (weights and scales: read permuted, a byte a weight)
            self.perm = self.blocks.perm(sources[0].ndim)

    def _source(self, tensor: Tensor, sharding: Any, verify: bool) -> Any:
        """`tensor`'s mapped pages, checked with `verify`, not copied: the step's one
        program takes them as its arguments, which copies them onto the default device
        (`transformed`), a JAX call fewer for each (a call costs the host 0.1-0.5 ms on a
        TPU v5e's: a load into bfloat16 1.3x faster there, bench/FINDINGS.md section 14);
        read into fresh memory where there are none to map."""
        return _from_file(tensor, None, verify)

    def _result_held(self, load: Load, name: str, out: Any, kept: bool) -> int:
        like, leaf = load.quantized.get(name), load.leaves.get(name)
        if like is not None:  # quantized in the one program that places it
            return self.blocks.held_bytes(self.sources[0], like.dtype, like)
        if leaf is not None:  # (its product: the leaf's dtype)
            out = jax.ShapeDtypeStruct(out.shape, spec_of(leaf)[1])
        return super()._result_held(load, name, out, kept)

    def _result_temporary(self, load: Load, name: str, out: Any) -> int:
        like = load.quantized.get(name)
        return 0 if like is None else self.blocks.held_bytes(self.sources[0], like.dtype, like)


class Ways:
    """How a load reads its steps: one way for each unit a reader takes at a time, in file
    order (``units``; several readers read several at once, as many as pay: `Readers`),
    built once from the headers and shared by the load, its budget and its plan.

    Steps that rename or transpose read into their leaves' own buffers, so any number run
    together. Transformed steps take turns with the scratch buffers (``scratch``), each
    free again once the step before that used it has been transformed: two, or one for a
    quantizing load, which so keeps one float tensor at a time (FP8 blocks too, though
    their scratch holds a byte a weight: a second buffer, for the next weight's read to
    overlap, would be the most memory such a load holds beside the model;
    bench/FINDINGS.md section 13), or for a load within a budget `limit` too small for two
    beside the unit that holds the most. Each buffer is mapped once, at its first read, as
    large as the most that its steps read. Transformed steps whose sources are copied from
    their files' mapped pages (`Transformed.maps`) take no buffer.

    Args:
        load: the load.
        steps: its steps, in file order.
        limit: its budget (``max_host_bytes``), in bytes, or None.
    """

    def __init__(self, load: Load, steps: list[Step], limit: int | None = None) -> None:
        self.load = load
        piece = STAGE_PIECE  # (read when each load begins)
        self.units = _units(load, [_way(load, step, piece) for step in steps])
        transforming = [w for w in self.units if isinstance(w, Transformed) and not w.maps]
        buffers = 1 if any(t in load.quantized for s in steps for t in s.targets) else 2
        sizes = _sizes(transforming, buffers)
        if limit is not None and buffers > 1 and sum(sizes) + max(self.held, default=0) > limit:
            buffers, sizes = 1, _sizes(transforming, 1)
        self.scratch = [Scratch(size) for size in sizes]
        for k, way in enumerate(transforming):
            way.scratch = self.scratch[k % buffers]
        staged = [way for way in self.units if isinstance(way, Staged)]
        size = max((way.own() for way in staged), default=0)
        count = min(max(RING, 1), sum(way.pieces() for way in staged))
        room = None if limit is None else limit - sum(sizes) - max(self.held, default=0)
        while room is not None and count > 1 and count * size > room:
            count -= 1  # (within a budget: fewer staging buffers, down to one)
        self.ring = Ring(count, size)
        for way in staged:
            way.ring = self.ring
        mapped = any(way.maps for way in self.units)
        self.start = MAPPED_START if mapped else START  # (the readers it starts with)

    @property
    def buffers(self) -> list[Scratch]:
        """Every buffer the load keeps for its whole length, as mapped: the scratch
        buffers and the staging ring."""
        return [*self.scratch, *self.ring.buffers]

    def close(self) -> None:
        """Lets go of what the staging ring keeps (`Ring.close`), once the reads are done."""
        self.ring.close()

    @property
    def releases(self) -> bool:
        """Whether the load has JAX let go of the host memory it read into as it ends
        (`release`), which JAX holds until its next garbage collection: the load copies
        host memory onto devices (one of its leaves, or the default device that
        transformed steps are placed on first, copies it), or reads a transformed step
        into a scratch buffer, a view of which a CPU device adopts."""
        here = jax.sharding.SingleDeviceSharding(default_device())
        copies = _staging(here) or any(_staging(sharding_of(v)) for v in self.load.leaves.values())
        return copies or any(buffer.capacity for buffer in self.scratch)

    @functools.cached_property
    def held(self) -> list[int]:
        """What each unit holds, as ``max_host_bytes`` counts it (:meth:`Way.held`): worked
        out when first asked (a load without a budget never asks)."""
        shapes: dict[Any, Any] = {}  # (a transform, its inputs) -> its outputs' shapes
        return [way.held(self.load, shapes) for way in self.units]


def _way(load: Load, step: Step, piece: int) -> Way:
    """The way `step` is read, alone (`piece`: the most bytes a staged piece takes)."""
    sources, transform = tensors_of(load.checkpoint, step), step.rule.transform
    leaf = _one_to_one(step, sources, load.leaves)
    if leaf is None or not isinstance(transform, identity | transpose):
        word = "quantized" if any(t in load.quantized for t in step.targets) else "scratch"
        kind = Fp8Blocks if isinstance(transform, dequantize_blocks) else Transformed
        return kind(step, sources, word, load)
    sharding, tensor = sharding_of(leaf), sources[0]
    whole = len(sharding.device_set) == 1 or sharding.is_fully_replicated
    if whole and _staging(sharding) and not tensor.packed:
        if _joined(sharding) and _local(tensor):
            turned = isinstance(transform, transpose)
            return Mapped(step, sources, leaf, _axes(step, tensor) if turned else None)
        kind = StagedTransposed if isinstance(transform, transpose) else Staged
        staged = kind(step, sources, leaf, piece)
        if staged.own() <= RING_MOST:  # (else read into a buffer of its own, as below)
            return staged
    if isinstance(transform, transpose):
        return Transposed(step, sources, leaf)
    return (Whole if whole else Blocks)(step, sources, leaf)


def _one_to_one(step: Step, sources: list[Tensor], leaves: Mapping[str, Any]) -> Any:
    """The leaf of a step from one tensor to one leaf (named as the step names it) of the
    tensor's dtype, which JAX holds as it is, and so read straight into it; or None."""
    wanted = [name for name in step.targets if name in leaves]
    if len(sources) == 1 == len(wanted) and wanted[0] == step.targets[0]:
        leaf, dtype = leaves[wanted[0]], sources[0].dtype
        if dtype == spec_of(leaf)[1] == jax.dtypes.canonicalize_dtype(dtype):
            return leaf
    return None


# How a load stages tensors onto devices that copy host memory (`Staged`, `Ring`), read
# when each load begins (bench/FINDINGS.md section 14 measured others: none 3% faster)
MAPPED_START = 8  # the readers a load with mapped steps (`Mapped`, `maps`) starts with (on a
# TPU v5e four were 7-15% faster than two; with the reader threads kept across loads, eight
# were 6% faster than four into FP8 loads of 0.5 GiB, the same on 1 GiB as it is, where four
# had been 5% faster while each load started its threads; `Readers` grows from there)
RING = 8  # the staging buffers, taken in turns
RING_MOST = 256 * 2**20  # the most bytes of one (a tensor that needs more: a buffer of its own)
STAGE_PIECE = 8 * 2**20  # the most bytes of a piece of a tensor (whole rows, at least one)
DIVISORS = 4096  # the most piece sizes tried for one that divides a tensor's rows


def _staging(sharding: Any) -> bool:
    """Whether a leaf on `sharding` is read through the staging ring: its devices copy
    host memory (none is a CPU device, which adopts a buffer instead)."""
    return all(device.platform != "cpu" for device in sharding.device_set)


def _plain(tensor: Tensor) -> bool:
    """Whether `tensor` is in a local file (`_local`), in a dtype JAX holds as it is."""
    return _local(tensor) and tensor.dtype == jax.dtypes.canonicalize_dtype(tensor.dtype)


def _local(tensor: Tensor) -> bool:
    """Whether `tensor` is in a local file, whose pages can be mapped (`Mapped`); else in
    object storage."""
    return isinstance(tensor.file, Path)


def _joined(sharding: Any) -> bool:
    """Whether a staged leaf on `sharding` is staged in pieces joined on its devices: they
    are this process's alone (a program writing pieces into place would be each process's
    own, entered in any order by its readers); else whole, in one piece."""
    return sharding.is_fully_addressable


SMALL = 4096  # a renamed tensor of at most this many bytes is read with its neighbours
BATCH = 64 * 1024  # the most bytes of small tensors read together (and the most steps:
BATCH_STEPS = 256  # tensors of no bytes take none)


def _units(load: Load, ways: list[Way]) -> list[Way]:
    """The ways a reader takes at a time, in order: runs of small tensors read whole as
    `Batch`es, a tensor read into its stacked leaf's host buffer as `InStack`, and every
    other way as it is."""
    units: list[Way] = []
    run: list[Way] = []
    held = 0
    for way in ways:
        tensor = way.sources[0]
        as_stored = type(way) in (Whole, Staged) or (type(way) is Mapped and way.perm is None)
        small = as_stored and tensor.nbytes <= SMALL and not tensor.packed
        if run and (not small or held + tensor.nbytes > BATCH or len(run) == BATCH_STEPS):
            units.append(Batch(run) if len(run) > 1 else _in_stack(load, run[0]))
            run, held = [], 0
        if small:
            run.append(way)
            held += tensor.nbytes
        else:
            units.append(_in_stack(load, way))
    if run:
        units.append(Batch(run) if len(run) > 1 else _in_stack(load, run[0]))
    return units


def _in_stack(load: Load, way: Way) -> Way:
    """`way`, or for a tensor read straight into its stacked leaf's host buffer, `InStack`."""
    layers = load.layers
    if isinstance(way, Whole | Transposed) and layers is not None:
        if layers.in_place(way.step.targets[0], way.sources[0]):
            return InStack(way)
    return way


def _sizes(transforming: list[Transformed], buffers: int) -> list[int]:
    """The bytes of each of `buffers` scratch buffers that the `transforming` ways take in
    turns: the most that one of its ways reads."""
    sizes = [0] * buffers
    for k, way in enumerate(transforming):
        sizes[k % buffers] = max(sizes[k % buffers], Scratch.bytes_for(way.sources))
    return sizes


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


def _stages(transform: Transform) -> list[Transform]:
    """The transforms one after the other that `transform` runs (a chain's, flattened)."""
    if isinstance(transform, identity):
        return []
    if isinstance(transform, chain):
        return [s for t in transform.transforms for s in _stages(t)]
    return [transform]


def _nbytes(spec: Any) -> int:
    if isinstance(spec, Parameter):  # (unpacked parts: their own bytes)
        return spec.nbytes
    return math.prod(spec.shape) * np.dtype(spec.dtype).itemsize
