"""One process of a two-process load of a per-layer checkpoint into a sharded stack of
layers (tests/loading/test_multiprocess.py): joins the job, loads FILE (Hugging Face names, each
layer's weight [out, in]) by rules into a stack split over the 8 global devices (4 a
process), once with each layer's kernel split by columns over 'model', once with the
layers themselves split over 'data' (each process holding half of them), and checks that
every shard it holds is bitwise the model's that was exported. Prints one line a case:

    process 0: columns: 12 leaves' 48 shards bitwise equal

    python tests/_stack_process.py FILE --coordinator HOST:PORT --num-processes 2 --process-id 0
"""

import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import convert, nn
from taktiny.io import load_safetensors

RULES = [
    *convert.linear("model.layers.{i}.proj", "layers.{i}.proj"),
    *convert.layer_norm("model.layers.{i}.norm", "layers.{i}.norm", bias=False),
]
SPLITS = {  # case -> (the stack's layer_axis, one layer's rules)
    "columns": (None, {"layers.*.proj.kernel": P(None, "model"), "**": P()}),
    "layers over processes": ("data", {"layers.*.proj.kernel": P(None, "model"), "**": P()}),
}


class Block(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.proj = nn.Linear(16, 32, rngs=rngs)
        self.norm = nn.RMSNorm(32)


class Model(nn.Module):
    def __init__(self, layer_axis: str | None = None, *, rngs: nn.Rngs):
        self.layers = nn.Stack(lambda r: Block(rngs=r), 4, rngs=rngs, layer_axis=layer_axis)


def model(layer_axis: str | None = None) -> Model:
    """The model the checkpoint is exported from (the same in every process)."""
    return Model(layer_axis, rngs=nn.Rngs(0))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from _process_load import joined  # (the job's arguments, as the bench's loads take them)

    args = joined()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    want = tt.flat_state_dict(model())
    for case, (layer_axis, rules) in SPLITS.items():
        abstract = tt.shard(jax.eval_shape(lambda a=layer_axis: model(a)), rules, mesh)
        loaded = load_safetensors(abstract, args.file, rules=RULES, progress=False)
        shards = 0
        for name, array in tt.flat_state_dict(loaded).items():
            assert array.sharding == tt.flat_state_dict(abstract)[name].sharding, name
            for shard in array.addressable_shards:
                expected = np.asarray(want[name])[shard.index]
                if np.asarray(shard.data).tobytes() != expected.tobytes():
                    raise SystemExit(f"process {args.process_id}: {name} differs at {shard.index}")
                shards += 1
        leaves = len(want)
        print(f"process {jax.process_index()}: {case}: {leaves} leaves' {shards} shards bitwise "
              f"equal", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
