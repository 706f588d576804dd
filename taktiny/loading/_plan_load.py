"""A load planned from the checkpoint's headers alone: what :func:`load_safetensors` would
do with each tensor, the bytes each device would hold and each process would read, the
host memory it would need at its peak, and every problem it would raise.

The plan reuses the load's own decisions rather than restating them: the same steps and
checks (`_steps.steps_of`, its error collected instead of raised), the same choice of how
each step is read (`_ways.Ways`), and the byte counts of `Tensor.bytes_read`, which
follows the choices of `Tensor.read_blocks`. Nothing is read but headers: a rule's tied
names, which a load reads and compares, are listed unchecked, and the problems only values
show (a narrowing cast that would overflow, damaged bytes) cannot be known.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._messages import table
from .._problems import StateProblem
from ..convert import AnyRule, ConversionProblem, Step, identity, stages_text
from ..io import Checkpoint, byte_size
from ..quant import Parameter
from ._budget import Budget
from ._checks import spec_of
from ._place import sharding_of
from ._record import migrated, open_load, parts_of, unkept
from ._steps import IDENTITY, results_of, steps_of
from ._ways import Way, Ways


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """What a load does with one step: the tensors it reads, the leaves it fills, and how.

    Attributes:
        sources: the checkpoint's names it reads.
        targets: the model's leaves it fills (a quantized parameter's two parts).
        rule: the rule that makes it (``"same name"`` without rules).
        transform: the rule's transform (``identity()``: a rename).
        way: how it is read: ``"direct"`` (whole into its leaf's buffer), ``"mapped"``
            (a local file's pages copied onto devices that copy host memory, a TPU's or a
            GPU's, and transposed there: no host memory of the load's), ``"staged"``
            (through the load's reused staging buffers, a few MiB of rows at a time,
            onto such devices, and written into place there, transposed there too: a
            tensor in object storage), ``"blocks"`` (each
            device's block into its own buffer), ``"transposed"`` (permuted piece by
            piece into its leaf's buffer), ``"scratch"`` (into a reused buffer, then
            transformed and cast by XLA; onto a default device that copies host memory,
            copied there from a local file's mapped pages instead) or ``"quantized"``
            (the same, then quantized).
        casts: ``(leaf, from dtype, to dtype)`` for each leaf whose dtype is not the one
            the transform makes.
        nbytes: the bytes its sources hold in the file.
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    rule: str
    transform: str
    way: str
    casts: tuple[tuple[str, str, str], ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What :func:`load_safetensors` would do with the same arguments, from the headers.

    Attributes:
        steps: one :class:`PlannedStep` per step, in the order the load reads them.
        device_bytes: bytes each device holds once the model is loaded (every leaf, its
            blocks on its sharding's devices), by device.
        read_bytes: bytes each process reads from the files, by process index (each reads
            its own devices' blocks of a sharded leaf, and every other tensor whole).
        scratch_bytes: the host memory the load needs beyond the model's own arrays, at
            its peak: its scratch buffers (kept to the end), and the temporaries of the
            steps in flight at once: the result of the transform being made (before its
            cast or quantization; one step at a time), and what the load's two readers
            hold of the two steps after it (a whole array cut into another sharding's
            blocks, a 4 MiB piece of a transposed or cut read, a stack's layer placed on
            CPU devices until it is written into its stacked leaf). A load from a fast
            store, which learns to read more steps at once, may hold those of more steps.
        peak_host_bytes: the host memory the load needs at its peak: ``scratch_bytes`` and
            the model's arrays on CPU devices, which live in host memory.
        ties: the tied pairs of names the rules declare; a load reads both and checks
            that they are equal, which the plan does not.
        error: the error the load would raise (:class:`~taktiny.StateDictError`,
            :class:`~taktiny.convert.ConversionError`, :class:`~taktiny.io.SafetensorsError`, or a
            ``ValueError`` for a checkpoint of a newer state version), not raised; None
            when it would load. The steps are then those the headers allow.
        kept: the leaves that keep the model's values: those the migrations of an older
            checkpoint add (:class:`~taktiny.convert.Init`), when the model has values
            for them (an abstract model's are in ``error`` instead).
        migrations: the migrations the load applies to an older checkpoint, in words
            (``"Block's migrations from state version 1 to 2 at 'blocks.0', 'blocks.1'"``);
            None when it applies none.
        held_bytes: the most host memory the load holds at once of what
            ``max_host_bytes`` counts (its scratch buffers and the bytes of the steps in
            flight; see :func:`load_safetensors`), by the load's own order of starts with
            as many readers as it ever uses (16): an upper bound of what it holds, never
            above the budget when one is given. The budget to give a load for it to run
            as it would without one.
        max_host_bytes: the budget planned for, in bytes; None: none. A budget one step
            cannot fit in is the plan's ``error`` (a ``ValueError`` naming the step, the
            bytes it needs and the budget to raise to).
    """

    steps: tuple[PlannedStep, ...]
    device_bytes: Mapping[Any, int]
    read_bytes: Mapping[int, int]
    scratch_bytes: int
    peak_host_bytes: int
    ties: tuple[tuple[str, str], ...]
    error: Exception | None
    kept: tuple[str, ...] = ()
    migrations: str | None = None
    held_bytes: int = 0
    max_host_bytes: int | None = None

    @property
    def problems(self) -> tuple[StateProblem | ConversionProblem | str, ...]:
        """Every problem the load would raise: the error's records (a
        :class:`~taktiny.StateProblem` or :class:`~taktiny.convert.ConversionProblem`
        each), or its message for a checkpoint that cannot be read; empty when it loads."""
        if self.error is None:
            return ()
        return tuple(getattr(self.error, "problems", (str(self.error),)))

    @property
    def ok(self) -> bool:
        """Whether the load would succeed (as far as the headers tell)."""
        return self.error is None

    def __str__(self) -> str:
        rows = [["sources", "targets", "transform", "way", "cast", "bytes"]]
        for s in self.steps:
            casts = ", ".join(f"{a}->{b}" for _, a, b in s.casts) or "-"
            targets = ", ".join(s.targets) if s.targets != s.sources else "(same)"
            transform = "-" if s.transform == repr(identity()) else s.transform
            rows.append([", ".join(s.sources), targets, transform, s.way, casts, f"{s.nbytes:,}"])
        lines = [table(rows)]
        lines.append(f"{len(self.steps)} steps, {sum(s.nbytes for s in self.steps):,} bytes")
        for device, n in self.device_bytes.items():
            lines.append(f"device {device}: holds {n:,} bytes")
        for process, n in self.read_bytes.items():
            lines.append(f"process {process}: reads {n:,} bytes")
        lines.append(
            f"peak host memory: {self.peak_host_bytes:,} bytes "
            f"({self.scratch_bytes:,} beyond the model's arrays)"
        )
        within = "" if self.max_host_bytes is None else f", max_host_bytes {self.max_host_bytes:,}"
        lines.append(
            f"held at once beyond the model's arrays (scratch and steps in flight): "
            f"{self.held_bytes:,} bytes{within}"
        )
        lines += [f"tied, checked when loading: {a} = {b}" for a, b in self.ties]
        if self.migrations is not None:
            lines.append(f"migrated: {self.migrations}")
        if self.kept:
            lines.append(f"kept from the model (added by a migration): {', '.join(self.kept)}")
        if self.error is None:
            lines.append("the load would succeed")
        else:
            lines.append(f"the load would raise {type(self.error).__name__}:")
            lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

    def __repr__(self) -> str:
        said = "ok" if self.error is None else f"{len(self.problems)} problems"
        return (
            f"LoadPlan({len(self.steps)} steps, read={dict(self.read_bytes)}, "
            f"peak_host_bytes={self.peak_host_bytes:,}, {said})"
        )


def plan_load(
    model: Any,
    path: str | os.PathLike[str] | Checkpoint,
    *,
    rules: Sequence[AnyRule] | None = None,
    allow: Mapping[str, Sequence[str]] | None = None,
    strict: bool = True,
    verify: bool = True,
    max_host_bytes: int | str | None = None,
) -> LoadPlan:
    """Plans ``load_safetensors(model, path, ...)`` from the checkpoint's headers, reading
    none of its tensors: before a 100 GB load starts, what each device will hold, what each
    process will read, the host memory it needs, and whether it would fail.

    The plan follows the load's own choices (it shares their code): which tensors are
    read straight into their leaves (whole, or each device's block), which are transposed
    into place piece by piece, which go through the load's scratch buffers (two, or one
    for a quantizing load) to be transformed, cast or quantized. Its problems are those
    the load would raise before reading any data, the same records in the same order.
    A checkpoint of older state versions is planned as the load migrates it: the steps
    its migrations make, the leaves they add in ``kept`` (each an error instead when the
    model is abstract and has no value for it, the other steps still planned).

    Args:
        model: the target, as :func:`load_safetensors` takes it: abstract, sharded or
            quantized (:func:`taktiny.quantize` of an abstract model).
        path: a checkpoint, as :func:`load_safetensors` takes it.
        rules: conversion rules, as :func:`load_safetensors` takes them.
        allow: with `rules`, problems to let through.
        strict: whether every leaf must be loaded.
        verify: whether the load checks checksums (a block read may then read the whole
            tensor first, which `read_bytes` counts).
        max_host_bytes: the load's budget of host memory beyond the model's arrays, as
            :func:`load_safetensors` takes it: the plan follows the load's choices under
            it (one scratch buffer instead of two when two do not fit), says the most the
            load holds of it (``held_bytes``), and, when one step cannot fit in it, has
            the load's refusal as its ``error``.

    Returns:
        A :class:`LoadPlan`; its ``error`` holds what the load would raise.

    Raises:
        SafetensorsError: the checkpoint's headers cannot be read (opening it fails).
        ValueError: `allow` without `rules`; a `max_host_bytes` that is not a positive
            size; a model sharded on an abstract mesh
            (``jax.eval_shape`` of a function that shards: plan
            :func:`taktiny.eval_shape`'s), naming the file and the model. What the load
            would raise besides (a checkpoint of a newer state version, `rules` for one of
            an older version, whose plan is the load its classes' migrations make) is the
            plan's ``error``.
    """
    limit = byte_size(max_host_bytes, "taktiny.io.plan_load: max_host_bytes")
    options = (rules, allow, strict, verify)
    return planned(model, path, options, has_values=False, max_host_bytes=limit)


def planned(
    model: Any,
    path: Any,
    options: tuple[Any, Any, bool, bool],
    *,
    has_values: bool,
    max_host_bytes: int | None = None,
) -> LoadPlan:
    """:func:`plan_load` with its `options` (rules, allow, strict, verify); with
    `has_values`, of the load into the concrete model that `model` describes (``taktiny
    plan`` makes it abstractly, with :func:`taktiny.eval_shape` of its factory): the
    leaves a migration adds keep the values that model has; under the budget
    `max_host_bytes` (bytes), or none."""
    rules, allow, strict, verify = options
    load = open_load(model, path, rules=rules, allow=allow, strict=strict, verify=verify)
    leaves, quantized = load.leaves, load.quantized
    ties: list[tuple[str, str]] = []
    error: Exception | None = None
    found: list[Step] = []  # the tensors that would load, beside the others' problems
    try:
        load = migrated(load, has_values=has_values)
        steps = steps_of(load, ties=ties, found=found)
        error = unkept(load)
    except ValueError as raised:  # (a StateDictError, ConversionError, SafetensorsError too)
        error, steps = raised, found
    migration = load.migration
    ways = Ways(load, steps, max_host_bytes)  # (one buffer instead of two when two do not fit)
    budget = Budget(max_host_bytes, ways)
    if error is None:
        error = budget.error
    steps_planned, made, held = [], [], []
    reads: dict[int, int] = {}
    for way in (part for unit in ways.units for part in unit.parts):
        temporary = way.temporary(load)
        made.append(temporary if way.transforms else 0)  # (in the load's own thread)
        held.append(0 if way.transforms else temporary)
        for process, n in way.reads(verify).items():
            reads[process] = reads.get(process, 0) + n
        steps_planned.append(_planned(way, leaves, quantized))
    device_bytes = _device_bytes(leaves)
    # at once: the result of the step being transformed, and what the two readers hold of
    # the two steps after it (those read into scratch buffers hold nothing more)
    made, held = [0, *made], [0, *held, 0, 0]
    at_once = max(m + held[j + 1] + held[j + 2] for j, m in enumerate(made))
    extra = sum(buffer.capacity for buffer in ways.buffers) + at_once
    on_host = sum(n for d, n in device_bytes.items() if d.platform == "cpu")
    kept: tuple[str, ...] = ()
    if migration is not None:
        unvalued = {q for p in migration.problems for q in parts_of(p.name, quantized)}
        kept = tuple(n for n in leaves if n in migration.added and n not in unvalued)
    return LoadPlan(
        tuple(steps_planned),
        types.MappingProxyType(device_bytes),
        types.MappingProxyType(dict(sorted(reads.items()))),
        extra,
        extra + on_host,
        tuple(ties),
        error,
        kept,
        None if migration is None else stages_text(migration.stages),
        budget.planned_peak(),
        max_host_bytes,
    )


def _planned(way: Way, leaves: Mapping[str, Any], quantized: Mapping[str, Any]) -> PlannedStep:
    """What the plan says of a step, read in `way`."""
    step, sources = way.step, way.sources
    targets = tuple(p for t in step.targets for p in parts_of(t, quantized) if p in leaves)
    casts = []
    if len(sources) == len(step.targets) and way.word != "quantized":  # each source to its leaf
        for tensor, name in zip(sources, step.targets, strict=True):
            if name in leaves and (want := spec_of(leaves[name])[1]) != tensor.dtype:
                casts.append((name, tensor.dtype.name, want.name))
    quantizing = way.word == "quantized" and step.rule is not IDENTITY
    outs = results_of(step, sources) if quantizing else ()
    stored = {n for n, out in zip(step.targets, outs, strict=False) if isinstance(out, Parameter)}
    for name in step.targets:
        like = quantized.get(name)
        if like is None:
            continue
        ints = np.dtype(like.part_values()[0].dtype).name  # (its integers: "int8", "int4")
        if name in stored:  # quantized parts a transform unpacked: placed as they are
            casts.append((name, ints, f"{ints} (as stored)"))
        else:
            have = sources[0].dtype.name if len(sources) == 1 else "float"
            casts.append((name, have, f"{ints} (quantized)"))
    rule = "same name" if step.rule is IDENTITY else repr(step.rule)
    nbytes = sum(t.nbytes for t in sources)
    return PlannedStep(
        step.sources, targets, rule, repr(step.rule.transform), way.word, tuple(casts), nbytes
    )


def _device_bytes(leaves: Mapping[str, Any]) -> dict[Any, int]:
    """The bytes each device holds of the model: each leaf's block on each of its devices."""
    out: dict[Any, int] = {}
    for leaf in leaves.values():
        shape, dtype = spec_of(leaf)
        sharding = sharding_of(leaf)
        block = sharding.shard_shape(shape)
        for device in sharding.device_set:
            out[device] = out.get(device, 0) + math.prod(block) * dtype.itemsize
    return dict(sorted(out.items(), key=lambda item: item[0].id))
