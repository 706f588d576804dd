"""Every Python code block in docs/ and README.md runs, top to bottom, one namespace per file."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md"])
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(page, tmp_path, monkeypatch, optax_promotion):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    blocks = BLOCK.findall(page.read_text())
    for i, block in enumerate(blocks):
        code = compile(block, f"{page.name}[block {i}]", "exec")
        exec(code, namespace)


def test_docs_have_code():
    assert len(BLOCK.findall((ROOT / "docs" / "saving-and-loading.md").read_text())) >= 10
