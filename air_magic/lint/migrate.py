"""``air-magic lint --fix`` on a notebook's cells given as text: what the lab extension's
"Migrate from serverless_gpu" command shows and applies.

The command sends the open notebook's cells (the model, unsaved edits included) and
gets back the fixed sources, a diff per changed cell and the findings left to fix by
hand, each with its hint::

    [source of each cell, None for markdown/raw]  --> fix_cells()  (the function
        `air-magic lint --fix NOTEBOOK` runs: the same cells give the same sources)
    --> {"sources": [...], "changes": [{"cell", "diff"}], "remaining": [{"cell", "code",
         "message", "hint", ...}], "fixed": N}

Cells are numbered from 1 in the findings and diffs (markdown cells count), as the CLI
numbers them; ``index`` is the cell's 0-based position.
"""

from __future__ import annotations

import difflib
from typing import Any, Sequence

from air_magic.lint._files import finding_text, lines, summary
from air_magic.lint.diagnostics import Diagnostic
from air_magic.lint.notebook import fix_cells

__all__ = ["migrate_cells"]


def _finding(d: Diagnostic) -> dict[str, Any]:
    return {
        "cell": d.cell,
        "index": d.cell - 1 if d.cell is not None else None,
        "line": d.line,
        "col": d.col,
        "code": d.code,
        "message": d.message,
        "hint": d.fix_title,
        "applicability": str(d.applicability),
        "fixable": d.fixable,
        "text": finding_text(d, where=f"cell {d.cell}:{d.line}:{d.col}" if d.cell is not None else None).rstrip(),
    }


def migrate_cells(sources: Sequence[str | None], *, path: str = "<notebook>", unsafe: bool = False) -> dict[str, Any]:
    """Fix the cells (``None`` for cells that are not code) as ``air-magic lint --fix``
    fixes a notebook file; JSON-able (see the module docstring).

    >>> out = migrate_cells(["from serverless_gpu import distributed"])
    >>> out["sources"][0]
    'from air_magic import distributed'
    """
    if not isinstance(sources, (list, tuple)) or not all(s is None or isinstance(s, str) for s in sources):
        raise TypeError("sources: a list of cell sources (str), null for cells that are not code")
    result = fix_cells(list(sources), path=path, unsafe=unsafe)
    changes = []
    for index, (old, new) in enumerate(zip(sources, result.sources)):
        if old is not None and new is not None and old != new:
            name = f"{path}:cell {index + 1}"
            diff = "".join(difflib.unified_diff(lines(old), lines(new), fromfile=name, tofile=name))
            changes.append({"cell": index + 1, "index": index, "diff": diff})
    remaining = list(result.remaining)
    return {
        "path": path,
        "sources": list(result.sources),
        "changes": changes,
        "fixed": len(result.fixed),
        "found": len(result.found),
        "remaining": [_finding(d) for d in remaining],
        "summary": summary(remaining, fixing=True, unsafe_hint=not unsafe) if remaining else "",
    }
