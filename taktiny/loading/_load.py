"""Streaming a safetensors checkpoint into a model, tensor by tensor.

Every name, shape and dtype is checked from the headers before a byte of data is read.
Then each tensor is read into memory Taktiny owns and placed with its leaf's sharding at
once; several readers read several tensors at a time, as many as make the reads faster
(`Readers`). A tensor the rules only rename, loaded into a leaf of its own dtype, is read
into the leaf's own buffers: whole, or the blocks this process's devices hold read
together, each becoming its device's shard (``jax.make_array_from_single_device_arrays``);
a tensor the rules only transpose is read into its leaf's buffer piece by piece. Onto
devices that copy host memory (a TPU, a GPU), a tensor in a local file is not read but
mapped and copied from the page cache (`Mapped`), one in object storage staged through a
ring of reused buffers (`Staged`). Anything
else a rule transforms is read whole into a reused buffer, transformed by XLA and placed
with ``jax.device_put``. A float tensor loaded into a quantized parameter (a `QArray`) is
quantized as it is placed, so a quantizing load holds one float tensor at a time besides
the quantized model. FP8 blocks (``convert.dequantize_blocks``) are read with their weights
already transposed, a byte each, and dequantized into the leaf's dtype (or quantized
again) by one XLA program. Under a budget (``max_host_bytes``, `_budget`), a step starts only
while what the load holds beyond the model's arrays stays within it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import jax

from ..arrays import default_device
from ..convert import AnyRule
from ..io import (
    RETRIES,
    Checkpoint,
    Replaced,
    Storage,
    Tensor,
    aligned_buffer,
    byte_size,
    result_of,
    stop_reads,
)
from ..state import Stacker
from ._budget import Budget
from ._place import Scratch
from ._readers import Readahead, Readers, reader_pool
from ._record import loaded, migrated, open_load, parts_of, unkept
from ._release import release
from ._steps import steps_of
from ._ways import Ways

PROGRESS_BYTES = 256 * 2**20  # loads of more bytes than this show a progress bar by default


def load_safetensors(
    model: Any,
    path: str | os.PathLike[str] | Checkpoint,
    *,
    rules: Sequence[AnyRule] | None = None,
    allow: Mapping[str, Sequence[str]] | None = None,
    strict: bool = True,
    progress: bool | None = None,
    verify: bool = True,
    max_host_bytes: int | str | None = None,
) -> Any:
    """Returns `model` with its parameters read from a safetensors checkpoint, streamed
    tensor by tensor straight onto each leaf's devices.

    `model` may be abstract (``jax.eval_shape`` or :func:`taktiny.eval_shape`), so nothing
    is initialised only to be overwritten: each leaf is placed with its ``sharding``, or
    on the default device when it has none. Before any data is read, every name, shape and
    dtype kind is checked from the headers, with one error listing every problem. The host
    holds about one tensor at a time; the model's own arrays are the only full copy. A
    load of a path that a save replaces meanwhile gives the checkpoint before the save or
    the one after, whole (see :func:`~taktiny.io.open_safetensors`).

    A stack of layers (:class:`taktiny.nn.Stack`) loads a checkpoint of its stacked
    leaves, or one that names its layers one by one (``layers.3.attention.query.kernel``,
    made by `rules` from a Hugging Face file's ``model.layers.3...``): each layer's tensor
    is then written into its slice of the stacked leaf as it arrives, so the host never
    holds a stacked array beside its parts.

    A quantized model (:func:`taktiny.quantize`) loads a checkpoint of its quantized parts
    (``<name>.value`` and ``<name>.scale``, 4-bit values unpacked), or a float checkpoint:
    a float tensor under the name of a :class:`~taktiny.QArray` (``dense.kernel``, as the
    float model saves it; or made by a rule) is checked against its logical shape, then
    quantized as that QArray is (bits, axis, group size, scale dtype) tensor by tensor,
    giving what ``tt.quantize`` of the float model would. Such a load holds one float
    tensor at a time besides the quantized model.

    Args:
        model: a module or any PyTree, concrete or abstract; it is not changed. Or a
            flat ``{name: array}`` dict, as :func:`~taktiny.io.save_safetensors` saves one
            (``{"encoder.lora_a": ...}``: adapters alone, say), whose keys are the names
            to load; the load then returns a flat dict of the same keys.
        path: a ``.safetensors`` file, a ``*.safetensors.index.json``, a folder holding one
            of them (see :func:`~taktiny.io.open_safetensors`), the same in object storage
            (an ``s3://``, ``gs://``, ``az://`` or ``https://`` URL, read by ranged requests
            in parallel: docs/storage.md), or an opened :class:`~taktiny.io.Checkpoint`.
            A checkpoint at a URL that one save replaces while it is read is read on, whole,
            from the objects that save keeps; one that two saves replace is opened again and
            read whole (an opened Checkpoint is not: its reads raise SafetensorsError).
        rules: conversion rules (:mod:`taktiny.convert`) from the checkpoint's names to the
            model's, applied tensor by tensor. Without rules the names must be the model's
            own flat names (:func:`taktiny.flat_state_dict`), or those of an older state
            version of its class: a checkpoint whose schema records an older version (no
            version: 1) is converted by the class's migrations (:func:`taktiny.migrate`),
            those of each versioned module inside it too, from the versions its schema
            records; checked as rules are, and the parameters they add keep the model's
            values (an abstract model has none: an error names each such parameter).
        allow: with `rules`, problems to let through, as :func:`taktiny.convert.check`
            takes them (``{"unused": ["**.inv_freq"]}``). Leaves no rule makes are not
            `allow`'s but `strict`'s to decide, with rules or without.
        strict: whether every leaf of the model must be loaded. With ``False`` the leaves
            the checkpoint (or the rules) do not make keep their values, with no ``allow``
            needed; an abstract model cannot, having none. Names the model lacks are errors
            either way.
        progress: show a progress bar (tqdm, installed with ``taktiny[safetensors]``);
            ``None`` shows one for checkpoints over 256 MiB.
        verify: check every tensor's bytes against the checksum Taktiny wrote into the
            header when it saved the file (files without checksums, such as Hugging
            Face's, load unchecked). Each piece of a tensor is hashed by the reader that
            read it, as soon as it is read.
        max_host_bytes: the most host memory the load may hold beyond the model's own
            arrays, in bytes (an int, or a string such as ``"512MiB"`` or ``"2GB"``, as
            :func:`~taktiny.io.save_safetensors`' ``max_shard_size``). What counts: the
            scratch buffers, as mapped (one instead of two when two do not fit), and what
            each step holds while it is in flight: a buffer it reads into that is not its
            leaf's own (staging on its way to other devices, the rows read a few MiB at a
            time to be cut or transposed, small tensors read together), the arrays a
            transform makes that are not the leaves (a chain's intermediates, results
            cast, quantized or moved afterwards), and in a stack of layers, each layer
            placed on CPU devices until it is written into its stacked leaf. A step
            starts only while the scratch, the steps in flight and its own bytes stay
            within the budget, and the read-ahead asked of the OS stays within what is
            left (the page cache it fills is the kernel's, not counted). Not counted: the
            model's arrays, which are the result, XLA's working memory inside one
            operation, and the page cache's pages of a local file mapped to be copied onto
            a TPU or a GPU (the kernel's too). A budget too small for one step is refused
            before a byte is read.
            :func:`~taktiny.io.plan_load` says what a load needs (``held_bytes``). None
            (the default): no budget, as many steps in flight as the readers read at
            once.

    Returns:
        A new model of the same structure (for a flat dict, a flat dict of its keys),
        holding the checkpoint's values cast to each leaf's dtype (within its dtype kind,
        as every load casts).

    Raises:
        taktiny.StateDictError: naming every unknown, missing, misshapen or mistyped name
            (unknown names are errors even with ``strict=False``: add a rule that ignores
            them); with `rules` (a ``convert.ConversionError``, its subclass, for one release
            more), as :func:`taktiny.convert.check`; for an older checkpoint, every problem
            of the migrations, naming the one to fix.
        SafetensorsError: for a corrupt checkpoint, naming the file and tensor; for
            damaged bytes, also both checksums. Nothing is returned then.
        ValueError: `allow` without `rules`; a checkpoint saved at a newer state version
            than the model's (or a module's inside it); `rules` for a checkpoint of an older
            version; a model sharded on an abstract mesh (``jax.eval_shape`` of a function
            that shards: use :func:`taktiny.eval_shape`), naming the file and the model.
            With `max_host_bytes`: one step that cannot fit in it beside the scratch
            buffer the load keeps, raised before any tensor is read, naming its tensor
            and leaf, the bytes it needs and the budget to raise to; or a budget that is
            not a positive size.
        TypeError: a flat dict target that names both ``"a"`` and ``"a.b"``, which no
            tree can hold.
        PermissionError: for a URL, a request the store refused, naming the URL and the
            credentials to check.
        ConnectionError: for a URL, a store that kept failing after the retries.
    """
    limit = byte_size(max_host_bytes, "taktiny.io.load_safetensors: max_host_bytes")
    for attempt in itertools.count(1):
        try:
            return _load(model, path, rules, allow, strict, progress, verify, limit)
        except Replaced:  # a save replaced an object of the checkpoint while it was read
            if isinstance(path, Checkpoint) or attempt == RETRIES:
                raise


def _load(
    model: Any,
    path: str | os.PathLike[str] | Checkpoint,
    rules: Sequence[AnyRule] | None,
    allow: Mapping[str, Sequence[str]] | None,
    strict: bool,
    progress: bool | None,
    verify: bool,
    limit: int | None,
) -> Any:
    """`load_safetensors`, once (`limit`: its budget in bytes)."""
    load = open_load(model, path, rules=rules, allow=allow, strict=strict, verify=verify)
    load = migrated(load)
    steps = steps_of(load)
    if (error := unkept(load)) is not None:
        raise error
    ways = Ways(load, steps, limit)
    budget = None if limit is None else Budget(limit, ways)
    if budget is not None and budget.error is not None:
        raise budget.error
    units = ways.units
    order = [t for way in units for t in way.sources]
    starts = list(itertools.accumulate((len(way.sources) for way in units), initial=0))
    sizes = [sum(t.nbytes for t in way.sources) for way in units]
    holder: set[Scratch] = set()  # the scratch buffers holding a step's sources
    readers = Readers(start=ways.start)
    placed: Any = {}
    stacker = None
    if load.layers is not None:  # per-layer names: each slice written into its stacked leaf
        made = {p for s in steps for t in s.targets for p in parts_of(t, load.quantized)}
        placed = stacker = Stacker(load.layers, load.layers.covered(made), aligned_buffer)
    running: dict[int, Future[Any]] = {}
    submitted = 0  # units

    # the caller's default device (`jax.default_device` is the calling thread's own): where
    # the reader threads place a leaf that names no sharding, as the load's thread does
    here = default_device()

    def read(u: int) -> Any:  # in a reader thread: preadv, hashing and XLA release the GIL
        ahead.reached(starts[u])  # the disk reads on while this unit is read and placed
        with jax.default_device(here):
            return units[u].read(verify, stacker)

    # slices placed on devices wait for the load's thread to write them into their stacked
    # leaves: with such stacks, few units in flight, so that the host holds few slices
    # beside the model (on one CPU device, each is read into place)
    layers = load.layers
    width = lambda: readers.width if layers is None else layers.widest(readers.width)

    def start_more() -> None:  # in order, as many as the readers, buffers and budget allow
        nonlocal submitted
        while submitted < len(units) and len(running) < width():
            buffer = units[submitted].scratch
            if buffer is not None and buffer in holder:
                return
            if budget is not None:
                if not budget.fits(submitted):
                    return
                budget.take(submitted)
            if buffer is not None:
                holder.add(buffer)
            running[submitted] = pool.submit(read, submitted)
            submitted += 1

    with (
        contextlib.closing(ways),  # (after the readers: what the staging ring keeps let go)
        _bar(progress, sum(sizes), load.checkpoint) as bar,
        Readahead(order, _ahead(budget, 256 * 2**20)) as ahead,
    ):
        pool = reader_pool()  # (the process's: a load waits for its own reads, not the pool)
        try:
            start_more()
            for u, way in enumerate(units):
                data = result_of(running.pop(u))  # (Ctrl-C stops the wait at once)
                readers.finished(sizes[u])
                ahead.window = _ahead(budget, readers.ahead)
                start_more()
                placed.update(way.place(load, data))
                holder.discard(way.scratch)  # (transformed: its buffer is free)
                if budget is not None:
                    budget.release(u)  # (placed: what it held is free)
                if budget is not None or way.scratch is not None:
                    start_more()
                bar.update(sizes[u])
        except BaseException:  # the reads not started are dropped, those in flight stopped
            stop_reads(_storages(order), running.values())
            raise
    out = loaded(load, placed)  # (each leaf resolved, checked and placed: written in)
    if ways.releases:  # (what JAX holds of the host memory the load read into, let go)
        release(out, _storages(order))
    return out


def _storages(tensors: Sequence[Tensor]) -> list[Storage]:
    """The storages `tensors` are read through, once each."""
    return list({id(t.storage): t.storage for t in tensors if t.storage}.values())


def _ahead(budget: Budget | None, window: int) -> int:
    """The read-ahead window: `window`, within what the budget leaves. (The page cache it
    fills is the kernel's, not the process's; capped all the same, for a storage whose
    read-ahead would fetch into the process.)"""
    room = None if budget is None else budget.room()
    return window if room is None else min(window, room)


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
