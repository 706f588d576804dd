"""`make test-accelerator` tests the host's accelerator or refuses to run: its environment
sees the host's JAX, and pytest stops before any test where JAX sees no TPU or GPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from _child import cpu_environment

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.program


def test_make_test_accelerator_runs_the_hosts_jax_held_at_its_versions():
    """A plain virtual environment would install JAX from the index for the CPU alone: on a
    TPU or GPU host every accelerator test would skip and the run pass. The target's
    environment sees the host's packages, jax and jaxlib constrained to the versions the
    host has (read by the Makefile's own command, run here), and pytest is told to
    require an accelerator."""
    alone = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}  # (not make's
    # child: under `make test`, a make in it would name the folders it enters)
    dry = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "test-accelerator"],
        cwd=ROOT,
        env=alone,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    assert any(re.search(r" -m venv --system-site-packages \.venv-accelerator$", c) for c in dry)
    (read,) = [c for c in dry if c.endswith(" > .venv-accelerator/host-jax.txt")]
    code = re.fullmatch(r"\S+ -c '(.*)' > \S+", read)
    assert code is not None
    held = subprocess.run(
        [sys.executable, "-c", code[1]], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert held == [f"jax=={jax.__version__}", f"jaxlib=={jax.lib.__version__}"]
    (install,) = [c for c in dry if " -m pip install " in c]
    assert " -c .venv-accelerator/host-jax.txt " in install
    assert dry[-1].startswith("JAX_PLATFORM_NAME=cpu .venv-accelerator/bin/python -m pytest")
    assert dry[-1].endswith(" --require-accelerator")


def test_require_accelerator_stops_before_any_test_where_jax_sees_none():
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    test = "tests/package/test_layout.py::test_the_tests_are_laid_out_like_the_packages"
    refused = subprocess.run(
        [*command, "--require-accelerator", test],
        cwd=ROOT,
        env=cpu_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == pytest.ExitCode.USAGE_ERROR, refused.stdout + refused.stderr
    assert re.search(
        r"--require-accelerator: JAX \S+ \(\S+\) sees no TPU or GPU devices here, only cpu: "
        r"every \[tpu\] and \[gpu\] test would be skipped and the run would pass having "
        r"tested no accelerator\. Run it with a JAX that has the accelerator's backend",
        refused.stderr,
    ), refused.stderr
    assert " passed" not in refused.stdout
