"""The documentation site (mkdocs.yml, `make docs`): it builds with warnings as errors, so
every link, cross-reference and docstring section on it resolves; every public name is on
it; and every public name, with the members the site shows, has a docstring whose `Args`
name each parameter, with `Returns` where it returns something and `Raises` where it
raises.

The docstrings are read as the site reads them: statically, by griffe (mkdocstrings'
loader), from the source under the repository root."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import griffe
import pytest

import taktiny
import taktiny.convert
import taktiny.io
import taktiny.models
import taktiny.nn

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (taktiny, taktiny.nn, taktiny.io, taktiny.convert, taktiny.models)
DIRECTIVE = re.compile(r"^::: (\S+)", re.M)
UNDOCUMENTED_PARAMETERS = {"self", "cls"}
ABSTRACT = {"NotImplementedError"}  # a base class's method that subclasses override


def public_names() -> list[str]:
    """The public path of every public name but the subpackages, from the packages as
    imported: `__all__` where a package has one (its names are imported when first used),
    else the names it imports."""
    paths = []
    for package in PACKAGES:
        names = getattr(package, "__all__", None) or [
            n for n in dir(package) if not n.startswith("_") and n != "jaxtyping"
        ]
        for name in names:
            if "ǁ" not in name and not isinstance(getattr(package, name), types.ModuleType):
                paths.append(f"{package.__name__}.{name}")
    return paths


@pytest.fixture(scope="module")
def api() -> griffe.Module:
    # a method without a docstring takes its base class's, as on the site (and in help())
    extensions = griffe.load_extensions("griffe_inherited_docstrings")
    return griffe.load(
        "taktiny",
        search_paths=[str(ROOT)],
        docstring_parser="google",
        resolve_aliases=True,
        extensions=extensions,
    )  # type: ignore[return-value]


def target(api: griffe.Module, path: str) -> griffe.Object:
    found = api[path.removeprefix("taktiny.")]
    return found.final_target if found.is_alias else found


def sections(obj: griffe.Object) -> dict[str, list[griffe.DocstringSection]]:
    by_kind: dict[str, list[griffe.DocstringSection]] = {}
    if obj.docstring is not None:
        for section in obj.docstring.parse("google"):
            by_kind.setdefault(section.kind.value, []).append(section)
    return by_kind


def documented(obj: griffe.Object, kind: str) -> set[str]:
    """The names an `Args` (kind "parameters") or `Attributes` section of `obj` describes."""
    return {item.name.lstrip("*") for s in sections(obj).get(kind, []) for item in s.value}


def raised(function: griffe.Function) -> set[str]:
    """The exception classes `function`'s own body raises by name (not those of its nested
    functions, nor those of the functions it calls: their Raises entries are by hand)."""
    if not function.lineno:
        return set()  # (a dataclass's generated __init__)
    tree = ast.parse(textwrap.dedent(function.source)).body[0]
    names, todo = set(), list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = ast.unparse(exc).rsplit(".", 1)[-1]
            if name[:1].isupper():  # a class: not a caught `error`, nor `self.damaged(...)`
                names.add(name)
        todo.extend(ast.iter_child_nodes(node))
    return names - ABSTRACT


def function_problems(function: griffe.Function, where: str) -> list[str]:
    if not function.docstring or not function.docstring.value.strip():
        return [f"{where}: no docstring"]
    if "property" in function.labels:
        return []  # (a property's docstring says what it is)
    problems = []
    parameters = [p.name for p in function.parameters if p.name not in UNDOCUMENTED_PARAMETERS]
    missing = [p for p in parameters if p not in documented(function, "parameters")]
    if missing:
        problems.append(f"{where}: the Args section lacks {missing}")
    returns = function.returns
    if (
        function.name != "__init__"
        and returns is not None
        and str(returns) not in ("None", "NoReturn", "Never")
        and "returns" not in sections(function)
    ):
        problems.append(f"{where}: no Returns section (it returns {returns})")
    raises = raised(function)
    listed = {
        str(item.annotation).rsplit(".", 1)[-1]
        for s in sections(function).get("raises", [])
        for item in s.value
    }
    if raises - listed:
        problems.append(f"{where}: the Raises section lacks {sorted(raises - listed)}")
    return problems


def class_problems(cls: griffe.Class, where: str) -> list[str]:
    if not cls.docstring or not cls.docstring.value.strip():
        return [f"{where}: no docstring"]
    problems = []
    described = documented(cls, "parameters") | documented(cls, "attributes")
    init = cls.members.get("__init__")
    if isinstance(init, griffe.Function):
        described |= documented(init, "parameters")
        parameters = [p.name for p in init.parameters if p.name not in UNDOCUMENTED_PARAMETERS]
        missing = [p for p in parameters if p not in described]
        if missing:
            problems.append(f"{where}: the Args section lacks {missing}")
        raises = raised(init) - {
            str(i.annotation).rsplit(".", 1)[-1]
            for obj in (cls, init)
            for s in sections(obj).get("raises", [])
            for i in s.value
        }
        if raises:
            problems.append(f"{where}: the Raises section lacks {sorted(raises)}")
    for name, member in cls.members.items():
        if member.is_alias or (name.startswith("_") and name != "__call__"):
            continue
        if isinstance(member, griffe.Function):
            problems += function_problems(member, f"{where}.{name}")
        elif isinstance(member, griffe.Attribute) and name not in described:
            if not member.docstring:
                problems.append(f"{where}.{name}: not described (a docstring, or Attributes)")
    return problems


def test_every_public_name_is_on_the_site():
    pages = (ROOT / "docs" / "api").glob("*.md")
    shown = {m for page in pages for m in DIRECTIVE.findall(page.read_text())}
    shown -= {package.__name__ for package in PACKAGES}  # (each page opens with its docstring)
    names = public_names()
    assert len(names) > 80
    assert sorted(set(names) - shown) == []
    assert sorted(shown - set(names)) == []  # and by its public path only


# (left out of `make mutate` with the programs: it reads the package's source text, which
# mutmut rewrites into trampolines that carry no docstrings; a mutant changes no docstring)
@pytest.mark.program
@pytest.mark.parametrize("path", public_names())
def test_every_public_name_is_documented(api, path):
    obj = target(api, path)
    if isinstance(obj, griffe.Class):
        problems = class_problems(obj, path)
    elif isinstance(obj, griffe.Function):
        problems = function_problems(obj, path)
    else:
        problems = [] if obj.docstring else [f"{path}: no docstring"]
    assert problems == []


@pytest.mark.program
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert "WARNING" not in built.stderr  # (counted by --strict only at the default verbosity)
    pages = {
        p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("*.html")
    }
    assert {"index.html", "modules.html", "api/taktiny.html", "api/nn.html"} <= pages
    reference = (tmp_path / "site" / "api" / "io.html").read_text()
    assert 'id="taktiny.io.load_safetensors"' in reference
