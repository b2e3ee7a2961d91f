"""What the kernel reads of the ranks' output, while they run and once they have ended.

Files the ranks write (names from :mod:`air_magic.protocol`) -> what the launch does::

    rank-0.log    --OutputPump (TailReader: whole new lines)--> the cell's stdout, up to a
                    limit, until the failure marker (the traceback is the cell's error)
    rank-<r>.log  --StallWatch (sizes, once a second)--> no line for a while: stacks
    request_stacks --stack-<r>.ask (or STACK_SIGNAL)--> stack-<r>.txt (each rank writes its threads' stacks)
    stack-<r>.txt --read_stacks, describe_stacks--> "where each rank was", the rank the
                    others wait for
    rank-<r>.log  --bound_log--> at the end, its first sixteenth and its end are kept
    rank-<r>.log  --log_end--> its last 16 KiB, for the message of a rank that failed
    result-<r>.pkl --read_records--> the records :func:`air_magic.kernel.outcome.decide` needs
"""

from __future__ import annotations

import bisect
import os
import re
import struct
import sys
import threading
import time
from typing import Any, Iterable, Mapping, Protocol, Sequence

from air_magic.kernel import outcome as _outcome
from air_magic.protocol import (
    STOP_MARK,
    THREAD_ANSWER_SECONDS,
    TRACEBACK_MARK,
    TailReader,
    ValueRecord,
    ask_for_stacks,
    stack_path,
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


def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


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


def request_stacks(
    work_dir: str, running: dict[int, int], timeout: float, thread_wait: float = THREAD_ANSWER_SECONDS
) -> None:
    """Ask every running rank (``{rank: pid}``) for its stacks (see
    :func:`~air_magic.protocol.ask_for_stacks`); wait (at most ``timeout`` s) until each
    stack file has stopped growing.  A rank whose thread has not answered in ``thread_wait``
    s (at most half the timeout) is asked by signal: faulthandler then writes the stacks from
    the signal handler, which reads other threads' frames as they change (a busy thread's can
    come out garbled), so a caller that can wait gives the thread longer."""
    asked = {rank: pid for rank, pid in running.items() if ask_for_stacks(work_dir, rank, pid)}
    begin = time.monotonic()
    deadline = begin + timeout
    resignalled = False
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = {rank: file_size(stack_path(work_dir, rank)) for rank in asked}
        if all(now[r] > 0 and now[r] == sizes.get(r) for r in asked):
            break
        if not resignalled and time.monotonic() - begin >= min(thread_wait, timeout / 2):
            resignalled = True
            for rank in [r for r in asked if now[r] == 0]:
                ask_for_stacks(work_dir, rank, asked[rank], by_signal=True)
        sizes = now


def read_stacks(work_dir: str, ranks: Iterable[int], sources: dict[str, tuple[str, str]]) -> dict[int, str]:
    """The stacks the ranks wrote, by rank, with the cells' names as the notebook shows them."""
    found = {}
    for rank in ranks:
        try:
            with open(stack_path(work_dir, rank), encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        except OSError:
            continue
        if text.strip():
            for filename, (display, _) in sources.items():
                text = text.replace(f'File "{filename}"', display)
            found[rank] = text
    return found


#: Frames of these files are torch's collectives and rendezvous: a rank in one waits for the others.
_COLLECTIVE_FILES = (
    "torch/distributed/distributed_c10d.py",
    "torch/distributed/rendezvous.py",
    "torch/distributed/c10d_logger.py",
)
_FRAME = re.compile(r'^\s*(?:File "(?P<file>[^"]+)"|(?P<cell>Cell In\[\d+\])), line (?P<line>\d+) in (?P<func>\S+)')


def describe_stacks(
    stacks: dict[int, str],
    world_size: int,
    absent: str | Mapping[int, str] = "had ended",
    waiting: Mapping[int, str] | None = None,
) -> str:
    """``[air_magic] where each rank was:`` and a line per rank; ``''`` with no stacks.
    A rank without a stack is said to be ``absent`` (one text for all, or each rank's own:
    a pool's rank that came back with its error, or done with the call).

    From each rank's main thread (the one running the launched code): its innermost
    frame of the user's code, and the torch collective it waits in, if any.  When some
    ranks wait in a collective and others do not, those others are behind: named.
    ``waiting``: the collective a rank waits in where its stack does not show it (one that
    DDP's or FSDP's hooks issued from autograd's backward, as its Flight Recorder says:
    ``all_reduce (DDP's gradient all-reduce)``).
    """
    if not stacks:
        return ""
    where: dict[int, tuple[str, str | None]] = {}
    for rank, text in sorted(stacks.items()):
        frames = _main_thread_frames(text)
        collective = next(
            (
                f["func"]
                for f in frames
                if any(f["file"].endswith(c) for c in _COLLECTIVE_FILES) and f["func"] != "wrapper"
            ),
            None,
        )
        user = next((f for f in frames if _is_user_frame(f["file"])), None)
        at = f"{user['file']}, line {user['line']} in {user['func']}" if user else "(no frame of the launched code)"
        if collective is None and waiting and rank in waiting:
            collective = waiting[rank]
        where[rank] = (at, collective)
    waiters = sorted(r for r, (_, c) in where.items() if c)
    lines = ["[air_magic] where each rank was:"]
    for rank, (at, collective) in sorted(where.items()):
        named = collective if collective and "(" in collective else f"{collective} (torch.distributed)"
        line = f"  rank {rank}: " + (f"in {named}, called at {at}" if collective else f"at {at}")
        if not collective and waiters:
            who = ", ".join(map(str, waiters))
            line += (
                f"  <- behind: rank{'s' if len(waiters) > 1 else ''} {who} wait{'' if len(waiters) > 1 else 's'} for it"
            )
        lines.append(line)
    missing: dict[str, list[int]] = {}
    for rank in range(world_size):
        if rank not in where:
            words = absent if isinstance(absent, str) else absent.get(rank, "had ended")
            missing.setdefault(words, []).append(rank)
    for words, ranks in missing.items():
        lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {words}")
    return "\n".join(lines)


def user_frame(text: str) -> tuple[str, bool]:
    """``file:N in func`` of the innermost frame of the launched code in a rank's stacks
    (its main thread; ``''`` if none), and whether that thread waits in a collective."""
    frames = _main_thread_frames(text)
    user = next((f for f in frames if _is_user_frame(f["file"])), None)
    waits = any(any(f["file"].endswith(c) for c in _COLLECTIVE_FILES) and f["func"] != "wrapper" for f in frames)
    return (f"{user['file']}:{user['line']} in {user['func']}" if user else ""), waits


_PY_SPY_FRAME = re.compile(r"^\s+(?P<func>.+?) \((?P<file>.+):(?P<line>\d+)\)$")


def py_spy_stacks(pid: int, timeout: float = 10.0) -> str:
    """A process's Python stacks read from outside by py-spy (``pip install py-spy``; it
    needs to be allowed to trace the process), in faulthandler's layout; ``''`` without
    py-spy, or when it could not read them.  Works while a C call holds the GIL."""
    import shutil
    import subprocess

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return ""
    try:
        done = subprocess.run(
            [spy, "dump", "--pid", str(pid), "--full-filenames", "--nonblocking"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = []
    for line in done.stdout.splitlines():
        if line.startswith("Thread "):
            lines.append(line)
            continue
        match = _PY_SPY_FRAME.match(line)
        if match:
            lines.append(f'  File "{match["file"]}", line {match["line"]} in {match["func"]}')
    return "\n".join(lines) if done.returncode == 0 else ""


#: No source file has this many lines: a frame that says so was read while it changed.
_NO_SUCH_LINE = 10_000_000


def _main_thread_frames(text: str) -> list[dict[str, str]]:
    """The frames, most recent first, of the thread that runs the launched code."""
    threads: list[list[dict[str, str]]] = [[]]
    for line in text.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            threads.append([])
            continue
        match = _FRAME.match(line)
        if match and int(match["line"]) < _NO_SUCH_LINE:  # (a frame faulthandler read half-changed)
            frame = match.groupdict()
            frame["file"] = frame["file"] or frame["cell"]
            threads[-1].append(frame)
    threads = [t for t in threads if t]
    for frames in threads:
        if any(f["file"].endswith("air_magic/rank/main.py") and f["func"] == "_run" for f in frames):
            return frames
    return threads[0] if threads else []


def _is_user_frame(filename: str) -> bool:
    if filename.startswith("Cell In["):
        return True
    parts = filename.replace(os.sep, "/")
    return not (
        "/site-packages/" in parts
        or "/lib/python" in parts
        or parts.startswith("<frozen")
        or os.path.abspath(filename).startswith(_PACKAGE_ROOT)
    )


#: air_magic's own folder: frames of files under it are not the user's.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class Watched(Protocol):
    """What the stall watch uses of a launch (:class:`~air_magic.kernel.launch.Launch`)."""

    @property
    def ranks(self) -> Sequence[Any]:
        """Each rank's state: ``log_path`` is read."""

    def stacks(self, timeout: float = 2.0) -> dict[int, str]:
        """Every running rank's stacks, by rank."""

    def where(self, stacks: dict[int, str]) -> str:
        """Where each rank was, from its stacks."""

    def notify(self, line: str, stream: str = "stdout") -> None:
        """Print a line with the launch's other lines."""


class StallWatch:
    """Names a straggler: when no rank has written a line for ``seconds``, look at every
    rank's stack; if some wait in a collective and others do not, say where each one is
    (once per quiet spell).  Silence alone is not a stall: a long step prints nothing."""

    def __init__(self, launch: Watched, seconds: float) -> None:
        self.launch = launch
        self.seconds = seconds
        self.sizes: list[int] = []
        self.quiet_since = time.monotonic()
        self.next_check = self.quiet_since + 1.0

    def check(self) -> None:
        now = time.monotonic()
        if self.seconds <= 0 or now < self.next_check:
            return
        self.next_check = now + 1.0
        sizes = [file_size(state.log_path) for state in self.launch.ranks]
        if sizes != self.sizes:
            self.sizes, self.quiet_since = sizes, now
            return
        if now - self.quiet_since < self.seconds:
            return
        self.quiet_since = now  # next look after another quiet spell
        where = self.launch.where(self.launch.stacks(timeout=1.0))
        if "<- behind" in where:  # printed with the launch's other lines, on a line of its own
            self.launch.notify(f"[air_magic] no rank has written anything for {self.seconds:g} s.\n{where}", "stderr")


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
