"""A pytest plugin that counts the programs XLA compiles in each test, and the seconds they
took: ``python -m pytest -p property_tests.compiles -n 0 ...`` prints them after the run.

On an accelerator a compile costs 0.1 to 10 s, so the count tells where a ``[tpu]``
variant's time goes. On the CPU, ``TAKTINY_ACCELERATOR_DRAW=1`` makes the ``[cpu]`` variants
draw as an accelerator's do (`property_tests.arrays.on_accelerator`), and the counts are
those of the programs an accelerator would compile (on its own devices: where it has fewer
than the CPU's 8, fewer meshes and specs). Counted in the process it runs in: run without
pytest-xdist's workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from jax import monitoring

_EVENT = "/jax/core/compile/backend_compile_duration"  # one per program compiled
_counts: dict[str, list[float]] = {}  # test id -> [programs, seconds]
_running: list[str] = []


def _compiled(event: str, seconds: float, **_: Any) -> None:
    if event == _EVENT and _running:
        count = _counts.setdefault(_running[-1], [0, 0.0])
        count[0] += 1
        count[1] += seconds


monitoring.register_event_duration_secs_listener(_compiled)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _running.append(item.nodeid)
    try:
        return (yield)
    finally:
        _running.pop()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _counts:
        return
    terminalreporter.section("programs compiled")
    for test, (programs, seconds) in sorted(_counts.items(), key=lambda kv: -kv[1][1]):
        terminalreporter.write_line(f"{int(programs):5d} {seconds:7.2f} s  {test}")
    programs = sum(int(n) for n, _ in _counts.values())
    seconds = sum(s for _, s in _counts.values())
    terminalreporter.write_line(f"{programs:5d} {seconds:7.2f} s  in all")
