"""Quantized models: their bytes, the time ``tt.quantize`` takes, and a float32 checkpoint
quantized tensor by tensor as ``taktiny.io.load_safetensors`` streams it into an int8 model.

- Bytes: an MLP of 6 ``Linear(4096, 4096)`` (100.7M parameters) in float32 and quantized
  (int8 per channel; int4 per channel, in groups of 64 and of 128), as parameter bytes
  (the sum of ``nbytes`` over the leaves, each QArray whole: an int4 value counts half a
  byte) and as the size of its safetensors file (int4 packed two per byte).
- Time to quantize: ``tt.quantize(model, ...)`` of that model until its arrays are ready,
  after a first call compiled it, every layout's samples interleaved.
- Streaming: the streaming group's 1.07 GB float32 checkpoint (16 ``Linear(4096, 4096)``)
  loaded into ``tt.quantize(abstract)`` (int8, one scale per channel) and, for reference,
  into the int4 model in groups of 64, against the plain load of the same file into the
  abstract float model; cold page cache, interleaved rounds. Peak memory: each load in a
  fresh subprocess (``bench.memory``'s worker, with this module as its registry).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from . import _disk, _formats, checkpoint, memory
from ._results import Config, Group, Table, Target, fmt_time
from ._timing import compare, paired_ratio

# (width, depth): the MLP whose bytes and quantization time are measured, 100.7M
# parameters; the streamed checkpoint's model, the streaming group's 1.07 GB of float32
SIZES = {"full": (4096, 6), "quick": (1024, 6), "smoke": (128, 2)}
STREAMED = {"full": (4096, 16), "quick": (1024, 16), "smoke": (128, 2)}
FLOAT, INT8, INT4, INT4_G64, INT4_G128 = (
    "float32",
    "int8",
    "int4",
    "int4, groups of 64",
    "int4, groups of 128",
)
LAYOUTS = {INT8: (8, None), INT4: (4, None), INT4_G64: (4, 64), INT4_G128: (4, 128)}
PLAIN, QUANTIZING, QUANTIZING_4 = (
    "Taktiny, float32 model",
    "Taktiny, int8 model",
    "Taktiny, int4 model (groups of 64)",
)
COLD = "Taktiny, int8 model, XLA's first compile inside the load"  # memory only
# the targets of issue 13
SMALLER_8, SMALLER_4, QUANTIZE_S, GROWTH, SHARE = 3.9, 7.5, 5.0, 0.35, 0.7


def _warm_xla() -> None:
    """Compiles and runs one tiny unrelated program, as any process that has used JAX has:
    XLA's first compile maps its compiler's code into the process (tens of MB of RSS)."""
    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.zeros((), np.float32)))


def _quantized_target(abstracts: dict[str, Any], bits: int, group: int | None) -> Any:
    import taktiny as tt

    return tt.quantize(abstracts["taktiny"], bits=bits, group_size=group)


def _prepare(bits: int | None, group: int | None = None, warm: bool = True) -> Callable:
    """What a memory worker does before it notes its memory: the case's abstract target
    (the quantized model, built by ``tt.quantize`` of the abstract float model), and XLA
    warmed (see `_warm_xla`) unless the case measures XLA's first compile too."""

    def prepare(abstracts: dict[str, Any]) -> dict[str, Any]:
        if warm:
            _warm_xla()
        if bits is None:
            return abstracts
        return {**abstracts, "quantized": _quantized_target(abstracts, bits, group)}

    return prepare


def _load_quantized(path: Path, abstracts: dict[str, Any]) -> Any:
    import taktiny.io as tio

    return tio.load_safetensors(abstracts["quantized"], path, progress=False)


def _load_plain(path: Path, abstracts: dict[str, Any]) -> Any:
    import taktiny.io as tio

    return tio.load_safetensors(abstracts["taktiny"], path, progress=False)


CALL = "taktiny.io.load_safetensors(tt.quantize(abstract{}), path)"
RESTORE = {  # case -> (the call the report shows, load(path, abstracts)); memory's registry
    PLAIN: ("taktiny.io.load_safetensors(abstract, path)", _load_plain),
    QUANTIZING: (CALL.format(""), _load_quantized),
    QUANTIZING_4: (CALL.format(", bits=4, group_size=64"), _load_quantized),
    COLD: (CALL.format(""), _load_quantized),
}
NEEDS = {case: ["taktiny.io"] for case in RESTORE}
PREPARE = {  # case -> prepare(abstracts), run by the memory worker before it notes memory
    PLAIN: _prepare(None),
    QUANTIZING: _prepare(8),
    QUANTIZING_4: _prepare(4, 64),
    COLD: _prepare(8, warm=False),
}


def _bytes(config: Config) -> tuple[list[Table], list[Target], list[str]]:
    """Parameter bytes of the MLP, float32 and quantized, and the time to quantize it."""
    import taktiny as tt
    import taktiny.io as tio

    width, depth = SIZES[config.mode]
    model = _formats.Big(width, depth, rngs=_formats.nn.Rngs(0))
    count = sum(x.size for x in jax.tree.leaves(model))
    is_q = lambda x: isinstance(x, tt.QArray)

    def quantize(layout: str) -> Any:
        bits, group = LAYOUTS[layout]
        return jax.block_until_ready(tt.quantize(model, bits=bits, group_size=group))

    first = {}
    for layout in LAYOUTS:  # the first call compiles
        start = time.perf_counter()
        quantize(layout)
        first[layout] = time.perf_counter() - start
    stats = compare(
        {layout: (lambda layout=layout: quantize(layout)) for layout in LAYOUTS},
        repeat=config.pick(7, 3, 1),
        warmup=0,
    )
    models = {FLOAT: model, **{layout: quantize(layout) for layout in LAYOUTS}}
    params = {k: sum(x.nbytes for x in jax.tree.leaves(m, is_leaf=is_q)) for k, m in models.items()}
    files = {}
    path = Path(config.scratch) / "quantized-bytes.safetensors"
    try:
        for k, m in models.items():
            tio.save_safetensors(path, m)
            files[k] = _disk.size(path)
    finally:
        _disk.remove(path)
    systems = list(models)
    title = f"{depth} x Linear({width}, {width}), {count / 1e6:.1f}M parameters"
    table = Table(f"Bytes of the MLP, {title}", systems, unit="B", reference=FLOAT)
    for k in systems:
        table.add("parameter bytes (nbytes)", k, "sum of leaf.nbytes, QArrays whole", params[k])
        table.add("safetensors file", k, "taktiny.io.save_safetensors(path, model)", files[k])
    ratios = Table(
        "How many times smaller than float32", systems, unit="x", log=False, reference=FLOAT
    )
    for k in systems:
        ratios.add("parameter bytes", k, "float32 bytes / bytes", params[FLOAT] / params[k])
        ratios.add("safetensors file", k, "float32 bytes / bytes", files[FLOAT] / files[k])
    times = Table(f"Time to quantize the MLP ({title})", list(LAYOUTS), reference=INT8, log=True)
    for layout, st in stats.items():
        bits, group = LAYOUTS[layout]
        call = f"tt.quantize(model, bits={bits}, group_size={group})"
        times.add("tt.quantize", layout, call, st.median, (st.low, st.high))
    targets = [
        Target(
            f"int8 parameter bytes of a {count / 1e6:.0f}M-parameter MLP >= {SMALLER_8:g}x "
            "smaller than float32",
            params[FLOAT] / params[INT8],
            SMALLER_8,
            True,
            "float32 parameter bytes / int8 parameter bytes (QArray.nbytes: values and scales)",
        ),
        Target(
            f"int4 (one scale per channel) parameter bytes of the MLP >= {SMALLER_4:g}x smaller "
            "than float32",
            params[FLOAT] / params[INT4],
            SMALLER_4,
            True,
            "float32 parameter bytes / int4 parameter bytes (an int4 value counts half a byte)",
        ),
        *(
            Target(
                f"tt.quantize of the {count / 1e6:.0f}M-parameter MLP to {layout} under "
                f"{QUANTIZE_S:g} s",
                stats[layout].median,
                QUANTIZE_S,
                False,
                "seconds, median, arrays ready, after a first (compiling) call",
            )
            for layout in LAYOUTS
        ),
    ]
    notes = [
        f"The MLP: {depth} x Linear({width}, {width}), {count:,} parameters. Parameter bytes: "
        + ", ".join(f"{k} {v:,}" for k, v in params.items())
        + ". Float32 scales in groups of 64 add 1/16 byte per weight to the half byte of an "
        "int4 value, which caps that layout at 7.11x (groups of 128: 7.53x; one scale per "
        "channel: 7.97x); the int4 target is met by one scale per channel and by groups of "
        "128, not by groups of 64.",
        "In memory, JAX's CPU backend holds jnp.int4 arrays packed too: 64Mi int4 values "
        "raise the resident memory by 32 MiB (though on_device_size_in_bytes() reports a byte "
        "per value), so parameter bytes are what the arrays occupy, as the int4 streaming "
        "load's memory below also shows.",
        "Time to quantize: interleaved rounds after one compiling call each; the first calls "
        "(compile included) took "
        + ", ".join(f"{k} {fmt_time(v)}" for k, v in first.items())
        + ".",
    ]
    return [table, ratios, times], targets, notes


def _check(path: Path, model: Any, abstracts: dict[str, Any]) -> None:
    """The quantizing loads give tt.quantize of the float model, bitwise (checked once)."""
    import taktiny as tt

    for bits, group in ((8, None), (4, 64)):
        target = {**abstracts, "quantized": _quantized_target(abstracts, bits, group)}
        got = _load_quantized(path, target).flat_state_dict()
        want = tt.quantize(model, bits=bits, group_size=group).flat_state_dict()
        for name, value in want.items():
            a, b = np.asarray(got[name]), np.asarray(value)
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (bits, group, name)


def _streaming(config: Config) -> tuple[list[Table], list[Target], list[str]]:
    """The quantizing streaming load against the plain one: time and peak memory."""
    start = time.perf_counter()
    width, depth = STREAMED[config.mode]
    model = _formats.Big(width, depth, rngs=_formats.nn.Rngs(0))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(model))
    abstracts = _formats.abstracts(width, depth)
    root = Path(config.scratch)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "quantized-streaming.safetensors"
    try:
        import taktiny.io as tio

        tio.save_safetensors(path, model)
        _disk.sync(path)
        _check(path, model, abstracts)
        del model
        size = _disk.size(path)
        targets = {
            PLAIN: abstracts,
            QUANTIZING: {**abstracts, "quantized": _quantized_target(abstracts, 8, None)},
            QUANTIZING_4: {**abstracts, "quantized": _quantized_target(abstracts, 4, 64)},
        }
        cases: dict[str, Any] = {
            s: checkpoint._restore_case(path, RESTORE[s][1], targets[s]) for s in targets
        }
        stats = compare(cases, repeat=config.pick(5, 3, 1))
        memories = {s: memory._measure(s, path, width, depth, registry=__name__) for s in RESTORE}
    finally:
        _disk.remove(path)
    title = f"{depth} x Linear({width}, {width}), float32, {nbytes / 1e6:,.0f} MB"
    systems = [PLAIN, QUANTIZING, QUANTIZING_4]
    times = Table(f"Cold-cache streaming load of {title}", systems, reference=PLAIN, log=True)
    for s in systems:
        times.add("load", s, RESTORE[s][0], stats[s].median, (stats[s].low, stats[s].high))
    share = {s: paired_ratio(stats[PLAIN], stats[s]) for s in systems}
    shares = Table(
        "Throughput against the plain streaming load (plain time / time, median of per-round "
        "ratios)",
        systems,
        unit="x",
        log=False,
        line=SHARE,
        reference=PLAIN,
        label="plain load time / time",
    )
    for s in systems:
        shares.add("plain time / time", s, RESTORE[s][0], share[s])
    measured = list(RESTORE)
    mem = Table(f"Peak resident memory (MB) of one load, {size / 1e6:,.0f} MB", measured, unit="B")
    growth = {}
    for s in measured:
        r, call = memories[s], RESTORE[s][0]
        growth[s] = (r["peak"] - r["before"]) / size
        mem.add("checkpoint size on disk", s, call, size)
        mem.add("process RSS before the load", s, call, r["before"])
        mem.add("peak RSS", s, call, r["peak"])
        mem.add("peak RSS growth (peak - before)", s, call, r["peak"] - r["before"])
    ratios = Table(
        "Peak RSS growth relative to the checkpoint's size",
        measured,
        unit="x",
        log=False,
        line=GROWTH,
        reference=PLAIN,
    )
    for s in measured:
        ratios.add("growth / checkpoint size", s, RESTORE[s][0], growth[s])
    gb = f"the {size / 1e9:.2f} GB float32 checkpoint"
    targets_out = [
        Target(
            f"Streaming {gb} into an abstract int8 model: peak RSS growth <= {GROWTH:g}x "
            "checkpoint size",
            growth[QUANTIZING],
            GROWTH,
            False,
            "(peak RSS - RSS just before the load) / checkpoint bytes, XLA warmed (see notes)",
        ),
        Target(
            f"Streaming {gb} into an abstract int8 model >= {SHARE:g}x the plain streaming "
            "load's throughput",
            share[QUANTIZING],
            SHARE,
            True,
            "plain load time / quantizing load time, median of per-round ratios",
        ),
    ]
    first_compile = memories[COLD]["peak"] - memories[COLD]["before"]
    first_compile -= memories[QUANTIZING]["peak"] - memories[QUANTIZING]["before"]
    rounds = {
        s: ", ".join(
            f"{p / x:.2f}" for p, x in zip(stats[PLAIN].samples, stats[s].samples, strict=True)
        )
        for s in systems[1:]
    }
    notes = [
        f"Streaming: {gb} (written by taktiny.io.save_safetensors from {title}); the "
        "quantizing loads were checked once against tt.quantize of the float model, bitwise. "
        "The file's pages are dropped from the page cache before each sample; one warm-up "
        f"sample per case (it compiles the quantization), then {config.pick(5, 3, 1)} "
        f"interleaved rounds. Plain time / time round by round: "
        + "; ".join(f"{s} {r}" for s, r in rounds.items())
        + f". Load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())} on "
        f"{os.cpu_count()} cores. The quantizing load reads each float tensor into one reused "
        "buffer while the OS reads ahead, and XLA quantizes it there (one float tensor at a "
        "time on top of the int8 model: 0.25x + 1/16 here). It can beat the plain load: that "
        "one maps and fills a fresh buffer for every tensor (1.07 GB of new pages, which it "
        "keeps as the model), this one refills one buffer and keeps a quarter of the bytes. "
        "The int4 load is slower because XLA's int4 rounding is (tt.quantize to int4 takes "
        "about four times as long as to int8, in the table above).",
        "Memory: each load in a fresh subprocess, one at a time; 'before' is its resident "
        "memory after importing taktiny.io, building the abstract target (tt.quantize of the "
        "abstract float model) and running one tiny unrelated jitted program; peak is VmHWM. "
        f"That program stands for any use of JAX before the load: XLA's first compile maps "
        f"its compiler's code into the process. The case '{COLD}' skips it, so its growth "
        f"also holds that first compile (file-backed code pages and XLA's runtime, "
        f"{first_compile / 1e6:,.0f} MB here, the same for any checkpoint size). Load time inside "
        "the worker (page cache not dropped): "
        + ", ".join(f"{s} {r['seconds']:.2f} s" for s, r in memories.items())
        + f". Group wall time {time.perf_counter() - start:.0f} s.",
    ]
    return [times, shares, mem, ratios], targets_out, notes


def run(config: Config) -> Group:
    """Measures the quantized bytes and quantization time, then the quantizing load."""
    start = time.perf_counter()
    group = Group("quantized", "Quantized models: bytes, quantizing, quantizing while streaming")
    for part in (_bytes, _streaming):
        tables, targets, notes = part(config)
        group.tables += tables
        group.targets += targets
        group.notes += notes
    group.seconds = time.perf_counter() - start
    return group
