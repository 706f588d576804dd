"""The peak host memory ``plan_load`` predicts, against the peak a fresh interpreter measures
(tests/_peak.py), for the loads that need memory beyond the model's arrays: casts and
quantization through scratch buffers, transforms whose results are cast, transposes cut
into several devices' blocks, blocks cut from rows, FP8 blocks dequantized (and quantized
again). Within the bound the bench's plan group
holds the 1 GB loads to (bench/load_plan.py). And what each load holds beyond its arrays
within ``held_bytes``, what ``max_host_bytes`` counts (a budget that counted nothing for
the rows a block read cuts from, onto CPU devices, fails here: planted by hand)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _child import cpu_environment
from _peak import CASES, SHAPES
from _quantized_files import fp8_folder

from taktiny.io import save_safetensors

HERE = Path(__file__).parents[1]
WITHIN = 0.10  # |predicted / measured - 1|, as bench/load_plan.py's WITHIN
NOISE = 2**20  # bytes the interpreter and the allocator may hold beyond what a load counts


@pytest.mark.program
@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="measures with Linux's /proc"
)
def test_the_predicted_peak_of_loads_through_scratch_buffers_is_the_measured(tmp_path):
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal(s, np.float32) for n, s in SHAPES.items()}
    save_safetensors(tmp_path / "f.safetensors", weights)
    fp8_folder(
        {f"{n}.weight": w.T for n, w in weights.items()},
        tmp_path / "fp8",
        quantized=lambda n: True,
        shards=1,
    )
    env = cpu_environment(
        PYTHONPATH=str(HERE.parent),
        MALLOC_MMAP_THRESHOLD_=str(2**20),  # (see tests/_peak.py)
    )
    run = subprocess.run(
        [sys.executable, str(HERE / "_peak.py"), str(tmp_path), *map(str, range(len(CASES)))],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=HERE.parent,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = {r["case"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert list(found) == CASES
    # each load needs memory beyond its arrays, in each of the ways a load holds it
    ways = {name: r["ways"] for name, r in found.items()}
    assert ways == {
        CASES[0]: ["scratch"],
        CASES[1]: ["quantized"],
        CASES[2]: ["scratch"],
        CASES[3]: ["transposed"],
        CASES[4]: ["blocks"],
        CASES[5]: ["scratch"],  # (the float8 weights and their scales read together)
        CASES[6]: ["quantized"],
    }
    assert all(r["scratch"] > 0 for r in found.values())
    off = {n: r["predicted"] / r["measured"] - 1 for n, r in found.items()}
    said = {n: f"predicted {r['predicted']:,}, measured {r['measured']:,}, {off[n]:+.1%}"
            for n, r in found.items()}  # fmt: skip
    within = dict.fromkeys(CASES, WITHIN)
    # the transposed arrays cut into blocks peak at one of two levels, run by run (two
    # schedules, probably: the largest tensor's read begun before or after the second
    # one's temporaries are let go): 110-113 MB or 128-130 MB measured against the plan's
    # 121.6 MB, before the reader threads were kept across loads as after (the lower level
    # some 2.5 MB lower since, probably the thread starts); the plan lies between the two
    within[CASES[3]] = 0.12
    assert all(abs(x) <= within[n] for n, x in off.items()), json.dumps(said, indent=1)
    # what the load holds beyond the model's arrays stays within held_bytes, the most that
    # max_host_bytes counts of it (an upper bound: as many readers as a load ever uses).
    # Blocks cut from rows onto CPU devices hold their 4 MiB of rows while they are read
    # (the blocks are the leaves), which a budget counting nothing for them leaves out
    beyond = {n: r["measured"] - r["arrays"] for n, r in found.items()}
    said = {n: f"held {r['held']:,}, measured {beyond[n]:,} beyond the arrays"
            for n, r in found.items()}  # fmt: skip
    # (pieces of rows of 4 MiB, each read while the last one's blocks are placed: 4.1-8.4
    # MB measured alone, 1.57 MB once in a fresh clone's make test, three workers on two
    # cores: more than the noise, always)
    assert beyond[CASES[4]] > NOISE, json.dumps(said, indent=1)
    assert all(beyond[n] <= r["held"] + NOISE for n, r in found.items()), json.dumps(said, indent=1)
