"""Object storage under concurrency and kills, against moto's server on 127.0.0.1
(conftest.py): a process saving to a URL over and over while this one loads it (every load
bitwise one of the versions, none an error); saving processes killed with SIGKILL at random
moments (the URL loads as one of the two versions, and the next save leaves only its own
objects); and a model split over 2 processes loading from a URL, each reading at most 0.55x
the checkpoint. Quick versions run in `make test`, long ones under the `thorough` marker."""

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import obstore
import pytest
from _s3 import kept
from _s3_saver import version
from obstore.store import from_url

from taktiny.io import load_safetensors, save_safetensors

pytestmark = pytest.mark.program

HERE = Path(__file__).resolve().parents[1]
ROOT = HERE.parent


def target() -> dict[str, jnp.ndarray]:
    return {k: jnp.zeros(v.shape, v.dtype) for k, v in version(0).items()}


def which(loaded) -> int | None:
    """The version `loaded` is bitwise, or None."""
    for number in (1, 2, 3):
        if all(np.asarray(loaded[k]).tobytes() == v.tobytes() for k, v in version(number).items()):
            return number
    return None


def saver(url: str, seconds: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE / "_s3_saver.py"), url, str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ,
    )


@pytest.mark.parametrize(
    "seconds", [8, pytest.param(60, marks=pytest.mark.thorough)], ids=["quick", "long"]
)
def test_loads_racing_saves_read_one_whole_version(s3, seconds):
    url = f"{s3}/race/model.safetensors"
    save_safetensors(url, version(1))
    job = saver(url, seconds)
    seen, loads = set(), 0
    try:
        while job.poll() is None:
            loaded = load_safetensors(target(), url, progress=False)
            number = which(loaded)
            assert number in (1, 2), "a load read a mix of two versions"
            seen.add(number)
            loads += 1
    finally:
        out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    saves = out.split()
    assert len(saves) >= 4 and loads >= 4, (saves, loads)
    assert seen == {1, 2}, (seen, saves, loads)  # loads fell between saves of both kinds


def objects(bucket: str) -> list[str]:
    return sorted(m["path"] for m in obstore.list(from_url(bucket)).collect())


@pytest.mark.parametrize(
    "kills", [3, pytest.param(15, marks=pytest.mark.thorough)], ids=["quick", "many"]
)
def test_a_killed_save_leaves_one_version_and_the_next_save_cleans_up(s3, kills):
    url = f"{s3}/kill/model.safetensors"
    rng = random.Random(kills)
    outcomes = []
    for _ in range(kills):
        save_safetensors(url, version(1), max_shard_size="150KB")
        job = saver(url, 30)  # saves 2, 1, 2, ... until killed
        time.sleep(rng.uniform(0.3, 2.5))  # (the interpreter starts in ~1 s)
        job.kill()
        job.communicate()
        number = which(load_safetensors(target(), url, progress=False))
        assert number in (1, 2)
        outcomes.append(number)
        written = save_safetensors(url, version(3), max_shard_size="300KB")
        # the killed save's are gone: the new checkpoint's and those it keeps are left
        assert objects(s3) == sorted({*(w.key for w in written), *kept(url)})
        assert len(kept(url)) >= 2  # (the record, and the previous checkpoint's objects)
        assert which(load_safetensors(target(), url, progress=False)) == 3


def test_each_of_two_processes_reads_at_most_its_share_of_an_object(s3, tmp_path):
    """bench/_process_load.py against a URL: each process of a model split over 2 reads
    its half of each tensor (and the header), bitwise, as from a local file."""
    from _processes import lines, run_processes

    rng = np.random.default_rng(0)
    values = {
        "outer": rng.standard_normal((512, 64), np.float32),
        "inner": rng.standard_normal((64, 2048), np.float32),
        "bias": rng.standard_normal((64,), np.float32),
    }
    url = f"{s3}/weights.safetensors"
    save_safetensors(url, values)
    total = sum(v.nbytes for v in values.values())
    program = [str(ROOT / "bench" / "_process_load.py"), url]
    outputs = run_processes(tmp_path, "load", "8", program=program, timeout=300)
    for i, out in enumerate(outputs):
        reads = [line.split(" in ")[0] for line in lines(out, "bitwise")]
        assert len(reads) == 2, out
        for line in reads:  # "process 0: read N of TOTAL bytes (verify=...)"
            read = int(line.split(" read ")[1].split(" of ")[0])
            assert read <= 0.55 * total, (i, line)
        assert [line.split("; ")[1] for line in lines(out, "bitwise")] == [
            "12 shards bitwise equal"  # 4 devices x 3 tensors
        ] * 2, out
