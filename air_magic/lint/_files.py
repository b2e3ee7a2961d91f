"""Reading, linting and fixing one ``.py`` file or notebook, and printing findings: what
``air-magic lint`` and ``%air_lint`` share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from air_magic.errors import AirMagicError
from air_magic.lint.diagnostics import ConvergenceError, Diagnostic
from air_magic.lint.rules import Applicability

__all__ = ["UnreadableFile", "FileResult", "lint_file", "lines", "finding_text", "summary", "plural"]


class UnreadableFile(AirMagicError):
    """The file cannot be read (as a notebook, for ``.ipynb``)."""


@dataclass
class FileResult:
    """What linting (and fixing) one file gave.

    ``remaining`` is what is left after fixing (everything found when not fixing),
    ``found`` what the file had before fixing; ``changes`` holds ``(cell, old, new)``
    for each fixed text (``cell`` is ``None`` for a ``.py`` file, else the cell number);
    ``sources`` the file's code as it is now (fixed or not): its text, or a notebook's cells
    (``None`` for cells that are not code).
    """

    path: str
    remaining: list[Diagnostic]
    found: list[Diagnostic]
    fixed: int = 0
    changes: list[tuple[int | None, str, str]] = field(default_factory=list)
    sources: list[str | None] = field(default_factory=list)


def lint_file(path: str, *, fix: bool = False, unsafe: bool = False, write: bool = False) -> FileResult:
    """Lint ``path`` (by its extension); with ``fix``, fix it too, and with ``write`` save
    the fixed text.  Raises :class:`UnreadableFile` when it cannot be read."""
    if path.endswith(".ipynb"):
        return _notebook(path, fix, unsafe, write)
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            source = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UnreadableFile(f"{path}: cannot read it ({exc})") from None
    from air_magic.lint.engine import check
    from air_magic.lint.fixes import fix_until_stable

    if not fix:
        found = check(source, path=path)
        return FileResult(path, found, found, sources=[source])
    result = fix_until_stable(source, lambda s: check(s, path=path), unsafe=unsafe, path=path)
    outcome = FileResult(
        path, list(result.remaining), list(result.found), fixed=len(result.fixed), sources=[result.source]
    )
    if result.source != source:
        outcome.changes.append((None, source, result.source))
        if write:
            with open(path, "w", encoding="utf-8", newline="") as fh:
                fh.write(result.source)
    return outcome


def _notebook(path: str, fix: bool, unsafe: bool, write: bool) -> FileResult:
    from air_magic.lint.notebook import fix_notebook_file, lint_notebook_file

    try:
        if not fix:
            found = lint_notebook_file(path)
            return FileResult(path, found, found, sources=_cells(path))
        result = fix_notebook_file(path, unsafe=unsafe, write=write)
    except ConvergenceError:
        raise
    except Exception as exc:  # not JSON, not a notebook, unreadable
        raise UnreadableFile(f"{path}: cannot read it as a notebook ({type(exc).__name__}: {exc})") from None
    outcome = FileResult(
        path,
        result.remaining_diagnostics,
        list(result.result.found),
        fixed=len(result.result.fixed),
        sources=list(result.result.sources),
    )
    for index, (old, new) in enumerate(zip(result.before, result.result.sources)):
        if old is not None and new is not None and old != new:
            outcome.changes.append((index + 1, old, new))
    return outcome


def _cells(path: str) -> list[str | None]:
    """A notebook's cells: each code cell's source, ``None`` for the others."""
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    return [cell.source if cell.cell_type == "code" else None for cell in notebook.cells]


def lines(text: str) -> list[str]:
    """``text`` split for a diff, the last line ended too."""
    out = text.splitlines(keepends=True)
    if out and not out[-1].endswith("\n"):
        out[-1] += "\n"
    return out


# -- output ----------------------------------------------------------------------------------------


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def finding_text(d: Diagnostic, where: str | None = None, mark: bool = True) -> str:
    """A finding as printed: ``where: CODE [*] message`` (``[*]``: a safe fix, with
    ``mark``) and what to do on the next line."""
    star = " [*]" if mark and d.fixable and d.applicability is Applicability.SAFE else ""
    text = f"{where if where is not None else d.location}: {d.code}{star} {d.message}\n"
    if d.fix_title:
        text += f"    fix: {d.fix_title}\n"
    return text


def summary(diagnostics: Sequence[Diagnostic], *, fixing: bool, unsafe_hint: bool) -> str:
    """``Found N findings (...).`` or, after fixing, ``N findings left to fix by hand (...).``;
    ``unsafe_hint`` counts the findings that only ``--unsafe-fixes`` fixes."""
    found = plural(len(diagnostics), "finding")
    safe = sum(1 for d in diagnostics if d.fixable and d.applicability is Applicability.SAFE)
    unsafe = sum(1 for d in diagnostics if d.fixable and d.applicability is Applicability.UNSAFE)
    notes = []
    if safe and not fixing:
        notes.append(f"{safe} fixable with --fix")
    if unsafe and unsafe_hint:
        # Each finding counted once: "more" only beside the safe ones, else "of them".
        if notes:
            notes.append(f"{unsafe} more with --fix --unsafe-fixes")
        else:
            notes.append(f"{unsafe} of them fixable with --fix --unsafe-fixes")
    if fixing:
        text = f"{found} left" if unsafe and unsafe_hint else f"{found} left to fix by hand"
    else:
        text = f"Found {found}"
    return text + (f" ({'; '.join(notes)})" if notes else "") + "."
