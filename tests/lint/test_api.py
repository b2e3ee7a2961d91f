"""The Python API the panel uses, and what importing the package costs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import ModuleType

from air_magic.lint import RULES, Applicability, Diagnostic, lint_function, lint_path, lint_source

MODULE = """\
import torch
from air_magic import distributed

features = torch.randn(1000, 4)
model = torch.nn.Linear(4, 1)
scale = 2.0


@distributed(gpus=2)
def train():
    import mlflow
    mlflow.set_experiment("/Shared/ranks")
    out = model(features) * scale
    return out.sum().item()


def helper(x):
    return x + 1
"""


def _load(tmp_path: Path) -> ModuleType:
    path = tmp_path / "training_module.py"
    path.write_text(MODULE)
    spec = importlib.util.spec_from_file_location("training_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gpus=2: the finding below is about it
        spec.loader.exec_module(module)
    return module


def test_lint_function_reports_launched_code_at_file_lines(tmp_path: Path) -> None:
    module = _load(tmp_path)
    found = lint_function(module.train)  # the DistributedFunction: its .func is linted
    assert [(d.line, d.code) for d in found] == [(9, "AM201"), (12, "AM304"), (13, "AM303"), (13, "AM303")]
    assert found[0].path == str(tmp_path / "training_module.py")
    captured = {d.message.split("`")[1] for d in found if d.code == "AM303"}
    assert captured == {"model", "features"}  # data and a model; not the float `scale`
    assert "(a Tensor in the notebook or module)" in next(d.message for d in found if "features" in d.message)
    assert all(d.fix is None for d in found)  # offsets of the function's text mean nothing in the file
    assert lint_function(module.train.func) == found


def test_lint_function_treats_any_function_as_launched(tmp_path: Path) -> None:
    module = _load(tmp_path)
    assert lint_function(module.helper) == []
    source = "def loop():\n    import mlflow\n    mlflow.set_experiment('/x')\n"
    namespace: dict[str, object] = {}
    exec(compile(source, "<no file>", "exec"), namespace)
    assert lint_function(namespace["loop"]) == []  # no source to read
    assert lint_function(len) == []


def test_lint_path_and_diagnostic_shape(tmp_path: Path) -> None:
    path = tmp_path / "x.py"
    path.write_text("from serverless_gpu import distributed\ndistributed(gpus=1)\n")
    found = lint_path(path)
    assert [d.code for d in found] == ["AM101", "AM201"]
    d = found[0]
    assert isinstance(d, Diagnostic)
    assert (d.path, d.cell, d.line, d.col, d.applicability, d.name) == (
        str(path),
        None,
        1,
        28,
        Applicability.SAFE,
        "legacy-import",
    )
    assert d.fixable and d.location == f"{path}:1:28"
    assert lint_source("") == []


def test_rule_table_is_well_formed() -> None:
    codes = [r.code for r in RULES]
    assert codes == sorted(codes) and len(set(codes)) == len(codes)
    kinds = {"0": "linter", "1": "imports", "2": "arguments", "3": "patterns", "4": "portability"}
    assert all(r.kind == kinds[r.code[2]] for r in RULES)
    assert len({r.name for r in RULES}) == len(RULES)


def test_every_move_target_exists() -> None:
    from air_magic.lint.rules import MOVES

    for legacy, move in sorted(MOVES.items()):
        try:
            module = importlib.import_module(move.module)
        except ImportError as exc:  # an optional dependency of the target is missing here
            assert move.module != "air_magic", exc
            continue
        assert hasattr(module, move.name), f"{legacy} moves to {move.module}.{move.name}, which does not exist"


def test_importing_air_magic_or_the_lint_package_does_not_import_libcst() -> None:
    code = textwrap.dedent(
        """
        import sys
        import air_magic, air_magic.lint, air_magic.lint.rules
        from air_magic.lint import Diagnostic, RULES
        print([m for m in ("libcst", "nbformat", "IPython", "torch") if m in sys.modules])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_lint_cell_reads_ipython_syntax() -> None:
    from air_magic.lint import lint_cell

    cell = "%%distributed -n 2 --accelerator-type a10\n%time import mlflow\nmlflow.set_experiment('/x')\n!ls"
    assert [(d.cell, d.line, d.code) for d in lint_cell(cell)] == [(None, 1, "AM207"), (None, 3, "AM304")]


def test_noqa_comments_hide_findings_and_their_fixes_as_in_ruff() -> None:
    from air_magic.lint import fix_source

    source = (
        "import torch\n"
        "torch.cuda.set_device(0)  # noqa\n"
        "torch.cuda.set_device(1)  # noqa: AM402 -- pinned on purpose\n"
        "torch.cuda.set_device(2)  # NOQA:AM401,AM303\n"
        "text = '# noqa'; torch.cuda.set_device(3)\n"
    )
    assert [(d.line, d.code) for d in lint_source(source)] == [(4, "AM402"), (5, "AM402")]
    lines = fix_source(source).splitlines()
    assert lines[1:3] == source.splitlines()[1:3]  # hidden: not fixed either
    assert lines[3:5] == ["if torch.cuda.is_available():", "    torch.cuda.set_device(2)  # NOQA:AM401,AM303"]


def test_noqa_hides_what_lint_function_finds_by_value(tmp_path: Path) -> None:
    def train_of(name: str, comment: str) -> object:
        path = tmp_path / f"{name}.py"
        path.write_text(
            "import torch\n\nPROBE = torch.zeros(4, 32)\nbatch = torch.ones(4, 32)\n\n\n"
            "def train():\n"
            f"    probe = PROBE.sum(){comment}\n"
            "    return probe + batch.sum()\n"
        )
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.train

    def found(train: object) -> list[tuple[int, str, str]]:
        return [(d.line, d.code, d.message.split("`")[1]) for d in lint_function(train)]  # type: ignore[arg-type]

    assert found(train_of("plain", "")) == [(8, "AM303", "PROBE"), (9, "AM303", "batch")]
    hidden = train_of("hidden", "  # noqa: AM303 -- 512 bytes, sent on purpose")
    assert found(hidden) == [(9, "AM303", "batch")]
