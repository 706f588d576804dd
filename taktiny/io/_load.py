"""Streaming a safetensors checkpoint into a model, tensor by tensor.

Every name, shape and dtype is checked from the headers before a byte of data is read.
Then each tensor is read into memory Taktiny owns and placed with its leaf's sharding at
once, so the host holds one tensor at a time. A tensor the rules only rename, loaded into
a leaf of its own dtype, is read device by device: each device's block of bytes goes into
a buffer of its own, and the blocks become one array with
``jax.make_array_from_single_device_arrays``. Anything a rule transforms is read whole,
transformed with NumPy and placed with ``jax.device_put``.
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _errors as err
from .. import _state, _tree, _values
from .._abstract import default_device
from ..convert._convert import check_ties
from ..convert._coverage import Step, check_allow, plan
from ..convert._rules import AnyRule, Rule
from ..convert._transforms import identity
from . import _read
from ._read import Checkpoint, Readahead, Tensor, open_safetensors

PROGRESS_BYTES = 256 * 2**20  # loads of more bytes than this show a progress bar by default


def load_safetensors(
    model: Any,
    path: str | os.PathLike[str] | Checkpoint,
    *,
    rules: Sequence[AnyRule] | None = None,
    allow: Mapping[str, Sequence[str]] | None = None,
    strict: bool = True,
    progress: bool | None = None,
) -> Any:
    """Returns `model` with its parameters read from a safetensors checkpoint, streamed
    tensor by tensor straight onto each leaf's devices.

    `model` may be abstract (``jax.eval_shape`` or :func:`taktiny.eval_shape`), so nothing
    is initialised only to be overwritten: each leaf is placed with its ``sharding``, or
    on the default device when it has none. Before any data is read, every name, shape and
    dtype kind is checked from the headers, with one error listing every problem. The host
    holds about one tensor at a time; the model's own arrays are the only full copy.

    Args:
        model: a module or any PyTree, concrete or abstract; it is not changed.
        path: a ``.safetensors`` file, a ``*.safetensors.index.json``, a folder holding one
            of them (see :func:`open_safetensors`), or an opened :class:`Checkpoint`.
        rules: conversion rules (:mod:`taktiny.convert`) from the checkpoint's names to the
            model's, applied tensor by tensor. Without rules the names must be the model's
            own flat names (:func:`taktiny.flat_state_dict`).
        allow: with `rules`, problems to let through, as :func:`taktiny.convert.check`
            takes them (``{"missing": ["head.*"]}``; load those with ``strict=False``).
        strict: whether every leaf of the model must be loaded. With ``False`` the leaves
            not in the checkpoint keep their values (an abstract model cannot: it has none).
        progress: show a progress bar (tqdm, installed with ``taktiny[safetensors]``);
            ``None`` shows one for checkpoints over 256 MiB.

    Returns:
        A new model of the same structure, holding the checkpoint's values cast to each
        leaf's dtype (within its dtype kind, as every load casts).

    Raises:
        taktiny.StateDictError: without `rules`, naming every unknown, missing, misshapen
            or mistyped name (unknown names are errors even with ``strict=False``: add a
            rule that ignores them).
        taktiny.convert.ConversionError: with `rules`, as :func:`taktiny.convert.check`.
        SafetensorsError: for a corrupt checkpoint, naming the file and tensor.
    """
    where = f"taktiny.io.load_safetensors({type(model).__name__})"
    if rules is None and allow is not None:
        raise ValueError(f"{where}: allow= applies to rules; pass rules= with it.")
    checkpoint = path if isinstance(path, Checkpoint) else open_safetensors(path)
    leaves = _tree.flat_state_dict(model)
    if rules is None:
        steps = _plain(checkpoint, leaves, strict, where)
    else:
        report, ties = plan(rules, checkpoint, leaves, check_allow(allow), where)
        check_ties(ties, checkpoint, where)
        steps = list(report.steps)
    problems = _absent(leaves, {t for s in steps for t in s.targets}, strict)
    if problems:
        raise err.StateDictError(where, problems)
    steps.sort(key=lambda s: min((str(t.file), t.offset) for t in _tensors(checkpoint, s)))
    total = sum(t.nbytes for s in steps for t in _tensors(checkpoint, s))
    order = [t for step in steps for t in _tensors(checkpoint, step)]
    starts = list(itertools.accumulate((len(s.sources) for s in steps), initial=0))
    scratch = (_Scratch(), _Scratch())  # step k reads into k % 2 while k - 1 transforms
    placed: dict[str, Any] = {}

    def read(k: int) -> Any:  # in the reader thread: preadv, mmap and XLA release the GIL
        ahead.reached(starts[k])  # the disk reads on while this step is read and placed
        step = steps[k]
        sources = _tensors(checkpoint, step)
        leaf = _direct(step, sources, leaves)
        if leaf is not None:  # renamed only: read and placed block by block, here
            return {step.targets[0]: _by_device(sources[0], _sharding(leaf))}
        return scratch[k % 2].read(sources)

    with (
        _bar(progress, total, checkpoint) as bar,
        Readahead(order) as ahead,
        ThreadPoolExecutor(1, thread_name_prefix="taktiny-read") as reader,
    ):
        pending = reader.submit(read, 0) if steps else None
        for k, step in enumerate(steps):
            assert pending is not None
            data = pending.result()
            pending = reader.submit(read, k + 1) if k + 1 < len(steps) else None
            if isinstance(data, dict):
                placed.update(data)
            else:
                placed.update(_transform(step, data, leaves, scratch[k % 2], where))
            bar.update(sum(checkpoint[n].nbytes for n in step.sources))
    return _state.load(model, placed, strict=strict, flat=True, nodes=_tree.NODES, caller=where)


def _tensors(checkpoint: Checkpoint, step: Step) -> list[Tensor]:
    return [checkpoint[name] for name in step.sources]


def _plain(
    checkpoint: Checkpoint, leaves: Mapping[str, Any], strict: bool, where: str
) -> list[Step]:
    """One renaming step per tensor, when the checkpoint uses the model's own names; every
    problem with the names, shapes and dtype kinds in one StateDictError."""
    problems: list[err.StateProblem] = []
    unknown = [(name, checkpoint[name]) for name in checkpoint if name not in leaves]
    problems += err.unknown(unknown, list(leaves), True, set(checkpoint))
    steps = []
    for name, tensor in checkpoint.items():
        leaf = leaves.get(name)
        if leaf is None:
            continue
        shape, dtype = _spec(leaf)
        if tuple(tensor.shape) != shape:
            problems.append(err.shape(name, shape, tuple(tensor.shape)))
        elif _values.kind(tensor.dtype) != _values.kind(dtype):
            want, have = _values.kind(dtype), _values.kind(tensor.dtype)
            problems.append(err.dtype_kind(name, dtype, tensor.dtype, str(want), str(have)))
        else:
            steps.append(Step(_IDENTITY, (name,), (name,)))
    problems += _absent(leaves, set(checkpoint), strict)
    if problems:
        raise err.StateDictError(where, problems)
    return steps


_IDENTITY = Rule("{name}", "{name}")


def _absent(leaves: Mapping[str, Any], loaded: set[str], strict: bool) -> list[err.StateProblem]:
    """The leaves not loaded that must be: all of them under strict=True, and those of an
    abstract model (they have no value to keep); checked before anything is read."""
    absent = [name for name in leaves if name not in loaded]
    if strict:
        return [err.missing(name) for name in absent]
    return [err.abstract(n) for n in absent if isinstance(leaves[n], jax.ShapeDtypeStruct)]


def _spec(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    dtype = getattr(leaf, "dtype", None)
    return tuple(np.shape(leaf)), np.dtype(dtype) if dtype is not None else np.result_type(leaf)


def _direct(step: Step, sources: list[Tensor], leaves: Mapping[str, Any]) -> Any:
    """The leaf a step fills with a tensor as it is on disk (a rename, same dtype), or None."""
    wanted = [name for name in step.targets if name in leaves]
    if isinstance(step.rule.transform, identity) and len(sources) == 1 == len(wanted):
        leaf = leaves[wanted[0]]
        if sources[0].dtype == _spec(leaf)[1] and wanted[0] == step.targets[0]:
            return leaf
    return None


def _transform(
    step: Step, read: list[np.ndarray], leaves: Mapping[str, Any], scratch: _Scratch, where: str
) -> dict[str, Any]:
    """A transforming step's targets, made from its sources (read into `scratch`) by XLA
    on the default device and placed on their leaves' shardings."""
    count = None if step.rule.gathered else len(step.targets)
    here = jax.sharding.SingleDeviceSharding(default_device())
    results = step.rule.transform(tuple(jax.device_put(a, here) for a in read), count)
    out: dict[str, Any] = {}
    problems: list[err.StateProblem] = []
    for name, value in zip(step.targets, results, strict=True):
        if name not in leaves:
            continue
        value = _values.convert(name, value, leaves[name], problems)
        if value is None:
            continue
        target = _sharding(leaves[name])
        if not target.is_fully_addressable:  # it spans processes: each places its own
            value = np.asarray(value)  # devices' parts of the (equal) host value
        value = jax.device_put(_values.placeable(value), target)
        out[name] = jnp.copy(value) if scratch.holds(value) else value  # (an identity)
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

    def read(self, tensors: Sequence[Tensor]) -> list[np.ndarray]:
        sizes = [-(-t.nbytes // 64) * 64 for t in tensors]  # each at a multiple of 64
        if sum(sizes) > self.size:
            self.size = sum(sizes)
            self.memory = mmap.mmap(-1, self.size, flags=_read.MAP_FLAGS)
            self.start = np.frombuffer(self.memory, np.uint8).ctypes.data
        view, at, out = memoryview(self.memory), 0, []
        for tensor, size in zip(tensors, sizes, strict=True):
            out.append(tensor.read_into(view[at : at + size]) if size else tensor.read())
            at += size
        return out

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


def _by_device(tensor: Tensor, sharding: Any) -> jax.Array:
    """`tensor` placed on `sharding`, each distinct block read once into its own buffer."""
    if tensor.nbytes == 0:
        return jax.device_put(np.zeros(tensor.shape, tensor.dtype), sharding)
    if sharding.is_fully_replicated:
        return jax.device_put(tensor.read(), sharding)
    blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(tensor.shape).items():
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, tensor.shape, strict=True))
        if bounds not in blocks:
            blocks[bounds] = tensor.read([slice(*b) for b in bounds])
        arrays.append(jax.device_put(blocks[bounds], device))
    return jax.make_array_from_single_device_arrays(tensor.shape, sharding, arrays)


class _Silent:
    def update(self, count: int) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _bar(progress: bool | None, total: int, checkpoint: Checkpoint) -> Any:
    if progress is False or (progress is None and total <= PROGRESS_BYTES):
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if progress is None:
            return _Silent()
        raise ImportError(
            "taktiny.io.load_safetensors(progress=True) shows its bar with tqdm: pip install "
            "'taktiny[safetensors]' (or tqdm), or pass progress=False."
        ) from None
    name = checkpoint.path.name
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=name)
