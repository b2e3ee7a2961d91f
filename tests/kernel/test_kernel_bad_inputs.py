"""The catalogue of bad inputs (docs/reference/errors.md), row by row in a real kernel; where warnings point.

The table is read from the document itself: a row whose message changes fails here until
the document says what the notebook shows.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from harness import CellResult, Kernel

pytestmark = pytest.mark.kernel

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "errors.md"

#: What ``_physical_gpus`` answers on each machine of the table's Machine column.
MACHINES = {
    "CPU": (),
    "2 × H200": ("NVIDIA H200",) * 2,
    "8 × H100": ("NVIDIA H100 80GB HBM3",) * 8,
}

#: Settings a row may change; unset before every row.
ROW_ENVIRONMENT = (
    "CUDA_VISIBLE_DEVICES",
    "AIR_MAGIC_MAX_CPU_RANKS",
    "AIR_MAGIC_CAPTURE_WARN_MB",
    "AIR_MAGIC_LOG_LIMIT",
    "AIR_MAGIC_OUTPUT_LIMIT",
    "AIR_MAGIC_STALL_SECONDS",
)

KERNEL_HELPERS = f'''
def _bad_inputs_machine(gpus, cores):
    """Pretend to be a machine of the table: its GPUs (as NVML names them) and its cores."""
    import os as _os
    import air_magic.accelerators as _accelerators
    _accelerators._physical_gpus = lambda: tuple(gpus)
    _accelerators.usable_cpu_count = lambda: cores
    for _name in {ROW_ENVIRONMENT!r}:
        _os.environ.pop(_name, None)

def _bad_inputs_launches():
    import os, re
    from air_magic.kernel.launcher import get_launcher
    return len([n for n in os.listdir(get_launcher().session_dir) if re.match(r"\\d{{4}}-", n)])

def _bad_inputs_cell_file(number):
    return next(f for f, n in get_ipython().compile._filename_map.items() if n == number)
'''


@dataclass(frozen=True)
class Row:
    number: int
    where: str
    machine: str
    cell: str
    shown: str


def _code_spans(text: str) -> list[str]:
    return [span.replace("\\|", "|") for span in re.findall(r"`([^`]+)`", text)]


def read_catalogue() -> tuple[str, list[Row]]:
    """The setup cell and the rows of docs/reference/errors.md."""
    text = DOC.read_text()
    setup = re.search(r"The rows assume this cell ran first:\s*```python\n(.*?)```", text, re.S)
    assert setup, "docs/reference/errors.md: the setup cell is missing"
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != 5 or not cells[0].isdigit():
            continue
        number, where, machine, written, shown = cells
        [message] = _code_spans(shown)
        rows.append(Row(int(number), where, machine, "\n".join(_code_spans(written)), message))
    return setup.group(1), rows


SETUP, ROWS = read_catalogue()


def first_line_shown(res: CellResult) -> str:
    """The first line the notebook shows for a failed cell (for Python's SyntaxError, which
    shows the place first, the line that names the error)."""
    if res.error is None:  # UsageError: IPython prints it, with no traceback
        return res.stderr.splitlines()[0]
    lines = [line for line in "\n".join(res.error["traceback"]).splitlines() if line.strip()]
    named = [line for line in lines if line.startswith(res.error["ename"] + ":")]
    if lines[0].startswith(res.error["ename"] + ":") or not named:
        return lines[0]
    return named[-1]


@pytest.fixture(scope="module")
def k(kernel: Kernel) -> Iterator[Kernel]:
    kernel.ok(KERNEL_HELPERS)
    kernel.ok(SETUP)
    yield kernel


def test_the_catalogue_covers_every_front_and_at_least_forty_inputs() -> None:
    assert len(ROWS) >= 40
    assert [row.number for row in ROWS] == list(range(1, len(ROWS) + 1))
    assert len({row.cell for row in ROWS}) == len(ROWS), "two rows with the same input"
    assert {row.where for row in ROWS} == {
        "decorator",
        "magic line",
        "launch call",
        "captured values",
        "hardware",
        "environment",
    }
    assert {row.machine for row in ROWS} <= set(MACHINES)


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.number}-{r.where.replace(' ', '-')}" for r in ROWS])
def test_bad_input_shows_its_catalogued_first_line(k: Kernel, row: Row) -> None:
    k.ok(f"_bad_inputs_machine({MACHINES[row.machine]!r}, 2)")
    before = k.value("_bad_inputs_launches()")
    res = k.run(row.cell)
    assert res.reply is not None and res.reply["status"] == "error", (res.stdout, res.stderr)
    assert first_line_shown(res) == row.shown
    assert k.value("_bad_inputs_launches()") == before  # refused before any rank started


# -- warnings point at the notebook's own line --------------------------------------------------


def warning_lines(res: CellResult) -> list[str]:
    return [line for line in res.stderr.splitlines() if re.match(r"^\S.*:\d+: \w+Warning: ", line)]


def out_value(res: CellResult) -> Any:
    assert res.error is None, res.error_text
    assert res.result is not None
    return ast.literal_eval(res.result)


def test_a_large_capture_warning_in_the_magic_names_the_cell_not_ipython(k: Kernel) -> None:
    k.ok("_bad_inputs_machine((), 2)")
    k.ok('os.environ["AIR_MAGIC_CAPTURE_WARN_MB"] = "1"\nbig_blob = b"x" * 2_000_000')
    try:
        res = k.run("%%distributed -n 2\nlen(big_blob)")
        assert out_value(res) == [2_000_000, 2_000_000]
        cell_file = k.value(f"_bad_inputs_cell_file({res.reply['execution_count']})")
        assert warning_lines(res) == [
            f"{cell_file}:1: CaptureWarning: 'big_blob' is 2 MB once pickled and is sent to every rank. "
            "Load or build it inside the cell instead: each rank then makes its own copy without going "
            "through the kernel."
        ]
        assert "IPython" not in res.stderr
    finally:
        k.ok('os.environ.pop("AIR_MAGIC_CAPTURE_WARN_MB", None)')


def test_a_large_argument_warning_names_the_line_of_the_call(k: Kernel) -> None:
    k.ok("_bad_inputs_machine((), 2)")
    k.ok('os.environ["AIR_MAGIC_CAPTURE_WARN_MB"] = "1"\nbig_arg = b"y" * 3_000_000')
    try:
        res = k.run("size = len(big_arg)\nvalues = train.distributed(big_arg)\n[len(v) for v in values]")
        assert out_value(res) == [3_000_000, 3_000_000]
        cell_file = k.value(f"_bad_inputs_cell_file({res.reply['execution_count']})")
        assert warning_lines(res) == [
            f"{cell_file}:2: CaptureWarning: 'argument 0' is 3 MB once pickled and is sent to every rank. "
            "Load or build it inside 'train' instead: each rank then makes its own copy without going "
            "through the kernel."
        ]
    finally:
        k.ok('os.environ.pop("AIR_MAGIC_CAPTURE_WARN_MB", None)')


def test_more_cpu_ranks_than_cores_run_with_a_warning_at_the_cell(k: Kernel) -> None:
    k.ok("_bad_inputs_machine((), 1)")
    res = k.run("%%distributed -n 2\nimport os\nint(os.environ['RANK'])")
    assert out_value(res) == [0, 1]
    cell_file = k.value(f"_bad_inputs_cell_file({res.reply['execution_count']})")
    assert warning_lines(res) == [
        f"{cell_file}:1: CPUOversubscriptionWarning: num_accelerators=2 starts 2 CPU ranks on 1 usable "
        "CPU core: the ranks share the cores and run slower than 1 rank would. Fine for trying out "
        "distributed code; pass num_accelerators=1 or fewer for speed."
    ]


# -- a decorated method ------------------------------------------------------------------------


def test_a_decorated_method_runs_with_its_instance_on_every_rank(k: Kernel) -> None:
    k.ok("_bad_inputs_machine((), 2)")
    k.ok(
        "class Scaler:\n"
        "    factor = 10\n"
        "    def __init__(self, offset):\n"
        "        self.offset = offset\n"
        "    @distributed(num_accelerators=2)\n"
        "    def apply(self, x):\n"
        "        import os\n"
        "        return int(os.environ['RANK']) * self.factor + self.offset + x\n"
        "scaler = Scaler(5)\n"
    )
    assert k.value("scaler.apply.distributed(1)") == [6, 16]
    assert k.value("scaler.apply.last_launch.status, Scaler.apply.last_launch is scaler.apply.last_launch") == (
        "finished",
        True,
    )
    # the same call through the class, with the instance passed explicitly
    assert k.value("Scaler.apply.distributed(Scaler(0), x=2)") == [2, 12]
