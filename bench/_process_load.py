"""One process of a multi-process sharded load (tests/loading/test_multiprocess.py, and the
streaming benchmark's bytes per process): joins the job, loads a safetensors file onto its
tensors split over all 8 global devices (4 per process), counting the bytes it reads from
the file, and checks that each shard it holds is bitwise the file's. Each tensor is split
on its first axis, its last, or (with three axes) its middle one. Prints one line per load:

    process 0: read 1234 of 5678 bytes (verify=False) in 0.12 s; 20 shards bitwise equal

    python bench/_process_load.py FILE --coordinator HOST:PORT --num-processes 2 --process-id 0
"""

import argparse
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny.io import load_safetensors, open_safetensors

CALL = "taktiny.io.load_safetensors(sharded_abstract, path), in each of 2 processes"


def spec(name: str, ndim: int) -> P:
    """How a tensor is split over the 8 devices: "outer..." names on the first axis, three
    axes on the middle one, anything else on the last."""
    if name.startswith("outer") or ndim == 1:
        return P("x")
    return P(None, "x", None) if ndim == 3 else P(*[None] * (ndim - 1), "x")


def counted(load, *args, **kwargs):
    """What `load(*args, **kwargs)` returns, and the bytes it read: with os.preadv, which
    every read of a load from a local file uses; for a URL, by its ranged GETs."""
    if "://" in str(args[1]):
        from taktiny.io._object_store import RemoteFile

        owner, name = RemoteFile, "read_into"  # (called as a method: self first)
    else:
        owner, name = os, "preadv"
    read, real = [], getattr(owner, name)

    def counting(*call):
        got = real(*call)
        read.append(got)
        return got

    setattr(owner, name, counting)
    try:
        return load(*args, **kwargs), sum(read)
    finally:
        setattr(owner, name, real)


def joined() -> argparse.Namespace:
    """This process's arguments (FILE and the job's), once it has joined the job (also
    for tests/_stack_process.py, a load of the same job into a stack of layers)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args()
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    return args


def main():
    args = joined()
    mesh = jax.make_mesh((8,), ("x",))
    checkpoint = open_safetensors(args.file)
    target: dict = {}  # nested by the names' dotted parts, as a model's state is
    for name, t in checkpoint.items():
        *parents, leaf = name.split(".")
        node = target
        for part in parents:
            node = node.setdefault(part, {})
        where = NamedSharding(mesh, spec(name, len(t.shape)))
        node[leaf] = jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=where)
    total = sum(t.nbytes for t in checkpoint.values())
    for verify in (False, True):
        start = time.perf_counter()
        loaded, read = counted(load_safetensors, target, args.file, verify=verify, progress=False)
        seconds = time.perf_counter() - start
        shards = 0
        for name, array in tt.flat_state_dict(loaded).items():
            whole = checkpoint[name].read()
            for shard in array.addressable_shards:
                if np.asarray(shard.data).tobytes() != whole[shard.index].tobytes():
                    raise SystemExit(f"process {args.process_id}: {name} differs at {shard.index}")
                shards += 1
        print(
            f"process {jax.process_index()}: read {read} of {total} bytes (verify={verify}) "
            f"in {seconds:.2f} s; {shards} shards bitwise equal",
            flush=True,
        )


def run_job(path: str, processes: int = 2, timeout: float = 600) -> list[str]:
    """Runs this program as `processes` processes of 4 CPU devices each on `path`; returns
    what each printed (raises, with their output, when one fails)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"}
    env.pop("XLA_FLAGS", None)
    argv = [
        sys.executable,
        __file__,
        path,
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(processes),
    ]
    jobs = [
        subprocess.Popen(
            [*argv, "--process-id", str(i)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(processes)
    ]
    outputs = [job.communicate(timeout=timeout)[0] for job in jobs]
    if any(job.returncode for job in jobs):
        raise RuntimeError("a process of the sharded load failed:\n" + "\n".join(outputs))
    return outputs


if __name__ == "__main__":
    main()
