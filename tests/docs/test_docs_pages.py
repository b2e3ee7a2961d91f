"""The README stays short and points at the site; every guide the site promises is there; what
the long README said before has a page; the example notebooks are the repository's, as last run."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

#: One task per guide (docs/guides/): the file and a phrase its first heading has.
GUIDES = {
    "cell.md": "Run a cell on every GPU",
    "decorator.md": "The decorator",
    "pool.md": "a pool",
    "debug.md": "Debug a rank",
    "hangs.md": "Why is it stuck?",
    "model-back.md": "Get the model back",
    "share-gpu-box.md": "Share a GPU box",
    "tracking.md": "MLflow tracking",
    "panel.md": "JupyterLab extension",
    "data.md": "Data and checkpoints",
    "terminal.md": "air-magic run",
    "ray.md": "Ray cluster",
    "migrate.md": "serverless_gpu",
    "frameworks.md": "DDP, FSDP2, DeepSpeed, transformers, Lightning, Accelerate",
}

#: Each section of the single-page README this site replaced, and the page that now holds it.
OLD_README = {
    "The two commands": ("getting-started.md", "## From a fresh clone: the two commands"),
    "What you get": ("guides/cell.md", "## What a rank sees"),
    "Errors you will see": ("guides/cell.md", "## Errors you will see"),
    "How it works (and which library does what)": ("how-it-works/architecture.md", "## The data flow of one launch"),
    "When tracking fails half-way": ("guides/tracking.md", "## When tracking fails half-way"),
    "Keep the ranks: a pool": ("guides/pool.md", "# Keep the ranks: a pool"),
    "Debug a rank": ("guides/debug.md", "# Debug a rank"),
    "Why is it stuck?": ("guides/hangs.md", "# Why is it stuck?"),
    "Get the model back": ("guides/model-back.md", "# Get the model back"),
    "Sharing a GPU box": ("guides/share-gpu-box.md", "# Share a GPU box"),
    "Beyond one machine: a Ray cluster": ("guides/ray.md", "# A Ray cluster"),
    "Live panel": ("guides/panel.md", "# The live panel"),
    "Data and checkpoints": ("guides/data.md", "# Data and checkpoints"),
    "From a terminal": ("guides/terminal.md", "# From a terminal"),
    "Migration linter": ("guides/migrate.md", "| AM410 |"),
    "Frameworks": ("guides/frameworks.md", "## FSDP2"),
    "JupyterLab extension": ("guides/panel.md", "## JupyterLab extension"),
    "Layout": ("how-it-works/architecture.md", "## Layout of the repository"),
}


def test_the_readme_is_short_and_says_where_everything_is() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for needed in (
        "bash quickstart.sh",
        ".venv/bin/python -m pytest",
        "bash scripts/build_docs.sh",
        "%%distributed --pool",
        "@distributed(",
        "docs/images/lab-pool.png",
        "Apache License 2.0",
    ):
        assert needed in text, needed
    for link in re.findall(r"\]\(([^)#]+)", text):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), f"the README links to {link}, which is not there"


def test_every_guide_is_there_and_in_the_guides_table_of_contents() -> None:
    toc = (DOCS / "guides" / "index.md").read_text()
    for name, phrase in GUIDES.items():
        first = (DOCS / "guides" / name).read_text().splitlines()[0]
        assert first.startswith("# ") and phrase in first, (name, first)
        assert f"\n{name[:-3]}\n" in toc, f"{name} is not in guides/index.md"


@pytest.mark.parametrize("section", list(OLD_README))
def test_what_the_old_readme_said_has_a_page(section: str) -> None:
    page, marker = OLD_README[section]
    assert marker in (DOCS / page).read_text(), f"{section!r}: {marker!r} is not in docs/{page}"


def _code(notebook: nbformat.NotebookNode) -> list[str]:
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_each_example_is_its_notebook_as_last_run(name: str) -> None:
    """docs/examples/NAME.ipynb has the code of notebooks/NAME.ipynb, and the outputs of a run
    (scripts/render_examples.py), with no path of the machine that ran it."""
    shown = nbformat.read(DOCS / "examples" / name, as_version=4)
    assert _code(shown) == _code(nbformat.read(ROOT / "notebooks" / name, as_version=4)), (
        f"docs/examples/{name} is older than notebooks/{name}: python scripts/render_examples.py notebooks/{name}"
    )
    outputs = [o for cell in shown.cells if cell.cell_type == "code" for o in cell.outputs]
    assert outputs and not [o for o in outputs if o.output_type == "error"]
    text = nbformat.writes(shown)
    assert "/home/me/work" in text  # the run's paths, as a reader's would be
    text = text.replace("/home/me/work", "").replace("/home/me", "")
    for path in {str(Path.home()), str(ROOT), os.path.dirname(sys.executable)} - {"/"}:
        assert path not in text, f"docs/examples/{name} shows {path}"
    assert name[:-6] in (DOCS / "examples" / "index.md").read_text()
    assert f"scripts/run_notebook.py notebooks/{name}" in shown.cells[1].source  # how to run it, under its title


def test_getting_started_s_install_lines_run_as_written_from_inside_a_clone(tmp_path: Path) -> None:
    """Each ``pip install`` line of the first code block, run where the page says (inside the
    clone, here a copy of the repository's files named ``air_magic``), resolves to this project
    (``--dry-run``: pip reads the project's metadata and installs nothing)."""
    import shutil
    import subprocess

    text = (DOCS / "getting-started.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block is not None
    lines = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.startswith("pip install")]
    assert lines == ["pip install .", "pip install '.[ray]'"], lines
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    clone = tmp_path / "air_magic"
    for name in files:
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    for line in lines:
        target = line.removeprefix("pip install ").strip("'")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-build-isolation", target],
            cwd=clone,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, (line, done.stderr[-2000:])
        assert "Would install air_magic" in done.stdout or "Would install air-magic" in done.stdout, done.stdout


def _prints_nothing(code: str, lang: str, in_ranks: bool = False) -> bool:
    """Whether a block, run, shows nothing: only imports, ``%load_ext``, definitions and
    assignments of values that are not calls (a launch shows its panel), and in a
    ``%%distributed`` cell's body any assignment (IPython's syntax is translated first)."""
    import ast

    from IPython.core.inputtransformer2 import TransformerManager

    if lang != "python":
        return False
    if code.lstrip().startswith("%%distributed"):  # the ranks' code: what it shows is the cell's
        return _prints_nothing(code.lstrip().split("\n", 1)[1] if "\n" in code.strip() else "", lang, True)
    if code.lstrip().startswith("%%"):
        return False
    try:
        tree = ast.parse(TransformerManager().transform_cell(code))
    except SyntaxError:
        return False
    quiet = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in tree.body:
        if (
            isinstance(node, quiet)
            or isinstance(node, ast.Assign)
            and (in_ranks or not isinstance(node.value, ast.Call))
        ):
            continue
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("run_line_magic"):
            if ast.literal_eval(call.args[0]) == "load_ext":
                continue
        return False
    return True


def test_each_guide_is_in_titled_sections_and_each_block_shows_its_output() -> None:
    """A manual, not a list: every guide has sections (``##``), and every block of code it
    shows is followed by the output it gives (a plain or ``text`` block), but the blocks that
    show nothing (imports, definitions, ``%load_ext``)."""
    for path in sorted((DOCS / "guides").glob("*.md")):
        if path.name == "index.md":
            continue
        text = path.read_text()
        assert len(re.findall(r"^## ", text, re.M)) >= 2, f"{path.name}: fewer than two sections"
        blocks = list(re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M))
        for i, block in enumerate(blocks):
            lang, code = block.group(1), block.group(2)
            if lang not in ("python", "bash") or _prints_nothing(code, lang):
                continue
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            between = text[block.end() : after.start()] if after else ""
            assert after is not None and after.group(1) in ("", "text") and not between.strip(), (
                f"{path.name}: no output after the block that starts {code.splitlines()[0]!r}"
            )
