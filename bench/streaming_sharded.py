"""Sharded streaming loads (issue 23): the streaming group's 1 GB safetensors checkpoint
loaded onto 8 simulated CPU devices, by each plan, against raw reads and the peers, cold
and warm; and each plan's peak memory against what the devices hold.

- Plans (every kernel; each bias split on "model"): one device; ``P("model", None)`` (outer
  axis split) and ``P(None, "model")`` (inner axis split) on a mesh of 8; ``P("data",
  "model")`` on a (2, 4) mesh.
- Raw reads, the baselines: the file read into fresh anonymous memory by one ``readinto``,
  and by 8 threads each ``preadv``-ing an eighth (the best a reader of this disk does cold).
- Peers, onto one device and onto the inner split: Orbax v1's safetensors layout
  (``ocp.load`` with the sharded abstract tree, which reads the byte ranges each device
  needs), ``safetensors.numpy`` and ``safetensors.flax`` then ``jax.device_put`` onto the
  shardings, and ``fastsafetensors`` (CPU mode, no GPUDirect; PyTorch tensors) then
  ``jax.device_put``. PyTorch's ``torch.load(mmap=True)`` is in the one-device cold table.
- Cold: the file's pages dropped before every sample; warm: read before, so every read
  comes from the page cache. Ratios are medians of per-round ratios.
- Memory: each plan's load in a fresh subprocess (``bench.memory``'s worker, with this
  module as its registry): peak RSS growth against the bytes the devices hold.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _disk, _process_load
from ._results import Config, Table, Target
from ._timing import Case, Stats, compare, paired_ratio

if jax.config.jax_num_cpu_devices < 8:  # the memory worker imports this module first
    jax.config.update("jax_num_cpu_devices", 8)

PLANS = {  # plan -> (mesh shape, axis names, the kernels' spec), None: one device
    "one device": None,
    'outer P("model", None)': ((8,), ("model",), P("model", None)),
    'inner P(None, "model")': ((8,), ("model",), P(None, "model")),
    '2-D P("data", "model")': ((2, 4), ("data", "model"), P("data", "model")),
}
INNER = 'inner P(None, "model")'
RAW, RAW8 = "raw read, 1 reader", "raw read, 8 readers"
TT = {plan: f"Taktiny, {plan}" for plan in PLANS}
ORBAX_V1 = "Orbax v1 safetensors"
NUMPY, FLAX, FAST = (
    "safetensors.numpy + device_put",
    "safetensors.flax + device_put",
    "fastsafetensors + device_put",
)
PEERS = [ORBAX_V1, NUMPY, FLAX, FAST]
ONE = {peer: f"{peer}, one device" for peer in PEERS}  # each peer onto one device too
SYSTEMS = [RAW, RAW8, *TT.values(), *PEERS, *ONE.values()]
SHARE, COLD_SHARE, GROWTH, PROCESS_SHARE = 0.85, 0.9, 1.05, 0.55  # issue 23's targets


def sharded(abstract: Any, plan: str) -> Any:
    """The abstract model with every kernel on `plan`'s sharding and every bias split on
    "model" (on one device for the one-device plan)."""
    if PLANS[plan] is None:
        return abstract
    shape, axes, spec = PLANS[plan]
    mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:8])

    def place(leaf: Any) -> Any:
        where = NamedSharding(mesh, spec if leaf.ndim == 2 else P("model"))
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where)

    return jax.tree.map(place, abstract)


def held(abstract: Any) -> int:
    """The bytes the devices hold once the model is loaded (each device its own blocks)."""
    total = 0
    for leaf in jax.tree.leaves(abstract):
        block = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(block)) * leaf.dtype.itemsize * len(leaf.sharding.device_set)
    return total


def _raw(path: Path, abstracts: Any = None) -> Any:
    """The file read into fresh anonymous memory by one readinto."""
    size = path.stat().st_size
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(memory))
    return memory


def _raw8(path: Path, abstracts: Any = None) -> Any:
    """The file read into fresh anonymous memory by 8 threads, an eighth each."""
    size = path.stat().st_size
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view, part = memoryview(memory), -(-size // 8)
    fd = os.open(path, os.O_RDONLY)
    try:

        def read(k: int) -> None:
            at, end = k * part, min(size, (k + 1) * part)
            while at < end:
                at += os.preadv(fd, [view[at:end]], at)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(read, range(8)))
    finally:
        os.close(fd)
    return memory


def _taktiny(path: Path, abstracts: dict[str, Any]) -> Any:
    import taktiny.io as tio

    return tio.load_safetensors(abstracts["taktiny"], path, progress=False)


def _put(arrays: dict[str, Any], abstracts: dict[str, Any]) -> Any:
    """The peers' host arrays placed on the model's shardings, by flat name."""
    import taktiny as tt

    want = tt.flat_state_dict(abstracts["taktiny"])
    return jax.device_put({k: arrays[k] for k in want}, {k: v.sharding for k, v in want.items()})


def _orbax_v1(path: Path, abstracts: dict[str, Any]) -> Any:
    from orbax.checkpoint import v1 as ocp

    import taktiny as tt

    context = ocp.Context(checkpoint_layout=ocp.options.CheckpointLayout.SAFETENSORS)
    with ocp.Context(context=context):
        return ocp.load(path, abstract_state=tt.flat_state_dict(abstracts["taktiny"]))


def _numpy(path: Path, abstracts: dict[str, Any]) -> Any:
    import safetensors.numpy

    return _put(safetensors.numpy.load_file(path), abstracts)


def _flax(path: Path, abstracts: dict[str, Any]) -> Any:
    import safetensors.flax

    return _put(safetensors.flax.load_file(path), abstracts)


def _fast(path: Path, abstracts: dict[str, Any]) -> Any:
    from fastsafetensors import fastsafe_open

    with fastsafe_open(str(path), framework="pt", device="cpu", nogds=True) as f:
        tensors = {name: f.get_tensor(name).numpy() for name in f.keys()}
    return _put(tensors, abstracts)


RESTORE = {  # case -> (the call the report shows, load(path, abstracts)): memory's registry
    RAW: ("f.readinto(fresh anonymous memory)", _raw),
    RAW8: ("8 threads, os.preadv of an eighth each into fresh anonymous memory", _raw8),
    **{
        TT[plan]: ("taktiny.io.load_safetensors(sharded_abstract, path)", _taktiny)
        for plan in PLANS
    },
    ORBAX_V1: (
        "ocp.load(path, abstract_state=sharded) in a SAFETENSORS-layout ocp.Context (v1)",
        _orbax_v1,
    ),
    NUMPY: ("jax.device_put(safetensors.numpy.load_file(path), shardings)", _numpy),
    FLAX: ("jax.device_put(safetensors.flax.load_file(path), shardings)", _flax),
    FAST: (
        "fastsafe_open(path, framework='pt', device='cpu', nogds=True), each tensor "
        ".numpy(), then jax.device_put(..., shardings)",
        _fast,
    ),
}
NEEDS = {
    **{s: [] for s in (RAW, RAW8)},
    **{TT[p]: ["taktiny.io"] for p in PLANS},
    ORBAX_V1: ["orbax.checkpoint.v1", "taktiny"],
    NUMPY: ["safetensors.numpy", "taktiny"],
    FLAX: ["safetensors.flax", "taktiny"],
    FAST: ["fastsafetensors", "taktiny"],
}
RESTORE.update({ONE[peer]: RESTORE[peer] for peer in PEERS})
NEEDS.update({ONE[peer]: NEEDS[peer] for peer in PEERS})
PLAN_OF = {
    **{TT[p]: p for p in PLANS},
    **{peer: INNER for peer in PEERS},
    **{ONE[peer]: "one device" for peer in PEERS},
}


def _on(plan: str) -> Any:
    """The abstract targets with the Taktiny model on `plan`'s shardings."""

    def prepare(abstracts: dict[str, Any]) -> dict[str, Any]:
        return {**abstracts, "taktiny": sharded(abstracts["taktiny"], plan)}

    return prepare


def _timed(load: Any, target: dict[str, Any]) -> Any:
    def run(path: Path) -> Any:
        return jax.block_until_ready(load(path, target))

    return run


PREPARE = {case: _on(plan) for case, plan in PLAN_OF.items()}  # the memory worker's targets


def _check(path: Path, abstracts: dict[str, Any], want: dict[str, Any]) -> None:
    """Every case's load gives the model's values on its plan's shardings (once, untimed)."""
    import taktiny as tt

    for case, plan in PLAN_OF.items():
        target = _on(plan)(abstracts)
        got = RESTORE[case][1](path, target)
        flat = got if isinstance(got, dict) else tt.flat_state_dict(got)
        for name, leaf in tt.flat_state_dict(target["taktiny"]).items():
            assert flat[name].sharding.is_equivalent_to(leaf.sharding, leaf.ndim), (case, name)
            assert np.asarray(flat[name]).tobytes() == np.asarray(want[name]).tobytes(), (
                case,
                name,
            )


def _cases(path: Path, abstracts: dict[str, Any], *, cold: bool) -> dict[str, Case]:
    def before() -> Path:
        if cold:
            os.sync()
            _disk.evict(path)
        return path

    return {
        case: Case(
            _timed(load, _on(PLAN_OF[case])(abstracts) if case in PLAN_OF else abstracts), before
        )
        for case, (_, load) in RESTORE.items()
    }


def run(
    config: Config, path: Path, abstracts: dict[str, Any], want: dict[str, Any], measure: Any
) -> tuple[list[Table], list[Target], list[str]]:
    """Times every case cold and warm and measures each Taktiny plan's memory; returns the
    tables, the targets and the notes for the streaming group. `measure(case)` runs the
    memory worker on `path` with this module as the registry."""
    _check(path, abstracts, want)
    stats: dict[str, dict[str, Stats]] = {}
    for kind in ("cold", "warm"):
        _raw(path)  # (warm: every page in the cache)
        stats[kind] = compare(
            _cases(path, abstracts, cold=kind == "cold"), repeat=config.pick(3, 2, 1)
        )
    memories = {plan: measure(TT[plan]) for plan in PLANS}
    processes = _two_processes(path)
    holds = {plan: held(sharded(abstracts["taktiny"], plan)) for plan in PLANS}

    times = Table("Sharded loads onto 8 devices (seconds)", SYSTEMS, reference=RAW, log=True)
    for kind in ("cold", "warm"):
        for s, st in stats[kind].items():
            times.add(kind, s, RESTORE[s][0], st.median, (st.low, st.high))
    share = Table(
        "Share of the raw read's throughput (raw time / time, median of per-round ratios)",
        SYSTEMS[1:],
        unit="x",
        log=False,
        line=SHARE,
        label="raw read time / time",
    )
    best_cold = {}
    for s in SYSTEMS[1:]:
        share.add(
            "warm: 1-reader raw time / time",
            s,
            RESTORE[s][0],
            paired_ratio(stats["warm"][RAW], stats["warm"][s]),
        )
        best = [
            min(a, b)
            for a, b in zip(stats["cold"][RAW].samples, stats["cold"][RAW8].samples, strict=True)
        ]
        best_cold[s] = float(
            np.median([b / x for b, x in zip(best, stats["cold"][s].samples, strict=True)])
        )
        share.add("cold: best raw time (1 or 8 readers) / time", s, RESTORE[s][0], best_cold[s])
    growth = {
        plan: (memories[plan]["peak"] - memories[plan]["before"]) / holds[plan] for plan in PLANS
    }
    memory = Table(
        "Peak RSS growth against the bytes the devices hold",
        [TT[p] for p in PLANS],
        unit="x",
        log=False,
        line=GROWTH,
    )
    for plan in PLANS:
        memory.add("growth / bytes held", TT[plan], RESTORE[TT[plan]][0], growth[plan])

    bytes_read = Table(
        "Bytes each of 2 processes (4 devices each) reads of the checkpoint, every tensor "
        "split over all 8 devices",
        [f"process {i}" for i in range(len(processes))],
        unit="x",
        log=False,
        line=PROCESS_SHARE,
        reference="process 0",
        label="bytes read / checkpoint bytes",
    )
    for i, found in enumerate(processes):
        for verify, (fraction, _) in found.items():
            bytes_read.add(f"verify={verify}", f"process {i}", _process_load.CALL, fraction)
    targets = [
        Target(
            f"2 processes, every tensor split: each reads <= {PROCESS_SHARE:g}x the checkpoint "
            f"(process {i}, verify={verify})",
            found[verify][0],
            PROCESS_SHARE,
            False,
            "bytes read by the process / checkpoint bytes",
        )
        for i, found in enumerate(processes)
        for verify in (False, True)
    ]
    for plan in PLANS:
        targets += [
            Target(
                f"Taktiny onto {plan} >= {SHARE:g}x a warm raw read into fresh memory",
                paired_ratio(stats["warm"][RAW], stats["warm"][TT[plan]]),
                SHARE,
                True,
                "warm 1-reader raw read time / Taktiny time, median of per-round ratios",
            ),
            Target(
                f"Taktiny onto {plan}, cold >= {COLD_SHARE:g}x the best cold raw read (1 or 8 "
                "readers)",
                best_cold[TT[plan]],
                COLD_SHARE,
                True,
                "best raw read time / Taktiny time, median of per-round ratios",
            ),
            Target(
                f"Taktiny onto {plan}: peak RSS growth <= {GROWTH:g}x what the devices hold",
                growth[plan],
                GROWTH,
                False,
                "(peak RSS - RSS just before the load) / bytes on the devices",
            ),
        ]
    targets += [
        Target(
            f"Taktiny onto the inner split faster than {peer} ({kind})",
            paired_ratio(stats[kind][peer], stats[kind][TT[INNER]]),
            1.0,
            True,
            f"{peer} time / Taktiny time, median of per-round ratios",
        )
        for peer in PEERS
        for kind in ("cold", "warm")
    ]
    targets += [
        Target(
            f"Taktiny onto one device faster than {peer} ({kind})",
            paired_ratio(stats[kind][ONE[peer]], stats[kind][TT["one device"]]),
            1.0,
            True,
            f"{peer} time / Taktiny time, median of per-round ratios",
        )
        for peer in PEERS
        for kind in ("cold", "warm")
    ]
    notes = [
        "Sharded loads: " + __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
        "Bytes the devices hold, per plan: "
        + ", ".join(f"{p} {holds[p] / 1e9:.3f} GB" for p in PLANS)
        + ". Memory workers' load seconds (page cache as left, indicative only): "
        + ", ".join(f"{p} {memories[p]['seconds']:.2f} s" for p in PLANS)
        + ".",
    ]
    notes.append(
        "Two processes: bench/_process_load.py run as 2 processes of 4 CPU devices each "
        "(jax.distributed on 127.0.0.1), each loading the file onto every kernel split "
        "P(None, 'x') and every bias P('x') over the 8 devices, counting its os.preadv bytes "
        "and comparing each shard it holds with the file, bitwise (they were equal). With "
        "verify=True each process checks the digests of the tiles it reads (8 x 8 per "
        "kernel), and reads no more: the biases, too small for tiles, are read whole once "
        "more to check them. Seconds per load: "
        + "; ".join(
            f"process {i} " + ", ".join(f"verify={v} {sec:.2f} s" for v, (_, sec) in f.items())
            for i, f in enumerate(processes)
        )
        + "."
    )
    return [times, share, memory, bytes_read], targets, notes


def _two_processes(path: Path) -> list[dict[bool, tuple[float, float]]]:
    """Per process: verify -> (bytes read / checkpoint bytes, seconds), from
    bench/_process_load.py run as 2 processes (each checks its shards bitwise)."""
    found = []
    for out in _process_load.run_job(str(path)):
        mine: dict[bool, tuple[float, float]] = {}
        for line in out.splitlines():
            if "shards bitwise equal" in line:  # process 0: read N of M bytes (verify=V) in S s
                words = line.split()
                share = int(words[3]) / int(words[5])
                mine[words[7] == "(verify=True)"] = (share, float(words[9]))
        found.append(mine)
    return found
