"""A breakpoint in a script run with ``air-magic run``: with stdin a terminal, pdb's prompt on
that terminal (rank by rank); with stdin a pipe (a job, CI), the one-line skip and no hang."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
from test_cli_run import environment

pytestmark = pytest.mark.process

SCRIPT = "import os\nx = 5\nbreakpoint()\ny = x + 1\nprint('rank', os.environ['RANK'], 'y', y, flush=True)\n"


def test_with_stdin_a_pipe_a_breakpoint_is_skipped_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "stop.py").write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "air_magic.cli", "run", "stop.py", "-n", "2", "--no-tracking"],
        cwd=tmp_path,
        env=environment(tmp_path),
        input="p x\nc\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "rank 0 y 6" in done.stdout
    assert (
        "[air_magic] breakpoint at stop.py, line 3 on rank 0 skipped: there is no stdin to debug it from "
        "(PYTHONBREAKPOINT=0 turns breakpoints off)"
    ) in done.stderr
    assert "(Pdb" not in done.stdout + done.stderr


def test_with_stdin_a_terminal_pdb_asks_there_rank_by_rank(tmp_path: Path) -> None:
    (tmp_path / "stop.py").write_text(SCRIPT)
    child = pexpect.spawn(
        sys.executable,
        ["-m", "air_magic.cli", "run", "stop.py", "-n", "2", "--no-tracking"],
        cwd=str(tmp_path),
        env=environment(tmp_path),
        encoding="utf-8",
        timeout=120,
    )
    try:
        child.expect_exact("(Pdb rank 0) ")
        child.sendline("p x")
        child.expect_exact("5")
        child.expect_exact("(Pdb rank 0) ")
        child.sendline("c")
        child.expect_exact("(Pdb rank 1) ")
        child.sendline("p x + 1")
        child.expect_exact("6")
        child.expect_exact("(Pdb rank 1) ")
        child.sendline("c")
        child.expect_exact("rank 0 y 6")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
