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
- FP8 (issue 40): a model of bias-free ``Linear(4096, 4096)`` layers (64 of them: a
  1.07 GB Hugging Face FP8 block-scaled checkpoint, ``float8_e4m3fn`` weights ``[out, in]``
  with a float32 ``weight_scale_inv`` per 128x128 block and its ``config.json``) loaded by
  ``taktiny.convert.quantized_rules`` into the abstract bfloat16 model and into
  ``tt.quantize`` of it (int8), against streaming the bfloat16 checkpoint of the same
  weights (2.15 GB, the dequantized FP8 values) into the bfloat16 model with the same
  transposing rules; cold page cache, interleaved rounds. Peak host memory of each load in a
  fresh subprocess, its growth against the loaded model's bytes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
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
# (width, depth) of the FP8 group's bias-free model: 64 x 4096 x 4096 is 1.07 GB of FP8
FP8_SIZES = {"full": (4096, 64), "quick": (1024, 16), "smoke": (128, 2)}
BF16_REF, FP8_BF16, FP8_INT8 = (
    "bf16 checkpoint -> bf16 model",
    "FP8 checkpoint -> bf16 model",
    "FP8 checkpoint -> int8 model",
)
FP8_CASES = [BF16_REF, FP8_BF16, FP8_INT8]
FP8_SHARE, FP8_GROWTH = 0.8, 1.05  # the targets of issue 40, point 4
BLOCK, E4M3_MAX = 128, 448.0
FP8_CONFIG = {
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
}


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
STREAMING_CASES = list(RESTORE)  # the float32 streaming part's (the FP8 part's follow)


class Bare(_formats.nn.Module):
    """`depth` bias-free ``Linear(width, width)`` layers, parameters in `param_dtype`."""

    def __init__(self, width: int, depth: int, *, param_dtype: Any, rngs: Any):
        nn = _formats.nn
        self.layers = [
            nn.Linear(width, width, use_bias=False, param_dtype=param_dtype, rngs=rngs)
            for _ in range(depth)
        ]


def _fp8_abstracts(width: int, depth: int) -> dict[str, Any]:
    """The bfloat16 model as shapes only (``jax.eval_shape``): what the FP8 loads read into."""
    shapes = jax.eval_shape(
        lambda: Bare(width, depth, param_dtype=jnp.bfloat16, rngs=_formats.nn.Rngs(0))
    )
    return {"taktiny": shapes}


def _fp8_rules() -> list[Any]:
    """The rules of the float checkpoint: each torch ``layers.{i}.weight`` [out, in]
    transposed into ``layers.{i}.kernel`` [in, out]."""
    import taktiny.convert as cv

    return cv.linear("layers.{i}", "layers.{i}", bias=False)


def _load_bf16(path: Path, abstracts: dict[str, Any]) -> Any:
    import taktiny.io as tio

    return tio.load_safetensors(abstracts["taktiny"], path, rules=_fp8_rules(), progress=False)


def _load_fp8(path: Path, abstracts: dict[str, Any], target: str = "taktiny") -> Any:
    """The FP8 checkpoint at `path` (its config.json beside it) into ``abstracts[target]``:
    opened, its rules made by quantized_rules, loaded."""
    import taktiny.convert as cv
    import taktiny.io as tio

    checkpoint = tio.open_safetensors(path)
    rules = cv.quantized_rules(_fp8_rules(), checkpoint)
    return tio.load_safetensors(abstracts[target], checkpoint, rules=rules, progress=False)


FP8_CALL = (
    "ckpt = taktiny.io.open_safetensors(path); taktiny.io.load_safetensors({}, ckpt, "
    "rules=cv.quantized_rules(cv.linear('layers.{{i}}', 'layers.{{i}}', bias=False), ckpt))"
)
RESTORE |= {
    BF16_REF: (
        "taktiny.io.load_safetensors(abstract, path, rules=cv.linear('layers.{i}', "
        "'layers.{i}', bias=False))",
        _load_bf16,
    ),
    FP8_BF16: (FP8_CALL.format("abstract"), _load_fp8),
    FP8_INT8: (FP8_CALL.format("tt.quantize(abstract)"), lambda p, a: _load_fp8(p, a, "quantized")),
}
NEEDS |= {case: ["taktiny.io", "taktiny.convert"] for case in FP8_CASES}
PREPARE |= {BF16_REF: _prepare(None), FP8_BF16: _prepare(None), FP8_INT8: _prepare(8)}
ABSTRACTS = {case: _fp8_abstracts for case in FP8_CASES}  # the memory worker's targets


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


def _speed_tables(
    title: str, against: str, reference: str, stats: dict[str, Any], cases: list[str], line: float
) -> tuple[Table, Table, dict[str, float]]:
    """The load-time table of `cases` (the first the reference) and their speed against it
    (the reference's time / time, median of per-round ratios): both tables, and the speeds."""
    first = cases[0]
    times = Table(title, cases, reference=first, log=True)
    for s in cases:
        times.add("load", s, RESTORE[s][0], stats[s].median, (stats[s].low, stats[s].high))
    share = {s: paired_ratio(stats[first], stats[s]) for s in cases}
    label = f"{reference} load time / time"
    shares = Table(
        f"{against} ({label}, median of per-round ratios)",
        cases,
        unit="x",
        log=False,
        line=line,
        reference=first,
        label=label,
    )
    for s in cases:
        shares.add(label, s, RESTORE[s][0], share[s])
    return times, shares, share


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
        memories = {
            s: memory._measure(s, path, width, depth, registry=__name__) for s in STREAMING_CASES
        }
    finally:
        _disk.remove(path)
    title = f"{depth} x Linear({width}, {width}), float32, {nbytes / 1e6:,.0f} MB"
    systems = [PLAIN, QUANTIZING, QUANTIZING_4]
    times, shares, share = _speed_tables(
        f"Cold-cache streaming load of {title}",
        "Throughput against the plain streaming load",
        "plain",
        stats,
        systems,
        SHARE,
    )
    measured = STREAMING_CASES
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


def _fp8_blocks(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`weight` [out, in] as Hugging Face's FP8 checkpoints hold it: float8_e4m3fn values and
    a float32 ``weight_scale_inv`` per 128x128 block, amax(|block|) / 448, so that
    ``value * scale_inv`` is the weight to e4m3's precision."""
    import ml_dtypes

    out, inn = weight.shape
    assert out % BLOCK == 0 and inn % BLOCK == 0, weight.shape  # whole blocks here
    blocks = weight.reshape(out // BLOCK, BLOCK, inn // BLOCK, BLOCK)
    scale = (np.abs(blocks).max(axis=(1, 3)) / np.float32(E4M3_MAX)).astype(np.float32)
    scale[scale == 0] = 1
    values = np.clip(blocks / scale[:, None, :, None], -E4M3_MAX, E4M3_MAX)
    return values.reshape(out, inn).astype(ml_dtypes.float8_e4m3fn), scale


def _dequantized(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The weight the FP8 values and block scales stand for, ``values * scale_inv`` in
    float32 (exact), rounded once to bfloat16: the bfloat16 checkpoint's tensor."""
    import ml_dtypes

    out, inn = values.shape
    blocks = values.astype(np.float32).reshape(out // BLOCK, BLOCK, inn // BLOCK, BLOCK)
    return (blocks * scale[:, None, :, None]).reshape(out, inn).astype(ml_dtypes.bfloat16)


def _write_fp8_pair(width: int, depth: int, bf16: Path, fp8: Path) -> None:
    """Writes the two checkpoints of one random model (uniform weights of LeCun's variance):
    the FP8 one (weights, block scales, and its config.json beside it) and the bfloat16 one
    holding the same values dequantized, both with safetensors' NumPy API, durably."""
    import safetensors.numpy

    rng = np.random.default_rng(0)
    bound = np.float32(np.sqrt(3.0 / width))
    floats, quantized = {}, {}
    for i in range(depth):
        weight = (rng.random((width, width), dtype=np.float32) * 2 - 1) * bound
        values, scale = _fp8_blocks(weight)
        floats[f"layers.{i}.weight"] = _dequantized(values, scale)
        quantized[f"layers.{i}.weight"] = values
        quantized[f"layers.{i}.weight_scale_inv"] = scale
    for path, tensors in ((bf16, floats), (fp8, quantized)):
        path.parent.mkdir(parents=True, exist_ok=True)
        safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    (fp8.parent / "config.json").write_text(json.dumps(FP8_CONFIG, indent=2))
    for path in (bf16, fp8):
        _disk.sync(path.parent)


def _model_bytes(model: Any) -> int:
    """The bytes of a model's leaves (arrays or shapes), each QArray whole (its nbytes)."""
    import taktiny as tt

    is_q = lambda x: isinstance(x, tt.QArray)
    leaves = jax.tree.leaves(model, is_leaf=is_q)
    return sum(
        x.nbytes if is_q(x) else int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves
    )


def _check_fp8(paths: dict[str, Path], targets: dict[str, dict[str, Any]]) -> str:
    """The FP8 load into the bfloat16 model gives the bfloat16 checkpoint's load, bitwise;
    the one into the int8 model, tt.quantize of that (checked once). Returns what the int8
    comparison found, for the notes."""
    import taktiny as tt

    reference = RESTORE[BF16_REF][1](paths[BF16_REF], targets[BF16_REF])
    want = reference.flat_state_dict()
    got = RESTORE[FP8_BF16][1](paths[FP8_BF16], targets[FP8_BF16]).flat_state_dict()
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name, value in want.items():
        a, b = np.asarray(got[name]), np.asarray(value)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
    del got
    want = tt.quantize(reference).flat_state_dict()
    got = RESTORE[FP8_INT8][1](paths[FP8_INT8], targets[FP8_INT8]).flat_state_dict()
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    differ = []
    for name, value in want.items():
        a, b = np.asarray(got[name]), np.asarray(value)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.tobytes() != b.tobytes():
            differ.append((name, float(np.max(np.abs(a.astype(np.float64) - b)))))
    if not differ:
        return "bitwise tt.quantize of the bfloat16 load"
    worst = max(differ, key=lambda x: x[1])
    return (
        f"tt.quantize of the bfloat16 load except in {len(differ)} of {len(want)} arrays "
        f"(largest difference {worst[1]:g}, in {worst[0]})"
    )


def _fp8(config: Config) -> tuple[list[Table], list[Target], list[str]]:
    """FP8 block-scaled checkpoint into a bfloat16 and an int8 model, against streaming the
    bfloat16 checkpoint of the same weights: time and peak memory (issue 40, point 4)."""
    start = time.perf_counter()
    width, depth = FP8_SIZES[config.mode]
    root = Path(config.scratch)
    folders = {"bf16": root / "fp8-bench-bf16", "fp8": root / "fp8-bench-fp8"}
    bf16_path = folders["bf16"] / "model.safetensors"
    fp8_path = folders["fp8"] / "model.safetensors"
    paths = {BF16_REF: bf16_path, FP8_BF16: fp8_path, FP8_INT8: fp8_path}
    repeat = config.pick(5, 3, 1)
    try:
        write_start = time.perf_counter()
        _write_fp8_pair(width, depth, bf16_path, fp8_path)
        written = time.perf_counter() - write_start
        sizes = {"bf16": _disk.size(bf16_path), "fp8": _disk.size(fp8_path)}
        abstracts = _fp8_abstracts(width, depth)
        targets = {s: PREPARE[s](abstracts) for s in FP8_CASES}
        model_bytes = {
            BF16_REF: _model_bytes(targets[BF16_REF]["taktiny"]),
            FP8_BF16: _model_bytes(targets[FP8_BF16]["taktiny"]),
            FP8_INT8: _model_bytes(targets[FP8_INT8]["quantized"]),
        }
        checked = _check_fp8(paths, targets)
        cases: dict[str, Any] = {
            s: checkpoint._restore_case(paths[s], RESTORE[s][1], targets[s]) for s in FP8_CASES
        }
        stats = compare(cases, repeat=repeat)
        memories = {
            s: memory._measure(s, paths[s], width, depth, registry=__name__) for s in FP8_CASES
        }
    finally:
        for folder in folders.values():
            _disk.remove(folder)
    gb = {k: f"{v / 1e9:.2f} GB" if v >= 1e8 else f"{v / 1e6:.3g} MB" for k, v in sizes.items()}
    title = f"{depth} x Linear({width}, {width}) without bias"
    times, shares, share = _speed_tables(
        f"Cold-cache load of {title}: FP8 checkpoint {gb['fp8']}, bfloat16 {gb['bf16']}",
        "Speed against streaming the bfloat16 checkpoint",
        "bf16",
        stats,
        FP8_CASES,
        FP8_SHARE,
    )
    mem = Table(f"Peak resident memory (MB) of one load, {title}", FP8_CASES, unit="B")
    growth = {}
    for s in FP8_CASES:
        r, call = memories[s], RESTORE[s][0]
        growth[s] = (r["peak"] - r["before"]) / model_bytes[s]
        mem.add("checkpoint size on disk", s, call, sizes["bf16" if s == BF16_REF else "fp8"])
        mem.add("loaded model bytes", s, call, model_bytes[s])
        mem.add("process RSS before the load", s, call, r["before"])
        mem.add("peak RSS", s, call, r["peak"])
        mem.add("peak RSS growth (peak - before)", s, call, r["peak"] - r["before"])
    ratios = Table(
        "Peak RSS growth relative to the loaded model's bytes",
        FP8_CASES,
        unit="x",
        log=False,
        line=FP8_GROWTH,
        reference=BF16_REF,
    )
    for s in FP8_CASES:
        ratios.add("growth / model bytes", s, RESTORE[s][0], growth[s])
    fp8_gb = f"the {gb['fp8']} FP8 block-scaled checkpoint"
    model = {FP8_BF16: "bfloat16", FP8_INT8: "int8 (tt.quantize)"}
    targets_out = [
        *(
            Target(
                f"Loading {fp8_gb} into an abstract {model[s]} model >= {FP8_SHARE:g}x the "
                "speed of streaming the bfloat16 checkpoint of the same model",
                share[s],
                FP8_SHARE,
                True,
                "bf16 checkpoint load time / FP8 load time, median of per-round ratios, cold "
                "page cache",
            )
            for s in (FP8_BF16, FP8_INT8)
        ),
        *(
            Target(
                f"Loading {fp8_gb} into an abstract {model[s]} model: peak RSS growth <= "
                f"{FP8_GROWTH:g}x the loaded model's bytes",
                growth[s],
                FP8_GROWTH,
                False,
                "(peak RSS - RSS just before the load) / model bytes (leaf nbytes, QArrays "
                "whole), XLA warmed",
            )
            for s in (FP8_BF16, FP8_INT8)
        ),
    ]
    rounds = {
        s: ", ".join(
            f"{p / x:.2f}" for p, x in zip(stats[BF16_REF].samples, stats[s].samples, strict=True)
        )
        for s in FP8_CASES[1:]
    }
    notes = [
        f"FP8: {title}, {depth * width * width / 1e6:,.1f}M parameters, uniform random weights "
        f"of LeCun's variance. The FP8 checkpoint ({sizes['fp8']:,} bytes) holds each "
        "layers.{i}.weight [out, in] as float8_e4m3fn with a float32 weight_scale_inv per "
        f"128x128 block (amax / 448), and a config.json beside it with "
        f"{json.dumps(FP8_CONFIG['quantization_config'])}; the bfloat16 checkpoint "
        f"({sizes['bf16']:,} bytes) holds the same weights dequantized (value x scale in "
        "float32, rounded once to bfloat16); both written by safetensors.numpy.save_file "
        f"({written:.0f} s with the random weights). Loaded model bytes: "
        + ", ".join(f"{s} {b:,}" for s, b in model_bytes.items())
        + f". Checked once: the FP8 load into the bfloat16 model gives the bfloat16 "
        f"checkpoint's load bitwise, and the one into the int8 model gives {checked}.",
        "Time: the checkpoint's pages are dropped from the page cache before each sample; one "
        f"warm-up sample per case (it compiles the dequantization), then {repeat} interleaved "
        "rounds. bf16 load time / time round by round: "
        + "; ".join(f"{s} {r}" for s, r in rounds.items())
        + f". Load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())} on "
        f"{os.cpu_count()} cores.",
        "Memory: each load in a fresh subprocess; 'before' is its resident memory after "
        "importing taktiny.io and taktiny.convert, building the abstract target "
        "(jax.eval_shape of the bfloat16 model; tt.quantize of it for int8) and running one "
        "tiny unrelated jitted program; peak is VmHWM; growth is taken against the bytes of "
        "the model the load returns (int8 values and their bfloat16 scales for the int8 one). "
        "Load time inside the worker (page cache not dropped): "
        + ", ".join(f"{s} {r['seconds']:.2f} s" for s, r in memories.items())
        + f". Part wall time {time.perf_counter() - start:.0f} s.",
        "How an FP8 load runs (taktiny/loading/README.md): each weight is read already "
        "transposed into the scratch buffer, a byte a weight, and one XLA program multiplies "
        "each block by its scale by broadcasting and rounds the product once into the "
        "leaf's dtype (into bfloat16 XLA fuses the float32 product away; two scratch "
        "buffers let the next weight be read meanwhile). For an int8 leaf the same program "
        "quantizes without holding the product: the scales from each block's largest "
        "float8 byte times its scale, the values in one pass over the bytes (8 ms and no "
        "temporaries for a 4096 x 4096 weight, where quantizing the product took 47 ms and "
        "96 MiB); a quantizing load reads through one scratch buffer. Warm (the worker "
        "times above) the int8 load waits for each transposed read, which the cold-cache "
        "rounds hide behind the disk; bench/FINDINGS.md section 13 has the profile.",
    ]
    return [times, shares, mem, ratios], targets_out, notes


def run(config: Config) -> Group:
    """Measures the quantized bytes and quantization time, then the quantizing load."""
    start = time.perf_counter()
    group = Group(
        "quantized",
        "Quantized models: bytes, quantizing, quantizing while streaming, FP8 checkpoints",
    )
    for part in (_bytes, _streaming, _fp8):
        tables, targets, notes = part(config)
        group.tables += tables
        group.targets += targets
        group.notes += notes
    group.seconds = time.perf_counter() - start
    return group
