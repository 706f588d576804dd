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
from _layout import floors

ROOT = Path(__file__).resolve().parents[2]

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
    # the faces' stubs (__init__.pyi) too: the lazy loader reads them when importing
    files = [*(ROOT / "taktiny").rglob("*.py"), *(ROOT / "taktiny").rglob("*.pyi")]
    sources = sorted(str(p.relative_to(ROOT)) for p in files)
    assert any(name.endswith("__init__.pyi") for name in sources)
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
    No file of io/ imports either at run time: io/'s face names the load's public names
    in its stub, imported when first used."""
    face = ROOT / "taktiny" / "io" / "__init__.pyi"
    assert "taktiny.loading" in taktiny_imports(face)
    steps = ROOT / "taktiny" / "loading" / "_steps.py"
    assert {"taktiny.convert", "taktiny.io"} <= runtime_imports(steps)
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


def _cycles(package: Path) -> list[list[str]]:
    """The circles of imports (at run time, inside functions too) among the private files
    of `package`: each the sorted names of the files that import one another."""
    files = {f"taktiny.{package.name}.{p.stem}": p for p in package.glob("_*.py")}
    files.pop(f"taktiny.{package.name}.__init__", None)
    graph = {
        module: {m if m in files else m.rsplit(".", 1)[0] for m in runtime_imports(path)}
        & files.keys() - {module}
        for module, path in files.items()
    }
    circles = {  # (a file's circle: the files it reaches that reach it back)
        tuple(
            sorted(m.rsplit(".", 1)[1] for m in _reach(graph, module) if module in _reach(graph, m))
        )
        for module in graph
    }
    return sorted(list(circle) for circle in circles if circle)


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` imports, directly or through others, in `graph`."""
    reached, todo = set(), [start]
    while todo:
        for other in graph[todo.pop()] - reached:
            reached.add(other)
            todo.append(other)
    return reached


def test_no_two_files_of_a_package_import_each_other():
    """Within a package, imports run one way: no private file imports another that
    imports it back, directly or through others (io's root error once lived in _read.py,
    which imports _storage.py, which opens _object_store.py, which raised it)."""
    graph_of = {"_a": {"_b"}, "_b": {"_c"}, "_c": {"_a"}, "_d": {"_a"}}
    assert _reach(graph_of, "_d") == {"_a", "_b", "_c"} and "_d" not in _reach(graph_of, "_a")
    packages = [p for p in sorted((ROOT / "taktiny").iterdir()) if (p / "__init__.py").exists()]
    assert len(packages) >= 9
    assert {p.name: _cycles(p) for p in packages if _cycles(p)} == {}


# The floors of the house, from the ground up, read from docs/architecture.md's table (the
# one place they are written): a file imports from its own package, or from a package on
# a lower floor, never from one above.
# The ground is the root package's own helpers, which import nothing of Taktiny's; the top
# is the root's files that join everything (the ``taktiny`` namespace, summaries, the CLI).
FLOORS = floors()
FLOOR = {unit: floor for floor, units in enumerate(FLOORS) for unit in units}
GROUND = {f"taktiny.{name}" for name in FLOORS[0]}


def _unit(module: str) -> str:
    """The package (or root module) of taktiny that `module` belongs to."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _package(unit: str) -> str:
    """The package a unit is part of: the root's own files are the root package's."""
    return "taktiny" if unit in FLOORS[0] + FLOORS[-1] else unit


def _house() -> list[tuple[str, str, str]]:
    """(file, its unit, a taktiny module it imports) for every import of every file."""
    found = []
    for path in sorted([*(ROOT / "taktiny").rglob("*.py"), *(ROOT / "taktiny").rglob("*.pyi")]):
        relative = path.relative_to(ROOT / "taktiny")
        unit = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        for module in taktiny_imports(path) - {"taktiny"}:  # (`from .. import x`: x counts)
            found.append((str(path.relative_to(ROOT)), unit, module))
    return found


def test_every_package_and_root_module_has_a_floor():
    units = {unit for _, unit, _ in _house()} | {_unit(m) for _, _, m in _house()}
    assert units == set(FLOOR)
    # the root modules: the ground floor's and the public namespace's (`models` above it)
    roots = {*FLOORS[0], *next(units for units in FLOORS if "__init__" in units)}
    assert [
        p.name for p in sorted((ROOT / "taktiny").iterdir()) if (p / "__init__.py").exists()
    ] == sorted(u for units in FLOORS for u in units if u not in roots)


def test_no_import_climbs_a_floor():
    """Every import runs down the floors or stays in its package (at any depth in a file,
    and for type checkers too), but one: io's face keeps the load's public names where
    users import them (``taktiny.io.load_safetensors``), by name, imported when first used
    (tests above: io/ imports no module of the load)."""
    climbs = sorted(
        (path, module) for path, unit, module in _house() if FLOOR[_unit(module)] > FLOOR[unit]
    )
    assert {(path, ".".join(module.split(".")[:2])) for path, module in climbs} == {
        ("taktiny/io/__init__.pyi", "taktiny.loading")
    }
    # a climb is found: the check sees what it is for
    assert FLOOR["state"] < FLOOR["sharding"] and FLOOR["quant"] < FLOOR["state"]


def test_packages_import_each_other_only_through_their_faces():
    """A package uses another's names through its face (``from ..state import flatten``),
    never by reaching into a private module of it (``from ..state._names import flatten``);
    the ground's helpers are the root package's own, which every floor may use."""
    reaching = sorted(
        (path, module)
        for path, unit, module in _house()
        if _package(_unit(module)) != _package(unit)
        and ".".join(module.split(".")[:2]) not in GROUND
        and any(part.startswith("_") for part in module.split(".")[2:])
    )
    assert reaching == []
    faces = {module for _, unit, module in _house() if _unit(module) != unit}
    assert {"taktiny.state", "taktiny.arrays", "taktiny.quant", "taktiny.module"} <= faces


def circles(package: str) -> list[str]:
    """The files of `package` that import themselves through its other files (at any depth
    in a file, and for type checkers too), as dotted names, sorted."""
    folder = ROOT / "taktiny" / package
    files = {f"taktiny.{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    imports = {name: taktiny_imports(path) & set(files) for name, path in files.items()}
    found = []
    for name in files:
        seen, todo = set(), list(imports[name])
        while todo:
            other = todo.pop()
            if other not in seen:
                seen.add(other)
                todo += imports[other]
        if name in seen:
            found.append(name)
    return sorted(found)


def test_the_files_of_the_load_import_each_other_one_way():
    """No file of taktiny/loading/ imports itself through others: each way a step is read
    is one type (`_ways`), which the budget, the plan and the load's loop import, and none
    of them imports back."""
    assert circles("loading") == []
    assert len(list((ROOT / "taktiny" / "loading").glob("_*.py"))) >= 9


def _face(package: str) -> tuple[list[str], list[str]]:
    """The public and the internal names the stub of `package`'s face lists."""
    stub = ROOT / "taktiny" / package / "__init__.pyi"
    public, internal, inside = [], [], True
    body = ast.parse(stub.read_text()).body
    assert ast.get_docstring(ast.Module(body, [])), stub  # (every face says what it holds)
    for statement in body[1:]:
        if isinstance(statement, ast.Expr):
            inside = False
        elif isinstance(statement, ast.ImportFrom):
            names = [a.asname for a in statement.names]
            (public if inside else internal).extend(n for n in names if not n.startswith("_"))
    return sorted(public), sorted(internal)


@pytest.mark.parametrize(
    "package",
    ["", "arrays", "quant", "state", "sharding", "module", "io", "nn", "convert", "loading"],
)
def test_each_face_writes_each_name_once_in_its_stub(package):
    """A package's ``__init__.py`` holds no name, only the call that reads its stub
    (``__init__.pyi``, which type checkers read): each name is written once. The stub's
    names after its heading are for Taktiny's own packages: importable, not public."""
    import importlib

    init = ROOT / "taktiny" / package / "__init__.py"
    body = ast.parse(init.read_text()).body
    assert [type(s).__name__ for s in body] == ["Expr", "ImportFrom", "Assign"]
    assert "_lazy.face(__name__, __file__, globals())" in ast.unparse(body[2])
    public, internal = _face(package)
    assert public
    module = importlib.import_module("taktiny" + (f".{package}" if package else ""))
    assert module.__all__ == public
    for name in public + internal:
        assert getattr(module, name) is not None
    shown = {n for n in dir(module) if not n.startswith("_")}
    assert set(public) <= shown and not shown & set(internal)
    with pytest.raises(AttributeError, match=r"has no attribute 'missing_name'"):
        module.missing_name  # noqa: B018


def test_the_version_is_written_once_in_pyproject():
    import importlib.metadata

    import taktiny

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert taktiny.__version__ == config["project"]["version"]
    assert taktiny.__version__ == importlib.metadata.version("taktiny")
    written = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "taktiny").rglob("*.py*")
        if path.is_file() and f'"{taktiny.__version__}"' in path.read_text(errors="replace")
    ]
    assert written == []


def test_the_cloud_extra_brings_what_saving_to_a_url_needs():
    """`pip install 'taktiny[cloud]'`, which docs/storage.md gives for URLs, is enough to
    save to one: a save needs the safetensors extra's packages too (a user with only the
    cloud extra met "needs the safetensors package" at the first save)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(extras["safetensors"]) <= set(extras["cloud"])
    assert any(r.startswith("obstore") for r in extras["cloud"])


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
    assert "taktiny.state" in module


def test_pyright_checks_the_state_walk_in_strict_mode():
    """`make lint` (the first step of `make test`) runs pyright, strict on taktiny/state/:
    every type there known, so the views' interface is checked, not assumed."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pyright"]
    assert "taktiny/state" in config["strict"]
    assert config["include"] == ["taktiny"]
    makefile = (ROOT / "Makefile").read_text()
    assert "$(VENV)/bin/pyright" in makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
