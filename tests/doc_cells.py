"""The code in a cell of a docs table: a code span, or a MyST role that links it to its
API entry (``{py:func}`mpfunc.half_dtype() <mpfunc.half_dtype>```, as the guide pages
write the first mention of a public name)."""

from __future__ import annotations

import re

_CELL = re.compile(r"(?:\{py:\w+\})?`([^`]+?)(?: <[\w.]+>)?`")


def cell_code(cell: str) -> str | None:
    """The code of ``cell`` if the whole cell is one code span or linked span, else None."""
    m = _CELL.fullmatch(cell.strip())
    return m.group(1) if m else None
