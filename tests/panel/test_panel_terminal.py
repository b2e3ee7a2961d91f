"""Terminal IPython, driven in a pseudo-terminal as a user types: no kernel, no widgets;
the panel is text lines.  What the terminal's screen keeps of a launch: the summary
before ``Out[n]:``; after Ctrl-C in a tqdm loop, the bar's last state on a line of its
own (no ``s]`` left of it), one ``KeyboardInterrupt`` line in the summary's words
without frames, the prompt back and the next launch working; no process left at exit,
a launch still running then included.

``--simple-prompt`` reads each line with ``input()``: the screen holds plain text, and
the prompts tell exactly when IPython waits for the next line.  (The default prompt
draws its input with cursor moves; what a running cell prints is the same.)
"""

from __future__ import annotations

import glob
import io
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Iterator

import pexpect  # IPython's own dependency on POSIX systems
import psutil
import pytest
from harness import LIVE_KERNEL_PIDS, describe, rank_processes, stray_processes, strip_ansi, wait_until
from screen import screen_lines

pytestmark = pytest.mark.process

COLUMNS = 200
PROMPT = r"In \[(\d+)\]: "
CONTINUATION = "   ...: "

#: A state of the cell's tqdm bar, whole: nothing before its percentage, nothing after its rate.
BAR = re.compile(r"\s*\d+%\|[^|]*\| \d+/1000 \[\d\d:\d\d<[^\]]*\]")


class Terminal:
    """``python -m IPython --simple-prompt`` in a pseudo-terminal of its own, in a temp folder."""

    def __init__(self, workdir: str) -> None:
        env = dict(os.environ)  # AIR_MAGIC_STATE_DIR, AIR_MAGIC_LOG_DIR: the session's temp folders
        env.pop("PYTEST_CURRENT_TEST", None)
        env.pop("AIR_MAGIC_WARM", None)  # a terminal warms as a user's does
        env.update(
            IPYTHONDIR=os.path.join(workdir, "ipython"),  # no profile, startup file or history of the user
            MLFLOW_TRACKING_URI=f"sqlite:///{os.path.join(workdir, 'mlflow.db')}",
            PYTHONDONTWRITEBYTECODE="1",
            TERM="xterm",
        )
        self.transcript = io.StringIO()
        self.child = pexpect.spawn(
            sys.executable,
            [
                "-m",
                "IPython",
                "--simple-prompt",
                "--colors=NoColor",
                "--no-banner",
                "--no-term-title",
                "--HistoryManager.enabled=False",
            ],
            cwd=workdir,
            env=env,
            encoding="utf-8",
            codec_errors="replace",
            dimensions=(50, COLUMNS),
            timeout=60,
        )
        self.child.logfile_read = self.transcript
        self.pid = self.child.pid
        LIVE_KERNEL_PIDS.add(self.pid)  # its helper is a helper, not a stray process
        self.count = int(self.prompt())

    def prompt(self, timeout: float = 60) -> str:
        """Wait for the next ``In [n]:`` prompt; its number."""
        self.child.expect(PROMPT, timeout=timeout)
        return str(self.child.match.group(1))

    def type_cell(self, code: str) -> int:
        """Type a cell line by line, each after its prompt, and the empty line that runs it;
        the transcript's offset where the cell's output begins."""
        lines = code.rstrip("\n").split("\n")
        for i, line in enumerate(lines):
            self.child.send(line + "\r")
            if i < len(lines) - 1 or code.startswith("%%"):
                self.child.expect_exact(CONTINUATION)
        if code.startswith("%%"):  # a cell magic's body ends at an empty line
            self.child.send("\r")
            self.child.expect_exact(CONTINUATION)
            start = len(self.transcript.getvalue())
            self.child.send("\r")
        else:
            start = len(self.transcript.getvalue())
        return start

    def output(self, start: int, timeout: float = 60) -> list[str]:
        """The screen rows the cell typed at ``start`` printed, up to the next prompt."""
        number = int(self.prompt(timeout))
        text = self.transcript.getvalue()[start:]
        text = text[: text.rfind(f"In [{number}]: ")]
        self.count = number
        return screen_lines(text, COLUMNS)

    def run(self, code: str, timeout: float = 60) -> list[str]:
        return self.output(self.type_cell(code), timeout)

    def close(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)
        LIVE_KERNEL_PIDS.discard(self.pid)


@pytest.fixture(scope="module")
def term() -> Iterator[Terminal]:
    workdir = tempfile.mkdtemp(prefix="air-magic-terminal-")
    terminal = Terminal(workdir)
    try:
        terminal.run("%load_ext air_magic")
        yield terminal
    finally:
        terminal.close()
        shutil.rmtree(workdir, ignore_errors=True)


def shown(rows: list[str]) -> str:
    return "\n".join(rows)


def outcome_order(rows: list[str], n: int, value: str) -> None:
    """Rank 0's output, the summary, then ``Out[n]:`` with the value, last."""
    text = shown(rows)
    finished = [
        i
        for i, row in enumerate(rows)
        if re.match(rf"\[air_magic\] Cell In\[{n}\] on 2 CPU ranks \(launch \S+\): finished in \d+\.\d s", row)
    ]
    assert len(finished) == 1, text
    out = [i for i, row in enumerate(rows) if row.startswith(f"Out[{n}]:")]
    assert len(out) == 1, text
    assert rows[out[0]] == f"Out[{n}]: {value}", text
    assert rows[: finished[0]].count("hello") == 1, text
    assert finished[0] < out[0], text
    assert not [row for row in rows[out[0] + 1 :] if row.strip()], text  # the value is the last thing shown
    assert "Traceback" not in text, text


def test_the_summary_comes_before_the_value(term: Terminal) -> None:
    n = term.count
    rows = term.run("%%distributed -n 2 --no-tracking\nimport os\nprint('hello', flush=True)\nint(os.environ['RANK'])")
    outcome_order(rows, n, "[0, 1]")
    assert rows[-1] == ""  # Out[n] ends its line (then an empty one before the prompt)


def test_the_summary_comes_before_the_value_with_tracking(term: Terminal) -> None:
    n = term.count
    rows = term.run(
        "%%distributed -n 2\nimport os\nprint('hello', flush=True)\nint(os.environ['RANK']) + 1", timeout=90
    )
    outcome_order(rows, n, "[1, 2]")
    text = shown(rows)
    out = next(i for i, row in enumerate(rows) if row.startswith("Out["))
    run = [i for i, row in enumerate(rows) if re.match(r"\[air_magic\] +MLflow run ", row)]
    assert len(run) == 1, text  # the run is said once: in the summary, not also in a block of its own
    assert run[0] < out, text  # the run's line too comes before the value


def test_an_interrupt_in_a_tqdm_loop_leaves_one_line_and_a_clean_screen(term: Terminal) -> None:
    n = term.count
    start = term.type_cell(
        "%%distributed -n 2 --no-tracking\n"
        "import time\n"
        "from tqdm import tqdm\n"
        "for i in tqdm(range(1000)):\n"
        "    time.sleep(0.05)\n"
    )
    # A state after the first (the bar is rewritten in place, mid-line) is on screen.
    term.child.expect(r"\| [1-9]\d*/1000 \[", timeout=60)
    began = time.monotonic()
    term.child.sendintr()
    rows = [row.replace("^C", "") for row in term.output(start, timeout=30)]
    assert time.monotonic() - began < 20
    text = shown(rows)
    raw = strip_ansi(term.transcript.getvalue()[start:])

    # One line says it all, last, in the summary's words; no frame of air_magic.
    said = [row for row in rows if row.startswith("KeyboardInterrupt")]
    assert len(said) == 1, text
    assert re.fullmatch(
        rf"KeyboardInterrupt: Cell In\[{n}\] was cancelled: you interrupted it after \d+\.\d s; its 2 ranks were stopped\.",
        said[0],
    ), said[0]
    assert [row for row in rows if row.strip()][-1] == said[0], text
    for frame in ("Traceback", "magics.py", "launcher.py", "launch.py", 'File "'):
        assert frame not in raw, text
    summary = [
        row
        for row in rows
        if re.match(rf"\[air_magic\] Cell In\[{n}\] on 2 CPU ranks \(launch \S+\): cancelled after", row)
    ]
    assert len(summary) == 1 and said[0][len("KeyboardInterrupt: ") :] in summary[0], text

    # Every row is whole: the bar's states, air_magic's lines, where each rank was, the
    # KeyboardInterrupt line.  No `s]` of a longer state under a shorter line, no states
    # run together on one row.
    bars = []
    for row in rows:
        if not row.strip() or row == said[0]:
            continue
        if BAR.fullmatch(row):
            bars.append(row)
            continue
        ours = row.startswith(("[air_magic] ", "  rank ", "  ranks "))  # "  rank 0: at Cell In[4], line 5 ..."
        assert ours and "it/s]" not in row and "/1000 [" not in row, f"{row!r} in\n{text}"
    assert bars, text
    assert not re.search(r"it/s\] *\d+%\|", raw), raw  # two states never run together (no \r between)

    # The ranks are gone; the prompt is back and the next launch works.
    assert wait_until(lambda: not rank_processes(), timeout=10), describe(rank_processes())
    n = term.count
    rows = term.run(
        "%%distributed -n 2 --no-tracking\nimport os\nprint('hello', flush=True)\nint(os.environ['RANK']) * 10"
    )
    outcome_order(rows, n, "[0, 10]")


def test_exit_leaves_no_process(term: Terminal) -> None:
    # A launch still running when the user leaves: its ranks go with IPython too.
    term.run("%%distributed -n 2 --no-tracking --async\nimport time\ntime.sleep(60)")
    assert wait_until(lambda: len(rank_processes()) >= 2, timeout=30), describe(rank_processes())
    family = psutil.Process(term.pid).children(recursive=True)  # the helper and its ranks
    term.child.send("exit\r")
    term.child.expect(pexpect.EOF, timeout=30)
    term.child.close()
    LIVE_KERNEL_PIDS.discard(term.pid)

    def gone() -> bool:
        for proc in family:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                pass
        return True

    assert wait_until(gone, timeout=10), describe(family)
    assert not stray_processes(), describe(stray_processes())
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"air_magic-{term.pid}-*")), "its session folder stayed"
