"""Reading what another process appends to a file, line by line, without missing or splitting a line."""

from __future__ import annotations

import os
from typing import Callable

# -- reading what a process appends to a file -------------------------------------------------


def file_size(path: str) -> int:
    """The size of the file at ``path``; 0 when there is none (yet, or any more)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _open_for_reading(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


class TailReader:
    """What was appended to a file since the last read, as whole lines.

    A rank's log (copied into the cell), a spool file (sent to MLflow), a metrics file
    (the panel): each reader keeps its ``offset`` and reads only what is new.  ``opener``
    opens the file (a spool's refuses links and files of other users).
    """

    def __init__(self, path: str, offset: int = 0, opener: Callable[[str], int] = _open_for_reading) -> None:
        self.path = path
        self.offset = offset
        self._opener = opener

    def _pread(self, size: int, at: int, grow: bool = False) -> bytes:
        fd = self._opener(self.path)
        try:
            data = os.pread(fd, size, at)
            while grow and b"\n" not in data and len(data) == size:  # one line longer than size
                size *= 2
                data = os.pread(fd, size, at)
            return data
        finally:
            os.close(fd)

    def read(self, limit: int = 1 << 20, final: bool = False, ends: tuple[bytes, ...] = (b"\n",)) -> bytes:
        """At most ``limit`` new bytes, up to the last line end (any of ``ends``); with
        ``final``, the unterminated rest too.  ``b""`` when the file is missing."""
        try:
            data = self._pread(limit, self.offset)
        except FileNotFoundError:
            return b""
        if not final:
            data = data[: max(data.rfind(end) for end in ends) + 1]
        self.offset += len(data)
        return data

    def read_lines(self, limit: int) -> list[bytes]:
        """The new whole lines (about ``limit`` bytes; a longer line is read whole), without
        their ``\\n``.  ``FileNotFoundError`` is the caller's."""
        data = self._pread(limit, self.offset, grow=True)
        end = data.rfind(b"\n") + 1
        if end == 0:
            return []
        self.offset += end
        return data[: end - 1].split(b"\n")

    def read_recent(self, limit: int) -> bytes:
        """Like :meth:`read`, but when more than ``limit`` bytes are new, the oldest are
        skipped (from a line start): a reader far behind keeps up instead of queueing."""
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return b""
        if size <= self.offset:
            return b""
        start = self.offset
        if size - start > limit:
            start = size - limit
        try:
            data = self._pread(size - start, start)
        except OSError:
            return b""
        if start != self.offset:
            cut = data.find(b"\n") + 1
            data = data[cut:]
            start += cut
        end = data.rfind(b"\n") + 1
        self.offset = start + end
        return data[:end]
