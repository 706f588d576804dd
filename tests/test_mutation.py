"""A smoke run of `make mutate`'s machinery, so that it cannot rot: mutmut, configured as in
pyproject.toml, mutates one function of a copy of the package, runs a small test against each
mutant in its fork server, and the report script reads the results."""

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import mutation_report  # noqa: E402

pytestmark = pytest.mark.program

SMOKE_TEST = """
import pytest
from taktiny._patterns import compile_pattern

def test_patterns():
    assert compile_pattern("a.*.c").fullmatch(".a.b.c")
    assert not compile_pattern("a.*.c").fullmatch(".a.b.d.c")
    assert compile_pattern("a.**").fullmatch(".a") and compile_pattern("**.c").fullmatch(".x.y.c")
    assert compile_pattern("l[0-2]").fullmatch(".l1") and not compile_pattern("l[!0-2]").fullmatch(".l1")
    with pytest.raises(ValueError, match="is a non-empty string"):
        compile_pattern("")
"""


def test_mutmut_runs_the_configured_pipeline_on_one_function(tmp_path):
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    smoke = {**config, "only_mutate": ["taktiny/_patterns.py"], "also_copy": []}
    lines = ["[tool.mutmut]"] + [f"{k} = {_toml(v)}" for k, v in smoke.items()]
    (tmp_path / "pyproject.toml").write_text("\n".join(lines) + "\n")
    shutil.copytree(ROOT / "taktiny", tmp_path / "taktiny")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_smoke.py").write_text(SMOKE_TEST)
    run = subprocess.run(
        [sys.executable, "-m", "mutmut", "run", "--max-children", "2",
         "taktiny._patterns.x_compile_pattern*"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = mutation_report.read(tmp_path / "mutants")
    codes = {n: c for n, c in results["taktiny/_patterns.py"].items() if "compile_pattern" in n}
    assert len(codes) >= 10 and all(code is not None for code in codes.values())
    summary = mutation_report.summarise(results, {})
    assert summary["files"]["taktiny/_patterns.py"]["killed"] >= len(codes) // 2
    assert mutation_report.main(["--mutants", str(tmp_path / "mutants"), "--no-targets"]) == 0
    report = (tmp_path / "mutants" / "report.md").read_text()
    assert re.search(r"\| taktiny/_patterns\.py \| \d+ \| \d+ \|", report)


def _toml(value):
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def test_collecting_the_tests_does_not_start_jax():
    # the mutation server collects the tests before it forks a process per mutant; a test
    # module that makes an array at import would start JAX's backend there, whose threads
    # do not survive a fork (each mutant would hang until its time limit)
    code = (
        "import sys, pytest\n"
        "from jax._src import xla_bridge  # a test may read JAX's internals\n"
        "pytest.main(['--collect-only', '-qqq', '-p', 'no:cacheprovider', '-o', 'addopts=',\n"
        "             '-m', 'not program', 'tests/'])\n"
        "print('STARTED' if xla_bridge._backends else 'NOT STARTED')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.stdout.splitlines()[-1] == "NOT STARTED", run.stdout[-2000:] + run.stderr[-2000:]


def test_the_report_counts_equivalents_apart_and_refuses_stale_ones(tmp_path, capsys):
    meta = tmp_path / "mutants" / "taktiny" / "_x.py.meta"
    meta.parent.mkdir(parents=True)
    codes = {"m.a__mutmut_1": 1, "m.a__mutmut_2": 0, "m.a__mutmut_3": 0, "m.a__mutmut_4": -11,
             "m.a__mutmut_5": 36, "m.a__mutmut_6": None, "m.a__mutmut_7": 33}  # fmt: skip
    meta.write_text(json.dumps({"exit_code_by_key": codes}))
    equivalents = tmp_path / "eq.toml"
    equivalents.write_text('[mutants]\n"m.a__mutmut_3" = "same behaviour"\n')
    counts = mutation_report.summarise(mutation_report.read(tmp_path / "mutants"), {
        "m.a__mutmut_3": "same behaviour"})["files"]["taktiny/_x.py"]  # fmt: skip
    assert dict(counts) == {"killed": 2, "survived": 1, "equivalent": 1, "suspicious": 1,
                            "not run": 1, "no tests": 1}  # fmt: skip
    assert mutation_report.rate(counts) == 2 / 5  # equivalents and unrun ones left out
    args = ["--mutants", str(tmp_path / "mutants"), "--equivalents", str(equivalents)]
    assert mutation_report.main(args) == 1  # 40% misses the target
    report = (tmp_path / "mutants" / "report.md").read_text()
    assert "| taktiny/_x.py | 7 | 2 | 1 | 1 | 1 | 1 | 1 | 40.0% |" in report
    assert "- `m.a__mutmut_4` (suspicious: segfault)" in report
    assert "- `m.a__mutmut_3`: same behaviour" in report
    capsys.readouterr()
    assert mutation_report.main([*args, "--survivors"]) == 0  # for make mutate to rerun them
    assert capsys.readouterr().out.split() == ["m.a__mutmut_2"]  # not the equivalent one
    equivalents.write_text('[mutants]\n"m.gone__mutmut_1" = "was equivalent"\n')
    codes = {k: 1 for k in codes}
    meta.write_text(json.dumps({"exit_code_by_key": codes}))
    assert mutation_report.main(args) == 1
    assert "lists m.gone__mutmut_1, which is no longer a mutant" in capsys.readouterr().out
