"""How values read from files and schemas are shown in messages. Imports nothing heavy: a
process that only opens safetensors headers uses it."""

from __future__ import annotations

import reprlib
from typing import Any


def short(value: Any) -> str:
    """`value` in a message: its repr, shortened to a few items of each container."""
    return _REPR.repr(value)


def layout_text(bits: int, axis: int, group_size: int | None) -> str:
    """A quantization layout in words: ``int4 (groups of 64 along axis 0)``."""
    per = "one scale per channel" if group_size is None else f"groups of {group_size}"
    return f"int{bits} ({per} along axis {axis})"


_REPR = reprlib.Repr()  # values shown in messages: a few items of each, 3 deep
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 80, 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 8


def table(rows: list[list[str]], numbers: int = 1) -> str:
    """`rows` as aligned columns, the last `numbers` of them (numbers) to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i >= len(row) - numbers else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    )
