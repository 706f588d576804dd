"""Interleaved repeated timing: every system measured side by side, medians compared.

The machine is shared and noisy, so absolute times drift. To keep ratios honest,
``compare`` runs one sample of every case in turn (in a fresh shuffled order each round),
after a warm-up of every case, and reports each case's median. Fast operations are
timed in batches of calls so that a sample lasts long enough to be measured well.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Case:
    """One system's way of doing the operation under test.

    ``before`` (untimed) runs before every sample and its result is passed to ``run``
    and then to ``after`` (untimed): fresh checkpoint paths, cache drops, clean-up.
    """

    run: Callable[..., Any]
    before: Callable[[], Any] | None = None
    after: Callable[[Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Stats:
    """The timing of one case: median seconds per call, and the spread of the samples."""

    median: float
    low: float  # the fastest sample
    high: float  # the slowest sample
    samples: tuple[float, ...]  # seconds per call of each sample, in round order
    calls_per_sample: int


def _sample(case: Case, number: int) -> float:
    """Seconds per call of one sample of `number` calls, with the GC paused as timeit does.

    A batched sample (a fast case) starts with one untimed call, so that the caches the
    previous system's sample cooled are warm again: steady state is what a loop sees.
    """
    arg = case.before() if case.before is not None else None
    if number > 1:
        case.run()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(number):
            case.run(arg) if case.before is not None else case.run()
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
        if case.after is not None:
            case.after(arg)
    return elapsed / number


def _calls_per_sample(case: Case, min_sample_s: float) -> int:
    """How many calls make one sample last about `min_sample_s` (1 for slow or hooked cases)."""
    if case.before is not None or case.after is not None:
        return 1
    number = 1
    while number < 100_000:
        took = _sample(case, number) * number
        if took >= min_sample_s:
            break
        number = max(number * 2, int(number * 1.2 * min_sample_s / max(took, 1e-9)))
    return number


def compare(
    cases: dict[str, Case | Callable[[], Any]],
    *,
    repeat: int,
    warmup: int = 1,
    min_sample_s: float = 0.01,
) -> dict[str, Stats]:
    """Times every case `repeat` times, interleaved, and returns each one's median.

    Args:
        cases: system name -> a zero-argument callable or a :class:`Case`.
        repeat: samples per case (the median is taken over these).
        warmup: untimed calls of each case first (compilation, caches, page faults).
        min_sample_s: the shortest a sample of a fast case may be; fast cases repeat
            their call within one sample until it lasts this long.
    """
    named = {name: c if isinstance(c, Case) else Case(c) for name, c in cases.items()}
    for case in named.values():
        for _ in range(warmup):
            _sample(case, 1)
    numbers = {name: _calls_per_sample(case, min_sample_s) for name, case in named.items()}
    times: dict[str, list[float]] = {name: [] for name in named}
    shuffle = random.Random(0).shuffle  # the same orders every run
    for _ in range(repeat):
        order = list(named)
        shuffle(order)  # a new order each round, so no case always follows the same neighbour
        for name in order:
            times[name].append(_sample(named[name], numbers[name]))
    return {
        name: Stats(statistics.median(ts), min(ts), max(ts), tuple(ts), numbers[name])
        for name, ts in times.items()
    }


def paired_ratio(a: Stats, b: Stats) -> float:
    """The median over rounds of a's sample / b's sample from the same round.

    Both ran in the same round, close together in time, so the slow drifts of a shared
    machine's load cancel in each ratio; this is the steadiest estimate of a / b.
    """
    return statistics.median(x / y for x, y in zip(a.samples, b.samples, strict=True))
