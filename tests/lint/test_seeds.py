"""The documentation pages' own code, pasted into a .py file and a notebook, as a new user would."""

from __future__ import annotations

import inspect
import shutil
import warnings
from pathlib import Path
from typing import Any

import nbformat
import pytest
from lint_support import FIXTURES, UPDATE

from air_magic import DistributedFunction
from air_magic.accelerators import AcceleratorType
from air_magic.lint import fix_notebook, fix_source, lint_notebook, lint_source

SEEDS = FIXTURES / "seeds"
PAGES = ["serverless_gpu_page", "databricks_air_page"]

#: What each finding's column must point at.
TOKENS = {
    "AM101": "distributed",
    "AM106": "serverless_gpu",
    "AM201": "gpus",
    "AM202": "gpu_type",
    "AM207": "H100",
    "AM401": '"nccl"',
    "AM402": "torch.cuda.set_device",
    "AM403": "torch.device",
    "AM404": "device_ids",
}


def _source(page: str) -> str:
    return (SEEDS / f"{page}.py").read_text()


def _points_at_its_token(source: str, d: Any) -> bool:
    line = source.splitlines()[d.line - 1]
    return line[d.col - 1 :].startswith(TOKENS[d.code])


def test_serverless_gpu_page_findings_point_at_the_right_lines() -> None:
    source = _source("serverless_gpu_page")
    findings = lint_source(source, filename="serverless_gpu_page.py")
    assert [(d.line, d.code) for d in findings] == [
        (6, "AM101"),
        (10, "AM201"),
        (10, "AM202"),  # quickstart
        (24, "AM402"),
        (25, "AM401"),  # complete example: setup()
        (47, "AM106"),
        (48, "AM101"),
        (51, "AM201"),
        (51, "AM202"),  # its imports and decorator
        (60, "AM403"),
        (64, "AM404"),  # its device and DDP
        (102, "AM101"),
        (106, "AM201"),
        (106, "AM202"),  # FAQ
    ]
    assert all(_points_at_its_token(source, d) for d in findings)
    assert all(d.fixable for d in findings)


def test_databricks_air_page_findings_point_at_the_right_lines() -> None:
    source = _source("databricks_air_page")
    findings = lint_source(source, filename="databricks_air_page.py")
    assert [(d.line, d.code) for d in findings] == [
        (5, "AM101"),
        (17, "AM402"),
        (18, "AM403"),
        (19, "AM401"),  # quickstart
        (33, "AM402"),
        (34, "AM401"),  # setup()
        (56, "AM101"),
        (68, "AM403"),
        (72, "AM404"),  # the training function
        (110, "AM101"),  # FAQ
    ]
    assert all(_points_at_its_token(source, d) for d in findings)


@pytest.mark.parametrize("page", PAGES)
def test_seed_page_fixes_cleanly(page: str) -> None:
    source = _source(page)
    fixed = fix_source(source)
    expected = SEEDS / f"{page}.fixed.py"
    if UPDATE:
        expected.write_text(fixed)
    assert fixed == expected.read_text()
    assert lint_source(fixed) == []
    assert fix_source(fixed) == fixed
    compile(fixed, f"{page}.py", "exec")
    # Only the lines with findings changed (the two-line import block became one line).
    flagged = {d.line for d in lint_source(source)}
    before, after = source.splitlines(), fixed.splitlines()
    untouched = [line for n, line in enumerate(before, 1) if n not in flagged]
    assert all(line in after for line in untouched)


@pytest.mark.parametrize("page", PAGES)
def test_fixed_seed_page_runs_with_air_magic(page: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed page runs top to bottom: imports, decorations and calls; only the launch
    itself is recorded instead of started (the pages' code needs CUDA and nccl)."""
    launches: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = []

    def record(self: DistributedFunction, *args: Any, **kwargs: Any) -> list[None]:
        inspect.signature(self.func).bind(*args, **kwargs)  # a wrong call fails as at a launch
        launches.append((self.func.__name__, self.spec, args, kwargs))
        return [None] * (self.spec.num_accelerators or 1)

    monkeypatch.setattr(DistributedFunction, "distributed", record)
    namespace: dict[str, Any] = {"__name__": page, "get_dataset": lambda path: [path], "file_path": "/data"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a legacy name left behind would be a FutureWarning
        exec(compile(fix_source(_source(page)), f"{page}.py", "exec"), namespace)

    run_train = namespace["run_train"]
    assert isinstance(run_train, DistributedFunction)
    assert [(name, args, kwargs) for name, _, args, kwargs in launches] == [
        ("run_train" if page == "serverless_gpu_page" else "train", (), {}),
        ("run_train", (), {"num_epochs": 3, "batch_size": 1}),
    ]
    if page == "serverless_gpu_page":
        assert all(spec.num_accelerators == 8 for _, spec, _, _ in launches)
        assert all(spec.accelerator_type == AcceleratorType.GPU_8xH100 for _, spec, _, _ in launches)
    else:
        assert all(spec.num_accelerators is None for _, spec, _, _ in launches)
    # On this machine: the same function on 2 CPU ranks.
    smaller = run_train.with_overrides(num_accelerators=2, accelerator_type="CPU")
    assert isinstance(smaller, DistributedFunction)
    assert (smaller.num_accelerators, smaller.accelerator_type) == (2, AcceleratorType.CPU)


def test_seeds_notebook_is_built_by_its_script() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_seeds_notebook", SEEDS / "make_notebook.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert nbformat.writes(module.build()) + "\n" == (SEEDS / "seeds.ipynb").read_text()


def test_seeds_notebook_findings_point_at_cells_and_lines() -> None:
    path = SEEDS / "seeds.ipynb"
    findings = lint_notebook(path)
    assert [(d.cell, d.line, d.code) for d in findings] == [
        (3, 1, "AM101"),
        (3, 5, "AM201"),
        (3, 5, "AM202"),  # quickstart
        (4, 8, "AM402"),
        (4, 9, "AM401"),  # setup()
        (5, 1, "AM106"),
        (5, 2, "AM101"),  # imports
        (6, 1, "AM201"),
        (6, 1, "AM202"),  # the training function
        (6, 10, "AM403"),
        (6, 14, "AM404"),  # its device and DDP
        (8, 9, "AM001"),  # the FAQ's "...." as printed
        (10, 1, "AM101"),  # databricks.air quickstart
        (10, 13, "AM402"),
        (10, 14, "AM403"),
        (10, 15, "AM401"),
        (11, 1, "AM207"),  # %%distributed --accelerator-type H100
        (11, 3, "AM403"),  # its device
    ]
    nb = nbformat.read(path, as_version=4)
    for d in findings:
        if d.code in TOKENS:
            assert _points_at_its_token(nb.cells[d.cell - 1].source, d), d
    assert str(findings[0]).startswith(f"{path}:cell 3:1:28: AM101 [*] ")


def test_seeds_notebook_fix_keeps_magics_outputs_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "seeds.ipynb"
    shutil.copy(SEEDS / "seeds.ipynb", path)
    before = nbformat.read(path, as_version=4)

    left = fix_notebook(path)
    assert [(d.cell, d.code) for d in left] == [(8, "AM001")]  # the FAQ cell is not Python
    after = nbformat.read(path, as_version=4)
    assert lint_notebook(path) == left
    assert after.metadata == before.metadata
    for old, new in zip(before.cells, after.cells):
        assert (old.cell_type, old.metadata, old.get("outputs"), old.get("execution_count"), old.get("id")) == (
            new.cell_type,
            new.metadata,
            new.get("outputs"),
            new.get("execution_count"),
            new.get("id"),
        )
    sources = [c.source for c in after.cells]
    assert sources[1] == before.cells[1].source  # %pip and ! lines survive
    assert sources[11] == before.cells[11].source  # %%bash is not touched
    assert sources[4] == "from air_magic import distributed"
    assert sources[10].startswith(
        "%%distributed -n 8 --accelerator-type GPU_8xH100\nsetup()\n"
        'device = torch.device(f"cuda:{int(os.environ[\'LOCAL_RANK\'])}" if torch.cuda.is_available() else "cpu")\n'
    )
    assert "@distributed(num_accelerators=8, accelerator_type='GPU_8xH100')" in sources[5]
    # Unchanged cells keep their exact text, and fixing again changes nothing.
    changed = {2, 3, 4, 5, 9, 10}
    assert all(sources[i] == before.cells[i].source for i in range(len(sources)) if i not in changed)
    text = path.read_text()
    fix_notebook(path)
    assert path.read_text() == text
