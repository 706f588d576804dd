"""Streaming a safetensors checkpoint into a model, tensor by tensor.

Every name, shape and dtype is checked from the headers before a byte of data is read.
Then each tensor is read into memory Taktiny owns and placed with its leaf's sharding at
once, so the host holds one tensor at a time. A tensor the rules only rename, loaded into
a leaf of its own dtype, is read device by device: each device's block of bytes goes into
a buffer of its own, and the blocks become one array with
``jax.make_array_from_single_device_arrays``. Anything a rule transforms is read whole,
transformed by XLA and placed with ``jax.device_put``. A float tensor loaded into a
quantized parameter (a `QArray`) is quantized as it is placed, so a quantizing load holds
one float tensor at a time besides the quantized model.
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
from .._quant import QArray, quantize_like
from ..convert._convert import check_ties
from ..convert._coverage import ConversionError, ConversionProblem, Step, check_allow, plan
from ..convert._coverage import _allowed as allowed_by
from ..convert._rules import AnyRule, Rule
from ..convert._transforms import identity
from . import _quantized as qz
from . import _read
from ._read import Checkpoint, Readahead, SafetensorsError, Tensor, open_safetensors

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

    A quantized model (:func:`taktiny.quantize`) loads a checkpoint of its quantized parts
    (``<name>.value`` and ``<name>.scale``, 4-bit values unpacked), or a float checkpoint:
    a float tensor under the name of a :class:`~taktiny.QArray` (``dense.kernel``, as the
    float model saves it; or made by a rule) is checked against its logical shape, then
    quantized as that QArray is (bits, axis, group size, scale dtype) tensor by tensor,
    giving what ``tt.quantize`` of the float model would. Such a load holds one float
    tensor at a time besides the quantized model.

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
    quantized = qz.quantized_arrays(model)
    if rules is None:
        steps = _plain(checkpoint, leaves, quantized, strict, where)
    else:
        steps = _ruled(rules, allow, checkpoint, leaves, quantized, where)
    made = {p for s in steps for t in s.targets for p in _parts(t, quantized)}
    problems = _absent(leaves, made, strict)
    if problems:
        raise err.StateDictError(where, problems)
    steps.sort(key=lambda s: min((str(t.file), t.offset) for t in _tensors(checkpoint, s)))
    total = sum(t.nbytes for s in steps for t in _tensors(checkpoint, s))
    order = [t for step in steps for t in _tensors(checkpoint, step)]
    starts = list(itertools.accumulate((len(s.sources) for s in steps), initial=0))
    direct = [_direct(s, _tensors(checkpoint, s), leaves) for s in steps]
    # step k reads into scratch k % 2 while step k - 1 transforms. A quantizing load keeps
    # one float tensor at a time: one buffer, which a step reads into once the step before
    # it is done with it (the Readahead keeps the disk reading meanwhile)
    shrinks = any(t in quantized for s in steps for t in s.targets)
    scratch = (_Scratch(),) if shrinks else (_Scratch(), _Scratch())
    placed: dict[str, Any] = {}

    def read(k: int) -> Any:  # in the reader thread: preadv, mmap and XLA release the GIL
        ahead.reached(starts[k])  # the disk reads on while this step is read and placed
        step = steps[k]
        sources = _tensors(checkpoint, step)
        leaf = direct[k]
        if leaf is not None:  # renamed only: read and placed block by block, here
            return {step.targets[0]: _by_device(sources[0], _sharding(leaf))}
        return scratch[k % len(scratch)].read(sources)

    with (
        _bar(progress, total, checkpoint) as bar,
        Readahead(order) as ahead,
        ThreadPoolExecutor(1, thread_name_prefix="taktiny-read") as reader,
    ):
        pending = reader.submit(read, 0) if steps else None
        for k, step in enumerate(steps):
            assert pending is not None
            data = pending.result()
            more = k + 1 < len(steps)
            # with one buffer, the next step reads into it once this one is done with it
            wait = more and len(scratch) == 1 and direct[k] is None and direct[k + 1] is None
            if more and not wait:
                pending = reader.submit(read, k + 1)
            if isinstance(data, dict):
                placed.update(data)
            else:
                buffer = scratch[k % len(scratch)]
                placed.update(_transform(step, data, leaves, quantized, buffer, where))
            if wait:
                pending = reader.submit(read, k + 1)
            bar.update(sum(checkpoint[n].nbytes for n in step.sources))
    return _state.load(model, placed, strict=strict, flat=True, nodes=_tree.NODES, caller=where)


def _tensors(checkpoint: Checkpoint, step: Step) -> list[Tensor]:
    return [checkpoint[name] for name in step.sources]


def _parts(name: str, quantized: Mapping[str, QArray]) -> tuple[str, ...]:
    """The leaves a step's target fills: a quantized parameter's two parts, or itself."""
    return (f"{name}.value", f"{name}.scale") if name in quantized else (name,)


def _plain(
    checkpoint: Checkpoint,
    leaves: Mapping[str, Any],
    quantized: Mapping[str, QArray],
    strict: bool,
    where: str,
) -> list[Step]:
    """One renaming step per tensor, when the checkpoint uses the model's own names (or a
    quantized parameter's own name for its float array); every problem with the names,
    shapes and dtype kinds in one StateDictError."""
    problems: list[err.StateProblem] = []
    steps = []
    done: set[str] = set()  # checkpoint names checked here, as quantized parameters
    covered: set[str] = set()  # the parts of those (loaded, or refused with a problem)
    for name, like in quantized.items():
        parts = [p for p in (f"{name}.value", f"{name}.scale") if p in checkpoint]
        tensor = checkpoint.get(name)
        if tensor is not None:  # a float array, quantized as it is loaded
            done.update([name, *parts])
            covered.update(_parts(name, quantized))
            problem = _both(name, parts) if parts else _quantizable(name, tensor, like)
            if problem is not None:
                problems.append(problem)
            else:
                steps.append(Step(_IDENTITY, (name,), (name,)))
        elif parts:
            problem = _representation(name, like, checkpoint)
            if problem is not None:
                problems.append(problem)
                done.update(parts)
                covered.update(_parts(name, quantized))
    unknown = [(n, checkpoint[n]) for n in checkpoint if n not in leaves and n not in done]
    floats = _quantized_into_float(checkpoint, leaves, [n for n, _ in unknown])
    problems += floats.values()
    unknown = [(n, t) for n, t in unknown if n.rpartition(".")[0] not in floats]
    problems += err.unknown(unknown, list(leaves), True, set(checkpoint))
    for name, tensor in checkpoint.items():
        leaf = leaves.get(name)
        if leaf is None or name in done:
            continue
        shape, dtype = _spec(leaf)
        _packed_unlisted(tensor, shape, dtype)
        if tuple(tensor.shape) != shape:
            problems.append(err.shape(name, shape, tuple(tensor.shape)))
        elif _values.kind(tensor.dtype) != _values.kind(dtype):
            want, have = _values.kind(dtype), _values.kind(tensor.dtype)
            problems.append(err.dtype_kind(name, dtype, tensor.dtype, str(want), str(have)))
        else:
            steps.append(Step(_IDENTITY, (name,), (name,)))
    made = {p for s in steps for t in s.targets for p in _parts(t, quantized)}
    problems += _absent(leaves, set(checkpoint) | made | covered | set(floats), strict)
    if problems:
        raise err.StateDictError(where, problems)
    return steps


def _both(name: str, parts: list[str]) -> err.StateProblem:
    return err.StateProblem(
        "structure",
        name,
        "a float array or its quantized parts",
        "both",
        f"the checkpoint holds both the float array {name!r} and the quantized parts "
        f"{parts} of this quantized parameter; keep one of them.",
    )


def _quantizable(name: str, tensor: Tensor, like: QArray) -> err.StateProblem | None:
    """What stops a float tensor from being quantized into the QArray `like` (None: nothing)."""
    layout = qz.describe(like.bits, like.axis, like.group_size)
    if _values.kind(tensor.dtype) != "floating":
        have = f"{tensor.dtype.name}{list(tensor.shape)}"
        return err.StateProblem(
            "dtype",
            name,
            "a float array",
            tensor.dtype.name,
            f"the model quantizes {name!r} as {layout}, and the checkpoint holds {have} "
            f"under its name, which is not a float array to quantize. Give the float array, "
            f"or the quantized parts {name}.value and {name}.scale.",
        )
    if tuple(tensor.shape) != like.shape:
        return err.StateProblem(
            "shape",
            name,
            like.shape,
            tuple(tensor.shape),
            f"shape mismatch: the model quantizes {name!r} ({layout}) from a float array of "
            f"shape {like.shape}, got {tuple(tensor.shape)}.",
        )
    return None


def _representation(name: str, like: QArray, checkpoint: Checkpoint) -> err.StateProblem | None:
    """A problem when the checkpoint's parts of `name` are quantized otherwise than `like`
    (by its recorded layout, or else by its values' dtype)."""
    want = (like.bits, like.axis, like.group_size)
    record = checkpoint.quantized.get(name)
    value = checkpoint.get(f"{name}.value")
    if record is not None:
        have: tuple[Any, ...] = _meta(record)
        if have == want:
            return None
        got = qz.describe(*have)
    elif value is None or value.dtype in (np.dtype(like.value.dtype), np.uint8):
        return None  # (uint8: a 4-bit array packed, unless its packing is unlisted: checked)
    else:
        bits = {"int8": 8, "int4": 4}.get(value.dtype.name)
        have, got = (bits, *want[1:]), f"{value.dtype.name} values"
    group = "" if have[2] is None else f", group_size={have[2]}"
    fix = (
        f"Quantize the model as the checkpoint was (tt.quantize(float_model, bits={have[0]}"
        f"{group})), or load a float checkpoint, which is quantized on load."
        if have[0]
        else "Load a float checkpoint, which is quantized on load."
    )
    return err.StateProblem(
        "dtype" if have[0] != want[0] else "shape",
        name,
        qz.describe(*want),
        got,
        f"the model quantizes {name!r} as {qz.describe(*want)}, the checkpoint holds it as "
        f"{got}. {fix}",
    )


def _quantized_into_float(
    checkpoint: Checkpoint, leaves: Mapping[str, Any], unknown: list[str]
) -> dict[str, err.StateProblem]:
    """A problem for each float leaf whose checkpoint holds quantized parts instead."""
    out: dict[str, err.StateProblem] = {}
    for name in unknown:
        base, _, part = name.rpartition(".")
        if part not in ("value", "scale") or base not in leaves or base in out:
            continue
        record = checkpoint.quantized.get(base)
        if record is None and not {f"{base}.value", f"{base}.scale"} <= set(checkpoint):
            continue
        shape, dtype = _spec(leaves[base])
        layout = "" if record is None else f" as {qz.describe(*_meta(record))}"
        bits = "bits=..." if record is None else f"bits={record['bits']}"
        group = "" if record is None or record["group_size"] is None else (
            f", group_size={record['group_size']}"
        )  # fmt: skip
        axis = "..." if record is None else record["axis"]
        out[base] = err.StateProblem(
            "structure",
            base,
            f"a float array {dtype.name}{list(shape)}",
            "quantized parts",
            f"the checkpoint holds it quantized{layout}, as {base}.value and {base}.scale; the "
            f"model holds a float array {dtype.name}{list(shape)}. Load it into the quantized "
            f"model, tt.quantize(model, {bits}{group}) (then tt.dequantize it for floats), or "
            f"pass rules that dequantize: convert.Rule(['{base}.value', '{base}.scale'], "
            f"'{base}', convert.dequantize(axis={axis}{group})).",
        )
    return out


def _meta(record: Mapping[str, Any]) -> tuple[int, int, int | None]:
    return record["bits"], record["axis"], record["group_size"]


def _packed_unlisted(tensor: Tensor, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Raises when a uint8 tensor stands where the model holds a 4-bit array of which it
    could be the packed bytes, but its file does not list it as packed."""
    if dtype.name in qz.FOUR_BIT and tensor.dtype == np.uint8 and not tensor.packed:
        if tuple(tensor.shape) == qz.packed_shape(shape):
            raise SafetensorsError(
                f"{tensor.file}: {tensor.name!r} is stored as uint8{list(tensor.shape)}, where "
                f"the model holds {dtype.name}{list(shape)}: 4-bit tensors are stored packed "
                f"two per byte, but the header metadata {qz.PACKED!r}, which lists each packed "
                f"tensor with its dtype and shape, does not list it, so it cannot be unpacked. "
                f"Write the checkpoint with taktiny.io.save_safetensors, which records it."
            )


def _ruled(
    rules: Sequence[AnyRule],
    allow: Mapping[str, Sequence[str]] | None,
    checkpoint: Checkpoint,
    leaves: Mapping[str, Any],
    quantized: Mapping[str, QArray],
    where: str,
) -> list[Step]:
    """The steps of the rules, checked from the headers. A quantized parameter may be made
    from its parts or from a float array (quantized on load): the plan sees both names,
    lets either be missing, and the pair is checked here."""
    allowed = check_allow(allow)
    if not quantized:
        report, ties = plan(rules, checkpoint, leaves, allowed, where)
        check_ties(ties, checkpoint, where)
        return list(report.steps)
    logical = {n: jax.ShapeDtypeStruct(q.shape, q.dtype) for n, q in quantized.items()}
    either = [p for n in quantized for p in (n, *_parts(n, quantized))]
    lenient = {**allowed, "missing": [*allowed.get("missing", ()), *either]}
    report, ties = plan(rules, checkpoint, {**leaves, **logical}, lenient, where)
    check_ties(ties, checkpoint, where)
    made = {t for s in report.steps for t in s.targets}
    problems = []
    for name in quantized:
        parts = [p for p in _parts(name, quantized) if p in made]
        if name in made and parts:
            problems.append(
                ConversionProblem(
                    "duplicate",
                    name,
                    f"made both as a float array (quantized on load) and as its quantized "
                    f"parts {parts}; make the rules produce one of them.",
                )
            )
        elif name not in made:
            problems += [
                ConversionProblem(
                    "missing",
                    part,
                    f"no rule produces this target leaf, nor the float array {name!r} its "
                    f"quantized parameter is made from on load; add a Rule, or allow it "
                    f"(allow={{'missing': [...]}}) and load with strict=False.",
                )
                for part in _parts(name, quantized)
                if part not in made and not allowed_by("missing", part, allowed)
            ]
    if problems:
        raise ConversionError(where, problems)
    return list(report.steps)


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
