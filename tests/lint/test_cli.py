"""``air-magic lint``: exit codes 0 / 1 / 2, text, JSON, --diff and --fix."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lint_support import FIXTURES

from air_magic.lint.cli import main

LEGACY = "from serverless_gpu import distributed\n\n@distributed(gpus=8, remote=True)\ndef train():\n    return 0\n"
CLEAN = "from air_magic import distributed\n\n@distributed(num_accelerators=8)\ndef train():\n    return 0\n"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "legacy.py").write_text(LEGACY)
    (tmp_path / "clean.py").write_text(CLEAN)
    (tmp_path / "notes.txt").write_text("gpus=8")  # not Python: not searched
    hidden = tmp_path / ".venv" / "lib"
    hidden.mkdir(parents=True)
    (hidden / "vendored.py").write_text(LEGACY)  # hidden folders are not searched
    shutil.copy(FIXTURES / "seeds" / "seeds.ipynb", tmp_path / "seeds.ipynb")
    return tmp_path


def test_clean_code_exits_0(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lint", str(project / "clean.py")]) == 0
    assert capsys.readouterr().out == "No findings.\n"


def test_findings_exit_1_with_locations_and_advice(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lint", str(project / "legacy.py")]) == 1
    out = capsys.readouterr().out.splitlines()
    path = project / "legacy.py"
    assert out[0].startswith(f"{path}:1:28: AM101 [*] `serverless_gpu.distributed` comes from the legacy")
    assert out[1] == "    fix: Use `air_magic.distributed` (the same API)"
    assert out[2] == f"{path}:3:14: AM201 [*] `gpus` is the old name of `num_accelerators`"
    assert out[4].startswith(f"{path}:3:22: AM206 `remote` chose between")
    assert out[-1] == "Found 3 findings (2 fixable with --fix)."


def test_folders_are_searched_for_py_and_ipynb(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lint", "--format", "json", str(project)]) == 1
    found = json.loads(capsys.readouterr().out)
    assert {Path(d["path"]).name for d in found} == {"legacy.py", "seeds.ipynb"}
    first = found[0]
    assert set(first) == {
        "code",
        "name",
        "message",
        "path",
        "cell",
        "line",
        "col",
        "end_line",
        "end_col",
        "applicability",
        "fix_title",
        "fixable",
    }
    notebook = [d for d in found if d["path"].endswith(".ipynb")]
    assert (notebook[0]["cell"], notebook[0]["line"], notebook[0]["code"]) == (3, 1, "AM101")
    assert {d["applicability"] for d in found} == {"safe", "display-only"}


def test_diff_shows_the_fix_and_writes_nothing(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = project / "legacy.py"
    assert main(["lint", "--diff", str(path), str(project / "seeds.ipynb")]) == 1
    captured = capsys.readouterr()
    assert path.read_text() == LEGACY
    assert f"--- {path}\n+++ {path}\n" in captured.out
    assert "-@distributed(gpus=8, remote=True)\n+@distributed(num_accelerators=8, remote=True)\n" in captured.out
    assert f"--- {project / 'seeds.ipynb'}:cell 5\n" in captured.out
    removed = "-import serverless_gpu\n-from serverless_gpu import distributed\n"
    assert removed + "+from air_magic import distributed\n" in captured.out
    assert captured.err == "2 files would be changed by --fix.\n"


def test_fix_writes_and_reports_what_is_left(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = project / "legacy.py"
    assert main(["lint", "--fix", str(path)]) == 1  # remote=True is for a person to remove
    assert path.read_text() == LEGACY.replace("serverless_gpu", "air_magic").replace("gpus=", "num_accelerators=")
    out = capsys.readouterr().out
    assert "AM206" in out and "Fixed 2 findings.\n1 finding left to fix by hand.\n" in out
    path.write_text(path.read_text().replace(", remote=True", ""))
    assert main(["lint", "--fix", str(path)]) == 0


def test_fix_says_when_the_code_asks_for_gpus_this_machine_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from air_magic import accelerators

    monkeypatch.setattr(accelerators, "_physical_gpus", lambda: ())  # NVML's answer: no GPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "train.py"
    path.write_text(LEGACY.replace("gpus=8, remote=True", "gpus=8, gpu_type='H100'"))
    assert main(["lint", "--fix", str(path)]) == 0
    assert "accelerator_type='GPU_8xH100'" in path.read_text()
    assert capsys.readouterr().out == (
        f"Note: {path} asks for GPU_8xH100 (8 H100 GPUs), and this machine has no NVIDIA GPU (CPU only): such a "
        "launch stops with AcceleratorMismatchError here. To run it on this machine, pass num_accelerators=2 and "
        'accelerator_type="CPU" (CPU ranks), in the decorator or with .with_overrides(...); %%distributed: -n 2 '
        "--accelerator-type CPU.\n"
        "Fixed 3 findings.\n"
    )
    assert main(["lint", str(path)]) == 0  # a plain check reports findings only
    assert capsys.readouterr().out == "No findings.\n"


def test_unsafe_fixes_need_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "port.py"
    path.write_text('import os\nos.environ["MASTER_PORT"] = "29500"\n')
    assert main(["lint", "--fix", str(path)]) == 1
    # Said once: the finding left is the one --unsafe-fixes fixes, not one more.
    assert "1 finding left (1 of them fixable with --fix --unsafe-fixes).\n" in capsys.readouterr().out
    assert main(["lint", "--fix", "--unsafe-fixes", str(path)]) == 0
    assert path.read_text() == "import os\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: VERB"),
        (["lint"], "the following arguments are required: PATH"),
        (["lint", "--format", "xml", "x.py"], "invalid choice: 'xml'"),
        (["check", "x.py"], "invalid choice: 'check'"),
        (["lint", "missing.py"], "air-magic lint: error: missing.py: no such file or folder"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_broken_notebook_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.ipynb"
    path.write_text("{not json")
    assert main(["lint", str(path)]) == 2
    assert f"{path}: cannot read it as a notebook" in capsys.readouterr().err


def test_the_console_script(project: Path) -> None:
    script = Path(sys.executable).with_name("air-magic")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "air_magic.lint.cli"]
    done = subprocess.run([*command, "lint", "-q", str(project / "legacy.py")], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stdout.count("\n") == 6  # three findings, each with its fix line; no summary with -q
    assert subprocess.run([*command, "--version"], capture_output=True, text=True).stdout.startswith("air-magic ")
