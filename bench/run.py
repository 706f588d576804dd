"""Runs Taktiny's benchmarks and writes the report.

    python bench/run.py                  # full run: bench/results.md and bench/plots/*.png
    python bench/run.py --quick          # small sizes, few samples: bench/out/ (< 1 minute)
    python bench/run.py --only state,dispatch --out /tmp/report
    python bench/run.py --only streaming --merge   # rerun one group into bench/results.md,
                                                   # keeping the other groups' results

Groups: state (state read/write), dispatch (jit dispatch), checkpoint (save/restore of a
1 GB model), memory (peak RSS of restoring it), sharded (tt.shard, and a sharded restore of
the 1 GB model with its Adam state on 8 simulated devices), streaming (taktiny.io's
streaming safetensors load of the 1 GB model against the raw read and its peers, and
`taktiny inspect`), quantized (the bytes of a quantized 100M-parameter MLP, the time to
quantize it, the 1 GB float32 checkpoint quantized to int8 as it streams in, and a 1 GB
FP8 block-scaled checkpoint loaded into a bfloat16 and an int8 model), decoding
(the Llama of examples/llama.py against the same model in plain JAX, and a cached decoding
step against a full forward), errors (the StateDictError of 1,000 misspelt names in a
10,002-leaf model, against its 0.5 s target), checksums (what verifying the digests costs a
warm streaming load of the 1 GB checkpoint, and a save), headers (open_safetensors of a
100,000-tensor header, against its 0.25 s target; `taktiny inspect`, against its 0.2 s; and
`taktiny diff` of a model whose module imports transformers' LlamaForCausalLM), lora (a
rank-8 LoRA training step of a 4 x 4096-wide MLP against full fine-tuning, in time and in the
bytes of parameters, gradients and Adam state; and a LoRA training step of the Llama example
against the base's forward and backward), plan (the peak host memory
taktiny.io.plan_load predicts for the plain, sharded, transposing and quantizing loads of
the 1 GB checkpoint, against the measured), overhead (what load_safetensors spends
outside reading bytes on a warm checkpoint of 3,000 small tensors), background (how long
save_safetensors(..., wait=False) blocks its caller, against a host copy of the arrays, and
the whole save against one that waits, and a training loop saving in the background,
with saves that wait and without), accelerator (bench/device_load.py's load onto an
accelerator and bench/device_save.py's saves from it, against their raw limits, beside
the same ratios on the CPU; without an accelerator, the figures of the last run on one,
from bench/accelerator.json, or skipped), storage (load_safetensors of a 512 MiB checkpoint from
an s3:// URL served by a local S3 stub, against concurrent ranged GETs of the same object
with obstore, Run:ai's Model Streamer and s3fs, and its peak host memory), scanned (the
Llama example with its layers in an nn.Stack run by lax.scan against a list of layers: the
compile and step time of a training step at 16 and 32 layers, streaming a 1 GB per-layer
Hugging Face checkpoint into the stacked model against the unstacked one, in time and peak
memory, and a load of one layer), models (taktiny.models.from_pretrained of a Llama 3.2
1B-shaped Hugging Face folder, in bfloat16, scanned, and quantized to int8 and int4 on the
way in, against transformers' from_pretrained and safetensors.flax, in time and peak host
memory). A full run takes under 30 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402

# The sharded group needs 8 devices; JAX takes the count only before its first use
jax.config.update("jax_num_cpu_devices", 8)

from bench import report  # noqa: E402
from bench._results import Config, Group, Skipped, fmt_ratio  # noqa: E402

# group name -> its module in bench/, imported when the group runs (an accelerator's host
# may lack what the others import: flax, torch, equinox)
GROUPS = {
    "state": "state",
    "dispatch": "dispatch",
    "checkpoint": "checkpoint",
    "memory": "memory",
    "sharded": "sharded",
    "streaming": "streaming",
    "quantized": "quantized",
    "decoding": "decoding",
    "errors": "errors",
    "checksums": "checksums",
    "headers": "headers",
    "lora": "lora",
    "plan": "load_plan",
    "overhead": "load_overhead",
    "background": "background_save",
    "accelerator": "accelerator",
    "storage": "storage",
    "scanned": "scanned",
    "models": "models",
}


def runner(name: str) -> Callable[[Config], Group]:
    """The function that runs the group `name`."""
    return importlib.import_module(f"bench.{GROUPS[name]}").run


def main(argv: list[str] | None = None) -> list[Group]:
    """Runs the chosen groups, writes the report, and returns the groups' results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few samples")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one sample (tests)")
    parser.add_argument("--only", default=",".join(GROUPS), help="comma-separated groups")
    parser.add_argument(
        "--out",
        type=Path,
        help="report folder (default: bench/, or bench/out/ for --quick, --smoke or --only)",
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        help="where checkpoints are written (a temporary folder is made in it)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="write into the report folder (default bench/) keeping the groups already there "
        "(its results.json) that this run does not measure",
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if unknown := [n for n in names if n not in GROUPS]:
        parser.error(f"unknown group(s) {unknown}; choose from {list(GROUPS)}")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    partial = mode != "full" or names != list(GROUPS)
    if args.merge and mode != "full" and args.out is None:
        parser.error("--merge into bench/ takes full runs only; give --out for --quick/--smoke")
    out = args.out or (HERE / "out" if partial and not args.merge else HERE)
    scratch = Path(tempfile.mkdtemp(prefix="taktiny-bench-", dir=args.scratch))
    config = Config(mode, scratch)
    start = time.perf_counter()
    groups = []
    try:
        for name in names:
            print(f"[bench] {name} ...", flush=True)
            try:
                groups.append(runner(name)(config))
            except Skipped as why:
                print(f"[bench] {name} skipped: {why}", flush=True)
                continue
            print(f"[bench] {name} done in {groups[-1].seconds:.1f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - start
    if not groups:
        print("[bench] nothing measured; no report written")
        return groups
    command = "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    path = report.write(
        groups,
        out,
        mode=mode,
        seconds=seconds,
        command=command.strip(),
        merge=args.merge,
        order=list(GROUPS),
    )
    for group in groups:
        for t in group.targets:
            print(f"[bench] {'met ' if t.met else 'MISS'} {fmt_ratio(t.value):>8}  {t.goal}")
    print(f"[bench] {len(groups)} group(s) in {seconds:.0f} s; report: {path}")
    return groups


if __name__ == "__main__":
    main()
