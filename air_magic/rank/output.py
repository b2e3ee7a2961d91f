"""A rank's output: its log, and the streams its code prints to (the kernel reads them:
:mod:`air_magic.kernel.rank_output`)::

    fd 1, fd 2 --O_APPEND--> rank-<r>.log       fd 0 <-- /dev/null
    sys.stdout --_LogFile--> the log (text after a progress bar's state starts with \\r)
    sys.stderr --_RangedFile--> the log, and each write's byte range --> its .stderr file
                                 (rank 0: the cell shows those bytes as stderr)
"""

from __future__ import annotations

import io
import os
import struct
import sys
from typing import Any

from air_magic.protocol import stderr_ranges_path

__all__ = ["redirect"]


def redirect(log_path: str, stderr_ranges: bool = False) -> None:
    """The rank's output to its log: fds 1 and 2 append to it, fd 0 reads /dev/null, and
    ``sys.stdout``/``sys.stderr`` write through (``stderr_ranges``: rank 0's ``sys.stderr``
    records where it wrote, so the cell shows those bytes as stderr)."""
    # Both descriptors append to the log (each write lands at its end, whoever wrote last).
    for target in (1, 2):
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, target)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    ranges = None
    if stderr_ranges:
        try:
            ranges = os.open(stderr_ranges_path(log_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError:
            ranges = None  # its output is then shown as stdout, as it was written to one log
    # Text streams as Python makes them with PYTHONUNBUFFERED=1 (what torchrun's
    # workers get): written through at once, with the encoding and error handlers the
    # helper's own start-up chose for its streams (a file, like the rank's log).
    sys.stdout = _text_stream(1, sys.__stdout__)
    sys.stderr = _text_stream(2, sys.__stderr__, ranges)
    sys.stdin = open(0, "r", closefd=False)
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin  # type: ignore[misc]


class _BarLine:
    """Whether the log's last line is a progress bar's state (a write that drew it after a
    ``\r``, as tqdm draws each update), shared by the rank's ``sys.stdout`` and ``sys.stderr``.

    Text printed while a bar's state ends the log's line (a ``print`` inside the loop) would
    run into it: ``steps 40%|████ | 4/10 loss 0.3``, and a snapshot of the bar with every
    print.  Such text starts with a ``\r`` instead: in the cell (and in the log as it is kept)
    it takes the line's place, so the prints keep lines of their own and the bar one line,
    its last state; the panel shows the bar live."""

    def __init__(self) -> None:
        self.open = False

    def separate(self, data: bytes) -> bytes:
        given = data
        if self.open and data and data[:1] not in (b"\r", b"\n"):
            data = b"\r" + data
        back, end = given.rfind(b"\r"), given.rfind(b"\n")
        if back > end and back < len(given) - 1:
            self.open = True  # a bar's state was drawn after a \r, and the line is not ended
        elif given:  # the line ended, or plain text (after a \r of its own) is on it now
            self.open = False
        return data


_bar_line = _BarLine()


class _LogFile(io.FileIO):
    """A descriptor that appends to the rank's log (text after a progress bar's state starts
    with a ``\r``: :class:`_BarLine`)."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd, "w", closefd=False)

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        super().write(_bar_line.separate(bytes(data)))
        return size


class _RangedFile(io.FileIO):
    """A descriptor that appends to the rank's log, and records in ``ranges`` the byte range
    of each write (two little-endian int64: start, end), so that the kernel shows these
    bytes of the log on the stream they were written to (stderr).  Python's writes to
    ``sys.stderr`` only: what C code writes to fd 2 itself is shown as stdout.

    The range is recorded before the bytes are written: whoever reads the log finds the
    range of any byte it reads.  (A write by another thread or process of the rank between
    the two would shift it: a line shown on the other stream, nothing lost.)"""

    def __init__(self, fd: int, ranges: int) -> None:
        super().__init__(fd, "w", closefd=False)
        self._ranges = ranges

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        written = _bar_line.separate(bytes(data))
        if size:
            try:
                start = os.fstat(self.fileno()).st_size  # where an appending write lands
                os.write(self._ranges, struct.pack("<qq", start, start + len(written)))
            except OSError:
                pass  # the output is in the log all the same, shown as stdout
        super().write(written)
        return size


def _text_stream(fd: int, like: Any, ranges: int | None = None) -> io.TextIOWrapper:
    raw = _LogFile(fd) if ranges is None else _RangedFile(fd, ranges)
    encoding = getattr(like, "encoding", None) or "utf-8"
    errors = getattr(like, "errors", None) or "backslashreplace"
    return io.TextIOWrapper(raw, encoding=encoding, errors=errors, write_through=True)
