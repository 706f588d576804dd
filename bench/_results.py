"""What a benchmark group hands to the report: tables of measurements and targets."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Literal

Mode = Literal["full", "quick", "smoke"]


@dataclasses.dataclass(frozen=True)
class Config:
    """How big and how often: ``full`` for the committed report, ``quick`` for development,
    ``smoke`` for the test that keeps every benchmark running (tiny sizes, one sample)."""

    mode: Mode = "full"
    scratch: Path = Path(tempfile.gettempdir())  # checkpoints go here, and are deleted

    def pick(self, full: Any, quick: Any, smoke: Any) -> Any:
        """The value for this mode."""
        return {"full": full, "quick": quick, "smoke": smoke}[self.mode]

    @property
    def repeat(self) -> int:
        """Samples per case for the fast (in-memory) benchmarks."""
        return self.pick(31, 5, 1)


@dataclasses.dataclass
class Cell:
    """One system's measurement of one operation: the call it makes and its value."""

    call: str
    value: float  # seconds, bytes or a ratio, as the table's unit says
    spread: tuple[float, float] | None = None  # fastest and slowest sample


@dataclasses.dataclass
class Table:
    """Operations (rows) by systems (columns); ratios are taken against `reference`."""

    title: str
    systems: list[str]
    rows: dict[str, dict[str, Cell]] = dataclasses.field(default_factory=dict)
    unit: Literal["s", "B", "x"] = "s"  # seconds, bytes, or a plain ratio
    reference: str = "Taktiny"
    log: bool = True  # plot on a log scale
    line: float | None = None  # a target to draw across the plot (ratio tables)
    label: str | None = None  # the plot's y axis, where the unit's own label does not fit

    def add(self, op: str, system: str, call: str, value: float, spread: Any = None) -> None:
        """Records `system`'s `value` for `op`."""
        self.rows.setdefault(op, {})[system] = Cell(call, value, spread)

    def value(self, op: str, system: str) -> float:
        """The recorded value (raises KeyError when that system has no such operation)."""
        return self.rows[op][system].value


@dataclasses.dataclass
class Target:
    """A goal the report marks as met or not: ``value >= threshold`` or ``<=``."""

    goal: str  # in words, e.g. "load_state_dict >= 5x faster than PyTorch load_state_dict"
    value: float
    threshold: float
    at_least: bool  # True: value must be >= threshold; False: <= threshold
    measured: str  # how value was computed, e.g. "PyTorch time / Taktiny time"

    @property
    def met(self) -> bool:
        """Whether the target is met."""
        return self.value >= self.threshold if self.at_least else self.value <= self.threshold


@dataclasses.dataclass
class Group:
    """Everything one benchmark group measured."""

    name: str
    title: str
    tables: list[Table] = dataclasses.field(default_factory=list)
    targets: list[Target] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0  # wall time of the group
    # the run that measured it: {"command", "mode", "seconds"}, set by report.write; a
    # report merged from several runs (run.py --merge) names each group's own
    run: dict[str, Any] | None = None


def faster(table: Table, op: str, system: str, ref_op: str | None = None) -> float:
    """How many times faster Taktiny's `ref_op` (default `op`) is than `system`'s `op`."""
    return table.value(op, system) / table.value(ref_op or op, table.reference)


def fmt_time(seconds: float) -> str:
    """Seconds in the unit that reads best: 1.23 s, 45.6 ms, 789 µs."""
    seconds = float(f"{seconds:.3g}")  # (rounded first: 999.6 µs reads 1 ms, not 1e+03 µs)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def fmt_ratio(value: float) -> str:
    """A measured ratio with the digits that matter near the thresholds: 0.836, 1.000, 137."""
    return f"{value:.3f}" if value < 100 else f"{value:.0f}"


class Skipped(Exception):
    """Raised by a group that cannot run on this machine (the accelerator group without an
    accelerator), with the reason; ``bench/run.py`` reports it and goes on."""
