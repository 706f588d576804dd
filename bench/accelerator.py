"""Loads and saves on an accelerator (issue 52, points 3 to 5), and quantized, adapted and
scanned compute there (issue 53): bench/device_load.py's, bench/device_save.py's,
bench/device_quantized.py's, bench/device_lora.py's and bench/device_scanned.py's
measurements on whatever accelerator JAX's default device is (a TPU, a GPU), reported with
the device named, beside the same ratios measured on the CPU by the groups ``streaming``
(the load against the raw read), ``background`` (the background save against a host copy,
and the training loop), ``lora`` (LoRA against full fine-tuning) and ``scanned`` (the
scanned step against the unrolled one).

- On an accelerator the group runs the scripts' ``main`` (the save first), and in a full
  run writes what they printed to bench/accelerator.json, each part as it ends.
- Without one (JAX's default device a CPU) it measures nothing: it reports the figures of
  the last run on an accelerator, from bench/accelerator.json, or is skipped when there
  are none. ``BENCH_ACCELERATOR_ON_CPU=1`` runs it on the CPU anyway, small (a check that
  the code runs; the figures mean nothing there, and no file is written).

    python bench/run.py --only accelerator --out /tmp/report   # on the accelerator's host
    python bench/run.py --only accelerator --merge             # then here: into results.md
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax

from ._results import Config, Group, Skipped, Table, Target

HERE = Path(__file__).resolve().parent
FIGURES = HERE / "accelerator.json"  # the last run on an accelerator
ON_CPU = "BENCH_ACCELERATOR_ON_CPU"
# device_load's figures (GiB/s) by their keys, named for the report
LOADS = {
    "taktiny": "Taktiny",
    "raw_read": "raw: file read (8 threads, reused buffers)",
    "raw_device_put": "raw: jax.device_put of host arrays",
    "raw_pipeline": "raw: read and device_put pipelined",
    "safetensors_flax": "safetensors.flax",
    "orbax": "Orbax restore",
    "device_put_loop": "safetensors.numpy + device_put",
}


def run(config: Config) -> Group:
    """Measures on the accelerator, or reports bench/accelerator.json (see the module)."""
    start = time.perf_counter()
    device = jax.devices()[0]
    forced = bool(os.environ.get(ON_CPU))
    if device.platform == "cpu" and not forced:
        if not FIGURES.exists():
            raise Skipped(
                f"no accelerator (JAX's default device is {device.platform}) and no figures "
                f"of an earlier run in {FIGURES.name}; run it on an accelerator's host, or "
                f"set {ON_CPU}=1 to try the code here"
            )
        figures = json.loads(FIGURES.read_text())
        print(
            f"[bench] accelerator: no accelerator here; reporting the figures measured on "
            f"{figures['device']} ({figures['date']}) from bench/{FIGURES.name}",
            flush=True,
        )
        group = build(figures, _twins())
        group.run = {
            "command": figures["command"],
            "mode": "full",
            "seconds": figures["seconds"],
        }
        return group
    figures = measure(config, small=device.platform == "cpu")
    figures["seconds"] = round(time.perf_counter() - start, 1)
    if config.mode == "full" and device.platform != "cpu":
        FIGURES.write_text(json.dumps(figures, indent=1) + "\n")
    group = build(figures, _twins())
    group.seconds = time.perf_counter() - start
    return group


def measure(config: Config, small: bool) -> dict[str, Any]:
    """Runs device_save's, device_load's, device_quantized's, device_lora's and
    device_scanned's ``main`` (in scratch folders); a part that fails is recorded with its
    error, not raised (the others' figures still count). A full run on an accelerator
    writes bench/accelerator.json after each part."""
    if small:  # (device_load and device_quantized take their sizes from the environment)
        os.environ.setdefault("DEVICE_LOAD_LAYERS", "2")
        for name, value in (("LAYERS", "2"), ("WIDTH", "256"), ("REPEATS", "2")):
            os.environ.setdefault(f"DEVICE_Q_{name}", value)
    from . import device_load, device_lora, device_quantized, device_save, device_scanned

    device = jax.devices()[0]
    figures: dict[str, Any] = {
        "device": str(device.device_kind),
        "platform": device.platform,
        "jax": jax.__version__,
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]).replace(str(HERE.parent) + "/", ""),
    }
    parts = {
        "save": lambda folder: device_save.main(folder, small=small or None),
        "load": device_load.main,
        "quantized": lambda folder: device_quantized.main(),
        "lora": lambda folder: device_lora.main(small),
        "scanned": lambda folder: device_scanned.main(["--smoke"] if small else []),
    }
    for name, part in parts.items():
        folder = Path(config.scratch) / f"device_{name}"
        folder.mkdir(parents=True, exist_ok=True)
        print(f"[bench] accelerator: {name} on {figures['device']} ...", flush=True)
        try:
            figures[name] = part(folder)
        except Exception as error:  # noqa: BLE001 - recorded; the other part goes on
            traceback.print_exc()
            figures[name] = {"error": f"{type(error).__name__}: {error}"}
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if config.mode == "full" and device.platform != "cpu":
            FIGURES.write_text(json.dumps(figures, indent=1) + "\n")
    return figures


def _twins() -> dict[str, float]:
    """The CPU twins of the group's ratios, from the CPU run in bench/results.json (those
    it has): the streaming load against the raw read, the background save's call against
    a host copy, the training loop saving in the background against no saves, the LoRA
    step against full fine-tuning, and the scanned step against the unrolled one (as a
    user gets `nn.Stack`, and with ``remat=dots_saveable``)."""
    path = HERE / "results.json"
    if not path.exists():
        return {}
    groups = {g["name"]: g for g in json.loads(path.read_text())}
    twins: dict[str, float] = {}
    for target in groups.get("streaming", {}).get("targets", []):
        if target["goal"].startswith("Taktiny streaming load of the") and "raw" in target["goal"]:
            twins["load"] = target["value"]
    for target in groups.get("background", {}).get("targets", []):
        if target["goal"].startswith("a background save blocks its caller"):
            twins["background"] = target["value"]
    for target in groups.get("lora", {}).get("targets", []):
        if target["goal"].startswith("a LoRA training step (rank 8 on every layer)"):
            twins["lora"] = target["value"]
    for target in groups.get("scanned", {}).get("targets", []):
        if target["goal"].startswith("training step time, scanned <="):
            twins["scanned"] = target["value"]
        if target["goal"].startswith("training step time, scanned with remat=dots_saveable"):
            twins["scanned_remat"] = target["value"]
    for table in groups.get("background", {}).get("tables", []):
        if table["title"].startswith("a training loop"):
            row = table["rows"].get("a step", {})
            if "wait=False" in row and "no saves" in row:
                twins["training"] = row["wait=False"]["value"] / row["no saves"]["value"]
    return twins


def build(figures: dict[str, Any], twins: dict[str, float]) -> Group:
    """The group's tables, targets and notes from the scripts' figures (`figures`, as
    bench/accelerator.json holds them) and the CPU twins (`_twins`)."""
    kind = figures["device"]
    save, load = figures.get("save", {}), figures.get("load", {})
    group = Group("accelerator", f"Loads, saves and training on an accelerator: {kind}")
    ratios = Table(
        f"Ratios on {kind}, beside their CPU twins (bench/results.json)",
        [kind, "CPU twin"],
        unit="x",
        reference=kind,
        log=False,
    )
    if "taktiny_vs_raw_limit" in load:
        gib = load["GiB"]
        table = Table(
            f"Loading a {gib:.2g} GiB bfloat16 safetensors file onto {kind}",
            [LOADS.get(k, k) for k in _speeds(load)],
            reference="Taktiny",
        )
        for key, speed in _speeds(load).items():
            call = "bench/device_load.py" + (" (bitwise)" if load.get(f"{key}_bitwise") else "")
            table.add("the load", LOADS.get(key, key), call, gib / speed)
        group.tables.append(table)
        op = "load / the raw limit (>= 0.8; CPU: >= 0.85 the raw read)"
        ratios.add(op, kind, "bench/device_load.py", load["taktiny_vs_raw_limit"])
        if "load" in twins:
            ratios.add(op, "CPU twin", "group streaming", twins["load"])
        group.targets.append(
            Target(
                f"a load onto {kind} >= 0.8x the raw limit (the slower of the file read and "
                f"jax.device_put)",
                load["taktiny_vs_raw_limit"],
                0.8,
                True,
                "Taktiny's GiB/s / the raw limit's (bench/device_load.py)",
            )
        )
    if "taktiny_vs_raw_pipeline" in load:
        group.targets.append(
            Target(
                f"a load onto {kind} >= 0.8x the raw pipeline (the file read into reused "
                f"buffers, each piece copied by jax.device_put as it is read)",
                load["taktiny_vs_raw_pipeline"],
                0.8,
                True,
                "Taktiny's GiB/s / the raw pipeline's (bench/device_load.py)",
            )
        )
    cases = {k: v for k, v in load.get("cases", {}).items() if isinstance(v, dict)}
    cases = {k: v for k, v in cases.items() if "vs_raw_pipeline" in v}
    if cases:
        _case_table(group, cases, kind)
    if "save_vs_raw" in save:
        _save_tables(group, ratios, save, twins, kind)
    quantized = figures.get("quantized", {})
    if "batch_1" in quantized:
        _quantized_tables(group, quantized, kind)
    lora, scanned = figures.get("lora", {}), figures.get("scanned", {})
    if "full" in lora:
        _lora_tables(group, ratios, lora, twins, kind)
    if "step_ms" in scanned.get("unrolled", {}):
        _scanned_tables(group, ratios, scanned, twins, kind)
    if ratios.rows:
        group.tables.append(ratios)
    parts = {"save": save, "load": load, "quantized": quantized, "lora": lora, "scanned": scanned}
    for name, part in parts.items():
        if "error" in part:
            group.notes.append(f"The {name} part failed: {part['error']}.")
    kept = "; figures in bench/accelerator.json" if figures["platform"] != "cpu" else ""
    group.notes.append(
        f"Measured on {kind} ({figures['platform']}, JAX {figures['jax']}) on "
        f"{figures['date']} by `{figures['command']}`{kept}. CPU twins: the same ratios in "
        f"this report's groups `streaming`, `background`, `lora` and `scanned`."
    )
    return group


def _lora_tables(
    group: Group, ratios: Table, lora: dict[str, Any], twins: dict[str, float], kind: str
) -> None:
    """device_lora's step times and XLA's bytes, and issue 53 point 3's targets: LoRA at
    most 0.75x full fine-tuning, QLoRA at most LoRA's time."""
    names = {
        "full": "full fine-tuning",
        "lora": "LoRA",
        "qlora_int8": "QLoRA, int8",
        "qlora_int4_g128": "QLoRA, int4 g128",
    }
    found = {k: v for k, v in names.items() if "step_ms" in lora.get(k, {})}
    title = f"A training step on {kind}: 32 x Linear(4096, 4096), {lora['rows']} rows, rank 8"
    table = Table(title, list(found.values()), reference="full fine-tuning")
    peak = Table(
        f"{title}: XLA's bytes", list(found.values()), unit="B", reference="full fine-tuning"
    )
    for key, name in found.items():
        table.add("the step", name, "bench/device_lora.py", lora[key]["step_ms"] / 1e3)
        if lora[key].get("peak_bytes") is not None:
            call = "arguments + outputs not donated + temporaries"
            peak.add("the step", name, call, lora[key]["peak_bytes"])
    group.tables += [table, *([peak] if peak.rows else [])]
    if "x_full" not in lora.get("lora", {}):
        return
    op = "LoRA step / full fine-tuning's (<= 0.75)"
    ratios.add(op, kind, "bench/device_lora.py", lora["lora"]["x_full"])
    if "lora" in twins:
        ratios.add(op, "CPU twin", "group lora", twins["lora"])
    group.targets.append(
        Target(
            f"a LoRA step on {kind} <= 0.75x full fine-tuning's time",
            lora["lora"]["x_full"],
            0.75,
            False,
            "median step times (bench/device_lora.py)",
        )
    )
    for key in ("qlora_int8", "qlora_int4_g128"):
        if "x_lora" in lora.get(key, {}):
            group.targets.append(
                Target(
                    f"a {names[key]} step on {kind} <= LoRA's time",
                    lora[key]["x_lora"],
                    1.0,
                    False,
                    "median step times (bench/device_lora.py)",
                )
            )


def _scanned_tables(
    group: Group, ratios: Table, scanned: dict[str, Any], twins: dict[str, float], kind: str
) -> None:
    """device_scanned's step and compile times by variant, and issue 53 point 2's targets:
    the stack as a user gets it within 1.05x the unrolled step, compiling in at most 0.2x
    its time, with no more temporary memory at 4 x 512 tokens."""
    names = {
        "unrolled": "unrolled",
        "stack": "nn.Stack",
        "stack_remat_dots": "remat=dots_saveable",
        "stack_remat_nobatch": "remat=dots_with_no_batch_dims_saveable",
        "stack_remat_all": "remat=True",
        "stack_unroll2": "scan unroll=2",
        "loop_over_stacked": "stacked weights, Python loop",
        "stack_adam_in_backward": "Adam in the backward scan",
        "stack_adam_in_backward_carried": "Adam in the backward scan, carried",
    }
    found = {k: v for k, v in names.items() if "step_ms" in scanned.get(k, {})}
    title = f"A Llama training step on {kind} (width 1024, 32 layers, 4 x 256 tokens, Adam)"
    step = Table(title, list(found.values()), reference="unrolled")
    for key, name in found.items():
        step.add("the step", name, "bench/device_scanned.py", scanned[key]["step_ms"] / 1e3)
        step.add("its compile", name, "bench/device_scanned.py", scanned[key]["compile_s"])
    group.tables.append(step)
    unrolled, stack = scanned["unrolled"], scanned.get("stack", {})
    if "x_unrolled" not in stack:
        return
    for op, key, twin in (
        ("scanned step / unrolled (<= 1.05)", "stack", "scanned"),
        ("scanned step, remat=dots_saveable / unrolled", "stack_remat_dots", "scanned_remat"),
    ):
        if "x_unrolled" in scanned.get(key, {}):
            ratios.add(op, kind, "bench/device_scanned.py", scanned[key]["x_unrolled"])
            if twin in twins:
                ratios.add(op, "CPU twin", "group scanned", twins[twin])
    group.targets += [
        Target(
            f"a scanned step on {kind} (nn.Stack's defaults) <= 1.05x the unrolled step",
            stack["x_unrolled"],
            1.05,
            False,
            "median step times (bench/device_scanned.py)",
        ),
        Target(
            f"its compile on {kind} <= 0.2x the unrolled step's",
            stack["compile_s"] / unrolled["compile_s"],
            0.2,
            False,
            "lower().compile() times (bench/device_scanned.py)",
        ),
    ]
    longer = "temp_MiB_twice_the_tokens"
    if longer in stack and longer in unrolled:
        group.targets.append(
            Target(
                f"its temporary memory on {kind} at 4 x 512 tokens <= the unrolled step's",
                stack[longer] / unrolled[longer],
                1.0,
                False,
                "compiled.memory_analysis().temp_size_in_bytes (bench/device_scanned.py)",
            )
        )


# device_load's cases, named for the report
CASES = {
    "renamed": "renamed by a rule",
    "transposed": "transposed by a rule",
    "stack": "per-layer names into an nn.Stack",
    "int8": "bfloat16 into int8",
    "int4": "bfloat16 into int4 (groups of 128)",
    "fp8_bf16": "FP8 blocks into bfloat16",
    "fp8_int8": "FP8 blocks into int8",
}


def _case_table(group: Group, cases: dict[str, Any], kind: str) -> None:
    """device_load's cases, each against the raw limits of its own file (the raw pipeline,
    and the slower of the read and ``jax.device_put`` measured apart), and issue 52's
    target for each: at least 0.8x the raw pipeline."""
    table = Table(
        f"Loads through rules, quantizing and into a stack on {kind}, against their own "
        f"file's raw limits",
        ["vs the raw pipeline", "vs the slower of read and device_put"],
        unit="x",
        reference="vs the raw pipeline",
        log=False,
        line=0.8,
    )
    for key, case in cases.items():
        name = CASES.get(key, key)
        table.add(name, "vs the raw pipeline", "bench/device_load.py", case["vs_raw_pipeline"])
        slower = "vs the slower of read and device_put"
        table.add(name, slower, "bench/device_load.py", case["vs_raw_limit"])
        group.targets.append(
            Target(
                f"a load {name} onto {kind} >= 0.8x the raw pipeline of its file",
                case["vs_raw_pipeline"],
                0.8,
                True,
                "the load's GiB/s / the raw pipeline's of the same file (bench/device_load.py)",
            )
        )
    group.tables.append(table)


def _quantized_tables(group: Group, quantized: dict[str, Any], kind: str) -> None:
    """device_quantized's forward times (ms) by batch, and issue 53's targets: int8 at most
    0.6x bfloat16's time and int4 at most 0.35x at decode batches (1 and 16), neither
    slower than bfloat16 at batch 256."""
    layers, width = quantized["layers"], quantized["width"]
    paths = {"bf16": "bfloat16"}
    for layout in ("int8", "int4_g128"):
        for path in (
            "product",
            "weight_first",
            "group_products",
            "group_products_f32",
            "group_kernel",
        ):
            if f"{layout}_{path}_ms" in quantized["batch_1"]:
                paths[f"{layout}_{path}"] = f"{layout}, {path.replace('_', ' ')}"
    table = Table(
        f"A forward through {layers} quantized layers of {width} x {width} on {kind} "
        f"(jitted; bfloat16 inputs)",
        list(paths.values()),
        reference="bfloat16",
    )
    batches = [int(k[len("batch_") :]) for k in quantized if k.startswith("batch_")]
    for batch in batches:
        row = quantized[f"batch_{batch}"]
        for key, name in paths.items():
            if f"{key}_ms" in row:  # (a candidate that failed at this batch: in the notes)
                table.add(
                    f"batch {batch}", name, "bench/device_quantized.py", row[f"{key}_ms"] / 1e3
                )
    group.tables.append(table)
    decode = [b for b in batches if b <= 16]
    for layout, most in (("int8", 0.6), ("int4_g128", 0.35)):
        worst = max(quantized[f"batch_{b}"][f"{layout}_product_vs_bf16"] for b in decode)
        group.targets.append(
            Target(
                f"{layout} layers on {kind} at batches {decode} <= {most}x bfloat16's time",
                worst,
                most,
                False,
                "the layer's forward / bfloat16's, the slowest batch (bench/device_quantized.py)",
            )
        )
        if "batch_256" in quantized:
            group.targets.append(
                Target(
                    f"{layout} layers on {kind} at batch 256 no slower than bfloat16",
                    quantized["batch_256"][f"{layout}_product_vs_bf16"],
                    1.0,
                    False,
                    "the layer's forward / bfloat16's (bench/device_quantized.py)",
                )
            )
    wrong = [
        f"{k[: -len('_close')]} at batch {b}"
        for b in batches
        for k, v in quantized[f"batch_{b}"].items()
        if k.endswith("_close") and not v
    ]
    checked = any(k.endswith("_close") for k in quantized["batch_1"])
    failed = {
        f"{k[: -len('_error')]} at batch {b}": v
        for b in batches
        for k, v in quantized[f"batch_{b}"].items()
        if k.endswith("_error")
    }
    group.notes.append(
        "The quantized forwards: each path checked against the bfloat16 layer of the "
        "dequantized weights (within 2^-6 of the largest output): "
        + (
            (f"NOT within it: {', '.join(wrong)}." if wrong else "all within it.")
            if checked
            else "not recorded in this run (see the command)."
        )
        + "".join(f" The path {k} failed: {v}." for k, v in failed.items())
    )


def _speeds(load: dict[str, Any]) -> dict[str, float]:
    """device_load's GiB/s figures by key (``taktiny`` first)."""
    speeds = {k[: -len("_GiBps")]: v for k, v in load.items() if k.endswith("_GiBps")}
    return dict(sorted(speeds.items(), key=lambda kv: kv[0] != "taktiny"))


def _save_tables(
    group: Group, ratios: Table, save: dict[str, Any], twins: dict[str, float], kind: str
) -> None:
    seconds, gib = save["seconds"], save["GiB"]
    raw, d2h = save["raw"], save["d2h_reference"]
    table = Table(
        f"Saving a {gib:.2g} GiB bfloat16 model ({save['layers']} x {save['width']} x "
        f"{save['width']}) from {kind} to {save['filesystem']}",
        ["Taktiny", "raw write", "device-to-host copy"],
    )
    raw_call = {
        "raw_pipelined": "copy_to_host_async() of all, then each written as it arrives; fsync",
        "raw_serial": "np.asarray of each, written in turn; fsync",
    }[raw]
    d2h_call = {
        "d2h": "copy_to_host_async() of all, then np.asarray of each",
        "d2h_serial": "np.asarray of each in turn",
    }[d2h]
    waits, call, whole = "save, wait=True", "save, wait=False: the call", "save, wait=False: all"
    table.add(waits, "Taktiny", "save_safetensors(path, model)", seconds["save"])
    table.add(waits, "raw write", raw_call, seconds[raw])
    table.add(waits, "device-to-host copy", d2h_call, seconds[d2h])
    table.add(call, "Taktiny", "save_safetensors(path, model, wait=False)", seconds["background"])
    table.add(call, "device-to-host copy", d2h_call, seconds[d2h])
    table.add(
        whole, "Taktiny", "save_safetensors(path, model, wait=False).result()",
        seconds["background_total"],
    )  # fmt: skip
    table.add(whole, "raw write", raw_call, seconds[raw])
    group.tables.append(table)
    training = save["training"]
    loop = Table(
        f"A training loop on {kind}: {training['steps']} steps of "
        f"{training['step_seconds'] * 1e3:.0f} ms, a background save every {training['every']}",
        ["no saves", "background saves"],
        reference="no saves",
    )
    for name, key in (("no saves", "none"), ("background saves", "background")):
        loop.add("the loop", name, f"bench/device_save.py: {key}", training["loop_seconds"][key])
    group.tables.append(loop)
    rows = {
        "blocking save / a raw write, in speed (>= 0.8)": ("save_vs_raw", None),
        "the background call / the device-to-host copy (<= 1.2)": (
            "background_vs_d2h",
            "background",
        ),
        "the loop saving in the background / without saves (<= 1.1)": (
            "training_vs_none",
            "training",
        ),
    }
    for op, (key, twin) in rows.items():
        ratios.add(op, kind, "bench/device_save.py", save[key])
        if twin in twins:
            ratios.add(op, "CPU twin", "group background", twins[twin])
    group.targets += [
        Target(
            f"a save from {kind} that waits >= 0.8x a raw write of the same bytes (the "
            f"device-to-host copy included)",
            save["save_vs_raw"],
            0.8,
            True,
            "raw write time / save_safetensors time, median of per-round ratios",
        ),
        Target(
            f"a background save from {kind} blocks its caller <= 1.2x the device-to-host copy "
            f"alone",
            save["background_vs_d2h"],
            1.2,
            False,
            "save_safetensors(..., wait=False)'s time / the copy's, median of per-round ratios",
        ),
        Target(
            f"a training loop on {kind} saving in the background every "
            f"{training['every']} steps <= 1.1x the loop without saves",
            save["training_vs_none"],
            1.1,
            False,
            "the loop's time / the same loop's without saves, median of per-round ratios",
        ),
    ]
    checks = [k for k in ("save_bitwise", "background_bitwise") if not save.get(k)]
    group.notes.append(
        f"The saves: {save['rounds']} interleaved rounds, fresh arrays on the device before "
        f"each clock, every file removed and os.sync() run after it; raw write "
        f"{save['GiBps'][raw]:.2f} GiB/s, Taktiny's save {save['GiBps']['save']:.2f} GiB/s, "
        f"the device-to-host copy {save['GiBps'][d2h]:.2f} GiB/s (one at a time: "
        f"{save['GiBps']['d2h_serial']:.2f}); a background save blocks "
        f"{seconds['background'] * 1e3:.0f} ms, stalls the training loop "
        f"{training['stall_per_save_seconds'] * 1e3:.0f} ms per save. "
        + (
            "Both saves read back bitwise equal to the device's arrays."
            if not checks
            else f"READ BACK DIFFERENT: {', '.join(checks)}."
        )
    )
