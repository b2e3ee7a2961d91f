"""What the kernel reads of the ranks' output, while they run and once they have ended.

Files the ranks write (names from :mod:`air_magic.protocol`) -> what the launch does::

    rank-0.log    --OutputPump (TailReader: whole new lines)--> the cell's stdout, up to a
                    limit, until the failure marker (the traceback is the cell's error)
    (stack-<r>.txt and the stall watch: where each rank is, :mod:`air_magic.kernel.inspect.stacks`)
    rank-<r>.log  --bound_log--> at the end, its first sixteenth and its end are kept
    rank-<r>.log  --log_end--> its last 16 KiB, for the message of a rank that failed
    result-<r>.pkl --read_records--> the records :func:`air_magic.kernel.outcome.decide` needs
"""

from __future__ import annotations

import bisect
import os
import struct
import sys
import threading
import time
from typing import Any

from air_magic.kernel import outcome as _outcome
from air_magic.protocol import (
    STOP_MARK,
    TRACEBACK_MARK,
    TailReader,
    ValueRecord,
    file_size,
    stderr_ranges_path,
)
from air_magic.rank import results as _results


def _bounded(handle: Any, size: int, limit: int) -> bytes:
    """What a log of ``size`` bytes (open in ``handle``) keeps under ``limit``: its first
    sixteenth, a line saying how much is gone, its end."""
    head_size = limit // 16
    tail_size = limit - head_size
    head = handle.read(head_size)
    handle.seek(size - tail_size)
    tail = handle.read()
    cut = size - head_size - tail_size
    mark = (
        f"\n[air_magic] {cut} bytes of this rank's output were cut here: its log keeps the first "
        f"{_size(head_size)} and the last {_size(tail_size)} (AIR_MAGIC_LOG_LIMIT).\n"
    ).encode()
    return head + mark + tail


def bound_log(path: str, limit: int) -> None:
    """Cut the middle out of a log longer than ``limit``: its first sixteenth and its end
    stay, with a line saying how much is gone (a rank that printed 1 GB leaves 16 MB)."""
    try:
        size = os.path.getsize(path)
        if size <= limit:
            return
        with open(path, "rb") as handle:
            kept = _bounded(handle, size, limit)
        tmp = f"{path}.bounded"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(kept)
        os.replace(tmp, path)
    except OSError:
        pass


def bound_log_in_place(path: str, limit: int) -> None:
    """:func:`bound_log` for the log of a rank that is still running (a pool's, between two
    calls): the file is rewritten in place, not replaced, since the rank keeps appending to it
    (its descriptors were opened with ``O_APPEND``: its next write lands at the new end).
    Where rank 0's writes to stderr were recorded, that record is emptied: it only spoke of
    bytes before the cut, which the kernel has shown already."""
    try:
        size = os.path.getsize(path)
        if size <= limit:
            return
        with open(path, "r+b") as handle:
            kept = _bounded(handle, size, limit)
            handle.seek(0)
            handle.write(kept)
            handle.truncate()
        ranges = stderr_ranges_path(path)
        if os.path.exists(ranges):
            os.truncate(ranges, 0)
    except OSError:
        pass


def _size(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


def log_end(path: str) -> str:
    """The last 16 KiB of a log, decoded (``''`` when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 16384))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


class StderrRanges:
    """Where a rank's ``sys.stderr`` wrote in its log (see :func:`stderr_ranges_path`):
    :meth:`refresh` reads the ranges recorded since; :meth:`covers` says whether a byte of
    the log was written to stderr.  No file (another backend, a pool): all of it is stdout."""

    def __init__(self, log: str) -> None:
        self.path = stderr_ranges_path(log)
        self._read = 0
        self._starts: list[int] = []
        self._ends: list[int] = []

    def refresh(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            data = b""
            while True:  # all that is new (a pool's rank writes to one log for its whole life)
                chunk = os.pread(fd, 1 << 20, self._read + len(data))
                data += chunk
                if len(chunk) < 1 << 20:
                    break
        finally:
            os.close(fd)
        whole = len(data) - len(data) % 16
        self._read += whole
        for start, end in struct.iter_unpack("<qq", data[:whole]):
            if self._starts and start < self._starts[-1]:  # another process of the rank (a fork)
                at = bisect.bisect_left(self._starts, start)
                self._starts.insert(at, start)
                self._ends.insert(at, end)
            else:
                self._starts.append(start)
                self._ends.append(end)

    def covers(self, offset: int) -> bool:
        at = bisect.bisect_right(self._starts, offset) - 1
        return at >= 0 and offset < self._ends[at]


class OutputPump:
    """Copies new output of one rank's log into ``sys.stdout`` (what the rank wrote to its
    ``sys.stderr`` into ``sys.stderr``: :class:`StderrRanges`), up to a limit.

    Whole lines only (a carriage return ends a line too, for progress bars), so the
    failure marker is always seen whole; the traceback after it is shown as the
    cell's error instead.

    A line a progress bar rewrites with carriage returns reaches the cell as its last
    state: each line is written once it ends, with only what follows its last ``\r``;
    while it is still being rewritten, its newest state is written at most once every
    ``progress_every`` s, as state + ``\r``: in Jupyter the next text, a status line
    too, takes its place.
    nbconvert and papermill keep every stream message as an output of its own: the
    notebook they save holds a few states of a bar, not one per step.

    In a terminal (``terminal``), a carriage return only moves the cursor: text shorter
    than the state would leave its end on screen (``s]``).  There a state is written as
    tqdm writes it, carriage return + state (padded over a longer one it replaces, cut to
    the terminal's width), the cursor after it; :meth:`end_line` ends such a line before any
    other text (a status line, the stacks of an interrupt, the summary), and the final
    :meth:`pump` ends it too.

    :meth:`hold_rest` reads what is left of the log while its file is still whole (the
    launch rewrites the logs as it ends); the final :meth:`pump` writes it.
    """

    def __init__(self, path: str, limit: int, progress_every: float = 2.0, terminal: bool = False) -> None:
        self.path = path
        self.limit = limit
        self.progress_every = progress_every
        self.terminal = terminal
        self.reader = TailReader(path)
        self.ranges = StderrRanges(path)
        self.shown = 0
        self.stopped = False
        self._line = b""  # the current line's newest state (after its last \r), not yet ended
        self._returned = False  # that state was followed by a \r: the line's next text replaces it
        self._line_shown = b""  # what of the current line the cell shows
        self._line_err = False  # the current line was written to stderr
        self._open_err = False  # terminal: the state the cursor stands after is on stderr
        self._open = 0  # terminal: the width of the state the cursor stands after (0: none)
        self._progress_at = 0.0
        self._held: bytes | None = None
        self._held_at = 0  # the log's offset of what is held
        self._lock = threading.Lock()

    def hold_rest(self) -> None:
        """Read the rest of the log now; the final :meth:`pump` writes it."""
        with self._lock:
            if self._held is None:
                room = max(0, self.limit - self.shown)
                self._held_at = self.reader.offset
                self._held = b"" if self.stopped else self.reader.read(room + (1 << 16), final=True)

    def pump(self, final: bool = False) -> None:
        with self._lock:
            self._pump(final)
            while final and not self.stopped and self._held is None and self.reader.offset < file_size(self.path):
                offset = self.reader.offset  # the final pump writes all that is left (a read is 1 MiB)
                self._pump(final)
                if self.reader.offset == offset:
                    break
            if final:
                self._end_line()

    def end_line(self) -> None:
        """In a terminal: end the line of a progress state the cursor stands after, so
        that the next text starts on a line of its own (nothing to do elsewhere)."""
        with self._lock:
            self._end_line()

    def _end_line(self) -> None:
        if self._open:
            self._open = 0
            out = sys.stderr if self._open_err else sys.stdout
            out.write("\n")
            out.flush()

    def _pump(self, final: bool) -> None:
        if self.stopped:
            return
        if self._held is not None:
            data, self._held, base = self._held, b"", self._held_at
            self._held_at += len(data)
        else:
            base = self.reader.offset
            data = self.reader.read(1 << 20, final=final, ends=(b"\n", b"\r"))
        self.ranges.refresh()  # after the log: a write's range is recorded before its bytes
        mark = min((i for i in (data.find(_MARK), data.find(_STOP_MARK)) if i >= 0), default=-1)
        if mark >= 0:
            data = data[:mark]
            final = True
        out = self._collapse(data, final, base)
        if mark >= 0:
            self.stopped = True
        room = self.limit - self.shown
        if sum(len(text) for _, text in out) > room:
            cut: list[tuple[bool, bytes]] = []
            for err, text in out:
                if len(text) > room:  # the last part that fits: up to its last whole line (cut
                    text = text[:room]  # inside the first and only line, what fits of it)
                    if b"\n" in text or cut:
                        text = text[: text.rfind(b"\n") + 1]
                cut.append((err, text))
                room -= len(text)
                if room <= 0 or not text:
                    break
            self._write(cut)
            self.stopped = True
            self._open = 0  # the line below starts on a line of its own
            sys.stdout.write(
                f"\n[air_magic] rank 0 printed more than {self.limit // 1024} KiB; the rest is not "
                f"shown here. Full log: {self.path}\n"
            )
            sys.stdout.flush()
            return
        self._write(out)

    def _collapse(self, data: bytes, final: bool, base: int) -> list[tuple[bool, bytes]]:
        """What of ``data`` (at offset ``base`` of the log) reaches the cell, each part with
        whether it goes to stderr: ended lines at their last state, and the state of the
        line being rewritten when it is time to show it (in a notebook followed by ``\r``,
        as tqdm's own output is cut: the next text, a status line too, starts on it; in a
        terminal as :meth:`_state` writes it).  A line goes where its line end was written."""
        out = []
        *ended, rest = data.split(b"\n")
        # A read ends after a \r: what the next read brings of the line replaces the state
        # before it (a bar updated once per read is not run into one long line).
        pending = self._line + (b"\r" if self._returned else b"")
        at = base
        for line in ended:
            at += len(line)  # the line's \n
            err = self.ranges.covers(at)
            out.append((err, self._state(_last_state(pending + line), ended=True, err=err)))
            at += 1
            pending = self._line_shown = b""
        if rest:
            self._line_err = self.ranges.covers(base + len(data) - 1)
        pending += rest
        self._line = _last_state(pending)
        self._returned = pending.endswith(b"\r")
        now = time.monotonic()
        if self._line and self._line != self._line_shown and (final or now - self._progress_at >= self.progress_every):
            self._progress_at = now
            returned = not final or b"\r" in rest
            out.append((self._line_err, self._state(self._line, ended=False, returned=returned, err=self._line_err)))
            self._line_shown = self._line
        return out

    def _state(self, text: bytes, ended: bool, returned: bool = True, err: bool = False) -> bytes:
        """How the cell gets a line's state: ended (with a newline), or shown while it is
        rewritten (see the class docstring: in a notebook, in a terminal)."""
        if not self.terminal:
            return text + (b"\n" if ended else b"\r" if returned else b"")
        if not ended:
            text = _fit(text, _columns() - 1)
        width = _width(text)
        if self._open:  # in place of the state the cursor stands after
            text = b"\r" + text + b" " * max(0, self._open - width)
        self._open = 0 if ended else max(width, 1)
        self._open_err = err
        return text + b"\n" if ended else text

    def _write(self, parts: list[tuple[bool, bytes]]) -> None:
        """Each part on its stream, the parts of one stream together."""
        runs: list[tuple[bool, bytes]] = []
        for err, text in parts:
            if runs and runs[-1][0] == err:
                runs[-1] = (err, runs[-1][1] + text)
            elif text:
                runs.append((err, text))
        for err, text in runs:
            self.shown += len(text)
            out = sys.stderr if err else sys.stdout
            out.write(text.decode("utf-8", "replace"))
            out.flush()


def _width(text: bytes) -> int:
    """Columns a line takes in a terminal (one per character)."""
    return len(text.decode("utf-8", "replace"))


def _fit(text: bytes, columns: int) -> bytes:
    """A state cut to the terminal's width: a wrapped one would leave rows behind at each
    update (a carriage return goes back to the start of the last row only)."""
    if columns < 20 or _width(text) <= columns:
        return text
    return text.decode("utf-8", "replace")[:columns].encode()


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except (AttributeError, OSError, ValueError):  # not a terminal after all, or a replaced stream
        return 80


def _last_state(line: bytes) -> bytes:
    """A line rewritten with carriage returns, as a terminal would leave it: what follows
    its last ``\r`` (one at its very end, as in ``\r\n``, does not count)."""
    if b"\r" not in line:
        return line
    parts = [part for part in line.split(b"\r") if part]
    return parts[-1] if parts else b""


def collapse_log(path: str) -> None:
    """Rewrite a log so that every line a progress bar rewrote with carriage returns keeps
    its last state only (an MLflow artifact of a tqdm loop is then readable)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
        if b"\r" not in data:
            return
        lines = data.split(b"\n")
        text = b"\n".join(_last_state(line) for line in lines)
        tmp = f"{path}.collapsed"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except OSError:
        pass


_MARK = TRACEBACK_MARK.encode()
_STOP_MARK = STOP_MARK.encode()


# -- the ranks' result records ----------------------------------------------------------------


def read_records(work_dir: str, ending: _outcome.Ending, shm_dir: str | None = None) -> dict[int, Any]:
    """The ranks' records as :func:`_outcome.decide` needs them: after a failure those of
    the ranks that did not finish; else every rank's, in order, up to the first that
    holds no value (what a value that cannot be loaded raised stands for it).  Their large
    tensors' files are in the launch's ``shm_dir``, or in ``work_dir`` where it had no room."""
    folders = (shm_dir, work_dir)
    records: dict[int, Any] = {}
    assembled: dict[int, Any] = {}  # DTensors' full tensors, one for every rank's entry
    for state in ending.ranks:
        if ending.failures and state.returncode == 0 and not state.left:
            continue  # finished: its value is not read
        try:
            records[state.rank] = _results.read_record(_results.result_path(work_dir, state.rank), folders, assembled)
        except FileNotFoundError:
            records[state.rank] = _outcome.MISSING
        except Exception as exc:  # cut short by a kill, or unloadable here (any unpickling error)
            records[state.rank] = exc
        if not ending.failures and not isinstance(records[state.rank], ValueRecord):
            break
    return records
