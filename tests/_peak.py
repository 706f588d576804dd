"""The peak host memory of loads that go through scratch buffers and temporaries, predicted
by ``plan_load`` and measured, for tests/loading/test_plan_peak.py. Run as a program in a fresh
interpreter (``python tests/_peak.py FOLDER CASE...``, case numbers: FOLDER holds
``f.safetensors`` and ``fp8/``, the same weights in FP8 blocks), with glibc's malloc
told to map every block of 1 MiB or more on its own (``MALLOC_MMAP_THRESHOLD_``): by
default it keeps freed blocks of up to 32 MiB for later, and a load would then grow the
process by less than it holds, reusing what the one before it freed (a 52 MB prediction
measured 35 MB). Each case is planned, loaded once (compiling what it runs, which a second
load does not repeat), and loaded again with the kernel's high-water mark of the process's
resident memory reset just before (``/proc/self/clear_refs``); the measured peak is that
mark less the memory just before the load. Prints one JSON line per case.
"""

from __future__ import annotations

import gc
import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before the backend starts

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import taktiny as tt  # noqa: E402
from taktiny import convert as cv  # noqa: E402
from taktiny import nn  # noqa: E402
from taktiny.io import load_safetensors, open_safetensors, plan_load  # noqa: E402

# the checkpoint's float32 tensors, in the file's order: the two scratch buffers take turns,
# the first holding 16 MiB then 4, the second 24 MiB then 32; one buffer holds all four
SHAPES = {"w0": (1024, 4096), "w1": (1536, 4096), "w2": (256, 4096), "w3": (2048, 4096)}
TRANSPOSE = [cv.Rule("{n}", "{n}", cv.transpose())]


def _sharded(shape: tuple[int, ...], dtype: object, spec: P) -> jax.ShapeDtypeStruct:
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), spec)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _linears() -> dict[str, nn.Linear]:
    return {n: nn.Linear(*s, use_bias=False, rngs=nn.Rngs(0)) for n, s in SHAPES.items()}


FP8 = [cv.Rule("{n}.weight", "{n}", cv.transpose())]  # the FP8 folder's [out, in] weights


def case(name: str) -> tuple[object, list[cv.Rule] | None]:
    """The target and rules of each load (the FP8 cases' rules made for their folder)."""
    if name == "FP8 blocks into bfloat16 (dequantized in float32, cast)":
        return {n: jax.ShapeDtypeStruct(s, jnp.bfloat16) for n, s in SHAPES.items()}, FP8
    if name == "FP8 blocks into int8 (dequantized, then quantized)":
        kernels = [cv.Rule("{n}.weight", "{n}.kernel", cv.transpose())]
        return tt.quantize(jax.eval_shape(_linears), bits=8), kernels
    if name == "cast to bfloat16 (two scratch buffers)":
        return {n: jax.ShapeDtypeStruct(s, jnp.bfloat16) for n, s in SHAPES.items()}, None
    if name == "quantizing to int8 (one scratch buffer)":
        return tt.quantize(jax.eval_shape(_linears), bits=8), [cv.Rule("{n}", "{n}.kernel")]
    if name == "transposing rule and a cast (scratch buffers, the transform's results)":
        return {
            n: jax.ShapeDtypeStruct(s[::-1], jnp.bfloat16) for n, s in SHAPES.items()
        }, TRANSPOSE
    if name == "transposing rule onto 8 devices (whole arrays cut into blocks)":
        return {
            n: _sharded(s[::-1], jnp.float32, P(None, "x")) for n, s in SHAPES.items()
        }, TRANSPOSE
    if name == "inner split on 8 devices (blocks cut from rows)":
        return {n: _sharded(s, jnp.float32, P(None, "x")) for n, s in SHAPES.items()}, None
    raise ValueError(name)


CASES = [
    "cast to bfloat16 (two scratch buffers)",
    "quantizing to int8 (one scratch buffer)",
    "transposing rule and a cast (scratch buffers, the transform's results)",
    "transposing rule onto 8 devices (whole arrays cut into blocks)",
    "inner split on 8 devices (blocks cut from rows)",
    "FP8 blocks into bfloat16 (dequantized in float32, cast)",
    "FP8 blocks into int8 (dequantized, then quantized)",
]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


def measure(folder: str, name: str) -> dict[str, object]:
    model, rules = case(name)
    path = f"{folder}/f.safetensors"
    if name.startswith("FP8"):  # the same weights as FP8 blocks, [out, in], beside config.json
        path = f"{folder}/fp8"
        rules = cv.quantized_rules(rules or [], open_safetensors(path))
    plan = plan_load(model, path, rules=rules)
    jax.block_until_ready(load_safetensors(model, path, rules=rules))  # (compiles, then freed)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the memory now
    before = _status("VmRSS")
    loaded = load_safetensors(model, path, rules=rules)
    jax.block_until_ready(loaded)
    peak = max(_status("VmHWM"), before)
    del loaded
    gc.collect()
    return {
        "case": name,
        "predicted": plan.peak_host_bytes,
        "scratch": plan.scratch_bytes,
        "measured": peak - before,
        "ways": sorted({s.way for s in plan.steps}),
        "held": plan.held_bytes,  # (what max_host_bytes counts, at most, beyond the arrays)
        "arrays": plan.peak_host_bytes - plan.scratch_bytes,  # (the model's, on the host)
    }


if __name__ == "__main__":
    for k in sys.argv[2:]:
        print(json.dumps(measure(sys.argv[1], CASES[int(k)])), flush=True)
