"""The wheel holds the package, its PEP 561 marker, and nothing else."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.program


def test_the_wheel_holds_the_package_its_type_marker_and_nothing_else(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("taktiny-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    package = sorted(n for n in names if not n.startswith("taktiny-"))
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "taktiny").rglob("*.py"))
    assert package == sorted([*sources, "taktiny/py.typed"])
    metadata = {n.split("/", 1)[1] for n in names if n.startswith("taktiny-")}
    assert metadata == {"METADATA", "WHEEL", "top_level.txt", "RECORD"}
