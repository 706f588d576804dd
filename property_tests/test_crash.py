"""Random SIGKILLs of saving processes: each killed save leaves exactly the previous
checkpoint or exactly the new one, loaded by its path and by its folder alike, and the next
save removes what it left (tests/_crash.py is the harness; tests/io/test_crash.py kills and
fails every step in turn), saves that wait and background saves
(``save_safetensors(..., wait=False)``, then ``result()``). ``make test`` kills 30 saves of
each; ``make property`` 300."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from property_tests.budget import examples
from tests._child import cpu_environment

HARNESS = Path(__file__).parent.parent / "tests" / "_crash.py"


@pytest.mark.program
@pytest.mark.parametrize("how", ["waits", "background"])
def test_saves_killed_at_random_moments_leave_one_whole_version(tmp_path, how):
    kills = examples(30)
    seed = int.from_bytes(os.urandom(4)) if kills > 30 else 0  # ci: the same moments each run
    run = subprocess.run(
        [sys.executable, str(HARNESS), "random", str(tmp_path), str(kills), str(seed), how],
        capture_output=True,
        text=True,
        timeout=900,
        env=cpu_environment(),
    )
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)
    assert results["failures"] == [], f"seed {seed}"
    assert results["kills"] == kills
    assert results["old"] and results["new"]  # kills fell both before and after the commits
    print(f"random kills (seed {seed}): {results}")
