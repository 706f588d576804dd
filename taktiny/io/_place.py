"""Reading and placing a load's steps: a renamed tensor read block by block onto its
leaf's devices, or a transforming step's sources read into a reused scratch buffer,
transformed by XLA and placed (a float array for a quantized parameter quantized as it is
placed)."""

from __future__ import annotations

import mmap
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _errors as err
from .. import _values
from .._abstract import default_device
from .._quant import QArray, quantize_like
from ..convert._coverage import Step
from ..convert._transforms import identity
from . import _read
from ._checks import _spec
from ._read import Tensor


def _direct(step: Step, sources: list[Tensor], leaves: Mapping[str, Any]) -> Any:
    """The leaf a step fills with a tensor as it is on disk (a rename, same dtype), or None."""
    wanted = [name for name in step.targets if name in leaves]
    if isinstance(step.rule.transform, identity) and len(sources) == 1 == len(wanted):
        leaf = leaves[wanted[0]]
        if sources[0].dtype == _spec(leaf)[1] and wanted[0] == step.targets[0]:
            return leaf
    return None


def _transform(
    step: Step,
    read: list[np.ndarray],
    leaves: Mapping[str, Any],
    quantized: Mapping[str, QArray],
    scratch: _Scratch,
    where: str,
) -> dict[str, Any]:
    """A transforming step's targets, made from its sources (read into `scratch`) by XLA
    on the default device and placed on their leaves' shardings; a float array made for a
    quantized parameter is quantized as it is, and its parts placed."""
    count = None if step.rule.gathered else len(step.targets)
    here = jax.sharding.SingleDeviceSharding(default_device())
    results = step.rule.transform(tuple(jax.device_put(a, here) for a in read), count)
    out: dict[str, Any] = {}
    problems: list[err.StateProblem] = []
    for name, result in zip(step.targets, results, strict=True):
        like = quantized.get(name)
        if like is not None:  # checked and cast as for the float model, then quantized
            logical = jax.ShapeDtypeStruct(like.shape, like.dtype)
            result = _values.convert(name, result, logical, problems)
            if result is None:
                continue
            q = quantize_like(result, like, name)
            made = [(f"{name}.value", q.value), (f"{name}.scale", q.scale)]
        else:
            made = [(name, result)] if name in leaves else []
        for part, value in made:
            value = _values.convert(part, value, leaves[part], problems)
            if value is None:
                continue
            target = _sharding(leaves[part])
            if not target.is_fully_addressable:  # it spans processes: each places its own
                value = np.asarray(value)  # devices' parts of the (equal) host value
            value = jax.device_put(_values.placeable(value), target)
            out[part] = jnp.copy(value) if scratch.holds(value) else value  # (an identity)
    jax.block_until_ready(out)  # the scratch is free again once the results exist
    if problems:
        raise err.StateDictError(where, problems)
    return out


class _Scratch:
    """One read buffer, reused by every transforming step: its sources are read into it
    (populated once, so its pages do not fault again), placed (JAX adopts them on CPU),
    transformed into arrays of their own, and the buffer is free for the next step."""

    def __init__(self) -> None:
        self.memory: Any = None
        self.start = self.size = 0

    def read(
        self, tensors: Sequence[Tensor], verify: bool
    ) -> tuple[list[np.ndarray], list[tuple[Tensor, Any]]]:
        """The tensors read into the buffer, and with `verify` the checks still to make:
        each tensor with its bytes, for :meth:`Tensor.check` (made by the caller, so that
        hashing one step overlaps reading the next)."""
        sizes = [-(-t.nbytes // 64) * 64 for t in tensors]  # each at a multiple of 64
        if sum(sizes) > self.size:
            self.size = sum(sizes)
            self.memory = mmap.mmap(-1, self.size, flags=_read.MAP_FLAGS)
            self.start = np.frombuffer(self.memory, np.uint8).ctypes.data
        view, at, out, checks = memoryview(self.memory), 0, [], []
        for tensor, size in zip(tensors, sizes, strict=True):
            if size:
                out.append(tensor.read_into(view[at : at + size], verify=False))
                if verify:
                    checks.append((tensor, view[at : at + tensor.nbytes]))
            else:
                out.append(tensor.read(verify=False))
            at += size
        return out, checks

    def holds(self, array: jax.Array) -> bool:
        """Whether `array` uses the buffer's memory (a result that is one of its sources)."""
        end = self.start + self.size
        for shard in array.addressable_shards:
            if shard.device.platform == "cpu" and shard.data.size:
                if self.start <= shard.data.unsafe_buffer_pointer() < end:
                    return True
        return False


def _sharding(leaf: Any) -> Any:
    sharding = getattr(leaf, "sharding", None)
    return sharding or jax.sharding.SingleDeviceSharding(default_device())


def _by_device(
    tensor: Tensor, sharding: Any, verify: bool
) -> tuple[jax.Array, list[tuple[Tensor, Any]]]:
    """`tensor` placed on `sharding`, each distinct block read once into its own buffer;
    and with `verify`, the check still to make of a tensor read whole (see
    `_Scratch.read`). A block read verifies the whole tensor first, streaming it."""
    if tensor.nbytes == 0:
        return jax.device_put(np.zeros(tensor.shape, tensor.dtype), sharding), []
    if sharding.is_fully_replicated:
        if tensor.packed:  # the bytes to check are the packed ones: checked as it unpacks
            return jax.device_put(tensor.read(verify=verify), sharding), []
        whole = tensor.read(verify=False)
        return jax.device_put(whole, sharding), [(tensor, whole)] if verify else []
    if verify:
        tensor.verify()
    blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(tensor.shape).items():
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, tensor.shape, strict=True))
        if bounds not in blocks:
            blocks[bounds] = tensor.read([slice(*b) for b in bounds], verify=False)
        arrays.append(jax.device_put(blocks[bounds], device))
    return jax.make_array_from_single_device_arrays(tensor.shape, sharding, arrays), []
