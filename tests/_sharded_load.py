"""One of the processes of tests/test_multiprocess.py's sharded-load test: joins the job,
loads a safetensors file onto a model split on every tensor over all 8 global devices
(4 per process), counting the bytes it reads from the file, and checks that each shard it
holds is bitwise the file's. Prints one line per load:

    process 0: read 1234 of 5678 bytes (verify=False); 20 shards bitwise equal

    python tests/_sharded_load.py FILE --coordinator HOST:PORT --num-processes 2 --process-id 0
"""

import argparse
import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taktiny.io import load_safetensors, open_safetensors

SPECS = {  # every tensor split over all 8 devices: outer, inner and middle axes
    "outer": P("x"),
    "inner": P(None, "x"),
    "cube": P(None, "x", None),
    "bias": P("x"),
}


def counted(load, *args, **kwargs):
    """What `load(*args, **kwargs)` returns, and the bytes it read with os.preadv (which
    every read of a load uses)."""
    read, real = [], os.preadv

    def preadv(fd, buffers, offset, *flags):
        got = real(fd, buffers, offset, *flags)
        read.append(got)
        return got

    os.preadv = preadv
    try:
        return load(*args, **kwargs), sum(read)
    finally:
        os.preadv = real


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args()
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    mesh = jax.make_mesh((8,), ("x",))
    checkpoint = open_safetensors(args.file)
    target = {
        name: jax.ShapeDtypeStruct(
            checkpoint[name].shape, checkpoint[name].dtype, sharding=NamedSharding(mesh, spec)
        )
        for name, spec in SPECS.items()
    }
    total = sum(checkpoint[name].nbytes for name in SPECS)
    for verify in (False, True):
        loaded, read = counted(load_safetensors, target, args.file, verify=verify)
        shards = 0
        for name, array in loaded.items():
            whole = checkpoint[name].read()
            for shard in array.addressable_shards:
                if np.asarray(shard.data).tobytes() != whole[shard.index].tobytes():
                    raise SystemExit(f"process {args.process_id}: {name} differs at {shard.index}")
                shards += 1
        print(f"process {jax.process_index()}: read {read} of {total} bytes (verify={verify}); "
              f"{shards} shards bitwise equal", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
