"""This project's own notebooks: the linter finds nothing in them, and the quickstart is the
documentation's example exactly as ``air-magic lint --fix`` leaves it."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from lint_support import FIXTURES

from air_magic.lint import fix_source, lint_notebook
from air_magic.lint.cli import main

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"

#: The documentation's complete example, section by section (``# -- Title ---`` in the page),
#: and the quickstart cell that holds each one as ``--fix`` leaves it.
EXAMPLE = {
    "Complete example: the model and utility functions": 1,
    "Import the library": 2,
    "The training function": 4,
    "Launch": None,  # see LAUNCH
}

#: The one difference, and why: the documentation launches on the 8 H100 GPUs its decorator
#: asks for, with 3 epochs of batch size 1; the notebook runs the same function on what this
#: machine has (every GPU, or 2 CPU ranks), with epochs and batch size from its environment.
LAUNCH = (
    "run_train.distributed(num_epochs=3, batch_size=1)",
    "run_here = run_train.with_overrides(num_accelerators=NUM_ACCELERATORS, accelerator_type=THIS_MACHINE)\n"
    "results = run_here.distributed(num_epochs=NUM_EPOCHS, batch_size=BATCH_SIZE)",
)


def _sections(text: str) -> dict[str, str]:
    """The code under each ``# -- Title ---`` line, without the blank lines around it."""
    marks = list(re.finditer(r"^# -- (.+?) -+\n", text, flags=re.M))
    return {
        m.group(1): text[m.end() : (marks[i + 1].start() if i + 1 < len(marks) else len(text))].strip("\n")
        for i, m in enumerate(marks)
    }


def test_the_linter_finds_nothing_in_the_projects_notebooks(capsys: pytest.CaptureFixture[str]) -> None:
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert len(paths) >= 5
    assert {p.name: lint_notebook(p) for p in paths} == {p.name: [] for p in paths}
    assert main(["lint", str(NOTEBOOKS)]) == 0
    assert capsys.readouterr().out == "No findings.\n"


def test_the_quickstart_is_the_documentation_example_after_lint_fix() -> None:
    page = (FIXTURES / "seeds" / "serverless_gpu_page.py").read_text()
    copied = "".join(f"# -- {name} ---\n{_sections(page)[name]}\n\n" for name in EXAMPLE)
    fixed = _sections(fix_source(copied))
    notebook = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    cells = [c.source for c in notebook.cells]
    code = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")

    for name, index in EXAMPLE.items():
        if index is not None:
            assert cells[index] == fixed[name], name
    documentation_launch, notebook_launch = LAUNCH
    assert fixed["Launch"] == documentation_launch
    assert notebook_launch in cells[7]
    assert documentation_launch not in code
    # The decorator keeps the documentation's 8 H100 GPUs; the launch cell chooses this machine.
    assert "@distributed(num_accelerators=8, accelerator_type='GPU_8xH100')\n" in cells[4]
