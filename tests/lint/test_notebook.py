"""Notebook cells: magics masked and restored, one module across cells, findings per cell."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from air_magic.lint import fix_notebook
from air_magic.lint.notebook import PYTHON_BODY_MAGICS, fix_cells, lint_cells, mask_magics, unmask


def codes(cells: list[str | None]) -> list[tuple[int | None, int, str]]:
    return [(d.cell, d.line, d.code) for d in lint_cells(cells)]


def test_masking_round_trips_every_ipython_line() -> None:
    source = (
        "%pip install -q torch\n"
        "!nvidia-smi\n"
        "files = !ls /data\n"
        "for f in files:\n"
        "    %time load(f)\n"
        "torch.cuda?\n"
        "%cd \\\n"
        "  /tmp\n"
        "x = 1 % 2\n"
        "y = a != b\n"
    )
    masked, masks = mask_magics(source, "T")
    assert masked.splitlines()[:8] == [
        "pass  # T_0",
        "pass  # T_1",
        "pass  # T_2",
        "for f in files:",
        "    pass  # T_3",
        "pass  # T_4",
        "pass  # T_5",
        "pass  # T_6",
    ]
    assert masked.splitlines()[8:] == ["x = 1 % 2", "y = a != b"]
    compile(masked, "cell", "exec")
    assert unmask(masked, masks) == source


def test_an_import_in_one_cell_is_seen_in_another() -> None:
    cells = [
        "import serverless_gpu as sg",
        "# a markdown-free comment cell",
        None,  # a markdown cell still counts in the numbering
        "@sg.distributed(gpus=2)\ndef train():\n    return 0",
    ]
    assert codes(cells) == [(4, 1, "AM101"), (4, 1, "AM201")]
    fixed = fix_cells(cells)
    assert fixed.sources == (
        "import air_magic as sg",
        cells[1],
        None,
        "@sg.distributed(num_accelerators=2)\ndef train():\n    return 0",
    )
    assert fixed.fixed == ("AM101", "AM201")
    assert fixed.remaining == ()


def test_a_cell_that_does_not_parse_is_reported_and_the_others_are_linted() -> None:
    cells = ["from serverless_gpu import distributed", "def broken(:\n    pass", "@distributed(gpus=1)\ndef f(): ..."]
    assert codes(cells) == [(1, 1, "AM101"), (2, 1, "AM001"), (3, 1, "AM201")]
    fixed = fix_cells(cells)
    assert fixed.sources[1] == cells[1]
    assert fixed.sources[0] == "from air_magic import distributed"


def test_other_cell_magics_are_skipped_and_python_bodies_linted() -> None:
    assert {"distributed", "time", "capture"} <= PYTHON_BODY_MAGICS
    cells = [
        "%%bash\nexport gpus=8\nfrom serverless_gpu import distributed",
        "%%time\nfrom serverless_gpu import distributed\ntrain = distributed(gpus=2)(print)",
        "%%writefile train.py\nfrom serverless_gpu import distributed",
    ]
    assert codes(cells) == [(2, 2, "AM101"), (2, 3, "AM201")]
    fixed = fix_cells(cells).sources
    assert fixed == (
        cells[0],
        "%%time\nfrom air_magic import distributed\ntrain = distributed(num_accelerators=2)(print)",
        cells[2],
    )


def test_distributed_cell_reads_data_built_in_another_cell() -> None:
    cells = [
        "import torch\nfeatures = torch.randn(100_000, 64)\nsteps = int('3')",
        "%%distributed -n 2\nimport torch.distributed as dist\ndist.init_process_group()\n"
        "total = features.sum() * steps\nlocal = torch.ones(1)\nlocal.sum()",
        "%%distributed -n 2\nimport mlflow\nmlflow.set_experiment('/ranks')",
    ]
    found = lint_cells(cells)
    assert [(d.cell, d.line, d.code) for d in found] == [(2, 4, "AM303"), (3, 3, "AM304")]
    assert "`features` is built outside `the %%distributed cell` (built at cell 1, line 2)" in found[0].message


def test_header_errors_are_reported_with_the_magic_parser_message() -> None:
    found = lint_cells(["%%distributed --num-accelerators two\nprint(1)"])
    assert [(d.cell, d.line, d.code) for d in found] == [(1, 1, "AM001")]
    assert found[0].message == (
        "cannot lint the %%distributed line: argument -n/--num-accelerators: invalid int value: 'two'"
    )


def test_header_values_that_ipython_expands_are_unknown_not_errors() -> None:
    for header in (
        "%%distributed -n $NUM_ACCELERATORS --no-tracking",
        "%%distributed -n {2 * half}",
        "%%distributed -n 2 --accelerator-type $TYPE",
        "%%distributed -n 2 --run-name run-{i}",
        "%%distributed -n 2 -- --lr 0.01",  # after --: the ranks' sys.argv
    ):
        assert lint_cells([f"{header}\nprint(1)"]) == [], header
    # An unknown count leaves a legacy type without its exact replacement.
    found = lint_cells(["%%distributed -n $N --accelerator-type H100\nprint(1)"])
    assert [(d.code, d.col) for d in found] == [("AM204", 40)]
    # Only what IPython expands: `$$N` is the text `$N`.
    found = lint_cells(["%%distributed -n $$N\nprint(1)"])
    assert [d.message for d in found] == [
        "cannot lint the %%distributed line: argument -n/--num-accelerators: invalid int value: '$N'"
    ]
    # The magic's own parser is left as it was.
    from IPython.core.error import UsageError
    from IPython.core.magic_arguments import parse_argstring

    from air_magic.magics import DistributedMagics

    with pytest.raises(UsageError, match="invalid int value"):
        parse_argstring(DistributedMagics.distributed, "-n $N")


def test_fixes_keep_masked_lines_and_cell_ends() -> None:
    cells = [
        "%pip install mlflow\nfrom pyspark.ml.torch.distributor import TorchDistributor\n!echo done",
        "def train():\n    %time pass\n    return 1\n",
        "TorchDistributor(num_processes=2).run(train)",
    ]
    fixed = fix_cells(cells).sources
    assert fixed == (
        "%pip install mlflow\nfrom air_magic import distributed\n!echo done",
        cells[1],
        "distributed(num_accelerators=2)(train).distributed()",
    )


def test_empty_and_magic_only_cells() -> None:
    cells = ["", "%load_ext air_magic", "   ", "%%distributed\n"]
    assert codes(cells) == []
    assert fix_cells(cells).sources == tuple(cells)


def test_a_notebook_file_keeps_every_byte_but_the_fixed_sources(tmp_path: Path) -> None:
    # Written by some other tool: two-space indent, unsorted keys, no cell ids, an output.
    text = (
        '{\n  "nbformat": 4,\n  "nbformat_minor": 5,\n  "metadata": {"custom": {"keep": true}},\n'
        '  "cells": [\n    {\n      "cell_type": "code",\n      "source": [\n'
        '        "from serverless_gpu import distributed\\n",\n        "distributed(gpus=2)"\n      ],\n'
        '      "metadata": {"tags": ["x"]},\n      "execution_count": 3,\n'
        '      "outputs": [{"output_type": "stream", "name": "stdout", "text": ["ok\\n"]}]\n    }\n  ]\n}\n'
    )
    path = tmp_path / "other.ipynb"
    path.write_text(text)
    assert [d.code for d in fix_notebook(path)] == []
    expected = text.replace("serverless_gpu", "air_magic").replace("gpus=2", "num_accelerators=2")
    assert json.loads(path.read_text()) == json.loads(expected)
    assert '"cells": [' in path.read_text() and '"id"' not in path.read_text()
