"""A test that hangs fails the run instead of stalling it (a background-save bug once left
`make test` blocked forever): pyproject.toml gives every test a time limit, pytest-timeout's
thread method ends a test blocked even inside C code, and pytest's faulthandler prints
every thread's stack first, so the failure says where it hung. Seen to fail with the limit
removed from pyproject.toml, with the signal method (which waits for a test blocked in C to
return to Python), and with the faulthandler's timeout past the limit (no stack shown)."""

import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from _child import cpu_environment

pytestmark = pytest.mark.program

ROOT = Path(__file__).resolve().parents[2]

HANGS = """\
import threading


def test_hangs():
    threading.Event().wait()  # (a lock acquire: blocked in C, as a stuck join is)


def test_after():
    pass
"""


def test_the_suite_limits_every_test_and_a_test_that_hangs_fails_naming_where(tmp_path):
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    ini = settings["ini_options"]
    assert ini["timeout_method"] == "thread"
    assert 60 <= ini["faulthandler_timeout"] < ini["timeout"] <= 600  # (make test: 12 min)
    (tmp_path / "test_hang.py").write_text(HANGS)
    started = time.monotonic()
    # the project's own settings, the times made short: the limit 4 s, the stacks at 2 s
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
         str(tmp_path), "-o", "timeout=4", "-o", "faulthandler_timeout=2", "-p",
         "no:cacheprovider", "-q", "-n", "1", str(tmp_path / "test_hang.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=cpu_environment(),
    )  # fmt: skip
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("1 failed, 1 passed in "), done.stdout
    failed = "FAILED test_hang.py::test_hangs - worker 'gw0' crashed while running"
    assert any(line.startswith(failed) for line in lines), done.stdout
    assert "Timeout (0:00:02)!" in done.stderr
    assert 'test_hang.py", line 5 in test_hangs' in done.stderr, done.stderr
    assert took < 90
