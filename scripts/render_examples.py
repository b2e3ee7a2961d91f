"""Run the example notebooks and keep them, with their outputs, as the docs show them.

python scripts/render_examples.py [notebooks/NAME.ipynb ...]   (default: every notebook)

Each notebook of ``notebooks/`` runs headless in a real kernel (``scripts/run_notebook.py``)
in a fresh folder, so its MLflow store and files land there; the executed copy is written
to ``docs/examples/NAME.ipynb``. The docs build renders those copies as they are (it never
executes a notebook). Paths of this machine in the outputs (the folder it ran in, the home
folder, the Python that ran it) are written as a reader's would be: ``/home/me/work``,
``/home/me``, ``/home/me/work/.venv/bin/python``. ``tests/docs/test_docs_examples.py``
checks that each copy has the code of its notebook.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import nbformat

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "examples"
sys.path.insert(0, str(ROOT / "scripts"))

import run_notebook  # noqa: E402

READER_HOME = "/home/me"
READER_WORK = "/home/me/work"


def scrubbed(value: Any, replacements: list[tuple[str, str]]) -> Any:
    """``value`` (text, or the JSON of an output's data) with this machine's paths replaced."""
    if isinstance(value, str):
        # the folder a notebook ran in, also where an earlier run left it in the text
        value = re.sub(re.escape(tempfile.gettempdir()) + r"/am-example-[A-Za-z0-9_]+", READER_WORK, value)
        for old, new in replacements:
            value = value.replace(old, new)
        return value
    if isinstance(value, list):
        return [scrubbed(item, replacements) for item in value]
    if isinstance(value, dict):
        return {key: scrubbed(item, replacements) for key, item in value.items()}
    return value


#: The line each example page starts with (after the notebook's title): how to run it.
HOW_TO_RUN = (
    "*How to run it:* open `notebooks/{name}` in Jupyter, or run it headless with "
    "`.venv/bin/python scripts/run_notebook.py notebooks/{name}`. Shown here with the outputs of "
    "its last run on 2 CPU ranks (`scripts/render_examples.py`)."
)


def say_how_to_run(notebook: Any, name: str) -> None:
    """Put :data:`HOW_TO_RUN` after the notebook's first cell (its title), once."""
    line = HOW_TO_RUN.format(name=name)
    if not any(cell.cell_type == "markdown" and cell.source == line for cell in notebook.cells):
        notebook.cells.insert(1, nbformat.v4.new_markdown_cell(line))
    for cell in notebook.cells:
        cell.pop("id", None)  # ids of nbformat 4.5 are not needed to render, and change every run
    notebook.nbformat_minor = min(notebook.nbformat_minor, 4)


def scrub_notebook(notebook: Any, replacements: list[tuple[str, str]]) -> None:
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            for key in ("text", "data", "traceback"):
                if key in output:
                    output[key] = scrubbed(output[key], replacements)
        cell.get("metadata", {}).pop("execution", None)


def machine_paths(work: str | None = None) -> list[tuple[str, str]]:
    """This machine's paths, most specific first, and what a reader's would be."""
    pairs = [
        (sys.executable, f"{READER_WORK}/.venv/bin/python"),
        (str(Path(sys.executable).parent), f"{READER_WORK}/.venv/bin"),
    ]
    if work:
        pairs += [(os.path.realpath(work), READER_WORK), (work, READER_WORK)]
    return pairs + [(str(ROOT), READER_WORK), (str(Path.home()), READER_HOME)]


def render(source: Path) -> int:
    with tempfile.TemporaryDirectory(prefix="am-example-") as work:
        copy = Path(work) / source.name
        shutil.copy(source, copy)
        executed = Path(work) / f"executed-{source.name}"
        here = os.getcwd()
        os.chdir(work)
        try:
            status = run_notebook.main([str(copy), "--output", str(executed)])
        finally:
            os.chdir(here)
        notebook = nbformat.read(executed, as_version=4)
        scrub_notebook(notebook, machine_paths(work))
        say_how_to_run(notebook, source.name)
        OUT.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, OUT / source.name)
        print(f"wrote {OUT.relative_to(ROOT) / source.name} (exit {status})", flush=True)
        return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="default: every notebooks/*.ipynb")
    parser.add_argument("--scrub-only", action="store_true", help="only redo the copies' paths and first line")
    args = parser.parse_args(argv)
    if args.scrub_only:
        for path in sorted(OUT.glob("*.ipynb")):
            notebook = nbformat.read(path, as_version=4)
            scrub_notebook(notebook, machine_paths())
            say_how_to_run(notebook, path.name)
            nbformat.write(notebook, path)
        return 0
    paths = [Path(p) for p in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    return max((render(path.resolve()) for path in paths), default=0)


if __name__ == "__main__":
    sys.exit(main())
