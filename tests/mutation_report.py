"""The report of a mutation run (`make mutate`): kill rates per file and per group, against
the targets in docs/testing.md.

Reads what mutmut left in ``mutants/`` (one ``.meta`` file per source file, with each mutant's
exit code) and the mutants judged equivalent, with a reason each, in
``tests/mutation_equivalents.toml``. Writes ``mutants/report.md``, prints the summary, and
exits 1 when a group misses its target.

    python tests/mutation_report.py [--mutants mutants] [--equivalents FILE] [--no-targets]
    python tests/mutation_report.py --survivors   # their names, to run them again
    python tests/mutation_report.py --pending 'taktiny.io.*'  # of those, the ones not run
    python tests/mutation_report.py --record      # keep the results in tests/mutation_results.json
    python tests/mutation_report.py --restore     # put the kept results back into mutants/

A run from scratch takes longer than one sitting, and ``mutants/`` is not committed, so the
results are kept in ``tests/mutation_results.json``: for each source file, the hash mutmut
gave each function and each mutant's exit code. ``--restore`` writes them back as mutmut's
``.meta`` files (for the files that have none), and mutmut then keeps the result of every
mutant whose function has the same hash, and judges again those of the functions that
changed.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import tomllib
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

HERE = Path(__file__).resolve().parent
# mutmut's exit codes, read as mutmut reads them: a failing test, a time limit (a mutant
# that loops) or the type checker kills a mutant; a pass survives; "no tests" reached it.
# Anything else (a segfault, an odd exit code) is "suspicious": neither killed nor hidden.
KILLED = {"killed", "timeout", "caught by type check"}
TARGETS = {"core": 0.90, "nn": 0.80}  # the share of non-equivalent mutants killed
# Files held to a target of their own, each on its own (issue 20: the last wave's code)
FILE_TARGET = 0.97
EACH_FILE = ("taktiny/io/", "taktiny/loading/", "taktiny/convert/", "taktiny/sharding/", "taktiny/quant/_qarray.py",
             "taktiny/quant/_fp8.py", "taktiny/quant/_compressed_tensors.py",
             "taktiny/nn/_attention.py", "taktiny/nn/_dot_product_attention.py",
             "taktiny/nn/_cache.py", "taktiny/nn/_rotary.py", "taktiny/nn/_pool.py",
             "taktiny/nn/_group_norm.py", "taktiny/nn/_quantized.py",
             "taktiny/state/_stacker.py")  # fmt: skip


def group_of(path: str) -> str:
    return "nn" if "/nn/" in path else "core"


def read(mutants: Path) -> dict[str, dict[str, int | None]]:
    """source file -> mutant name -> exit code (None: not run)."""
    found: dict[str, dict[str, int | None]] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        source = str(meta.relative_to(mutants))[: -len(".meta")]
        found[source] = json.loads(meta.read_text())["exit_code_by_key"]
    return found


RESULTS = HERE / "mutation_results.json"


def record(mutants: Path, results: Path) -> int:
    """Keep what ``mutants/`` holds in ``results``; returns the number of mutants kept."""
    kept: dict[str, dict] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        source = str(meta.relative_to(mutants))[: -len(".meta")]
        data = json.loads(meta.read_text())
        numbered: dict[str, dict[int, int | None]] = {}
        for key, code in data["exit_code_by_key"].items():
            function, _, number = key.rpartition(".")[2].rpartition("__mutmut_")
            numbered.setdefault(function, {})[int(number)] = code
        # a function's mutants are numbered 1 to n: their codes as a list, in that order
        codes = {f: [c[n] for n in range(1, len(c) + 1)] for f, c in numbered.items()}
        kept[source] = {"hashes": data["hash_by_function_name"], "codes": codes}
    lines = []  # one line per function, so that a diff shows which functions changed
    for source, entry in sorted(kept.items()):
        rows = [f"  {_json(f)}: {_json(c)}" for f, c in sorted(entry["codes"].items())]
        lines.append(f"{_json(source)}: {{\"hashes\": {_json(entry['hashes'])}, \"codes\": {{\n"
                     + ",\n".join(rows) + "}}")  # fmt: skip
    results.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    return sum(len(c) for f in kept.values() for c in f["codes"].values())


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def restore(mutants: Path, results: Path) -> int:
    """Write the kept results back as mutmut's ``.meta`` files, for the source files that
    have none; returns the number of files written."""
    written = 0
    if not results.exists():
        return 0
    for source, kept in json.loads(results.read_text()).items():
        meta = mutants / f"{source}.meta"
        if meta.exists():  # what this machine judged is newer than what was kept
            continue
        module = source.removesuffix(".py").replace("/", ".")
        codes = {f"{module}.{function}__mutmut_{number}": code
                 for function, listed in kept["codes"].items()
                 for number, code in enumerate(listed, 1)}  # fmt: skip
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({
            "exit_code_by_key": codes, "hash_by_function_name": kept["hashes"],
            "type_check_error_by_key": {}, "durations_by_key": {},
            "estimated_durations_by_key": {}}))  # fmt: skip
        written += 1
    return written


def pending(
    results: dict[str, dict[str, int | None]], globs: list[str], changed: list[str] = ()
) -> list[str]:
    """The mutants matching a glob (mutmut's names) that have not run, and a glob of the
    mutants of each function in `changed` (mutmut's name for it, module included), which
    mutmut numbers anew when it makes them; the globs themselves for a run from scratch
    (no results yet), for mutmut to expand."""
    if not results:
        return list(globs)
    found = [name for codes in results.values() for name, code in codes.items()
             if code is None and any(fnmatch.fnmatchcase(name, g) for g in globs)]  # fmt: skip
    fresh = [f"{f}__mutmut_*" for f in changed if any(fnmatch.fnmatchcase(f, g) for g in globs)]
    return [n for n in found if not n.startswith(tuple(g[:-1] for g in fresh))] + fresh


def changed(mutants: Path, root: Path) -> list[str]:
    """The functions (mutmut's names) whose source differs from the one their results in
    `mutants` were judged on: mutmut finds them only when it makes the mutants again, at
    the start of a run, after the names to run were chosen."""
    from mutmut.mutation.file_mutation import compute_function_hashes

    found = []
    for meta in sorted(mutants.rglob("*.py.meta")):
        source = root / str(meta.relative_to(mutants))[: -len(".meta")]
        if not source.exists():
            continue
        module = str(source.relative_to(root)).removesuffix(".py").replace("/", ".")
        kept = json.loads(meta.read_text()).get("hash_by_function_name", {})
        now = compute_function_hashes(source.read_text())
        found += [f"{module}.{f}" for f, h in now.items() if kept.get(f, h) != h]
    return found


def status(name: str, code: int | None, equivalent: dict[str, str]) -> str:
    """killed, equivalent, survived, no tests, suspicious or not run."""
    found = status_by_exit_code[code]
    if found in KILLED:
        return "killed"
    if name in equivalent:
        return "equivalent"
    if found in ("survived", "no tests"):
        return found
    return "not run" if code is None else "suspicious"


def summarise(results: dict[str, dict[str, int | None]], equivalent: dict[str, str]) -> dict:
    """Counts per file and per group."""
    files = {}
    for source, codes in results.items():
        counts: Counter[str] = Counter()
        for name, code in codes.items():
            counts[status(name, code, equivalent)] += 1
        files[source] = counts
    groups: dict[str, Counter[str]] = {}
    for source, counts in files.items():
        groups.setdefault(group_of(source), Counter()).update(counts)
    return {"files": files, "groups": groups}


def rate(counts: Counter[str]) -> float | None:
    """The share of judged, non-equivalent mutants killed; None when none was judged."""
    judged = counts["killed"] + counts["survived"] + counts["no tests"] + counts["suspicious"]
    return counts["killed"] / judged if judged else None


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def report(results: dict, equivalent: dict[str, str], summary: dict) -> str:
    lines = ["# Mutation report", "", "| file | mutants | killed | survived | no tests | "
             "suspicious | equivalent | not run | kill rate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    rows = [*summary["files"].items(), *((f"**{g}**", c) for g, c in summary["groups"].items())]
    for name, c in rows:
        total = sum(c.values())
        lines.append(
            f"| {name} | {total} | {c['killed']} | {c['survived']} | {c['no tests']} | {c['suspicious']} | "
            f"{c['equivalent']} | {c['not run']} | {percent(rate(c))} |"
        )
    lines += ["", "## Mutants not killed", ""]
    for codes in results.values():
        for name, code in codes.items():
            found = status(name, code, equivalent)
            if found in ("survived", "no tests", "suspicious"):
                lines.append(f"- `{name}` ({found}: {status_by_exit_code[code]})")
    lines += ["", "## Equivalent mutants", ""]
    lines += [f"- `{name}`: {why}" for name, why in sorted(equivalent.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mutants", type=Path, default=Path("mutants"))
    parser.add_argument("--equivalents", type=Path, default=HERE / "mutation_equivalents.toml")
    parser.add_argument("--no-targets", action="store_true", help="exit 0 whatever the rates")
    parser.add_argument(
        "--survivors",
        action="store_true",
        help="only print the names of survivors and of mutants no test reached (not equivalent ones)",
    )
    parser.add_argument("--pending", nargs="*", metavar="GLOB",
                        help="only print the names matching a GLOB that have not run")  # fmt: skip
    parser.add_argument("--results", type=Path, default=RESULTS, help="for --record, --restore")
    parser.add_argument("--record", action="store_true", help="keep mutants/' results")
    parser.add_argument("--restore", action="store_true", help="put kept results back")
    args = parser.parse_args(argv)
    if args.record:
        print(f"kept {record(args.mutants, args.results)} mutants' results in {args.results}")
        return 0
    if args.restore:
        print(f"restored the results of {restore(args.mutants, args.results)} files")
        return 0
    results = read(args.mutants)
    equivalent = tomllib.loads(args.equivalents.read_text()).get("mutants", {})
    if args.pending:  # mutmut runs again every mutant named, judged or not: name only these
        print(" ".join(pending(results, args.pending, changed(args.mutants, HERE.parent))))
        return 0
    if args.survivors:  # survived or reached by no test: judged again against today's tests
        found = [n for codes in results.values() for n, c in codes.items() if c in (0, 33)]
        print(" ".join(n for n in found if n not in equivalent))
        return 0
    if not results:
        print(f"no mutation results under {args.mutants}/: run `make mutate` first")
        return 1
    summary = summarise(results, equivalent)
    (args.mutants / "report.md").write_text(report(results, equivalent, summary))
    stale = sorted(set(equivalent) - {n for codes in results.values() for n in codes})
    for name in stale:
        print(f"{args.equivalents.name} lists {name}, which is no longer a mutant: remove it")
    missed = list(stale)
    for group, counts in summary["groups"].items():
        goal, got = TARGETS[group], rate(counts)
        missed += [] if got is not None and got >= goal and not counts["not run"] else [group]
        print(f"{group:5} {percent(got):>6} killed (target {goal:.0%}): {dict(counts)}")
    for source, counts in summary["files"].items():
        got = rate(counts)
        if not sum(counts.values()):  # a file of constants: no mutants
            continue
        if source.startswith(EACH_FILE) and (got is None or got < FILE_TARGET or counts["not run"]):
            missed.append(source)
            print(f"{source} {percent(got)} killed, {counts['not run']} not run "
                  f"(target {FILE_TARGET:.0%} of its own, all run)")  # fmt: skip
    print(f"report: {args.mutants / 'report.md'}")
    return 1 if missed and not args.no_targets else 0


if __name__ == "__main__":
    sys.exit(main())
