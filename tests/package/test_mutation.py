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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import mutation_report  # noqa: E402

pytestmark = pytest.mark.program

SMOKE_TEST = """
import pytest
from taktiny.state._patterns import compile_pattern

def test_patterns():
    assert compile_pattern("a.*.c").fullmatch(".a.b.c")
    assert not compile_pattern("a.*.c").fullmatch(".a.b.d.c")
    assert compile_pattern("a.**").fullmatch(".a") and compile_pattern("**.c").fullmatch(".x.y.c")
    assert compile_pattern("l[0-2]").fullmatch(".l1") and not compile_pattern("l[!0-2]").fullmatch(".l1")
    with pytest.raises(ValueError, match="is a non-empty string"):
        compile_pattern("")
"""

SEES_NOTHING = """
from taktiny.state._patterns import compile_pattern

def test_patterns():  # reaches the function, so that mutmut runs it, and checks nothing
    try:
        compile_pattern("a.*.c")
    except Exception as error:
        if type(error).__module__.startswith("mutmut"):  # its check that a failure is seen
            raise
"""


@pytest.mark.thorough  # (22 s: `make property` runs it)
def test_mutmut_runs_the_configured_pipeline_on_one_function(tmp_path):
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    smoke = {**config, "only_mutate": ["taktiny/state/_patterns.py"], "also_copy": []}
    lines = ["[tool.mutmut]"] + [f"{k} = {_toml(v)}" for k, v in smoke.items()]
    (tmp_path / "pyproject.toml").write_text("\n".join(lines) + "\n")
    shutil.copytree(ROOT / "taktiny", tmp_path / "taktiny")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_smoke.py").write_text(SMOKE_TEST)
    run = subprocess.run(
        [sys.executable, "-m", "mutmut", "run", "--max-children", "2",
         "taktiny.state._patterns.x_compile_pattern__mutmut_1*"],  # 1 and 10-19: 11 of its 22
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = mutation_report.read(tmp_path / "mutants")
    codes = {n: c for n, c in results["taktiny/state/_patterns.py"].items()
             if "compile_pattern__mutmut_1" in n}  # fmt: skip
    assert len(codes) == 11 and all(code is not None for code in codes.values())
    summary = mutation_report.summarise(results, {})
    assert summary["files"]["taktiny/state/_patterns.py"]["killed"] >= len(codes) // 2
    assert mutation_report.main(["--mutants", str(tmp_path / "mutants"), "--no-targets"]) == 0
    report = (tmp_path / "mutants" / "report.md").read_text()
    assert re.search(r"\| taktiny/state/_patterns\.py \| \d+ \| \d+ \|", report)

    # kept, removed, restored: mutmut keeps the results of functions whose hash is the same
    kept = tmp_path / "kept.json"
    mutation_report.record(tmp_path / "mutants", kept)
    shutil.rmtree(tmp_path / "mutants")
    assert mutation_report.restore(tmp_path / "mutants", kept) == 1
    rerun = "taktiny.state._patterns.x_compile_pattern__mutmut_1"
    (tmp_path / "tests" / "test_smoke.py").write_text(SEES_NOTHING)
    run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "2", rerun],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    again = mutation_report.read(tmp_path / "mutants")["taktiny/state/_patterns.py"]
    assert again[rerun] == 0  # judged again, against a test that checks nothing
    assert {n: c for n, c in again.items() if n in codes and n != rerun} == {
        n: c for n, c in codes.items() if n != rerun}  # fmt: skip


def _toml(value):
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def test_collecting_the_tests_does_not_start_jax(request):
    # the mutation server collects the tests before it forks a process per mutant; a test
    # module that makes an array at import would start JAX's backend there, whose threads
    # do not survive a fork (each mutant would hang until its time limit). This session
    # collected them (all of them, under `make test`), and the root conftest.py noted the
    # first node after whose collection the backend ran, if any.
    root_conftest = request.config.pluginmanager.get_plugin(str(ROOT / "conftest.py"))
    assert request.config.stash.get(root_conftest.BACKEND_STARTED_BY, None) is None


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
    # the survivor and the one no test reached, not the equivalent one
    assert capsys.readouterr().out.split() == ["m.a__mutmut_2", "m.a__mutmut_7"]
    equivalents.write_text('[mutants]\n"m.gone__mutmut_1" = "was equivalent"\n')
    codes = {k: 1 for k in codes}
    meta.write_text(json.dumps({"exit_code_by_key": codes}))
    assert mutation_report.main(args) == 1
    assert "lists m.gone__mutmut_1, which is no longer a mutant" in capsys.readouterr().out


def test_the_last_waves_files_are_held_to_their_own_target(tmp_path, capsys):
    root = tmp_path / "mutants" / "taktiny"
    (root / "io").mkdir(parents=True)

    def write(path: str, killed: int, survived: int) -> None:
        codes = {f"m.{path}__mutmut_{i}": 1 if i < killed else 0 for i in range(killed + survived)}
        (root / path).write_text(json.dumps({"exit_code_by_key": codes}))

    write("_x.py.meta", 100, 0)
    write("io/_save.py.meta", 96, 4)  # the core group: 98% killed, over its 90%
    equivalents = tmp_path / "eq.toml"
    equivalents.write_text("[mutants]\n")
    args = ["--mutants", str(tmp_path / "mutants"), "--equivalents", str(equivalents)]
    assert mutation_report.main(args) == 1
    assert "taktiny/io/_save.py 96.0% killed, 0 not run (target 97%" in capsys.readouterr().out
    write("io/_save.py.meta", 97, 3)
    assert mutation_report.main(args) == 0
    write("_x.py.meta", 90, 10)  # a file outside the list only counts in its group
    assert mutation_report.main(args) == 0


def test_the_files_held_to_their_own_target_exist():
    """Each target of EACH_FILE names a file or folder of the package, so that a file that
    moves takes its target along (quant/_qarray.py was once held as taktiny/_qarray.py,
    a path gone since, and so to no target at all)."""
    root = Path(mutation_report.__file__).resolve().parent.parent
    missing = [path for path in mutation_report.EACH_FILE if not (root / path).exists()]
    assert not missing, f"EACH_FILE names paths that are gone: {missing}"


def test_results_are_kept_and_restored_and_pending_ones_named(tmp_path):
    meta = tmp_path / "mutants" / "taktiny" / "io" / "_x.py.meta"
    meta.parent.mkdir(parents=True)
    codes = {"taktiny.io._x.x_f__mutmut_1": 1, "taktiny.io._x.x_f__mutmut_2": None,
             "taktiny.io._x.xǁCǁm__mutmut_1": 0}  # fmt: skip
    meta.write_text(json.dumps({"exit_code_by_key": codes, "hash_by_function_name": {
        "x_f": "ab", "xǁCǁm": "cd"}, "type_check_error_by_key": {}, "durations_by_key": {},
        "estimated_durations_by_key": {}}))  # fmt: skip
    kept = tmp_path / "kept.json"
    assert mutation_report.record(tmp_path / "mutants", kept) == 3
    assert mutation_report.restore(tmp_path / "mutants", kept) == 0  # never over newer results
    meta.unlink()
    assert mutation_report.restore(tmp_path / "mutants", kept) == 1
    back = json.loads(meta.read_text())
    assert back["exit_code_by_key"] == codes
    assert back["hash_by_function_name"] == {"x_f": "ab", "xǁCǁm": "cd"}
    results = mutation_report.read(tmp_path / "mutants")
    assert mutation_report.pending(results, ["taktiny.io.*"]) == ["taktiny.io._x.x_f__mutmut_2"]
    assert mutation_report.pending(results, ["taktiny.nn.*"]) == []
    assert mutation_report.pending({}, ["taktiny.io.*"]) == ["taktiny.io.*"]  # from scratch
    # a function changed since it was judged: all its mutants, as mutmut will number them
    changed = ["taktiny.io._x.xǁCǁm", "taktiny.io._x.x_f", "taktiny.nn._y.x_h"]
    assert mutation_report.pending(results, ["taktiny.io.*"], changed) == [
        "taktiny.io._x.xǁCǁm__mutmut_*", "taktiny.io._x.x_f__mutmut_*"]  # fmt: skip
    source = tmp_path / "taktiny" / "io" / "_x.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    return 1\n\n\nclass C:\n    def m(self):\n        return 2\n")
    from mutmut.mutation.file_mutation import compute_function_hashes

    now = compute_function_hashes(source.read_text())
    meta.write_text(json.dumps({**back, "hash_by_function_name": {**now, "x_f": "ab"}}))
    assert mutation_report.changed(tmp_path / "mutants", tmp_path) == ["taktiny.io._x.x_f"]
    assert mutation_report.restore(tmp_path / "elsewhere", tmp_path / "none.json") == 0
