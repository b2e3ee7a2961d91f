"""Applying fixes: non-overlapping byte edits, then lint again, until nothing changes.

A pass takes the fixes allowed at the requested level, in source order, and skips any
fix with an edit that overlaps an edit already taken (an identical edit, such as the
import two fixes both need, is taken once).  The skipped ones come back on the next
pass, against the new text.  Fixes that never settle are a bug: after
:data:`MAX_PASSES` passes :class:`ConvergenceError` names the codes still firing and
nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from air_magic.lint.diagnostics import ConvergenceError, Diagnostic, Edit, Fix
from air_magic.lint.rules import Applicability

__all__ = ["MAX_PASSES", "FixResult", "apply_fixes", "fix_until_stable", "allowed"]

MAX_PASSES = 10


@dataclass(frozen=True)
class FixResult:
    """The fixed text, what was fixed (codes, in the order fixed), what is left and what
    the text given had (``found``)."""

    source: str
    fixed: tuple[str, ...]
    remaining: tuple[Diagnostic, ...]
    found: tuple[Diagnostic, ...] = ()


def allowed(diagnostic: Diagnostic, unsafe: bool) -> bool:
    fix = diagnostic.fix
    if fix is None or not fix.edits:
        return False
    if fix.applicability is Applicability.SAFE:
        return True
    return unsafe and fix.applicability is Applicability.UNSAFE


def _overlaps(edit: Edit, taken: Sequence[Edit]) -> bool:
    for other in taken:
        if edit == other:
            continue
        if edit.start == edit.end == other.start == other.end:
            return True  # two different insertions at one place: order would be a guess
        if edit.start < other.end and other.start < edit.end:
            return True
        if edit.start == edit.end and other.start < edit.start < other.end:
            return True
        if other.start == other.end and edit.start < other.start < edit.end:
            return True
    return False


def apply_fixes(source: str, fixes: Sequence[Fix]) -> tuple[str, list[int]]:
    """Apply the fixes that do not overlap; returns the new text and the indexes applied."""
    data = source.encode("utf-8")
    taken: list[Edit] = []
    applied = []
    order = sorted(range(len(fixes)), key=lambda i: min(e.start for e in fixes[i].edits))
    for index in order:
        edits = fixes[index].edits
        if any(_overlaps(e, taken) for e in edits):
            continue
        taken.extend(e for e in edits if e not in taken)
        applied.append(index)
    # From the end, so earlier offsets stay valid; a replacement before an insertion at
    # the same offset keeps the inserted text in front of it.
    for edit in sorted(set(taken), key=lambda e: (e.start, e.end), reverse=True):
        data = data[: edit.start] + edit.text.encode("utf-8") + data[edit.end :]
    return data.decode("utf-8"), sorted(applied)


def fix_until_stable(
    source: str,
    lint: Callable[[str], list[Diagnostic]],
    *,
    unsafe: bool = False,
    path: str = "<string>",
) -> FixResult:
    """Lint and fix ``source`` until no allowed fix is left (at most :data:`MAX_PASSES` passes)."""
    fixed: list[str] = []
    found: tuple[Diagnostic, ...] | None = None
    for _ in range(MAX_PASSES):
        diagnostics = lint(source)
        if found is None:
            found = tuple(diagnostics)
        todo = [d for d in diagnostics if allowed(d, unsafe)]
        if not todo:
            return FixResult(source, tuple(fixed), tuple(diagnostics), found)
        new, applied = apply_fixes(source, [d.fix for d in todo if d.fix is not None])
        if new == source:
            return FixResult(source, tuple(fixed), tuple(diagnostics), found)
        fixed.extend(todo[i].code for i in applied)
        source = new
    diagnostics = lint(source)
    codes = sorted({d.code for d in diagnostics if allowed(d, unsafe)})
    if not codes:
        return FixResult(source, tuple(fixed), tuple(diagnostics), found or ())
    raise ConvergenceError(path, MAX_PASSES, codes)
