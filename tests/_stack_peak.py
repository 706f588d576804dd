"""The peak host memory of streaming a per-layer checkpoint into a stacked model, for
tests/loading/test_into_stack.py: run as a program in a fresh interpreter (``python
tests/_stack_peak.py FILE LAYERS WIDTH``), with glibc told to map every block of 1 MiB or
more on its own (as tests/_peak.py explains). Each case loads once (compiling), then again
with the kernel's high-water mark reset; prints one JSON line a case: the peak growth, the
model's bytes, and what plan_load says the load holds beyond them (``held_bytes``, what
``max_host_bytes`` counts).

The cases: the stack on one CPU device (each layer read into its slice of the stacked
buffer); its kernels' columns split over 8 CPU devices (each layer's blocks, cut from its
rows, placed on the devices, wait for the load's thread to write them into the stacked
leaves); the same within a budget of one and a half such kernels (a slice and its rows).
"""

from __future__ import annotations

import gc
import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before the backend starts

from jax.sharding import PartitionSpec as P  # noqa: E402

import taktiny as tt  # noqa: E402
from taktiny import nn  # noqa: E402
from taktiny.io import load_safetensors, plan_load  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int, *, rngs: nn.Rngs):
        self.a = nn.Linear(width, width, use_bias=False, rngs=rngs)
        self.b = nn.Linear(width, width, use_bias=False, rngs=rngs)


def model(layers: int, width: int) -> nn.Stack:
    return nn.Stack(lambda rngs: Block(width, rngs=rngs), layers, rngs=nn.Rngs(0))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def measure(path: str, target: object, budget: int | None) -> dict[str, int]:
    plan = plan_load(target, path, max_host_bytes=budget)
    jax.block_until_ready(load_safetensors(target, path, max_host_bytes=budget))  # (compiles)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    loaded = jax.block_until_ready(load_safetensors(target, path, max_host_bytes=budget))
    peak = max(_status("VmHWM"), before)
    size = sum(x.nbytes for x in jax.tree.leaves(loaded))
    leaves = len(tt.flat_state_dict(loaded))
    del loaded
    gc.collect()
    growth = peak - before
    return {"growth": growth, "model": size, "leaves": leaves, "held": plan.held_bytes}


def main(path: str, layers: int, width: int) -> None:
    abstract = jax.eval_shape(lambda: model(layers, width))
    columns = tt.shard(abstract, {"**": P(None, "x")}, jax.make_mesh((8,), ("x",)))
    kernel = width * width * 4  # (its rows are read a piece at a time, and it is a slice)
    cases = {
        "one device": (abstract, None),
        "columns on 8 devices": (columns, None),
        "columns on 8 devices, within one and a half kernels' slices and rows": (
            columns,
            3 * kernel,
        ),
    }
    for case, (target, budget) in cases.items():
        print(json.dumps({"case": case, "budget": budget, **measure(path, target, budget)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
