"""Checksums: what verifying every tensor's XXH3-128 digest costs a warm streaming load of
the 1 GB float32 checkpoint (``load_safetensors(abstract, path)``, verifying by default,
against ``verify=False``), what writing the digests costs a save, and ``taktiny verify``'s
throughput.

- Loads: the file's pages stay in the page cache (one read before the timing), so the
  disk is out of the comparison and what is left is Taktiny's own work: the reads from
  the page cache into the model's buffers, and the hashing of each piece as it is read,
  in the reader that read it, while the others read on. Interleaved rounds; the cost is the
  median of per-round ratios.
- Saves: ``save_safetensors`` with its digests against ``safetensors.numpy.save_file`` of
  the same arrays (no digests, no fsync), each to a fresh path.
- ``taktiny verify``: the in-process check of every tensor (``taktiny.io._verify``), warm.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import jax
import numpy as np

from . import _disk, _formats
from ._results import Config, Group, Table, Target
from ._timing import Case, compare, paired_ratio

VERIFIED, UNVERIFIED = "Taktiny, verify=True (default)", "Taktiny, verify=False"
SAVE_TT, SAVE_ST = "taktiny.io.save_safetensors", "safetensors.numpy.save_file"
COST = 1.05  # the bound: verifying costs at most 5% of the warm load


def run(config: Config) -> Group:
    import safetensors.numpy

    import taktiny.io as tio
    from taktiny.io._verify import verify

    start = time.perf_counter()
    width, depth = _formats.SIZES[config.mode]
    model = _formats.Big(width, depth, rngs=_formats.nn.Rngs(0))
    abstract = _formats.abstracts(width, depth)["taktiny"]
    nbytes = sum(x.nbytes for x in jax.tree.leaves(model))
    flat = {k: np.asarray(v) for k, v in model.flat_state_dict().items()}
    group = Group("checksums", f"Checksums of a {nbytes / 1e9:.2f} GB safetensors checkpoint")
    root = Path(config.scratch)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "checksums.safetensors"
    repeat = config.pick(9, 5, 1)
    try:
        tio.save_safetensors(path, model)
        path.read_bytes()  # warm: the pages in the page cache
        loads = compare(
            {
                VERIFIED: lambda: jax.block_until_ready(
                    tio.load_safetensors(abstract, path, progress=False)
                ),
                UNVERIFIED: lambda: jax.block_until_ready(
                    tio.load_safetensors(abstract, path, progress=False, verify=False)
                ),
            },
            repeat=repeat,
        )
        count = iter(range(10**6))

        def fresh() -> Path:
            return root / f"save-{next(count)}.safetensors"

        def removed(p: Path) -> None:
            _disk.remove(p)

        saves = compare(
            {
                SAVE_TT: Case(lambda p: tio.save_safetensors(p, flat), fresh, removed),
                SAVE_ST: Case(
                    lambda p: safetensors.numpy.save_file(flat, p, {"format": "pt"}),
                    fresh,
                    removed,
                ),
            },
            repeat=config.pick(5, 3, 1),
        )
        verified = compare({"taktiny verify": lambda: verify(path)}, repeat=repeat)
        assert verify(path).checked == len(flat)
    finally:
        _disk.remove(path)

    cost = paired_ratio(loads[VERIFIED], loads[UNVERIFIED])
    title = f"{depth} x Linear({width}, {width}), float32, {nbytes / 1e6:,.0f} MB"
    table = Table(f"Warm-cache load, {title}", [VERIFIED, UNVERIFIED], reference=UNVERIFIED)
    for name, st in loads.items():
        call = f"taktiny.io.load_safetensors(abstract, path) ({name})"
        table.add("load", name, call, st.median, (st.low, st.high))
    saving = Table(f"Save, {title}", [SAVE_TT, SAVE_ST], reference=SAVE_ST)
    for name, st in saves.items():
        saving.add("save", name, f"{name}(path, flat)", st.median, (st.low, st.high))
    check = verified["taktiny verify"]
    speed = Table(
        "taktiny verify (in process), warm page cache",
        ["taktiny verify"],
        unit="x",
        reference="taktiny verify",
        log=False,
        label="GB/s",
    )
    gbs = nbytes / check.median / 1e9
    speed.add("GB/s", "taktiny verify", "taktiny.io._verify.verify(path)", gbs)
    group.tables += [table, saving, speed]
    group.targets.append(
        Target(
            f"verifying every tensor costs at most {COST - 1:.0%} of the warm streaming load",
            cost,
            COST,
            False,
            "verify=True time / verify=False time, median of per-round ratios",
        )
    )
    group.notes.append(
        f"{repeat} interleaved rounds after a warm-up; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores. Save "
        f"with digests / safetensors' own save: "
        f"{paired_ratio(saves[SAVE_TT], saves[SAVE_ST]):.2f}x (Taktiny's also fsyncs each file "
        "and its folder, and commits by rename). taktiny verify reads and hashes "
        f"{nbytes / check.median / 1e9:.1f} GB/s from the page cache."
    )
    group.seconds = time.perf_counter() - start
    return group
