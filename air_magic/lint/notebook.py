"""Notebooks: code cells are linted as one module, so an import in cell 2 is seen in cell 5.

::

    cells ──mask magics──> one module, a separator comment before each cell
          ──lint / fix (engine, fixes)──> split at the separators ──unmask──> cells

* IPython line magics, ``!shell`` lines and ``obj?`` help lines become
  ``pass  # <token>`` (same indentation, same line count) and come back verbatim
  afterwards, as nbQA does.
* A ``%%distributed`` cell: its header is parsed with the magic's options
  (:func:`air_magic.options.line_parser`, plain argparse: no IPython needed; a legacy
  ``--accelerator-type`` value is fixed there, ``AM207``) and its body is linted as Python
  that runs on every rank.  ``$name`` and ``{expr}`` in the header, which IPython expands
  before the magic sees the line, are values the linter cannot know: an option given one
  is unknown, not an error.  ``%%time`` and ``%%capture`` bodies are plain Python too;
  cells of any other cell magic (``%%bash``, ``%%writefile`` ...) are skipped.
* A cell that does not parse is reported (``AM001``) and left out; the others are still
  linted.
* Findings point at ``cell N, line M``: N counts every cell of the notebook from 1
  (markdown too, as ``nb.cells[N - 1]``), M is the line inside the cell.

Notebook files are read and written with nbformat; only the ``source`` of cells a fix
changed is replaced, outputs and metadata are left as they are.
"""

from __future__ import annotations

import functools
import json
import os
import re
import string
import uuid
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from air_magic.lint.diagnostics import ConvergenceError, Diagnostic, Edit, Fix
from air_magic.lint.fixes import MAX_PASSES, allowed, apply_fixes
from air_magic.lint.rules import Applicability
from air_magic.options import OPTIONS_BY_KEYWORD, OptionError, line_parser, unquoted

__all__ = [
    "CellsResult",
    "lint_cells",
    "fix_cells",
    "lint_notebook_file",
    "fix_notebook_file",
    "mask_magics",
    "PYTHON_BODY_MAGICS",
]

#: Cell magics whose body is Python run in the notebook's namespace.
PYTHON_BODY_MAGICS = frozenset({"distributed", "time", "capture"})

_LINE_MAGIC = re.compile(r"^\s*(%|!(?!=))")
_ASSIGNED_MAGIC = re.compile(r"^\s*[A-Za-z_][\w.]*(\s*,\s*[A-Za-z_][\w.]*)*\s*=\s*[%!](?!=)")
_HELP = re.compile(r"^\s*(\?{1,2}[\w.*]+|[\w.*]+\?{1,2})\s*$")
_ACCEL = OPTIONS_BY_KEYWORD["accelerator_type"]
_ACCEL_OPTION = re.compile(rf"({re.escape(_ACCEL.flag or '')}(?:=|\s+))([\"']?)([^\s\"']+)\2")


# -- masking -------------------------------------------------------------------------------------


def mask_magics(source: str, token: str) -> tuple[str, dict[str, str]]:
    """Replace IPython-only lines by ``pass  # <token>_<n>``; returns the text and the originals."""
    masks: dict[str, str] = {}
    out = []
    continued = False
    for line in source.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        ending = line[len(body) :]
        if continued or _LINE_MAGIC.match(body) or _ASSIGNED_MAGIC.match(body) or _HELP.match(body):
            key = f"{token}_{len(masks)}"
            masks[key] = body
            indent = body[: len(body) - len(body.lstrip())] if not continued else ""
            out.append(f"{indent}pass  # {key}{ending}")
            continued = body.endswith("\\")
            continue
        out.append(line)
    return "".join(out), masks


def unmask(text: str, masks: dict[str, str]) -> str:
    if not masks:
        return text
    pattern = re.compile(r"^[ \t]*pass  # (" + "|".join(re.escape(k) for k in masks) + r")$")
    lines = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        match = pattern.match(body)
        lines.append(masks[match.group(1)] + line[len(body) :] if match else line)
    return "".join(lines)


# -- one lint view of a list of cells ---------------------------------------------------------


@dataclass
class _Cell:
    index: int
    source: str
    python: str | None = None  # masked text linted as Python (None: not linted)
    masks: dict[str, str] = field(default_factory=dict)
    header: str | None = None  # the %%distributed line
    start: int = 0  # first line of the cell in the joined module
    added_newline: bool = False


class _Joined:
    """Code cells joined into one module, with the maps back to cells."""

    def __init__(self, sources: Sequence[str | None], path: str, numbers: Sequence[int]) -> None:
        self.path = path
        self.numbers = list(numbers)
        self.token = "air_magic_" + uuid.uuid4().hex[:12]
        self.cells: list[_Cell] = []
        self.early: list[Diagnostic] = []  # findings made before joining (syntax, headers)
        self.header_fixes: dict[int, list[tuple[Diagnostic, Edit]]] = {}
        from air_magic.lint.engine import Region

        self.regions: list[Region] = []
        chunks: list[str] = []
        line = 1
        for index, source in enumerate(sources):
            if source is None:
                continue
            cell = _Cell(index, source)
            self.cells.append(cell)
            python = self._prepare(cell)
            if python is None:
                continue
            chunks.append(f"# {self.token}_cell_{index}\n")
            line += 1
            cell.start = line
            cell.added_newline = bool(python) and not python.endswith("\n")
            text = python + ("\n" if cell.added_newline else "")
            cell.python = python
            chunks.append(text)
            count = text.count("\n")
            if cell.header is not None and count > 1:
                self.regions.append(Region(line + 1, line + count - 1, "the %%distributed cell"))
            line += count
        self.text = "".join(chunks)

    def _prepare(self, cell: _Cell) -> str | None:
        source = cell.source
        first, _, rest = source.partition("\n")
        if first.startswith("%%"):
            magic = first[2:].split(None, 1)[0] if first[2:].strip() else ""
            if magic not in PYTHON_BODY_MAGICS:
                return None
            if magic == "distributed":
                cell.header = first
                self._check_header(cell)
        masked, cell.masks = mask_magics(source, f"{self.token}_{cell.index}")
        try:
            import libcst as cst

            cst.parse_module(masked)
        except Exception as exc:  # broad: libcst.ParserSyntaxError, or whatever a grammar libcst lacks raises
            from air_magic.lint.engine import syntax_error

            found = syntax_error(masked, exc, self.path, what="this cell")
            self.early.append(replace(found, cell=self.numbers[cell.index]))
            return None
        return masked

    def _check_header(self, cell: _Cell) -> None:
        assert cell.header is not None
        line = cell.header[len("%%distributed") :]
        try:
            args = _parse_header(line)
        except (OptionError, ValueError) as exc:  # refused options, unbalanced quotes
            self.early.append(
                Diagnostic.from_rule(
                    "AM001",
                    {"what": "the %%distributed line", "error": str(exc)},
                    path=self.path,
                    cell=self.numbers[cell.index],
                    line=1,
                    col=1,
                    end_line=1,
                    end_col=len(cell.header) + 1,
                    fix_title="Fix the options (%%distributed? lists them)",
                )
            )
            return
        from air_magic.accelerators import GPUType
        from air_magic.lint.engine import accelerator_replacement

        value = unquoted(_ACCEL, args.accelerator_type)
        legacy = GPUType.parse(value) if isinstance(value, str) else None
        match = _ACCEL_OPTION.search(cell.header)
        if legacy is None or match is None:
            return
        col = match.start(3) + 1
        count = args.num_accelerators if isinstance(args.num_accelerators, int) else None
        replacement = accelerator_replacement(legacy, count)
        number = self.numbers[cell.index]
        if replacement is None:
            self.early.append(
                Diagnostic.from_rule(
                    "AM204",
                    {"old": value},
                    path=self.path,
                    cell=number,
                    line=1,
                    col=col,
                    end_line=1,
                    end_col=match.end(3) + 1,
                )
            )
            return
        new, reason = replacement
        start = len(cell.header[: match.start(3)].encode("utf-8"))
        edit = Edit(start, start + len(match.group(3).encode("utf-8")), new)
        diagnostic = Diagnostic.from_rule(
            "AM207",
            {"old": value, "new": new, "reason": reason},
            path=self.path,
            cell=number,
            line=1,
            col=col,
            end_line=1,
            end_col=match.end(3) + 1,
            applicability=Applicability.SAFE,
            fix=Fix(Applicability.SAFE, (edit,)),
        )
        self.early.append(diagnostic)
        self.header_fixes.setdefault(cell.index, []).append((diagnostic, edit))

    # -- positions ---------------------------------------------------------------------------

    def locate(self, line: int) -> tuple[_Cell, int]:
        found = None
        for cell in self.cells:
            if cell.python is not None and cell.start <= line:
                found = cell
        assert found is not None, line
        return found, line - found.start + 1

    def describe(self, line: int) -> str:
        """Where a line is, as a finding names it: ``cell 3, line 2``; ``line 2`` when one cell
        is linted on its own (a launch's cell: the finding is shown under the cell's name)."""
        cell, inner = self.locate(line)
        if len(self.cells) == 1:
            return f"line {inner}"
        return f"cell {self.numbers[cell.index]}, line {inner}"

    def lint(self) -> list[Diagnostic]:
        from air_magic.lint.engine import check

        found = list(self.early)
        if self.text:
            for d in check(self.text, path=self.path, regions=self.regions, describe_line=self.describe):
                cell, line = self.locate(d.line)
                end_cell, end_line = self.locate(d.end_line) if d.end_line else (cell, line)
                found.append(
                    replace(
                        d,
                        cell=self.numbers[cell.index],
                        line=line,
                        end_line=end_line if end_cell is cell else line,
                    )
                )
        found.sort(key=lambda d: (d.cell or 0, d.line, d.col, d.code))
        return found

    def split(self, text: str) -> dict[int, str]:
        """Cell index -> new source, from a fixed joined text."""
        marks = list(re.finditer(rf"^# {self.token}_cell_(\d+)\n", text, flags=re.M))
        linted = [c for c in self.cells if c.python is not None]
        if [int(m.group(1)) for m in marks] != [c.index for c in linted]:
            raise RuntimeError("a fix removed a cell boundary; nothing was changed")  # a bug
        out = {}
        for n, (mark, cell) in enumerate(zip(marks, linted)):
            end = marks[n + 1].start() if n + 1 < len(marks) else len(text)
            body = text[mark.end() : end]
            if cell.added_newline and body.endswith("\n"):
                body = body[:-1]
            out[cell.index] = unmask(body, cell.masks)
        return out


#: Stands, while a ``%%distributed`` line is parsed, for what IPython expands there.
_EXPANSION = "air_magic_expansion_" + uuid.uuid4().hex[:12]


class _Unknown:
    """An option value that IPython computes when the cell runs (``-n $N``)."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = _Unknown()


#: ``$name`` as IPython's ``DollarFormatter`` finds it in literal text (not inside a
#: single-quoted stretch); ``$$name`` is the text ``$name``.
_DOLLAR = re.compile(r"(.*?)\$(\$?[\w\.]+)(?=([^']*'[^']*')*[^']*$)")


def _expanded(line: str) -> str:
    """``line`` as IPython passes it to the magic, each ``$name`` / ``{expr}`` replaced by
    :data:`_EXPANSION` (``$$`` and ``{{`` become ``$`` and ``{``, as IPython makes them).

    Found as IPython's own formatter (``InteractiveShell.var_expand``, ``DollarFormatter``)
    finds them; a line it cannot parse, IPython leaves as it is, and so does this.
    """
    parts = []
    try:
        for literal, field_name, _spec, _conversion in string.Formatter().parse(line):
            text, start = "", 0
            for match in _DOLLAR.finditer(literal):
                before, name = match.group(1, 2)
                if name.startswith("$"):  # $$foo --> $foo
                    text += before + name
                else:
                    parts += [text + before, _EXPANSION]
                    text = ""
                start = match.end()
            parts.append(text + literal[start:])
            if field_name is not None:
                parts.append(_EXPANSION)
    except ValueError:
        return line
    return "".join(parts)


@functools.lru_cache(maxsize=1)
def _header_parser() -> Any:
    """The magic's options, whose typed ones take an expansion as :data:`UNKNOWN`."""
    return line_parser(_accepting_expansion)


def _accepting_expansion(convert: Any) -> Any:
    def parse(text: str) -> Any:
        return UNKNOWN if _EXPANSION in text else convert(text)

    parse.__name__ = getattr(convert, "__name__", repr(convert))  # argparse names it in errors
    return parse


def _parse_header(line: str) -> Any:
    """The options of a ``%%distributed`` line (what follows the magic's name), split like
    a shell as the magic does; what follows ``--`` is the ranks' ``sys.argv``, not
    options.  An option whose value IPython would expand is :data:`UNKNOWN`.  Raises
    ``ValueError`` (unbalanced quotes) or :class:`~air_magic.options.OptionError` (a
    ``ValueError`` too) with the magic's parser's message for anything else it refuses."""
    import shlex

    words = shlex.split(_expanded(line))
    if "--" in words:
        words = words[: words.index("--")]
    args = _header_parser().parse_args(words)
    for name, value in vars(args).items():
        if isinstance(value, str) and _EXPANSION in value:
            setattr(args, name, UNKNOWN)
    return args


@dataclass(frozen=True)
class CellsResult:
    """Cell sources after fixing (``None`` for cells that are not code), what was fixed,
    what is left and what the cells given had (``found``)."""

    sources: tuple[str | None, ...]
    fixed: tuple[str, ...]
    remaining: tuple[Diagnostic, ...]
    found: tuple[Diagnostic, ...] = ()


def _numbers(sources: Sequence[str | None], numbers: Sequence[int] | None) -> list[int]:
    return list(numbers) if numbers is not None else list(range(1, len(sources) + 1))


def lint_cells(
    sources: Sequence[str | None], *, path: str = "<notebook>", numbers: Sequence[int] | None = None
) -> list[Diagnostic]:
    """Lint notebook cells (``None`` for markdown/raw cells); ``numbers`` names the cells
    in the findings (default 1, 2, 3 ...)."""
    return _Joined(sources, path, _numbers(sources, numbers)).lint()


def fix_cells(
    sources: Sequence[str | None],
    *,
    path: str = "<notebook>",
    numbers: Sequence[int] | None = None,
    unsafe: bool = False,
) -> CellsResult:
    """Fix notebook cells until nothing changes (see :func:`air_magic.lint.fixes.fix_until_stable`)."""
    labels = _numbers(sources, numbers)
    current = list(sources)
    fixed: list[str] = []
    found: tuple[Diagnostic, ...] | None = None
    for passes in range(MAX_PASSES + 1):
        joined = _Joined(current, path, labels)
        diagnostics = joined.lint()
        if found is None:
            found = tuple(diagnostics)
        # Header fixes (AM207) edit the cell's first line, which the joined module masks.
        todo = [d for d in diagnostics if allowed(d, unsafe) and d.code != "AM207"]
        headers = joined.header_fixes
        if not todo and not headers:
            return CellsResult(tuple(current), tuple(fixed), tuple(diagnostics), found)
        if passes == MAX_PASSES:
            codes = {d.code for d in todo} | ({"AM207"} if headers else set())
            raise ConvergenceError(path, MAX_PASSES, sorted(codes))
        new = list(current)
        if todo:
            text, applied = apply_fixes(joined.text, [d.fix for d in todo if d.fix is not None])
            fixed.extend(todo[i].code for i in applied)
            for index, body in joined.split(text).items():
                new[index] = body
        for index, pairs in headers.items():
            cell = new[index]
            assert cell is not None
            header, newline, rest = cell.partition("\n")
            header, _ = apply_fixes(header, [Fix(Applicability.SAFE, (edit,)) for _, edit in pairs])
            new[index] = header + newline + rest
            fixed.extend(d.code for d, _ in pairs)
        if new == current:
            return CellsResult(tuple(current), tuple(fixed), tuple(diagnostics), found)
        current = new
    raise AssertionError("unreachable")


# -- notebook files ------------------------------------------------------------------------------


def _read(path: str | os.PathLike[str]) -> Any:
    import nbformat

    with warnings.catch_warnings():
        # A notebook whose cells lack ids is still read; it is not this linter's finding.
        warnings.simplefilter("ignore")
        return nbformat.read(os.fspath(path), as_version=4)


def _sources(nb: Any) -> list[str | None]:
    return [c.source if c.cell_type == "code" else None for c in nb.cells]


def lint_notebook_file(path: str | os.PathLike[str]) -> list[Diagnostic]:
    nb = _read(path)
    return lint_cells(_sources(nb), path=os.fspath(path))


@dataclass(frozen=True)
class NotebookFixResult:
    before: tuple[str | None, ...]
    result: CellsResult

    @property
    def changed(self) -> bool:
        return self.before != self.result.sources

    @property
    def remaining_diagnostics(self) -> list[Diagnostic]:
        return list(self.result.remaining)


def fix_notebook_file(path: str | os.PathLike[str], *, unsafe: bool = False, write: bool = True) -> NotebookFixResult:
    """Fix a notebook's code cells and (with ``write``) save it, replacing only the
    ``source`` of the cells that changed."""
    nb = _read(path)
    before = _sources(nb)
    result = fix_cells(before, path=os.fspath(path), unsafe=unsafe)
    outcome = NotebookFixResult(tuple(before), result)
    if write and outcome.changed:
        _write_sources(os.fspath(path), nb, before, result.sources)
    return outcome


def _write_sources(path: str, nb: Any, before: Sequence[str | None], after: Sequence[str | None]) -> None:
    """Save new cell sources.  A version 4 file is edited as JSON, so every other byte stays
    as the tool that wrote it left it (key order, indentation, cells without ids); an
    older one is converted and written by nbformat."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    data = json.loads(text)
    if data.get("nbformat") != 4 or len(data.get("cells", ())) != len(before):
        import nbformat

        for cell, old, new in zip(nb.cells, before, after):
            if new is not None and new != old:
                cell.source = new
        nbformat.write(nb, path)
        return
    for cell, old, new in zip(data["cells"], before, after):
        if new is not None and new != old:
            cell["source"] = new.splitlines(keepends=True) if isinstance(cell["source"], list) else new
    indent = re.match(r"\{\r?\n([ \t]*)", text)
    out = json.dumps(data, indent=len(indent.group(1)) if indent else 1, ensure_ascii="\\u" in text and text.isascii())
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(out + ("\n" if text.endswith("\n") else ""))
