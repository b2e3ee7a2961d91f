"""Reading and checking the rule fixtures under ``fixtures/<CODE>/``.

A fixture is ``input.py`` (or ``input.cells``: notebook cells, each starting with a
``# %%`` line), ``expected.py`` / ``expected.cells`` (the input after ``--fix
--unsafe-fixes``) and ``findings.txt`` (what ``lint`` reports for the input, one
finding a line).  ``AIR_MAGIC_UPDATE_FIXTURES=1`` rewrites the expected files from
the current output; review the diff before committing it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from air_magic.lint import Diagnostic, fix_source, lint_source
from air_magic.lint.notebook import fix_cells, lint_cells

FIXTURES = Path(__file__).parent / "fixtures"
UPDATE = os.environ.get("AIR_MAGIC_UPDATE_FIXTURES") == "1"
SEPARATOR = "# %%\n"


def read_cells(text: str) -> list[str | None]:
    assert text.startswith(SEPARATOR), "a .cells file starts with '# %%'"
    return [chunk.rstrip("\n") for chunk in text[len(SEPARATOR) :].split(SEPARATOR)]


def write_cells(cells: list[str | None]) -> str:
    return "".join(SEPARATOR + (c or "") + "\n" for c in cells)


@dataclass
class Fixture:
    code: str
    folder: Path

    @property
    def notebook(self) -> bool:
        return (self.folder / "input.cells").exists()

    @property
    def suffix(self) -> str:
        return ".cells" if self.notebook else ".py"

    @property
    def input(self) -> str:
        return (self.folder / f"input{self.suffix}").read_text()

    def lint(self, text: str | None = None) -> list[Diagnostic]:
        text = self.input if text is None else text
        name = f"input{self.suffix}"
        if self.notebook:
            return lint_cells(read_cells(text), path=name)
        return lint_source(text, filename=name)

    def fix(self, text: str | None = None, unsafe: bool = True) -> str:
        text = self.input if text is None else text
        if self.notebook:
            return write_cells(list(fix_cells(read_cells(text), path="input.cells", unsafe=unsafe).sources))
        return fix_source(text, unsafe=unsafe)

    def expected(self, name: str, actual: str) -> str:
        path = self.folder / name
        if UPDATE:
            path.write_text(actual)
        return path.read_text()


def render(diagnostics: list[Diagnostic]) -> str:
    lines = []
    for d in diagnostics:
        lines.append(f"{d} ({d.applicability})")
        lines.append(f"    fix: {d.fix_title}")
    return "".join(line + "\n" for line in lines)


def undefined_names(source: str) -> set[str]:
    """Names the code reads that nothing binds (what a NameError would name)."""
    import libcst as cst
    from libcst.metadata import MetadataWrapper, ScopeProvider

    wrapper = MetadataWrapper(cst.parse_module(source))
    scopes = set(wrapper.resolve(ScopeProvider).values())
    names = set()
    for scope in scopes:
        if scope is None:
            continue
        for access in scope.accesses:
            if not access.referents:
                node = access.node
                names.add(node.value if isinstance(node, cst.Name) else cst.Module([]).code_for_node(node))
    return names
