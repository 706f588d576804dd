"""The report: bench/results.md (every table, every ratio, every target) and a PNG bar
chart per table (matplotlib, Agg backend), Taktiny's bar beside each peer's."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from pathlib import Path
from typing import Any

from ._results import Cell, Group, Table, Target, fmt_ratio, fmt_time

# Benchmarks that arrive with later issues; the report keeps a place for each
PENDING: dict[str, str] = {}  # groups still to come: name -> what they will measure


def _value(table: Table, value: float) -> str:
    if table.unit == "x":
        return f"{value:.2f}x"
    return fmt_time(value) if table.unit == "s" else f"{value / 1e6:,.0f} MB"


def _cell(table: Table, op: str, system: str) -> str:
    row = table.rows[op]
    if system not in row:
        return "—"
    value, ref = row[system].value, row.get(table.reference)
    if system == table.reference or ref is None or table.unit != "s":
        return _value(table, value)
    return f"{_value(table, value)} ({value / ref.value:.2f}x)"


def _markdown_table(table: Table) -> list[str]:
    systems = [s for s in table.systems if any(s in row for row in table.rows.values())]
    lines = [f"| {table.title} | " + " | ".join(systems) + " |"]
    lines.append("|---|" + "---:|" * len(systems))
    for op in table.rows:
        lines.append(f"| {op} | " + " | ".join(_cell(table, op, s) for s in systems) + " |")
    if table.unit == "x":
        return [*lines, ""]
    lines += ["", "<details><summary>The call each system makes</summary>", ""]
    for system in systems:
        calls = {op: row[system].call for op, row in table.rows.items() if system in row}
        if len(set(calls.values())) == 1:
            lines.append(f"- {system}: `{next(iter(calls.values()))}`")
        else:
            lines.append(f"- {system}: " + "; ".join(f"{op} `{c}`" for op, c in calls.items()))
    return [*lines, "", "</details>", ""]


def plot(table: Table, path: Path) -> None:
    """A grouped bar chart: one group of bars per operation, one bar per system."""
    import matplotlib  # (here: an accelerator's host may not have it; `write` skips plots)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in table.systems if any(s in row for row in table.rows.values())]
    ops = list(table.rows)
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(ops) * len(systems) / 3), 4.2))
    colours = plt.get_cmap("tab10").colors  # pyright: ignore[reportAttributeAccessIssue]
    scale = 1e6 if table.unit == "B" else 1.0
    for j, system in enumerate(systems):
        xs = [
            i + (j - (len(systems) - 1) / 2) * width
            for i, op in enumerate(ops)
            if system in table.rows[op]
        ]
        values = [table.rows[op][system].value / scale for op in ops if system in table.rows[op]]
        bars = ax.bar(
            xs,
            values,
            width,
            label=system,
            color=colours[j % 10],
            edgecolor="black" if system == table.reference else None,
        )
        if table.unit == "s" and system != table.reference:
            for bar, op in zip(bars, [op for op in ops if system in table.rows[op]], strict=True):
                ref = table.rows[op].get(table.reference)
                if ref is not None:
                    ratio = table.rows[op][system].value / ref.value
                    ax.annotate(
                        f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2g}x",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
    if table.line is not None:
        ax.axhline(table.line, color="grey", linestyle="--", linewidth=1)
        ax.annotate(
            f"target {table.line:g}x",
            (len(ops) - 0.5, table.line),
            ha="right",
            va="bottom",
            fontsize=7,
            color="grey",
        )
    ax.set_xticks(range(len(ops)), ops)
    if table.unit == "s":
        ax.set_yscale("log" if table.log else "linear")
        ax.set_ylabel(f"seconds per call (median{', log scale' if table.log else ''})")
    else:
        ax.set_ylabel(table.label or {"B": "MB", "x": "x checkpoint size"}[table.unit])
    ax.set_title(
        table.title + (f" (labels: x {table.reference}'s time)" if table.unit == "s" else ""),
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _versions() -> str:
    import importlib

    names = [
        ("jax", "jax"),
        ("flax", "flax"),
        ("equinox", "equinox"),
        ("torch", "torch"),
        ("orbax-checkpoint", "orbax.checkpoint"),
        ("safetensors", "safetensors"),
    ]
    versions = []
    for name, module in names:
        try:
            version = getattr(importlib.import_module(module), "__version__", "?")
        except ImportError:
            version = "not installed"
        versions.append(f"{name} {version}")
    return ", ".join(versions)


def load(path: Path) -> list[Group]:
    """The groups a results.json holds (as :func:`write` wrote them)."""
    groups = []
    for data in json.loads(path.read_text()):
        tables = [
            Table(
                t["title"],
                t["systems"],
                {
                    op: {
                        s: Cell(c["call"], c["value"], tuple(c["spread"]) if c["spread"] else None)
                        for s, c in row.items()
                    }
                    for op, row in t["rows"].items()
                },
                t["unit"],
                t["reference"],
                t["log"],
                t["line"],
                t.get("label"),
            )
            for t in data["tables"]
        ]
        targets = [
            Target(t["goal"], t["value"], t["threshold"], t["at_least"], t["measured"])
            for t in data["targets"]
        ]
        groups.append(
            Group(
                data["name"],
                data["title"],
                tables,
                targets,
                data["notes"],
                data["seconds"],
                data.get("run"),
            )
        )
    return groups


def _merged(kept: list[Group], new: list[Group]) -> list[Group]:
    """`kept` with each group of `new` in place of the one of its name (new ones last)."""
    fresh = {g.name: g for g in new}
    out = [fresh.pop(g.name, g) for g in kept]
    return out + list(fresh.values())


def _key(run: dict[str, Any] | None) -> str:
    return json.dumps(run, sort_keys=True)


def _provenance(groups: list[Group], this_run: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The run most groups come from (the report's own), and a sentence for each group
    measured by another run."""
    counts: dict[str, int] = {}
    for g in groups:
        counts[_key(g.run)] = counts.get(_key(g.run), 0) + 1
    best = max(counts.values())
    main = next((g.run for g in groups if g.run and counts[_key(g.run)] == best), this_run)
    lines = []
    for g in groups:
        if _key(g.run) == _key(main):
            continue
        if g.run is None:
            origin = "an earlier run that did not record its command"
        else:
            origin = (
                f"`{g.run['command']}` (mode {g.run['mode']}, {g.run['seconds']:.0f} s), run on "
                "its own"
            )
        lines += [
            f"The group `{g.name}` ({g.title}) is from {origin}; its section and targets were "
            "merged into this report (`python bench/run.py --only NAME --merge`). "
            "`python bench/run.py` runs it with the others.",
            "",
        ]
    return main, lines


def write(
    groups: list[Group],
    out: Path,
    *,
    mode: str,
    seconds: float,
    command: str,
    merge: bool = False,
    order: list[str] | None = None,
) -> Path:
    """Writes results.md, plots/*.png and results.json under `out`; returns results.md.

    Each group without a ``run`` is marked as measured by this one (command, mode, wall
    time). With `merge`, the groups already in ``out/results.json`` are kept, but for those
    of the same names as `groups`, and the report names the run each group comes from.
    With `order` (group names), the groups are written in that order (others last). Without
    matplotlib, no plots are drawn (an accelerator's host may lack it).
    """
    this_run = {"command": command, "mode": mode, "seconds": round(seconds, 1)}
    for group in groups:
        if group.run is None:
            group.run = this_run
    if merge and (out / "results.json").exists():
        groups = _merged(load(out / "results.json"), groups)
    if order is not None:
        rank = {name: i for i, name in enumerate(order)}
        groups = sorted(groups, key=lambda g: rank.get(g.name, len(order)))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        drawn = False
        print("[bench] matplotlib is not installed: no plots drawn")
    else:
        drawn = True
    main, provenance = _provenance(groups, this_run)
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Taktiny benchmarks",
        "",
        f"`{main['command']}` — mode **{main['mode']}**, wall time **{main['seconds']:.0f} s**, "
        f"{os.cpu_count()} CPU cores, Python {platform.python_version()}, {_versions()}.",
        "",
        *provenance,
        "Every number is the median of repeated samples, all systems' samples interleaved in "
        "one run (see `bench/_timing.py`). Cells read `time (Nx)`: N is that system's time "
        "divided by the reference system's (the first column), so N > 1 means the reference "
        "is faster.",
        "",
        "## Targets",
        "",
        "| target | measured | needed | met |",
        "|---|---:|---:|:---:|",
    ]
    for group in groups:
        for t in group.targets:
            need = f"{'≥' if t.at_least else '≤'} {t.threshold:g}"
            met = "yes" if t.met else "**no**"
            lines.append(f"| {t.goal} | {fmt_ratio(t.value)} ({t.measured}) | {need} | {met} |")
    if any(not t.met for g in groups for t in g.targets):
        findings = os.path.relpath(Path(__file__).parent / "FINDINGS.md", out)
        lines += [
            "",
            "Why the missed targets miss, from profiles, and what would close them: "
            f"[FINDINGS.md]({findings}) (reproduce with `python bench/diagnose.py load`, "
            "`python bench/diagnose.py orbax` and `python bench/diagnose.py streaming`).",
        ]
    for group in groups:
        lines += ["", f"## {group.title}", "", f"Group `{group.name}`, {group.seconds:.0f} s.", ""]
        for i, table in enumerate(group.tables, 1):
            name = f"{group.name}-{i}.png"
            lines += _markdown_table(table)
            if drawn:
                plot(table, plots / name)
                lines += [f"![{table.title}](plots/{name})", ""]
        lines += [f"- {note}" for note in group.notes]
    if PENDING:
        lines += ["", "## Later groups", ""]
        lines += [f"- **{name}** (pending): {text}" for name, text in PENDING.items()]
    path = out / "results.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps([_jsonable(g) for g in groups], indent=1))
    return path


def _jsonable(group: Group) -> Any:
    data = dataclasses.asdict(group)
    for t, target in zip(data["targets"], group.targets, strict=True):
        t["met"] = target.met
    return json.loads(json.dumps(data, default=str), parse_constant=lambda c: math.nan)
