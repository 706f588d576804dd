"""The layout as docs/architecture.md draws it, read for the tests that hold the code to it
(tests/package/test_package.py: the floors; tests/package/test_layout.py: the rest)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def table(heading: str) -> list[list[str]]:
    """The rows of the first table under `heading` in docs/architecture.md, each a list
    of its cells (the header and its rule left out)."""
    text = ARCHITECTURE.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def quoted(cell: str) -> list[str]:
    """The names written `like this` in a cell, in order."""
    return re.findall(r"`([^`]+)`", cell)


def floors() -> list[tuple[str, ...]]:
    """The floors from the ground up: each floor's packages (or root modules)."""
    rows = sorted(table("The floors"), key=lambda row: int(row[0]))
    assert [int(row[0]) for row in rows] == list(range(len(rows))), "floors numbered 0, 1, ..."
    return [tuple(quoted(row[1])) for row in rows]
