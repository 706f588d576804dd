"""The environment of a Python program a test runs as a child process: this one's, on the
CPU (``JAX_PLATFORMS=cpu``: a child must not take an accelerator the test process may hold,
since one process at a time opens a TPU), with the platform's import-time warning filtered
(JAX on a TPU host whose kernel leaves transparent hugepages off warns of it when it is
imported, even for the CPU; it says how the host is set up, nothing of the code under test,
and a test that reads the child's standard error would take it for the program's)."""

from __future__ import annotations

import os

HOST_WARNING = "ignore:Transparent hugepages are not enabled"  # (PYTHONWARNINGS: a prefix)


def cpu_environment(**extra: str) -> dict[str, str]:
    """This process's environment for a child on the CPU, with `extra` variables set."""
    filters = [f for f in (os.environ.get("PYTHONWARNINGS"), HOST_WARNING) if f]
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": ",".join(filters), **extra}
