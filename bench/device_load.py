"""Loads onto an accelerator (issue 52, point 3): a 1 GiB bfloat16 safetensors file (32
layers of 4096 x 4096) loaded onto the default device, against the raw limit measured in
the same run and against the peers; then the same loads through rules that rename and
transpose, quantizing ones (bfloat16 into int8 and int4, FP8 blocks into bfloat16 and
int8), one into a stack of layers, and, where sockets work, one from object storage.

The raw limit is the slower of the file read into reused host buffers (8 threads, each its
own buffer, faulted before the clock) and ``jax.device_put`` of host arrays already in
memory; the pipeline of the two (8 threads, each reading 8 MiB pieces into two reused
buffers of its own in turns and copying each onto the device as soon as it is read) is
reported beside them, and Taktiny's loads are given against it as the median of per-round
ratios, each load timed right after a run of the pipeline of its own file (the pipeline's
speed moves between runs on the lent TPU's host). Each case's limit reads its own file.
The peers: ``safetensors.flax.load_file``, Orbax's restore of the same model, and the plain
loop (``safetensors.numpy.load_file`` then ``jax.device_put``). Every load is checked
bitwise on the host: against the file's arrays (renamed, stacked), their transposes
(transposed), ``tt.quantize`` of the float model (quantizing loads) and NumPy's float32
product of the FP8 blocks rounded to bfloat16 (FP8).

``taktiny`` is the load as it is: each tensor copied onto the device from the file's
mapped pages (``Mapped`` in ``taktiny/loading/_ways.py``), eight readers from the start.
``variants`` loads the file with two or four readers from the start, and through the
staging ring that a tensor in object storage takes (pieces of 8 MiB and a ring of 8, as
the load stages one; 16 and 16), each against the same limit. Other ways to stage (tensors
whole, read by threads; small pages; transposed on the host) were measured and pruned:
bench/FINDINGS.md section 14.

Where sockets work (not on the lent TPU machine), ``object_storage`` loads the file from a
local S3-compatible server onto the CPU, and times its read half apart: the tensors read as
the staged load reads them into its ring of reused buffers, hashed, with no copy onto a
device (`_ring_reads`), against raw ranged GETs of the same object.

``--peak folder [case]`` then loads a file written there alone, in a process of its own,
for its peak host memory (``ru_maxrss`` after the load, less before it) and its ways
(case: ``renamed`` (default), ``transposed``, ``int8``, ``fp8_int8``, ``stack``).
``--summary FILE...`` prints a few lines from the JSON those wrote.

Run ``python bench/device_load.py [folder]`` on a machine with an accelerator; it prints one
JSON object. On a CPU the figures mean little (a CPU device adopts host memory): there the
variants force the staging ring so that its code runs. ``DEVICE_LOAD_LAYERS`` (32) and
``DEVICE_LOAD_WIDTH`` (4096) make it smaller; ``DEVICE_LOAD_REPEATS`` (3) sets the samples.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

LAYERS = int(os.environ.get("DEVICE_LOAD_LAYERS", "32"))  # (fewer for a quick try on a CPU)
WIDTH = int(os.environ.get("DEVICE_LOAD_WIDTH", "4096"))
REPEATS = int(os.environ.get("DEVICE_LOAD_REPEATS", "3"))
GiB = 2**30
MiB = 2**20

# What each variant sets, restored after: the readers a load of mapped tensors starts with
# (`_ways.MAPPED_START`, 8; they then grow while it pays), or a local file staged through
# the ring as a tensor in object storage is (`_ways._local`), with that ring's piece size
# and length
VARIANTS: dict[str, dict[str, Any]] = {
    "readers_from_2": {"_ways.MAPPED_START": 2},
    "readers_from_4": {"_ways.MAPPED_START": 4},
    "ring_pieces_8MiB_ring8": {"_ways._local": lambda tensor: False},
    "ring_pieces_16MiB_ring16": {
        "_ways._local": lambda tensor: False,
        "_ways.STAGE_PIECE": 16 * MiB,
        "_ways.RING": 16,
    },
}


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i in range(LAYERS):
        bits = rng.integers(0, 2**16, (WIDTH, WIDTH), dtype=np.uint16) & 0x7F7F  # finite
        out[f"layers.{i}.kernel"] = bits.view(ml_dtypes.bfloat16)
    return out


def _sharding() -> Any:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _abstract(shapes: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, Any]:
    return {n: jax.ShapeDtypeStruct(s, d, sharding=_sharding()) for n, (s, d) in shapes.items()}


def _modules(stacked: bool) -> Any:
    """The abstract model of LAYERS Linear(WIDTH, WIDTH) layers without biases, in
    bfloat16 on the default device: a list of layers, or an ``nn.Stack`` of them."""
    import taktiny as tt
    from taktiny import nn

    class Layers(nn.Module):
        def __init__(self, *, rngs: nn.Rngs):
            linear = lambda rngs: nn.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
            if stacked:
                self.layers = nn.Stack(linear, LAYERS, rngs=rngs)
            else:
                self.layers = [linear(rngs) for _ in range(LAYERS)]

    abstract = tt.eval_shape(lambda: Layers(rngs=nn.Rngs(0)))
    sharding = _sharding()
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=sharding), abstract
    )


def _timed(fn: Callable[[], Any], repeats: int = REPEATS) -> tuple[float, float, Any]:
    """The median and the first of `repeats` timed calls, and the last one's result."""
    times, out = [], None
    for _ in range(repeats):
        out = None
        start = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times[0], out


def _ranges(path: Path) -> list[tuple[int, int]]:
    """The byte range of each tensor in a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    base = 8 + n
    return [
        (base + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
        for k, v in header.items()
        if k != "__metadata__"
    ]


def _raw(paths: list[Path], threads: int) -> float:
    """GiB/s of the files read by `threads` threads, each into its own reused buffer
    (faulted before the clock)."""
    ranges = [(path, offset, n) for path in paths for offset, n in _ranges(path)]
    buffers = [np.zeros(max(n for _, _, n in ranges), np.uint8) for _ in range(threads)]
    fds = {path: os.open(path, os.O_RDONLY) for path in paths}

    def work(k: int) -> None:
        for path, offset, n in ranges[k::threads]:
            view, got = memoryview(buffers[k])[:n], 0
            while got < n:
                got += os.preadv(fds[path], [view[got:]], offset + got)

    seconds = _threaded(threads, work)
    for fd in fds.values():
        os.close(fd)
    return sum(n for _, _, n in ranges) / GiB / seconds


def _raw_pipeline(
    path: Path, threads: int = 8, piece: int = 8 * MiB, repeats: int | None = None
) -> float:
    """GiB/s of the file read `piece` bytes at a time by `threads` threads, each into two
    reused buffers of its own in turns (faulted before the clock), each piece copied onto
    the device as soon as it is read; a buffer is read into again once its copy is done
    (the median of `repeats` runs, `REPEATS` by default)."""
    size = path.stat().st_size
    pieces = [(offset, min(piece, size - offset)) for offset in range(0, size, piece)]
    buffers = [[np.ones(piece, np.uint8) for _ in range(2)] for _ in range(threads)]
    fd, device = os.open(path, os.O_RDONLY), jax.devices()[0]

    def work(k: int) -> None:
        copies: list[Any] = [None, None]
        for i, (offset, n) in enumerate(pieces[k::threads]):
            if copies[i % 2] is not None:
                copies[i % 2].block_until_ready()
            view, got = memoryview(buffers[k][i % 2])[:n], 0
            while got < n:
                got += os.preadv(fd, [view[got:]], offset + got)
            copies[i % 2] = jax.device_put(buffers[k][i % 2][:n], device)
        jax.block_until_ready(copies)

    seconds = _threaded(threads, work, repeats)
    os.close(fd)
    return size / GiB / seconds


def _threaded(threads: int, work: Callable[[int], None], repeats: int | None = None) -> float:
    """The median seconds of `repeats` (`REPEATS`) runs of ``work(k)`` for k in
    range(threads), each in a thread of its own."""
    times = []
    for _ in range(REPEATS if repeats is None else repeats):
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _raw_put(arrays: dict[str, np.ndarray]) -> float:
    device = jax.devices()[0]
    values = list(arrays.values())
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready([jax.device_put(a, device) for a in values])
        times.append(time.perf_counter() - start)
    return sum(a.nbytes for a in values) / GiB / statistics.median(times)


def _host_bits(x: Any) -> np.ndarray:
    """`x`'s bytes on the host, as unsigned integers of its width."""
    host = np.asarray(x)
    return host.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[host.dtype.itemsize])


def _bitwise(got: Any, want: Any) -> bool:
    """Whether two trees hold the same leaves bit for bit, compared on the host: a program
    on a TPU cannot tell (it flushes bfloat16 subnormals to zero and makes NaNs canonical
    as it reads them, a bitcast to integers included: FINDINGS 14)."""
    a, b = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(a) != len(b):
        return False
    return all(
        x.shape == y.shape and x.dtype == y.dtype and np.array_equal(_host_bits(x), _host_bits(y))
        for x, y in zip(a, b, strict=True)
    )


def _as_held(got: Any, want: Any) -> bool:
    """Whether two trees hold the same values as a TPU's programs hold them: equal bits but
    where `want` has a subnormal (then `got` may hold a zero) or a NaN (then any NaN)."""
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if not jnp.issubdtype(x.dtype, jnp.floating):  # (NumPy's own does not know bfloat16)
            if not np.array_equal(x, y):
                return False
            continue
        tiny = float(ml_dtypes.finfo(y.dtype).smallest_normal)
        same = _host_bits(x) == _host_bits(y)
        y32, x32 = y.astype(np.float32), x.astype(np.float32)
        same |= (np.abs(y32) < tiny) & (x32 == 0)
        same |= np.isnan(y32) & np.isnan(x32)
        if not same.all():
            return False
    return True


@contextlib.contextmanager
def _settings(settings: dict[str, Any]) -> Iterator[None]:
    """The attributes of taktiny.loading's modules set as `settings` names them
    (``"_ways.RING"``) for the block, restored after."""
    import importlib

    old = {}
    for name, value in settings.items():
        module, attribute = name.split(".")
        module = importlib.import_module(f"taktiny.loading.{module}")
        old[name] = (module, attribute, getattr(module, attribute))
        setattr(module, attribute, value)
    try:
        yield
    finally:
        for module, attribute, value in old.values():
            setattr(module, attribute, value)


@contextlib.contextmanager
def _staged_on_cpu() -> Iterator[bool]:
    """On a CPU device, the staging ring forced (a CPU device adopts host memory, so a load
    never stages there): its code runs, its figures mean little. Yields whether forced."""
    import taktiny.loading._ways as ways

    if jax.devices()[0].platform != "cpu":
        yield False
        return
    real = ways._staging
    ways._staging = lambda sharding: True
    try:
        yield True
    finally:
        ways._staging = real


def _figure(
    nbytes: int,
    limit: float,
    load: Callable[[], Any],
    want: Any,
    pipeline: Path | None = None,
    **timing: Any,
) -> dict[str, Any]:
    """One load timed: GiB/s of `nbytes` (median, and the first call's, which compiles),
    against `limit`, and whether it gave `want` bit for bit. With `pipeline` (its file),
    each timed load is preceded by a run of that file's raw pipeline, and the load is
    given against it as the median of the rounds' ratios (``vs_raw_pipeline``: the
    pipeline's own speed moved by 1.7x between two runs a minute apart on the lent TPU's
    host, FINDINGS 14, so it is measured beside each load). A collection between the two,
    untimed, has JAX let go of the host buffers the pipeline's copies read, which the load
    would otherwise pay for in its first collection (12 ms on the TPU v5e's host); after
    the load, the next pipeline waits, untimed, until the load's reader thread has
    unmapped the file (35 ms for 1 GiB there), whose time it would otherwise share."""
    if pipeline is None:
        seconds, first, out = _timed(load, **timing)
        ratios, pipes = [], []
    else:
        first, out = _timed(load, repeats=1)[1:]
        times, ratios, pipes = [], [], []
        for _ in range(timing.get("repeats", REPEATS)):
            pipes.append(_raw_pipeline(pipeline, repeats=1))
            out = None
            gc.collect()  # (untimed: JAX lets go of what the pipeline's copies read)
            start = time.perf_counter()
            out = load()
            jax.block_until_ready(out)
            times.append(time.perf_counter() - start)
            ratios.append(nbytes / GiB / times[-1] / pipes[-1])
            _unmapped(pipeline)  # (untimed: the next pipeline runs alone)
        seconds = statistics.median(times)
    speed = nbytes / GiB / seconds
    figure = {
        "GiBps": speed,
        "first_GiBps": nbytes / GiB / first,
        "vs_raw_limit": speed / limit,
        "bitwise": _bitwise(out, want),
        "as_held": _as_held(out, want),
    }
    if ratios:
        figure["vs_raw_pipeline"] = statistics.median(ratios)
        figure["raw_pipeline_GiBps"] = statistics.median(pipes)
    return figure


def _unmapped(path: Path, most: float = 2.0) -> None:
    """Waits until the process maps no page of `path` (at most `most` seconds; where
    ``/proc/self/maps`` lists them): a load has a reader thread unmap the file's windows
    after it returns (``loading._release``), which a raw pipeline run meanwhile would
    share its time with."""
    maps, name = Path("/proc/self/maps"), str(path.resolve())
    end = time.perf_counter() + most
    while maps.exists() and time.perf_counter() < end:
        if not any(line.rstrip().endswith(name) for line in maps.read_text().splitlines()):
            return
        time.sleep(0.002)


def _write_fp8(folder: Path, arrays: dict[str, np.ndarray]) -> tuple[Path, dict[str, Any]]:
    """An FP8 block-scaled checkpoint of the layers (as DeepSeek's and transformers'
    FineGrainedFP8 write one: ``weight`` [out, in] in float8_e4m3fn beside a float32
    ``weight_scale_inv`` of one factor per 128 x 128 block, and its config.json), and the
    oracle: each product in float32, rounded to bfloat16, laid out [in, out]."""
    from taktiny.io import save_safetensors

    tensors, oracle = {}, {}
    block = 128
    for i, (name, array) in enumerate(arrays.items()):
        w = np.asarray(array, np.float32).T  # [out, in], as a torch Linear holds it
        blocks = w.reshape(WIDTH // block, block, WIDTH // block, block)
        scale = np.abs(blocks).max(axis=(1, 3)) / 448
        scale = np.where(scale == 0, 1, scale).astype(np.float32)
        full = np.repeat(np.repeat(scale, block, 0), block, 1)
        weight = (w / full).astype(ml_dtypes.float8_e4m3fn)
        tensors[f"model.layers.{i}.proj.weight"] = weight
        tensors[f"model.layers.{i}.proj.weight_scale_inv"] = scale
        product = weight.astype(np.float32) * full
        oracle[name] = jax.device_put(product.astype(ml_dtypes.bfloat16).T, _sharding())
    fp8 = folder / "fp8"
    fp8.mkdir(exist_ok=True)
    save_safetensors(fp8 / "model.safetensors", tensors)
    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (fp8 / "config.json").write_text(json.dumps({"quantization_config": config}))
    return fp8 / "model.safetensors", oracle


def _fp8_rules(folder: Path) -> list[Any]:
    """The rules that load the FP8 checkpoint `_write_fp8` wrote into `folder` into the
    layers (``cv.linear`` of each, read through its block scales: ``cv.quantized_rules``)."""
    from taktiny import convert as cv
    from taktiny.io import open_safetensors

    linear = [
        r
        for i in range(LAYERS)
        for r in cv.linear(f"model.layers.{i}.proj", f"layers.{i}", bias=False)
    ]
    return cv.quantized_rules(linear, open_safetensors(folder))


def _fp8_targets(folder: Path) -> tuple[Path, list[Any], dict[str, Any]]:
    """The FP8 twin of the layers written into `folder` and read once (in the page cache),
    the rules that load it, and the two models it loads into: ``bf16`` (the layers) and
    ``int8`` (``tt.quantize`` of them)."""
    import taktiny as tt

    folder.mkdir(parents=True, exist_ok=True)
    fp8, _ = _write_fp8(folder, _arrays())
    fp8.read_bytes()
    layers = _modules(stacked=False)
    return fp8, _fp8_rules(fp8.parent), {"bf16": layers, "int8": tt.quantize(layers)}


def _cases(
    folder: Path,
    path: Path,
    arrays: dict[str, np.ndarray],
    put: float,
    want: dict[str, Any],
    cases: dict[str, Any],
) -> None:
    """The loads the issue lists besides the plain one, each against the raw limit of its
    own file (read) and the device_put figure of this run (`put`), checked bitwise; their
    figures put into `cases` as they come."""
    import taktiny as tt
    from taktiny import convert as cv
    from taktiny.io import load_safetensors, save_safetensors

    hf = folder / "hf.safetensors"  # torch's names; [out, in] = the file's kernels' bytes
    save_safetensors(hf, {f"model.layers.{i}.weight": a for i, a in enumerate(arrays.values())})
    hf.read_bytes()
    limit, pipe = min(_raw([hf], 8), put), hf
    nbytes = sum(a.nbytes for a in arrays.values())
    flat = _abstract({n: (a.shape, a.dtype) for n, a in arrays.items()})
    renamed = [cv.Rule("model.layers.{i}.weight", "layers.{i}.kernel")]
    cases["renamed"] = _figure(
        nbytes, limit, lambda: load_safetensors(flat, hf, rules=renamed), want, pipe
    )
    transposed = [cv.Rule("model.layers.{i}.weight", "layers.{i}.kernel", cv.transpose())]
    turned = {n: np.ascontiguousarray(a.T) for n, a in arrays.items()}  # (on the host: a
    # TPU's transpose would flush the subnormals the check looks for)
    cases["transposed"] = _figure(
        nbytes, limit, lambda: load_safetensors(flat, hf, rules=transposed), turned, pipe
    )
    del turned
    cases["raw_limit_hf_GiBps"] = limit

    limit, pipe = min(_raw([path], 8), put), path
    layers = _modules(stacked=False)
    floats = load_safetensors(layers, path)
    stack = _modules(stacked=True)
    stacked = {"kernel": np.stack(list(arrays.values()))}  # (on the host, as the transposes)
    load = lambda: load_safetensors(stack, path)
    cases["stack"] = _figure(nbytes, limit, load, stacked, pipe)
    del stacked
    for name, options in {"int8": {"bits": 8}, "int4": {"bits": 4, "group_size": 128}}.items():
        quantized = tt.quantize(layers, **options)
        oracle = tt.quantize(floats, **options)
        load = lambda quantized=quantized: load_safetensors(quantized, path)
        cases[name] = _figure(nbytes, limit, load, oracle, pipe)
        del oracle
    cases["raw_limit_GiBps"] = limit

    fp8, oracle = _write_fp8(folder, arrays)
    fp8.read_bytes()
    limit, pipe = min(_raw([fp8], 8), put), fp8
    nbytes = fp8.stat().st_size
    rules = _fp8_rules(fp8.parent)
    # (the oracle in the model's order: a dict's leaves come sorted, layers.10 before layers.2)
    oracle = jax.tree.unflatten(
        jax.tree.structure(layers), [oracle[f"layers.{i}.kernel"] for i in range(LAYERS)]
    )
    load = lambda: load_safetensors(layers, fp8.parent, rules=rules)
    cases["fp8_bf16"] = _figure(nbytes, limit, load, oracle, pipe)
    bf16 = load_safetensors(layers, fp8.parent, rules=rules)
    int8, oracle = tt.quantize(layers), tt.quantize(bf16)
    del bf16
    load = lambda: load_safetensors(int8, fp8.parent, rules=rules)
    cases["fp8_int8"] = _figure(nbytes, limit, load, oracle, pipe)
    cases["raw_limit_fp8_GiBps"] = limit


def _sockets() -> bool:
    """Whether this machine opens TCP sockets (the TPU machine lent here does not)."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
        return True
    except OSError:
        return False


def _object_storage(folder: Path, path: Path, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The read half of a load from object storage: the file served by a local
    S3-compatible server (``bench._s3_stub``, which sends each range with ``sendfile``, as
    the storage group does: moto reads the whole object for each ranged GET) loaded onto
    the CPU (which adopts what is read: no copy onto a device), against the raw local read
    of the same file (and, for context, the storage group's raw ranged GETs of it into a
    faulted buffer, 8 in flight), and checked bitwise."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import storage
    from bench._s3_stub import Stub
    from taktiny.io import load_safetensors

    cpu = jax.devices("cpu")[0]
    sharding = jax.sharding.SingleDeviceSharding(cpu)
    abstract = {
        n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for n, a in arrays.items()
    }
    raw = _raw([path], 8)
    with Stub(folder) as stub, mock.patch.dict(os.environ, stub.environment()):
        url = f"s3://bench/{path.name}"
        seconds, _, out = _timed(lambda: load_safetensors(abstract, url))
        ranged = storage.Raw(path.stat().st_size)  # (bucket "bench", this file's name)
        gets, _, _ = _timed(lambda: ranged(8))
        ring = _timed(lambda: _ring_reads(url))[0]
    same = all(
        np.array_equal(np.asarray(out[n]).view(np.uint16), a.view(np.uint16))
        for n, a in arrays.items()
    )
    speed = sum(a.nbytes for a in arrays.values()) / GiB / seconds
    return {
        "GiBps": speed,
        "raw_local_read_GiBps": raw,
        "vs_raw_local_read": speed / raw,
        "raw_ranged_gets_GiBps": path.stat().st_size / GiB / gets,  # (8 in flight, obstore)
        "read_half_GiBps": path.stat().st_size / GiB / ring,
        "read_half_vs_raw_ranged_gets": gets / ring,
        "bitwise": same,
    }


def _ring_reads(url: str, readers: int = 4) -> int:
    """The read half of a load from object storage onto a device that copies host memory
    (a TPU's): every tensor read as the staged load reads it (``Tensor.read_rows``, pieces
    of ``STAGE_PIECE`` bytes of rows, each hashed and checked) into a ring of ``RING``
    reused buffers (faulted before the clock), `readers` tensors at a time, with no copy
    onto a device. On the TPU machine the ring's copies run at several GiB/s
    (``variants``), faster than these reads here; the TPU machine opens no sockets, so
    the two halves are measured apart. Returns the bytes read."""
    from taktiny.io import open_safetensors
    from taktiny.loading import _ways

    checkpoint = open_safetensors(url)
    tensors = [checkpoint[name] for name in checkpoint.keys()]
    buffers: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
    for _ in range(_ways.RING):
        buffers.put(np.ones(_ways.STAGE_PIECE, np.uint8))

    def read(tensor: Any) -> int:
        taken: list[np.ndarray] = []

        def into(nbytes: int) -> memoryview:
            if taken:  # (the piece before it is done with: its buffer back in the ring)
                buffers.put(taken.pop())
            taken.append(buffers.get())
            return taken[-1].data[:nbytes]

        rows = _ways._rows(tensor, _ways.STAGE_PIECE)
        count = sum(piece.nbytes for piece in tensor.read_rows(rows, into, verify=True))
        for buffer in taken:
            buffers.put(buffer)
        return count

    with ThreadPoolExecutor(readers) as pool:
        return sum(pool.map(read, tensors))


def peak(folder: Path, case: str = "renamed") -> dict[str, object]:
    """One of Taktiny's loads alone (run it in a process of its own: one process at a time
    may hold a TPU), from the files a run wrote in `folder`: its peak host memory beyond
    what the process held before the load (``ru_maxrss``, which counts the page cache's
    pages the load maps, and the process's own memory alone: anonymous pages, sampled
    every millisecond), and the way each step was read."""
    import resource

    import taktiny as tt
    from taktiny import convert as cv
    from taktiny.io import load_safetensors, open_safetensors, plan_load

    path, rules = folder / "model.safetensors", None
    checkpoint = open_safetensors(path)
    model: Any = _abstract({n: (tuple(t.shape), t.dtype) for n, t in checkpoint.items()})
    if case == "transposed":
        path = folder / "hf.safetensors"
        rules = [cv.Rule("model.layers.{i}.weight", "layers.{i}.kernel", cv.transpose())]
    elif case == "int8":
        model = tt.quantize(_modules(stacked=False))
    elif case == "stack":
        model = _modules(stacked=True)
    elif case == "fp8_int8":
        path = folder / "fp8"
        rules = _fp8_rules(path)
        model = tt.quantize(_modules(stacked=False))
    ways = sorted({s.way for s in plan_load(model, path, rules=rules).steps})
    before, anonymous = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, _anonymous()
    with _Sampled(_anonymous) as most:
        jax.block_until_ready(load_safetensors(model, path, rules=rules))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "case": case,
        "taktiny_peak_host_MiB": (after - before) / 1024,
        "taktiny_peak_anonymous_MiB": (most.value - anonymous) / MiB,
        "ways": ways,
    }


def _anonymous() -> int:
    """The process's anonymous resident bytes (``RssAnon``; 0 where /proc has none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _Sampled:
    """The most that `measure()` gave, sampled every millisecond in a thread while the
    block runs (``value``)."""

    def __init__(self, measure: Callable[[], int]) -> None:
        self.measure, self.value = measure, measure()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(0.001):
            self.value = max(self.value, self.measure())

    def __enter__(self) -> _Sampled:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        self.value = max(self.value, self.measure())


def main(folder: Path) -> dict[str, object]:
    import orbax.checkpoint as ocp
    from safetensors.flax import load_file as flax_load
    from safetensors.numpy import load_file as numpy_load

    from taktiny.io import load_safetensors, save_safetensors

    arrays = _arrays()
    path = folder / "model.safetensors"
    save_safetensors(path, arrays)  # (with its checksums, which the load verifies)
    path.read_bytes()  # in the page cache, for every reader alike
    abstract = _abstract({n: (a.shape, a.dtype) for n, a in arrays.items()})
    nbytes = sum(a.nbytes for a in arrays.values())
    want = {n: jax.device_put(a, jax.devices()[0]) for n, a in arrays.items()}
    orbax_path = folder / "orbax"
    shutil.rmtree(orbax_path, ignore_errors=True)  # (Orbax refuses to save over a folder)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(orbax_path.resolve(), want)
    checkpointer.wait_until_finished()
    figures: dict[str, Any] = {
        "device": str(jax.devices()[0].device_kind),
        "GiB": nbytes / GiB,
        "transparent_hugepages": _thp(),
    }
    SO_FAR.append(figures)  # (what a run stopped midway prints)
    figures["raw_read_GiBps"] = _raw([path], 8)
    figures["raw_device_put_GiBps"] = put = _raw_put(arrays)
    figures["raw_pipeline_GiBps"] = _raw_pipeline(path)
    limit = min(figures["raw_read_GiBps"], put)
    figures["raw_limit_GiBps"] = limit
    loads = {
        "taktiny": lambda: load_safetensors(abstract, path),
        "taktiny_unverified": lambda: load_safetensors(abstract, path, verify=False),
        "safetensors_flax": lambda: flax_load(str(path)),
        "orbax": lambda: checkpointer.restore(orbax_path.resolve(), target=abstract),
        "device_put_loop": lambda: {
            n: jax.device_put(a, jax.devices()[0]) for n, a in numpy_load(str(path)).items()
        },
    }
    for name, load in loads.items():  # (Taktiny's against the pipeline run beside each)
        figures[name] = _figure(nbytes, limit, load, want, path if "taktiny" in name else None)
        figures[f"{name}_GiBps"] = figures[name]["GiBps"]  # (the keys of earlier runs)
        figures[f"{name}_bitwise"] = figures[name]["bitwise"]
    figures["taktiny_vs_raw_limit"] = figures["taktiny"]["vs_raw_limit"]
    figures["taktiny_vs_raw_pipeline"] = figures["taktiny"]["vs_raw_pipeline"]
    with _staged_on_cpu() as forced:
        figures["staging_forced_on_cpu"] = forced
        figures["variants"] = variants = {}
        for name, settings in VARIANTS.items():
            with _settings(settings):
                variants[name] = _figure(
                    nbytes, limit, lambda: load_safetensors(abstract, path), want
                )
        figures["best_variant"] = max(variants, key=lambda v: variants[v]["GiBps"])
        figures["cases"] = {}
        _cases(folder, path, arrays, put, want, figures["cases"])
    if _sockets():
        figures["object_storage"] = _object_storage(folder, path, arrays)
    else:
        figures["object_storage"] = "skipped: this machine opens no sockets"
    return figures


def _thp() -> str:
    """The kernel's transparent huge pages setting (``[madvise]``: where asked for)."""
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown"


def summary(paths: list[Path]) -> str:
    """A few lines from a run's JSON and its ``--peak`` ones: each load's GiB/s (median,
    first) and its ratio to the raw limit, whether it was bitwise, and the peaks."""
    lines = []
    for path in paths:
        try:
            figures = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            lines.append(f"{path.name}: {error}")
            continue
        if "case" in figures:
            peak_mib = figures["taktiny_peak_host_MiB"]
            own = figures.get("taktiny_peak_anonymous_MiB", float("nan"))
            lines.append(
                f"peak {figures['case']}: {peak_mib:.0f} MiB ({own:.0f} MiB the process's "
                f"own) {figures['ways']}"
            )
            continue
        raw = ("raw_read_GiBps", "raw_device_put_GiBps", "raw_pipeline_GiBps", "raw_limit_GiBps")
        lines.append(" ".join(f"{k[:-6]}={figures[k]:.2f}" for k in raw if k in figures))
        if "taktiny_vs_raw_pipeline" in figures:
            lines.append(f"taktiny vs raw pipeline: {figures['taktiny_vs_raw_pipeline']:.2f}x")
        if figures.get("stopped"):
            lines.append("STOPPED midway (timeout): the figures so far")
        cases = figures.get("cases", {})
        loads = {k: v for k, v in figures.items() if isinstance(v, dict) and "vs_raw_limit" in v}
        loads.update({f"variant {k}": v for k, v in figures.get("variants", {}).items()})
        loads.update({f"case {k}": v for k, v in cases.items() if isinstance(v, dict)})
        for name, f in loads.items():
            lines.append(
                f"{name}: {f['GiBps']:.2f} GiB/s (first {f['first_GiBps']:.2f}) "
                f"{f['vs_raw_limit']:.2f}x"
                + ("" if f["bitwise"] else " NOT BITWISE")
                + ("" if f.get("as_held", True) else " NOT EVEN AS A TPU HOLDS IT")
            )
        limits = {k: round(v, 2) for k, v in cases.items() if k.startswith("raw")}
        lines.append(f"best variant: {figures.get('best_variant')}; case limits {limits}")
        lines.append(f"object storage: {figures.get('object_storage')}")
    return "\n".join(lines)


SO_FAR: list[dict[str, Any]] = []  # the figures of the run under way (main's)


def _stopped(signum: int, frame: Any) -> None:
    """On SIGTERM (a ``timeout``), the figures so far, printed as the whole run's are."""
    print(json.dumps({**(SO_FAR[-1] if SO_FAR else {}), "stopped": True}, indent=1), flush=True)
    os._exit(124)


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, _stopped)
    if sys.argv[1:2] == ["--peak"]:  # (after a run that wrote the files: their folder)
        case = sys.argv[3] if len(sys.argv) > 3 else "renamed"
        print(json.dumps(peak(Path(sys.argv[2]), case), indent=1))
    elif sys.argv[1:2] == ["--summary"]:  # (the JSON files of a run)
        print(summary([Path(p) for p in sys.argv[2:]]))
    elif len(sys.argv) > 1:
        Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
        print(json.dumps(main(Path(sys.argv[1])), indent=1))
    else:
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(main(Path(folder)), indent=1))
