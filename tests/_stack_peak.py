"""The peak host memory of streaming a per-layer checkpoint into a stacked model, for
tests/test_io_stack.py: run as a program in a fresh interpreter (``python
tests/_stack_peak.py FILE LAYERS WIDTH``), with glibc told to map every block of 1 MiB or
more on its own (as tests/_peak.py explains). Loads once (compiling), then again with the
kernel's high-water mark reset; prints one JSON line: the peak growth and the model's bytes.
"""

from __future__ import annotations

import gc
import json
import sys

import jax

import taktiny as tt
from taktiny import nn
from taktiny.io import load_safetensors


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


def main(path: str, layers: int, width: int) -> None:
    abstract = jax.eval_shape(lambda: model(layers, width))
    jax.block_until_ready(load_safetensors(abstract, path))  # (compiles, then freed)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    loaded = jax.block_until_ready(load_safetensors(abstract, path))
    peak = max(_status("VmHWM"), before)
    size = sum(x.nbytes for x in jax.tree.leaves(loaded))
    print(
        json.dumps(
            {"growth": peak - before, "model": size, "leaves": len(tt.flat_state_dict(loaded))}
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
