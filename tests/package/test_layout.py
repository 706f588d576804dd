"""docs/architecture.md is the one place the layout is written down; these tests hold the
code to it (its floors are tests/package/test_package.py's), and every file path the docs name to
a file that exists, so that a move that forgets the docs fails here."""

import ast
import re
from pathlib import Path

import pytest
from _layout import ROOT, floors, quoted, table

pytestmark = pytest.mark.program

PACKAGES = sorted(p.parent.name for p in (ROOT / "taktiny").glob("*/__init__.pyi"))
# a file of a package, named with its package (``state/_names.py``, ``taktiny/io/_read.py``)
PATH = re.compile(rf"\b(?:taktiny/)?({'|'.join(PACKAGES)})/(_[a-z0-9_]+\.(?:py|md))\b")
# the text a reader meets: the docs, the design notes beside the code, and the code itself
TEXTS = sorted(
    [
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "README.md",
        *(ROOT / "taktiny").rglob("*.md"),
        *(ROOT / "taktiny").rglob("*.py"),
        *(ROOT / "taktiny").rglob("*.pyi"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "bench").rglob("*.py"),
    ]
)


def face(package: str) -> set[str]:
    """Every name `package`'s face offers, public or for Taktiny's own packages."""
    stub = (ROOT / "taktiny" / package / "__init__.pyi").read_text()
    return set(re.findall(r"\bas (\w+)$", stub, re.MULTILINE))


def test_the_floors_name_every_package_once():
    floors = [quoted(row[1]) for row in table("The floors")]
    named = [unit for units in floors for unit in units]
    assert len(named) == len(set(named))
    assert set(PACKAGES) <= set(named)
    roots = {p.stem for p in (ROOT / "taktiny").glob("*.py")}
    assert set(named) - set(PACKAGES) == roots  # the root's own modules, each on its floor


def test_each_concept_is_carried_by_names_its_packages_faces_offer():
    rows = table("Where each concept lives")
    assert len(rows) >= 15
    for concept, packages, names in rows:
        homes = quoted(packages)
        groups = names.split(";")  # a concept of several packages: their names in order
        assert len(groups) == len(homes), concept
        for package, group in zip(homes, groups, strict=True):
            assert package in PACKAGES, (concept, package)
            offered = face(package)
            missing = [name for name in quoted(group) if name not in offered]
            assert quoted(group) and missing == [], (concept, package, missing)


def test_a_concept_naming_a_name_no_face_offers_fails(monkeypatch):
    import _layout

    rows = [*table("Where each concept lives"), ["gone", "`state`", "`no_such_name`"]]
    monkeypatch.setattr(_layout, "table", lambda heading: rows)
    monkeypatch.setitem(globals(), "table", _layout.table)
    with pytest.raises(AssertionError, match="no_such_name"):
        test_each_concept_is_carried_by_names_its_packages_faces_offer()


def test_every_file_path_written_in_the_docs_and_the_code_exists():
    written = {
        (str(text.relative_to(ROOT)), f"{package}/{name}")
        for text in TEXTS
        for package, name in PATH.findall(text.read_text())
    }
    assert len(written) > 20  # (the pattern finds them)
    gone = sorted((text, path) for text, path in written if not (ROOT / "taktiny" / path).exists())
    assert gone == []


def test_each_file_begins_with_the_docstring_that_says_what_it_holds():
    """`head -n1` of a package's files is its table of contents (docs/architecture.md)."""
    files = sorted((ROOT / "taktiny").rglob("*.py"))
    first = {str(p.relative_to(ROOT)): p.read_text().split("\n", 1)[0] for p in files}
    assert [name for name, line in first.items() if not re.match(r'"""\S', line)] == []


def test_the_tests_are_laid_out_like_the_packages():
    """A package's tests are in the folder of its name (``tests/loading/``); the tests of the
    whole (the wheel, the docs, the examples, the command) in ``tests/package/``; beside
    them, only helpers (``_models.py``, ...), which no pytest run collects."""
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name[0] not in "_."}
    assert folders <= {*PACKAGES, "package"} and len(folders) >= 8
    loose = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert loose == []


# Tests that reach into another package's private modules, each with its reason (a test
# may reach into its own folder's package: that is what the folder is for).
REACHING_ACROSS = {
    "io/test_checksum.py": "reads through the load's Readers to count a verified read",
    "io/test_read.py": "the load's Readahead against the reads it keeps ahead of",
    "io/test_object_store.py": "a stalled object-store load (the load record) under Ctrl-C",
    "io/test_quantized_files.py": "spies on the load's placing of packed 4-bit tensors",
    "state/test_representations.py": "spies on quant's quantize_array to see where it runs",
    "state/test_schema.py": "the taktiny command (taktiny._cli.main) on a schema",
    "loading/test_budget.py": "the taktiny command (taktiny._cli.main) plans within a budget",
    "loading/test_plan_load.py": "the taktiny command (taktiny._cli.main) prints a plan",
    "loading/test_into_stack.py": "takes the CPU devices for an accelerator's in the fill of stacks",
    "io/test_hostile.py": "the taktiny command (taktiny._cli.main) on hostile files",
    "package/test_bench.py": "the load profile puts back the loader's reader pool it swaps",
}


def _private_imports(path: Path) -> set[str]:
    """The packages (or ``package``, for the root's modules) whose private modules the test
    file at `path` imports; the ground's helpers (``taktiny._problems``, ...) are every
    floor's, as they are the library's."""
    ground = {f"taktiny.{name}" for name in floors()[0]}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if ".".join(parts[:2]) in ground:
                continue
            if parts[0] == "taktiny" and any(p[0] == "_" != p[1:2] for p in parts[1:]):
                found.add(parts[1] if parts[1][0] != "_" else "package")
    return found


def test_tests_use_other_packages_through_their_faces():
    """A test imports the private modules of its own folder's package only; any other
    package it uses through its face (``from taktiny.io import Tensor``), but for the named
    few above."""
    reaching = {
        str(path.relative_to(ROOT / "tests"))
        for path in (ROOT / "tests").rglob("test_*.py")
        if _private_imports(path) - {path.parent.name}
    }
    assert reaching == set(REACHING_ACROSS)


def _quantization_inside(path: Path) -> list[str]:
    """What the code of `path` knows of QArray that only `quant.Parameter` should tell it:
    the name QArray, a part's name built from a parameter's (``f"{name}.value"``, ``name +
    ".scale"``), a QArray's layout read off a parameter (``q.bits``, ``q.group_size``; a
    transform's own fields, ``self.bits``, are its own). Docstrings may name them."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Name) and node.id == "QArray":
            text = "QArray"
        elif isinstance(node, ast.alias) and node.name == "QArray":
            text = "import QArray"
        elif isinstance(node, ast.Attribute) and node.attr in ("QArray", "bits", "group_size"):
            owner = ast.unparse(node.value)
            text = None if owner == "self" or owner.startswith("jnp.iinfo") else ast.unparse(node)
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
        ):
            text = node.value if node.value.startswith((".value", ".scale")) else None
        if text is not None:
            found.append(f"{getattr(node, 'lineno', '?')}: {text}")
    return found


def test_only_quant_and_the_layers_know_a_quantized_parameter_is_a_QArray():
    """Outside `quant` (and the layers of `nn`), code asks `quant.Parameter` (a value's
    parts and their names, how it is made, its layout and record, its problems) and never
    tests for QArray, builds its parts' names or reads its layout."""
    library = ROOT / "taktiny"
    found = {
        path.relative_to(library).as_posix(): _quantization_inside(path)
        for path in sorted(library.rglob("*.py"))
        if not path.relative_to(library).as_posix().startswith(("quant/", "nn/"))
    }
    assert {path: hits for path, hits in found.items() if hits} == {}


def test_a_file_that_tests_for_QArray_outside_quant_fails(tmp_path):
    """The check above can fail: each way of knowing a QArray is found."""
    path = tmp_path / "_file.py"
    path.write_text(
        '"""A docstring may name QArray and f"{name}.value"."""\n'
        "from ..quant import QArray\n"
        "def f(x, name):\n"
        "    return isinstance(x, QArray), f'{name}.scale', name + '.value', x.bits\n"
    )
    assert sorted(_quantization_inside(path)) == [
        "2: import QArray",
        "4: .scale",
        "4: .value",
        "4: QArray",
        "4: x.bits",
    ]
