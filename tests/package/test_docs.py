"""Every Python code block in docs/ and README.md runs, top to bottom, one namespace per file;
where the page shows what a block prints (the word "prints" and a ```text block right after
it), the block prints exactly that."""

import contextlib
import io
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.program

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md"])
BLOCK = re.compile(r"^```python\n(.*?)^```\n(?:\s*prints\s*\n\s*```text\n(.*?)^```)?", re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run_and_print_what_the_page_shows(
    page, tmp_path, monkeypatch, optax_promotion
):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for i, (block, shown) in enumerate(BLOCK.findall(page.read_text())):
        code = compile(block, f"{page.name}[block {i}]", "exec")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code, namespace)
        if shown:
            assert out.getvalue() == shown, f"{page.name}[block {i}] printed:\n{out.getvalue()}"


def test_docs_have_code_and_shown_output():
    text = (ROOT / "docs" / "saving-and-loading.md").read_text()
    assert len(BLOCK.findall(text)) >= 10
    assert sum(bool(shown) for _, shown in BLOCK.findall(text)) >= 1
