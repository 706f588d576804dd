"""The report of a mutation run (`make mutate`): kill rates per file and per group, against
the targets in docs/testing.md.

Reads what mutmut left in ``mutants/`` (one ``.meta`` file per source file, with each mutant's
exit code) and the mutants judged equivalent, with a reason each, in
``tests/mutation_equivalents.toml``. Writes ``mutants/report.md``, prints the summary, and
exits 1 when a group misses its target.

    python tests/mutation_report.py [--mutants mutants] [--equivalents FILE] [--no-targets]
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
# mutmut's exit codes: 1 and 3 (a test failed, or pytest broke) kill a mutant, and so does
# its time limit (a mutant that loops is caught); 0 survives; 5 and 33 had no test to run.
KILLED = {1: "killed", 3: "killed", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout"}
SURVIVED, NO_TESTS = {0}, {5, 33}
TARGETS = {"core": 0.90, "nn": 0.80}  # the share of non-equivalent mutants killed


def group_of(path: str) -> str:
    return "nn" if "/nn/" in path else "core"


def read(mutants: Path) -> dict[str, dict[str, int | None]]:
    """source file -> mutant name -> exit code (None: not run)."""
    found: dict[str, dict[str, int | None]] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        source = str(meta.relative_to(mutants))[: -len(".meta")]
        found[source] = json.loads(meta.read_text())["exit_code_by_key"]
    return found


def summarise(results: dict[str, dict[str, int | None]], equivalent: dict[str, str]) -> dict:
    """Counts per file and per group."""
    files = {}
    for source, codes in results.items():
        counts: Counter[str] = Counter()
        for name, code in codes.items():
            if code in KILLED:
                counts["killed"] += 1
            elif name in equivalent:
                counts["equivalent"] += 1
            elif code in SURVIVED:
                counts["survived"] += 1
            elif code in NO_TESTS:
                counts["no tests"] += 1
            else:
                counts["not run"] += 1
        files[source] = counts
    groups: dict[str, Counter[str]] = {}
    for source, counts in files.items():
        groups.setdefault(group_of(source), Counter()).update(counts)
    return {"files": files, "groups": groups}


def rate(counts: Counter[str]) -> float:
    judged = counts["killed"] + counts["survived"] + counts["no tests"]
    return counts["killed"] / judged if judged else 1.0


def report(results: dict, equivalent: dict[str, str], summary: dict) -> str:
    lines = ["# Mutation report", "", "| file | mutants | killed | survived | no tests | "
             "equivalent | kill rate |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    rows = [*summary["files"].items(), *((f"**{g}**", c) for g, c in summary["groups"].items())]
    for name, c in rows:
        total = sum(c.values())
        lines.append(
            f"| {name} | {total} | {c['killed']} | {c['survived']} | {c['no tests']} | "
            f"{c['equivalent']} | {rate(c):.1%} |"
        )
    lines += ["", "## Surviving mutants", ""]
    for codes in results.values():
        for name, code in codes.items():
            if code not in KILLED and name not in equivalent:
                lines.append(f"- `{name}` ({'no tests' if code in NO_TESTS else 'survived'})")
    lines += ["", "## Equivalent mutants", ""]
    lines += [f"- `{name}`: {why}" for name, why in sorted(equivalent.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mutants", type=Path, default=Path("mutants"))
    parser.add_argument("--equivalents", type=Path, default=HERE / "mutation_equivalents.toml")
    parser.add_argument("--no-targets", action="store_true", help="exit 0 whatever the rates")
    args = parser.parse_args(argv)
    results = read(args.mutants)
    if not results:
        print(f"no mutation results under {args.mutants}/: run `make mutate` first")
        return 1
    equivalent = tomllib.loads(args.equivalents.read_text()).get("mutants", {})
    summary = summarise(results, equivalent)
    (args.mutants / "report.md").write_text(report(results, equivalent, summary))
    missed = []
    for group, counts in summary["groups"].items():
        goal = TARGETS[group]
        met = rate(counts) >= goal
        missed += [] if met else [group]
        print(f"{group:5} {rate(counts):6.1%} killed (target {goal:.0%}): {dict(counts)}")
    print(f"report: {args.mutants / 'report.md'}")
    return 1 if missed and not args.no_targets else 0


if __name__ == "__main__":
    sys.exit(main())
