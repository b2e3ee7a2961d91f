"""lint/: the migration linter and its fixes, on files, cells and notebooks (libcst).
Imports nothing of the engine, nor torch or MLflow: it runs where neither is installed.

Migration linter: move ``serverless_gpu`` / ``databricks.air`` / TorchDistributor code to air_magic,
and make GPU-only code (NCCL, ``cuda:N`` devices) run on CPU ranks too.

>>> from air_magic.lint import lint_source, fix_source
>>> code = "from serverless_gpu import distributed\\n@distributed(gpus=8, gpu_type='H100')\\ndef f(): ...\\n"
>>> [d.code for d in lint_source(code)]
['AM101', 'AM201', 'AM202']
>>> print(fix_source(code), end="")
from air_magic import distributed
@distributed(num_accelerators=8, accelerator_type='GPU_8xH100')
def f(): ...

The rules are in :mod:`air_magic.lint.rules` (and the docs: guides/migrate.md, reference/lint-rules.rst); ``# noqa: CODE`` at
the end of a line hides that finding there, as in ruff.  ``.py`` files and notebooks are
linted the same way; the command line is ``air-magic lint [--fix] PATH...``
and the notebook magic ``%air_lint``.  Importing this package does not import libcst:
the functions below do, when they are called.
"""

from __future__ import annotations

import inspect
import os
import textwrap
from typing import Any, Callable

from air_magic.lint.diagnostics import ConvergenceError, Diagnostic, Edit, Fix
from air_magic.lint.rules import RULES, RULES_BY_CODE, Applicability, Rule

__all__ = [
    "Applicability",
    "ConvergenceError",
    "Diagnostic",
    "Edit",
    "Fix",
    "Rule",
    "RULES",
    "RULES_BY_CODE",
    "lint_source",
    "lint_cell",
    "fix_source",
    "lint_notebook",
    "fix_notebook",
    "lint_function",
    "lint_path",
]


def lint_source(source: str, *, filename: str = "<string>") -> list[Diagnostic]:
    """The findings in Python source ``source``, sorted by position.

    Parameters
    ----------
    source : str
        Python code (no IPython magics; use :func:`lint_notebook` for those).
    filename : str
        Shown as the ``path`` of every finding.

    Returns
    -------
    list of Diagnostic
        ``AM001`` alone when the code does not parse.
    """
    from air_magic.lint.engine import check

    return check(source, path=filename)


def lint_cell(source: str, *, filename: str = "<cell>") -> list[Diagnostic]:
    """The findings in one notebook cell, IPython syntax included.

    Line magics and ``!shell`` lines are skipped over; a ``%%distributed`` cell's header is
    checked and its body linted as code that runs on every rank (``AM303``, ``AM304``
    apply to it); other cell magics are not Python and give no findings.  ``cell`` is
    ``None`` and lines are the cell's own.
    """
    from dataclasses import replace

    from air_magic.lint.notebook import lint_cells

    return [replace(d, cell=None) for d in lint_cells([source], path=filename)]


def fix_source(source: str, *, unsafe: bool = False, filename: str = "<string>") -> str:
    """``source`` with every safe fix applied (and unsafe ones with ``unsafe=True``).

    Fixes are applied until nothing changes, so ``fix_source(fix_source(s)) == fix_source(s)``.
    Raises :class:`ConvergenceError` (with the codes involved) if they never settle.
    """
    from air_magic.lint.engine import check
    from air_magic.lint.fixes import fix_until_stable

    return fix_until_stable(source, lambda s: check(s, path=filename), unsafe=unsafe, path=filename).source


def lint_notebook(path: str | os.PathLike[str]) -> list[Diagnostic]:
    """The findings in a ``.ipynb`` file; ``cell`` and ``line`` point into the notebook."""
    from air_magic.lint.notebook import lint_notebook_file

    return lint_notebook_file(path)


def fix_notebook(path: str | os.PathLike[str], *, unsafe: bool = False, write: bool = True) -> list[Diagnostic]:
    """Fix a notebook's code cells in place (outputs and metadata untouched); returns what
    is left to fix by hand.  With ``write=False`` nothing is written."""
    from air_magic.lint.notebook import fix_notebook_file

    return fix_notebook_file(path, unsafe=unsafe, write=write).remaining_diagnostics


def lint_path(path: str | os.PathLike[str]) -> list[Diagnostic]:
    """Lint a ``.py`` file or a notebook, by its extension."""
    text = os.fspath(path)
    if text.endswith(".ipynb"):
        return lint_notebook(text)
    with open(text, encoding="utf-8") as fh:
        return lint_source(fh.read(), filename=text)


def lint_function(func: Callable[..., Any]) -> list[Diagnostic]:
    """The findings for one function (or ``@distributed`` function), as the panel shows them.

    Lines are those of the file or notebook cell the function was defined in.  Besides
    its source, the values the function reads from its module are looked at: data or a
    model built outside it is reported (``AM303``).  ``# noqa`` comments in the function
    hide findings as in a file.  Returns ``[]`` when the source is not available (a
    function built with ``exec``, a builtin).
    """
    from air_magic.lint._noqa import noqa_lines, unsuppressed
    from air_magic.lint.engine import check

    target = getattr(func, "func", func)
    target = inspect.unwrap(target)
    try:
        lines, first = inspect.getsourcelines(target)
    except (OSError, TypeError):
        return []
    source = textwrap.dedent("".join(lines))
    code = getattr(target, "__code__", None)
    filename = inspect.getsourcefile(target) or str(getattr(code, "co_filename", "<function>"))
    offset = max(first - 1, 0)
    found = [
        _shifted(d, offset)
        for d in check(
            source,
            path=filename,
            describe_line=lambda n: f"line {n + offset}",
            launched=[getattr(target, "__name__", "")],
        )
        if d.code != "AM306"  # a call elsewhere cannot be seen from here
    ]
    found.extend(unsuppressed(_captured_at_runtime(target, source, filename, offset), noqa_lines(source), offset))
    found.sort(key=lambda d: (d.line, d.col, d.code))
    return found


def _shifted(d: Diagnostic, offset: int) -> Diagnostic:
    from dataclasses import replace

    # The fix's byte offsets refer to the function's own text; they mean nothing in the
    # file, so a shifted finding carries no fix.
    return replace(
        d,
        line=d.line + offset,
        end_line=d.end_line + offset,
        fix=None,
        applicability=d.applicability,
    )


#: Types (by module-qualified class name, anywhere in the MRO) of data and models.
_HEAVY_TYPES = (
    "torch.Tensor",
    "torch.nn.modules.module.Module",
    "torch.utils.data.dataset.Dataset",
    "torch.utils.data.dataset.IterableDataset",
    "torch.utils.data.dataloader.DataLoader",
    "numpy.ndarray",
    "pandas.core.frame.DataFrame",
    "pandas.core.series.Series",
    "datasets.arrow_dataset.Dataset",
    "datasets.dataset_dict.DatasetDict",
    "pyspark.sql.dataframe.DataFrame",
)


def _heavy(value: Any) -> str | None:
    for klass in type(value).__mro__:
        name = f"{klass.__module__}.{klass.__qualname__}"
        if name in _HEAVY_TYPES:
            return type(value).__name__
    return None


def _captured_at_runtime(func: Any, source: str, filename: str, offset: int) -> list[Diagnostic]:
    """``AM303`` for module-level data or models the function reads (found by value)."""
    import ast

    try:
        names = inspect.getclosurevars(func)
    except (TypeError, ValueError):
        return []
    values = {**names.globals, **names.nonlocals}
    heavy = {name: kind for name, value in values.items() if (kind := _heavy(value))}
    if not heavy:
        return []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    first: dict[str, ast.Name] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in heavy and isinstance(node.ctx, ast.Load):
            seen = first.get(node.id)
            if seen is None or (node.lineno, node.col_offset) < (seen.lineno, seen.col_offset):
                first[node.id] = node
    label = getattr(func, "__name__", "the function")
    out = []
    for name, node in first.items():
        fields = {"name": name, "func": label, "where": f"a {heavy[name]} in the notebook or module"}
        out.append(
            Diagnostic.from_rule(
                "AM303",
                fields,
                path=filename,
                line=node.lineno + offset,
                col=node.col_offset + 1,
                end_line=(node.end_lineno or node.lineno) + offset,
                end_col=(node.end_col_offset or node.col_offset) + 1,
            )
        )
    return out
