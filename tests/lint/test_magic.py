"""``%air_lint`` in a real IPython shell, and in a kernel after ``%load_ext air_magic``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
from IPython.core.error import UsageError
from lint_support import FIXTURES


@pytest.fixture(scope="module")
def shell() -> Iterator[Any]:
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    from air_magic.lint.magic import LintMagics

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    ip = InteractiveShell.instance(config=config)
    ip.register_magics(LintMagics)
    yield ip
    ip.user_ns.pop("__vsc_ipynb_file__", None)
    # The shell is process-wide: later tests of this process run as plain Python again.
    InteractiveShell.clear_instance()


def run(shell: Any, cell: str) -> int:
    """Run a cell as the notebook would; returns its number."""
    number = shell.execution_count
    shell.run_cell(cell, store_history=True)
    return number


def test_history_is_linted_cell_by_cell(shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    first = run(shell, "from serverless_gpu import distributed")  # ModuleNotFoundError: still linted
    second = run(shell, "@distributed(gpus=8, gpu_type='H100')\ndef train():\n    return 0")
    capsys.readouterr()
    run(shell, "%air_lint --history")
    out = capsys.readouterr().out
    assert f"In [{first}]:1:28: AM101 [*] `serverless_gpu.distributed`" in out
    assert f"In [{second}]:1:14: AM201 [*] `gpus` is the old name of `num_accelerators`" in out
    assert f"In [{second}]:1:22: AM202 [*]" in out
    assert "    fix: Use `accelerator_type='GPU_8xH100'`" in out
    assert re.search(r"Found \d+ findings \(\d+ fixable with --fix\)\.", out)

    run(shell, "%air_lint --fix --history")
    out = capsys.readouterr().out
    assert f"# In [{first}], fixed:\nfrom air_magic import distributed\n" in out
    assert (
        f"# In [{second}], fixed:\n@distributed(num_accelerators=8, accelerator_type='GPU_8xH100')\n"
        "def train():\n    return 0\n"
    ) in out


def test_one_cell_by_number_and_as_a_diff(shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    number = run(shell, "import os\nos.environ['MASTER_PORT'] = '29500'")
    capsys.readouterr()
    run(shell, f"%air_lint {number}")
    out = capsys.readouterr().out
    assert out.startswith(f'In [{number}]:2:1: AM305 `os.environ["MASTER_PORT"] = ...` replaces')
    run(shell, f"%air_lint --diff --unsafe-fixes {number}")
    out = capsys.readouterr().out
    assert f"--- In [{number}]\n+++ In [{number}] (fixed)\n" in out
    assert "-os.environ['MASTER_PORT'] = '29500'\n" in out


def test_a_function_of_the_notebook(shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run(shell, "import os\ndef loop():\n    os.environ['MASTER_ADDR'] = 'localhost'\n    return 1")
    capsys.readouterr()
    run(shell, "%air_lint loop")
    out = capsys.readouterr().out
    assert re.search(r":3:5: AM305 `os.environ\[\"MASTER_ADDR\"\] = ...` replaces", out), out


def test_the_notebook_file_when_known(shell: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    notebook = tmp_path / "seeds.ipynb"
    shutil.copy(FIXTURES / "seeds" / "seeds.ipynb", notebook)
    shell.user_ns["__vsc_ipynb_file__"] = str(notebook)
    try:
        capsys.readouterr()
        run(shell, "%air_lint")
        out = capsys.readouterr().out
        assert out.startswith(f"{notebook}:cell 3:1:28: AM101 [*]")
        assert "Found 18 findings (17 fixable with --fix)." in out
        run(shell, "%air_lint --fix")
        out = capsys.readouterr().out
        assert f"# {notebook}:cell 5, fixed:\nfrom air_magic import distributed\n" in out
        assert "1 finding left to fix by hand." in out
        assert notebook.read_bytes() == (FIXTURES / "seeds" / "seeds.ipynb").read_bytes()  # not rewritten
    finally:
        del shell.user_ns["__vsc_ipynb_file__"]


def test_unknown_target_is_a_usage_error(shell: Any) -> None:
    with pytest.raises(UsageError, match="'nothing_here' is neither a function of this notebook"):
        shell.run_line_magic("air_lint", "nothing_here")
    with pytest.raises(UsageError, match=r"there is no cell In\[9999\] to lint"):
        shell.run_line_magic("air_lint", "9999")


@pytest.mark.kernel
def test_air_lint_in_a_kernel(kernel_factory: Any) -> None:
    notebook = FIXTURES / "seeds" / "seeds.ipynb"
    kernel = kernel_factory(extra_env={"JPY_SESSION_NAME": str(notebook)})
    try:
        res = kernel.run("from serverless_gpu import distributed\ntrain = distributed(gpus=2)(print)")
        assert res.error is not None and res.error["ename"] == "ModuleNotFoundError"
        out = kernel.ok("%air_lint").stdout
        assert out.startswith(f"{notebook}:cell 3:1:28: AM101 [*]")
        out = kernel.ok("%air_lint --history").stdout
        assert re.search(r"^In \[\d+\]:1:28: AM101 \[\*\] `serverless_gpu.distributed`", out, flags=re.M), out
        assert re.search(r"^In \[\d+\]:2:21: AM201 \[\*\] `gpus`", out, flags=re.M), out
        kernel.ok("%unload_ext air_magic")
        assert "UsageError: Line magic function `%air_lint` not found" in kernel.run("%air_lint").stderr
    finally:
        kernel.shutdown()  # its helper must not outlive the test
