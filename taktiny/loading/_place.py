"""Reading and placing a load's steps: a renamed tensor read into its leaf's own buffers
(whole, or the blocks of this process's devices together) and placed on its devices; a
transposed one read piece by piece into its leaf's buffer; or a transforming step's
sources read into a reused scratch buffer, transformed by XLA and placed (a float array
for a quantized parameter quantized as it is placed)."""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from .._problems import Problems
from ..arrays import default_device
from ..convert import Step, dequantize_blocks, transpose
from ..io import MAP_FLAGS, Tensor
from ..quant import Parameter
from ..state import checked_value, placeable
from ..state import problems as err
from ._checks import spec_of
from ._record import Load


def _canonical(names: Sequence[str], read: list[Any], problems: Problems) -> list[Any]:
    """The tensors read, those of a 64-bit dtype cast to what JAX holds them in without
    x64 (int32, float32, ...) when every value survives; a problem for each that does not
    (JAX itself would wrap 2**40 + 5 to 5, or turn 1e300 into inf, without a word)."""
    out: list[Any] = []
    for name, array in zip(names, read, strict=True):
        dtype = jax.dtypes.canonicalize_dtype(array.dtype)
        if dtype != array.dtype:
            array = checked_value(name, array, jax.ShapeDtypeStruct(array.shape, dtype), problems)
        out.append(array)
    return out


def transformed(load: Load, step: Step, read: list[Any], scratch: Scratch | None) -> dict[str, Any]:
    """A transforming step's targets, made from its sources (read into `scratch`, or, with
    None, by the step's reader: on the default device, or FP8 blocks' mapped pages) by XLA
    on the default device and placed on their leaves' shardings; a float array made for a
    quantized parameter is quantized as it is, and its parts placed."""
    leaves, quantized, where = load.leaves, load.quantized, load.where
    count = None if step.rule.gathered else len(step.targets)
    here = jax.sharding.SingleDeviceSharding(default_device())
    problems = Problems()
    read = _canonical(step.sources, read, problems)
    if problems:
        raise err.StateDictError(where, problems)
    # read by the step's reader (`Transformed.maps`): on the default device already, or
    # host arrays that FP8 blocks' program copies as its arguments (`Fp8Blocks._source`)
    arrays = tuple(read) if scratch is None else tuple(jax.device_put(a, here) for a in read)
    blocks = step.rule.transform
    if isinstance(blocks, dequantize_blocks):  # FP8 blocks, read laid out: one XLA program
        results: Any = [_fp8_placed(blocks, arrays, step.targets[0], load, scratch is not None)]
    else:
        results = step.rule.transform(arrays, count)
    out: dict[str, Any] = {}
    for name, result in zip(step.targets, results, strict=True):
        like = quantized.get(name)
        made: list[tuple[str, Any]] = []
        if isinstance(result, list):  # made for its leaf, or its parts, already
            made = result
        elif isinstance(result, Parameter):  # made quantized (a compressed-tensors module):
            if like is not None:  # its parts as they are, in the layout the plan checked
                made = result.named_parts(name)
            elif name in leaves:  # or dequantized into the float leaf's dtype
                made = [(name, result.to_float(spec_of(leaves[name])[1]))]
        elif like is not None:  # checked and cast as for the float model, then quantized
            logical = jax.ShapeDtypeStruct(like.shape, like.dtype)
            result = checked_value(name, result, logical, problems)
            if result is None:
                continue
            made = like.from_float(result, name).named_parts(name)
        elif name in leaves:
            made = [(name, result)]
        for part, value in made:
            value = checked_value(part, value, leaves[part], problems)
            if value is None:
                continue
            target = sharding_of(leaves[part])
            if target.is_fully_addressable:
                value = jax.device_put(placeable(value), target)
            else:  # it spans processes: each places its own devices' parts of the (equal)
                value = placed(np.asarray(value), target)  # host value
            held = scratch is not None and scratch.holds(value)
            out[part] = jnp.copy(value) if held else value  # (an identity)
    if scratch is not None:
        jax.block_until_ready(out)  # the scratch is free again once the results exist
    if problems:
        raise err.StateDictError(where, problems)
    return out


def _fp8_placed(
    blocks: dequantize_blocks, arrays: tuple[Any, ...], name: str, load: Load, laid_out: bool
) -> list[Any]:
    """The (name, array) pairs a step of FP8 blocks places: the product in its leaf's
    dtype, or a quantized parameter's parts (the weights read `laid_out` by the transform
    into a scratch buffer, else as stored: ``dequantize_blocks.placed``)."""
    like = load.quantized.get(name)
    weights, scales = arrays
    if like is not None:
        parts = blocks.placed(weights, scales, like.dtype, like, laid_out)
        return list(zip(like.part_names(name), parts, strict=True))
    if name not in load.leaves:
        return []
    return [(name, blocks.placed(weights, scales, spec_of(load.leaves[name])[1], None, laid_out))]


class Scratch:
    """One read buffer, reused by every transforming step: its sources are read into it
    (populated once, so its pages do not fault again), placed (JAX adopts them on CPU),
    transformed into arrays of their own, and the buffer is free for the next step.

    It is mapped once, at its first read, as large as the most that any of its steps reads
    (`size`, worked out from the headers: :meth:`bytes_for` of each step's sources). Grown
    step by step, it would hold the smaller memory beside the larger one: JAX lets go of
    the arrays it adopted from a buffer only at its next garbage collection. (A step that
    needs more than `size` still gets it: the buffer is mapped again, larger.)

    Args:
        size: the bytes the largest of its steps reads.
    """

    def __init__(self, size: int, huge: bool = False) -> None:
        self.memory: Any = bytearray()  # (a step of zero-size tensors alone allocates none)
        self.start = self.size = 0
        self.capacity, self.huge = size, huge

    @staticmethod
    def bytes_for(tensors: Sequence[Tensor]) -> int:
        """The bytes a step reading `tensors` takes of a buffer: each at a multiple of 64."""
        return sum(-(-t.nbytes // 64) * 64 for t in tensors)

    def read(
        self, tensors: Sequence[Tensor], verify: bool, perm: Sequence[int] | None = None
    ) -> list[np.ndarray]:
        """The tensors read into the buffer; with `verify`, each one's bytes hashed piece
        by piece as they are read, and checked; with `perm`, the first one's axes permuted
        as it is read (:meth:`Tensor.read_transposed`)."""
        view, at, out = self.view(self.bytes_for(tensors)), 0, []
        for k, tensor in enumerate(tensors):
            size = self.bytes_for([tensor])
            if size and k == 0 and perm is not None:
                shape = tuple(tensor.shape[p] for p in perm)
                into = np.frombuffer(view[at : at + size], tensor.dtype, math.prod(shape))
                out.append(tensor.read_transposed(perm, verify=verify, out=into.reshape(shape)))
            elif size:
                out.append(tensor.read_into(view[at : at + size], verify=verify))
            else:
                out.append(tensor.read(verify=False))
            at += size
        return out

    def view(self, nbytes: int) -> memoryview:
        """The buffer's first `nbytes`, mapped at the first call (as large as `size`, or
        `nbytes` when more) with its pages faulted at once: in huge pages (2 MiB, where
        the kernel has them to give) for a buffer made `huge`."""
        if nbytes > self.size:
            self.memory = bytearray()  # (let go first: not held beside the larger one)
            self.size = max(nbytes, self.capacity)
            self.memory = _mapped(self.size, self.huge)
            self.start = np.frombuffer(self.memory, np.uint8).ctypes.data
        return memoryview(self.memory)[:nbytes]

    def holds(self, array: jax.Array) -> bool:
        """Whether `array` uses the buffer's memory (a result that is one of its sources)."""
        return adopted(array, self.start, self.size)


def adopted(array: jax.Array, start: int, size: int) -> bool:
    """Whether a shard of `array` is the host memory of `size` bytes at address `start`
    (a CPU device adopts host memory it is given instead of copying it)."""
    for shard in array.addressable_shards:
        if shard.device.platform == "cpu" and shard.data.size:
            if start <= shard.data.unsafe_buffer_pointer() < start + size:
                return True
    return False


def _mapped(size: int, huge: bool) -> mmap.mmap:
    """`size` bytes of fresh anonymous memory, page-aligned, every page faulted now; with
    `huge`, asked for in huge pages first (``MADV_HUGEPAGE``: one fault each 2 MiB instead
    of each 4 KiB, where the kernel's transparent huge pages allow it, else small ones)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if not huge or advice is None or not _huge_pages():
        return mmap.mmap(-1, size, flags=MAP_FLAGS)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # (refused: small pages)
        memory.madvise(advice)
    np.frombuffer(memory, np.uint8)[:: mmap.PAGESIZE] = 0  # each page faulted, as populated
    return memory


@functools.cache
def _huge_pages() -> bool:
    """Whether the kernel gives transparent huge pages to memory that asks for them (a
    kernel without them, or a sandbox's, has no such setting: the buffer is then mapped
    and faulted in one call, which is cheaper there than one fault each page)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False


def sharding_of(leaf: Any) -> Any:
    sharding = getattr(leaf, "sharding", None)
    return sharding or jax.sharding.SingleDeviceSharding(default_device())


def placed_by_device(tensor: Tensor, sharding: Any, verify: bool) -> jax.Array:
    """`tensor` placed on `sharding`: read whole when every device holds all of it;
    otherwise the distinct blocks this process's devices hold read together, each byte
    they need once (:meth:`Tensor.read_blocks`), each block into its own buffer. With
    `verify`, checked against its checksum as :meth:`Tensor.read_blocks` says."""
    if tensor.nbytes == 0:
        return placed(np.zeros(tensor.shape, tensor.dtype), sharding)
    if sharding.is_fully_replicated:
        return placed(tensor.read(verify=verify), sharding)
    where = {
        device: tuple(s.indices(n)[:2] for s, n in zip(index, tensor.shape, strict=True))
        for device, index in sharding.addressable_devices_indices_map(tensor.shape).items()
    }
    blocks = list(dict.fromkeys(where.values()))
    read = dict(zip(blocks, tensor.read_blocks(blocks, verify=verify), strict=True))
    arrays = jax.device_put([read[b] for b in where.values()], list(where))
    return jax.make_array_from_single_device_arrays(tensor.shape, sharding, arrays)


def placed_together(arrays: Sequence[np.ndarray], leaves: Sequence[Any]) -> list[jax.Array]:
    """Small tensors read together (`read_together`), each placed whole with its leaf's
    sharding by one batched transfer. The load's own thread makes it: transfers made from
    two threads at once only queue for each other."""
    return jax.device_put(list(arrays), [sharding_of(leaf) for leaf in leaves])


def placed_transposed(step: Step, tensor: Tensor, leaf: Any, verify: bool) -> jax.Array:
    """`tensor` with its axes permuted by the step's transpose, read piece by piece into
    place (:meth:`Tensor.read_transposed`, checked as it is read with `verify`), then
    placed with `leaf`'s sharding."""
    perm = cast(transpose, step.rule.transform).perm
    return placed(tensor.read_transposed(perm, verify=verify), sharding_of(leaf))


def placed(host: np.ndarray, sharding: Any) -> jax.Array:
    """The host array `host` placed on `sharding`. One that spans processes takes from each
    process its own devices' parts (``jax.make_array_from_callback``): ``jax.device_put``
    would first compare the array across the processes, a collective, which reader
    threads placing several tensors at once would enter in another order in each process
    (and wait on each other's for ever)."""
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
