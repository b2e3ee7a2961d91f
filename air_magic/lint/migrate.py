"""``air-magic lint --fix`` on a notebook's cells given as text: what the lab extension's
"Migrate from serverless_gpu" command shows and applies.

The command sends the open notebook's cells (the model, unsaved edits included) and
gets back the fixed sources, a diff per changed cell and the findings left to fix by
hand, each with its hint::

    [source of each cell, None for markdown/raw]  --> fix_cells()  (the function
        `air-magic lint --fix NOTEBOOK` runs: the same cells give the same sources)
    --> {"sources": [...], "changes": [{"cell", "diff"}], "remaining": [{"cell", "code",
         "message", "hint", ...}], "fixed": N, "hardware": [...]}

``hardware``: a note for each GPU shape the migrated code asks for (``accelerator_type=`` of
``@distributed``, ``--accelerator-type`` of ``%%distributed``) that this machine does not
have, with how to run it here (the dialog shows them first).

Cells are numbered from 1 in the findings and diffs (markdown cells count), as the CLI
numbers them; ``index`` is the cell's 0-based position.
"""

from __future__ import annotations

import difflib
import re
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
        "hardware": hardware_notes(result.sources),
    }


#: A GPU shape asked for in code: ``accelerator_type="GPU_8xH100"`` or ``--accelerator-type GPU_8xH100``.
_GPU_ASKED = re.compile(r"""accelerator_type\s*=\s*(['"])(GPU_\w+)\1|--accelerator-type[ =]+(GPU_[\w]+)""", re.I)


def hardware_notes(sources: Sequence[str | None], subject: str = "The migrated code") -> list[str]:
    """For each GPU shape the code asks for and this machine lacks (too few GPUs, another
    model, none at all): what a launch of it does here, and how to run it here instead
    (each note begins with ``subject``)."""
    asked: list[str] = []
    for source in sources:
        for match in _GPU_ASKED.finditer(source or ""):
            value = match.group(2) or match.group(3)
            if value.upper() not in (a.upper() for a in asked):
                asked.append(value)
    if not asked:
        return []
    from air_magic.accelerators import AcceleratorType, detect_hardware
    from air_magic.errors import ConfigurationError

    here = detect_hardware()
    have = here.accelerator_type
    notes = []
    for value in asked:
        try:
            wanted = AcceleratorType.parse(value)
        except ConfigurationError:
            continue  # said by the linter's own findings
        if not have.is_cpu and have.model == wanted.model and have.count >= wanted.count:
            continue
        instead = (
            'pass num_accelerators=2 and accelerator_type="CPU" (CPU ranks), in the decorator or with '
            ".with_overrides(...); %%distributed: -n 2 --accelerator-type CPU"
            if have.is_cpu
            else f"omit accelerator_type to use what it has ({have.value})"
        )
        notes.append(
            f"{subject} asks for {wanted.value} ({wanted.count} {wanted.model} GPUs), and this machine has "
            f"{here.describe()}: such a launch stops with AcceleratorMismatchError here. To run it on this machine, "
            f"{instead}."
        )
    return notes
