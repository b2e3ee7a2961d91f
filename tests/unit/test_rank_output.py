"""OutputPump: rank 0's log copied into the cell, a progress bar at its latest state, in a
notebook (``state\\r``: the next text takes its place) and in a terminal (``\\r`` + state,
the line ended before any other text)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from screen import screen_lines

from air_magic.kernel.rank_output import OutputPump


class Log:
    """A rank's log, written as tqdm writes a bar: ``\\r`` + state, ``\\n`` at its close."""

    def __init__(self, path: str) -> None:
        self.path = path
        open(path, "wb").close()

    def write(self, text: str) -> None:
        with open(self.path, "ab") as handle:
            handle.write(text.encode())


def bar(n: int, total: int = 100) -> str:
    return f"{100 * n // total:3d}%|{'#' * (10 * n // total):<10}| {n}/{total} [00:0{n % 10}<00:05, 19.9{n % 10}it/s]"


def run_bar(pump: OutputPump, log: Log, steps: range, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """One state of the bar per read of the pump (a slow bar); what each read wrote."""
    written = []
    for n in steps:
        log.write("\r" + bar(n))
        pump.pump()
        written.append(capsys.readouterr().out)
    return written


def test_a_bar_updated_once_per_read_shows_one_state_at_a_time(tmp_path: Any, capsys: Any) -> None:
    log = Log(str(tmp_path / "rank-0.log"))
    pump = OutputPump(log.path, 1 << 20, progress_every=0)
    written = run_bar(pump, log, range(6), capsys)
    # Each read brings the state before the newest \r: it replaces the one shown, it is
    # not run into it ("  0%|... 0/100 [...]  1%|... 1/100 [...]").
    assert written == [""] + [bar(n) + "\r" for n in range(5)], written
    log.write("\r" + bar(100) + "\n")
    pump.pump(final=True)
    assert capsys.readouterr().out == bar(100) + "\n"


def test_in_a_terminal_a_bar_is_rewritten_in_place_and_ended_before_other_text(tmp_path: Any, capsys: Any) -> None:
    log = Log(str(tmp_path / "rank-0.log"))
    pump = OutputPump(log.path, 1 << 20, progress_every=0, terminal=True)
    shown = "".join(run_bar(pump, log, range(12), capsys))
    assert shown.startswith(bar(0) + "\r" + bar(1)), shown  # tqdm's way: \r + state, the cursor after it
    assert screen_lines(shown) == [bar(10)]
    # A line of air_magic's own (a status line, the stacks of an interrupt) is not written
    # over the bar: the bar's line is ended first, once.
    pump.end_line()
    pump.end_line()
    print("[air_magic] short")
    log.write("\r" + bar(12))
    pump.pump()
    log.write("\r" + bar(13))
    pump.pump(final=True)  # the final pump ends the bar's line too
    print("[air_magic] summary")
    shown += capsys.readouterr().out
    assert screen_lines(shown) == [bar(10), "[air_magic] short", bar(13), "[air_magic] summary", ""], shown


def test_in_a_terminal_a_shorter_state_leaves_nothing_of_a_longer_one(tmp_path: Any, capsys: Any) -> None:
    log = Log(str(tmp_path / "rank-0.log"))
    pump = OutputPump(log.path, 1 << 20, progress_every=0, terminal=True)
    for text in ("\rloading a long file name.bin", "\rparsed", "\r"):
        log.write(text)
        pump.pump()
    log.write("done\n")  # the line ends: its last state, over the state shown
    pump.pump()
    print("[air_magic] x")
    assert screen_lines(capsys.readouterr().out) == ["done", "[air_magic] x", ""]


def test_in_a_terminal_a_state_wider_than_the_terminal_is_cut_to_its_width(tmp_path: Any, capsys: Any) -> None:
    log = Log(str(tmp_path / "rank-0.log"))
    pump = OutputPump(log.path, 1 << 20, progress_every=0, terminal=True)
    for n in range(3):
        log.write(f"\r{n} " + "x" * 150)
        pump.pump()
    shown = capsys.readouterr().out  # captured: not a terminal, 80 columns assumed
    assert screen_lines(shown, columns=80) == ["1 " + "x" * 77], shown
    log.write("\n")
    pump.pump(final=True)
    assert screen_lines(capsys.readouterr().out, columns=80)[0] == "2 " + "x" * 78  # an ended line is whole


def test_what_the_rank_wrote_to_stderr_goes_to_stderr_in_order(tmp_path: Any, capsys: Any) -> None:
    """The rank's real streams: fd 1 and fd 2 of a process whose sys.stderr records its ranges."""
    import subprocess
    import sys

    from air_magic.protocol import stderr_ranges_path

    path = str(tmp_path / "rank-0.log")
    code = (
        "import sys, logging\n"
        "from air_magic.rank.output import redirect\n"
        f"redirect({path!r}, stderr_ranges=True)\n"
        "print('one')\n"
        "print('two', file=sys.stderr)\n"
        "logging.warning('three')\n"
        "for i in range(3):\n"
        "    sys.stderr.write(f'\\r{i}/3')\n"
        "sys.stderr.write('\\n')\n"
        "print('four')\n"
        "sys.stdout.write('five')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert open(path, "rb").read() == b"one\ntwo\nWARNING:root:three\n\r0/3\r1/3\r2/3\nfour\nfive"
    assert os.path.getsize(stderr_ranges_path(path)) % 16 == 0
    pump = OutputPump(path, limit=1 << 20)
    pump.pump(final=True)
    captured = capsys.readouterr()
    assert captured.out == "one\nfour\nfive"
    assert captured.err == "two\nWARNING:root:three\n2/3\n"


def test_a_log_without_stderr_ranges_is_all_stdout(tmp_path: Any, capsys: Any) -> None:
    log = Log(str(tmp_path / "rank-0.log"))
    log.write("a\nb\n")
    OutputPump(log.path, limit=1 << 20).pump(final=True)
    assert capsys.readouterr() == ("a\nb\n", "")


def test_text_after_a_progress_bar_s_state_takes_its_line() -> None:
    """The rank's streams (rank/output.py's _BarLine): a print after a bar's state starts with
    a carriage return; anything else is written as it was given."""
    from air_magic.rank.output import _BarLine

    line = _BarLine()
    writes = [b"\rsteps 10%", b"loss", b" ", b"1", b"\n", b"\rsteps 20%", b"\rsteps 30%", b"\n", b"plain", b"\n"]
    assert [line.separate(w) for w in writes] == [
        b"\rsteps 10%",
        b"\rloss",  # takes the bar's line
        b" ",
        b"1",
        b"\n",
        b"\rsteps 20%",
        b"\rsteps 30%",  # a bar's own redraw, as it was
        b"\n",  # the bar's end
        b"plain",
        b"\n",
    ]
    line = _BarLine()
    assert line.separate(b"50%\r") == b"50%\r" and line.separate(b"next\n") == b"next\n"  # a bar that returns first
