"""The wheel holds the package, its PEP 561 marker and the `taktiny` command, and nothing else;
the package unpickles nothing."""

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.program


def test_the_wheel_holds_the_package_its_type_marker_and_nothing_else(tmp_path):
    # built from a copy of what the wheel is made of: setuptools would pack the stale files
    # a checkout's build/ keeps from earlier builds (a module since moved, say)
    source = tmp_path / "source"
    shutil.copytree(
        ROOT / "taktiny", source / "taktiny", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*command, "-w", str(tmp_path), str(source)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("taktiny-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    package = sorted(n for n in names if not n.startswith("taktiny-"))
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "taktiny").rglob("*.py"))
    assert package == sorted([*sources, "taktiny/py.typed"])
    metadata = {n.split("/", 1)[1] for n in names if n.startswith("taktiny-")}
    assert metadata == {"METADATA", "WHEEL", "top_level.txt", "RECORD", "entry_points.txt"}
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[console_scripts]\ntaktiny = taktiny._cli:main" in scripts


UNPICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve"}


def unpickler_imports(source: str) -> list[str]:
    """The pickle-family modules that `source` imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
        else:
            continue
        found += [n for n in names if n in UNPICKLERS]
    return found


def test_no_module_of_the_package_imports_pickle():
    """Nothing in Taktiny unpickles data: no module imports a pickle-family module."""
    assert unpickler_imports("import os, pickle\nfrom dill import loads") == ["pickle", "dill"]
    found = {
        str(path.relative_to(ROOT)): unpickler_imports(path.read_text())
        for path in sorted((ROOT / "taktiny").rglob("*.py"))
    }
    assert len(found) > 20
    assert {name: hits for name, hits in found.items() if hits} == {}


def taktiny_imports(path: Path, source: str | None = None) -> set[str]:
    """The taktiny modules that the file at `path` (or `source`, read as that file)
    imports (at any depth in it), as dotted names."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.split(".")[0] == "taktiny"}


def runtime_imports(path: Path) -> set[str]:
    """:func:`taktiny_imports` of the file at `path`, leaving out those in ``if
    TYPE_CHECKING:`` blocks (names for type checkers, never imported when it runs)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if isinstance(block, list) and any(map(_type_checking, block)):
                kept = [n for n in block if not _type_checking(n)]
                setattr(node, field, kept or [ast.Pass()])
    return taktiny_imports(path, ast.unparse(tree))


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def test_the_file_formats_import_neither_the_load_nor_the_conversions():
    """taktiny/io/ is what a file is (headers, reads, checksums, saves, torch files,
    Orbax); the load (taktiny/loading/) joins it with taktiny/convert/ and the state walk.
    No file of io/ imports either: io/'s face names the load's public names by module
    path, imported when first used, and imports them for type checkers only."""
    face = ROOT / "taktiny" / "io" / "__init__.py"
    assert "taktiny.loading" in taktiny_imports(face)  # (for type checkers: left out)
    assert "taktiny.loading" not in runtime_imports(face)
    steps = ROOT / "taktiny" / "loading" / "_steps.py"
    assert {"taktiny.convert._coverage", "taktiny.io._checkpoint"} <= runtime_imports(steps)
    found = {
        str(path.relative_to(ROOT)): sorted(
            name
            for name in runtime_imports(path)
            if name.split(".")[1:2] in (["convert"], ["loading"])
        )
        for path in sorted((ROOT / "taktiny" / "io").glob("*.py"))
    }
    assert len(found) >= 10
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_the_state_walk_never_imports_the_module_layer():
    """taktiny/state/ knows a module by its class (`_taktiny_data`), not by importing
    taktiny/module/: the layers go one way (module/ uses state/)."""
    here = ROOT / "taktiny" / "state" / "_tree.py"
    assert "taktiny.state._names" in taktiny_imports(here)
    found = {
        str(path.relative_to(ROOT)): sorted(
            name for name in taktiny_imports(path) if name.startswith("taktiny.module")
        )
        for path in sorted((ROOT / "taktiny" / "state").glob("*.py"))
    }
    assert len(found) >= 8
    assert {name: hits for name, hits in found.items() if hits} == {}
    module = taktiny_imports(ROOT / "taktiny" / "module" / "_module.py")
    assert "taktiny.state._tree" in module


def test_pyright_checks_the_state_walk_in_strict_mode():
    """`make lint` (the first step of `make test`) runs pyright, strict on taktiny/state/:
    every type there known, so the views' interface is checked, not assumed."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pyright"]
    assert "taktiny/state" in config["strict"]
    assert config["include"] == ["taktiny"]
    makefile = (ROOT / "Makefile").read_text()
    assert "$(VENV)/bin/pyright" in makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
