"""The kernel-side launcher: one per kernel, shared by ``@distributed`` and ``%%distributed``.

Data flow::

    kernel (this module)                    helper process (_zygote)          ranks (_rank)
    --------------------                    ------------------------          -------------
    LaunchSpec + Payload
      |  resolve against hardware
      |  payload.pkl  -> work dir (0700)
      |  ("launch", request) ------------>  bind 127.0.0.1:0, fork N -------> setsid, log file,
      |                                     host TCPStore on that socket       env/cwd/sys.path,
      |  <------------ ("started", pids)                                       run code,
      |                                     pidfd per rank <----- exit ------  result-<r>.pkl
      |  <------------ ("exit", rank, rc)   first rc != 0: stop the others     (+ /dev/shm tensors)
      |  <------------ ("done")
      |  read result-<r>.pkl in rank order -> list, or one exception naming the rank
      v
    observers (MLflow run, panel) see start and end through LaunchObserver

Rank 0's log is copied into the cell while a blocking launch waits (from the main
thread, in short slices, so an interrupt is handled at once); every rank's full log
stays in the launch's log folder.  A kernel that dies takes everything with it: the
helper sees EOF on its control socket, each rank sees EOF on a pipe whose only write
end is in the kernel.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, Protocol

from . import _results
from ._rank import STACK_SIGNAL, TRACEBACK_MARK, joined_path, stack_path
from .accelerators import detect_hardware
from .capture import Payload
from .errors import (
    LaunchCancelledError,
    LaunchError,
    LaunchTimeoutError,
    RankCrashedError,
    RankFailedError,
    RankTraceback,
    ResultError,
    attach_rank_rendering,
)
from .hints import hints_for
from .spec import LaunchSpec, Placement

__all__ = ["Launcher", "Launch", "LaunchObserver", "get_launcher", "describe_exit"]

#: Bytes of rank 0's output copied into the cell per launch; past it the cell says so.
OUTPUT_LIMIT = int(os.environ.get("AIR_MAGIC_OUTPUT_LIMIT", str(1 << 20)))
#: Seconds without a line from any rank after which the ranks' stacks are looked at, and
#: a rank that the others wait for in a collective is named (0: never).
STALL_SECONDS = float(os.environ.get("AIR_MAGIC_STALL_SECONDS", "300"))
#: Bytes of each rank's log kept once a launch has ended (its beginning and its end).
LOG_LIMIT = int(os.environ.get("AIR_MAGIC_LOG_LIMIT", str(16 << 20)))
_POLL = 0.05


class LaunchObserver(Protocol):
    """What optional pieces (MLflow tracking, the panel) see of a launch."""

    def before_start(self, launch: "Launch", env: dict[str, str]) -> None:
        """Called before the ranks start; may add environment variables for them."""

    def after_end(self, launch: "Launch") -> None:
        """Called once every rank has ended and the outcome is known (an observer may also
        have ``before_end(launch)``, called for every observer before the first
        ``after_end``: to read what another observer's ``after_end`` cleans up)."""


ObserverFactory = Callable[["Launch"], "LaunchObserver | None"]


@dataclass
class RankState:
    rank: int
    log_path: str
    pid: int | None = None
    returncode: int | None = None
    ended_at: float | None = None  # time.monotonic() when the helper saw it exit
    stopped: bool = False  # ended by air_magic's stop signal (another rank failed, cancel, timeout)
    left: bool = False  # exited with code 0 but returned nothing (os._exit(0)): a failure
    returned_early: bool = False  # returned while the others wait for it in init_process_group()

    @property
    def state(self) -> str:
        if self.returncode is None:
            return "starting" if self.pid is None else "running"
        if self.returncode == 0 and not self.left:
            return "finished"
        return "stopped" if self.stopped else "failed"


_SIGNAL_NOTES = {
    signal.SIGKILL: "possibly out of memory (the kernel's OOM killer sends SIGKILL)",
    signal.SIGSEGV: "a segmentation fault in native code (an extension, a driver, or a bad tensor access)",
    signal.SIGABRT: "aborted by native code (a failed assertion in a C++ library, or a CUDA/NCCL error)",
    signal.SIGBUS: (
        "a bus error: most often /dev/shm is full (DataLoader workers share batches through "
        "it; Docker gives containers 64 MB unless run with --shm-size=8g or --ipc=host)"
    ),
    signal.SIGTERM: "terminated by SIGTERM",
    signal.SIGINT: "interrupted by SIGINT",
}


def describe_exit(returncode: int) -> str:
    """``-9`` -> ``'was killed by SIGKILL (exit -9), possibly out of memory ...'``."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"was killed by signal {-returncode} (exit {returncode})"
        note = _SIGNAL_NOTES.get(sig)
        return f"was killed by {sig.name} (exit {returncode})" + (f": {note}" if note else "")
    if returncode == 0:
        return (
            "exited (code 0) without returning: something ended the process early "
            "(os._exit(0), or a library that exits), so the other ranks would have waited for it"
        )
    return f"exited with code {returncode} without reporting an exception (os._exit() or a crash in native code)"


def _bound_log(path: str, limit: int) -> None:
    """Cut the middle out of a log longer than ``limit``: its first sixteenth and its end
    stay, with a line saying how much is gone (a rank that printed 1 GB leaves 16 MB)."""
    try:
        size = os.path.getsize(path)
        if size <= limit:
            return
        head_size = limit // 16
        tail_size = limit - head_size
        with open(path, "rb") as handle:
            head = handle.read(head_size)
            handle.seek(size - tail_size)
            tail = handle.read()
        cut = size - head_size - tail_size
        mark = (
            f"\n[air_magic] {cut} bytes of this rank's output were cut here: its log keeps the first "
            f"{_size(head_size)} and the last {_size(tail_size)} (AIR_MAGIC_LOG_LIMIT).\n"
        ).encode()
        tmp = f"{path}.bounded"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(head + mark + tail)
        os.replace(tmp, path)
    except OSError:
        pass


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


#: Frames of these files are torch's collectives and rendezvous: a rank in one waits for the others.
_COLLECTIVE_FILES = (
    "torch/distributed/distributed_c10d.py",
    "torch/distributed/rendezvous.py",
    "torch/distributed/c10d_logger.py",
)
_FRAME = re.compile(r'^\s*(?:File "(?P<file>[^"]+)"|(?P<cell>Cell In\[\d+\])), line (?P<line>\d+) in (?P<func>\S+)')


def describe_stacks(stacks: dict[int, str], world_size: int) -> str:
    """``[air_magic] where each rank was:`` and a line per rank; ``''`` with no stacks.

    From each rank's main thread (the one running the launched code): its innermost
    frame of the user's code, and the torch collective it waits in, if any.  When some
    ranks wait in a collective and others do not, those others are behind: named.
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
        where[rank] = (at, collective)
    waiting = sorted(r for r, (_, c) in where.items() if c)
    lines = ["[air_magic] where each rank was:"]
    for rank, (at, collective) in sorted(where.items()):
        line = f"  rank {rank}: " + (
            f"in {collective} (torch.distributed), called at {at}" if collective else f"at {at}"
        )
        if not collective and waiting:
            who = ", ".join(map(str, waiting))
            line += (
                f"  <- behind: rank{'s' if len(waiting) > 1 else ''} {who} wait{'' if len(waiting) > 1 else 's'} for it"
            )
        lines.append(line)
    missing = [r for r in range(world_size) if r not in where]
    if missing:
        lines.append(f"  rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}: had ended")
    return "\n".join(lines)


def _main_thread_frames(text: str) -> list[dict[str, str]]:
    """The frames, most recent first, of the thread that runs the launched code."""
    threads: list[list[dict[str, str]]] = [[]]
    for line in text.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            threads.append([])
            continue
        match = _FRAME.match(line)
        if match:
            frame = match.groupdict()
            frame["file"] = frame["file"] or frame["cell"]
            threads[-1].append(frame)
    threads = [t for t in threads if t]
    for frames in threads:
        if any(f["file"].endswith("air_magic/_rank.py") and f["func"] == "_run" for f in frames):
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
        or "/air_magic/" in parts
        and os.path.dirname(filename) == _PACKAGE_DIR
    )


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _size(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 16384))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class _StallWatch:
    """Names a straggler: when no rank has written a line for ``seconds``, look at every
    rank's stack; if some wait in a collective and others do not, say where each one is
    (once per quiet spell).  Silence alone is not a stall: a long step prints nothing."""

    def __init__(self, launch: "Launch", seconds: float) -> None:
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
        sizes = [_file_size(state.log_path) for state in self.launch.ranks]
        if sizes != self.sizes:
            self.sizes, self.quiet_since = sizes, now
            return
        if now - self.quiet_since < self.seconds:
            return
        self.quiet_since = now  # next look after another quiet spell
        where = self.launch.where(self.launch.stacks(timeout=1.0))
        if "<- behind" in where:
            sys.stderr.write(f"[air_magic] no rank has written anything for {self.seconds:g} s.\n{where}\n")
            sys.stderr.flush()


class _OutputPump:
    """Copies new output of one rank's log into ``sys.stdout``, up to a limit.

    Whole lines only (a carriage return ends a line too, for progress bars), so the
    failure marker is always seen whole; the traceback after it is shown as the
    cell's error instead.
    """

    def __init__(self, path: str, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.offset = 0
        self.shown = 0
        self.stopped = False

    def pump(self, final: bool = False) -> None:
        if self.stopped:
            return
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read(1 << 20)
        except FileNotFoundError:
            return
        if not final:
            end = max(data.rfind(b"\n"), data.rfind(b"\r"))
            data = data[: end + 1]
        if not data:
            return
        self.offset += len(data)
        mark = data.find(_MARK)
        if mark >= 0:
            data = data[:mark]
            self.stopped = True
        room = self.limit - self.shown
        if len(data) > room:
            cut = data[:room]
            if b"\n" in cut:
                cut = cut[: cut.rfind(b"\n") + 1]
            self._write(cut)
            self.stopped = True
            sys.stdout.write(
                f"\n[air_magic] rank 0 printed more than {self.limit // 1024} KiB; the rest is not "
                f"shown here. Full log: {self.path}\n"
            )
            sys.stdout.flush()
            return
        self._write(data)

    def _write(self, data: bytes) -> None:
        if not data:
            return
        self.shown += len(data)
        sys.stdout.write(data.decode("utf-8", "replace"))
        sys.stdout.flush()


_MARK = TRACEBACK_MARK.encode()


class Launch:
    """One launch of a function or cell on N ranks, running in the background.

    ``result()`` waits for it (``.distributed()`` does exactly that), ``cancel()``
    stops it, ``done()`` and ``status`` tell where it is.
    """

    def __init__(self, launcher: "Launcher", spec: LaunchSpec, placement: Placement, payload: Payload) -> None:
        self.launcher = launcher
        self.spec = spec
        self.placement = placement
        self.label = payload.label
        self.kind = payload.kind
        self.id = f"{next(launcher._counter):04d}-{uuid.uuid4().hex[:8]}"
        self.work_dir = os.path.join(launcher.session_dir, self.id)
        self.log_dir = os.path.join(self.work_dir, "logs")
        self.shm_dir = os.path.join(launcher.shm_root, self.id) if launcher.shm_root else None
        self.world_size = placement.world_size
        self.ranks = [RankState(r, os.path.join(self.log_dir, f"rank-{r}.log")) for r in range(self.world_size)]
        self.run_id: str | None = None
        self.run_url: str | None = None
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.status = "starting"
        # Only the cell/function sources stay (for the panel's linter): the pickled
        # arguments and globals are not pinned in the kernel by `last_launch`.
        self.sources = payload.sources
        self._stop_reason: str | None = None
        self._failures: list[int] = []
        self._stop_at: float | None = None  # time.monotonic() when the helper began to stop it
        self._records: dict[int, tuple[Any, ...] | None] = {}  # error records read so far
        self._helper: Any = None  # the helper process its ranks are forked from
        self._cancel_requested = False
        self._done = threading.Event()
        self._outcome: tuple[bool, Any] | None = None
        self._error_text: str | None = None
        self.observers: list[LaunchObserver] = []
        self._notices: collections.deque[tuple[str, str]] = collections.deque()
        #: Where the time of the launch went, for ``benchmarks/launch`` and the curious:
        #: ``time.monotonic()`` (one clock for every process of the machine) at ``call``,
        #: ``sent`` (the helper has the request), ``started`` (its ranks are forked),
        #: ``done`` (every rank has ended), ``outcome`` (the values are read) and
        #: ``returned``; and seconds spent in each observer's hooks (``tracking.before_start``...).
        self.timings: dict[str, float] = {"call": time.monotonic()}
        self._waiter = False  # a blocking wait (the cell) prints the notices; else the launcher

    # -- public handle ----------------------------------------------------------------------

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def log_paths(self) -> list[str]:
        return [r.log_path for r in self.ranks]

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the launch; the per-rank return values in rank order, or raise its error."""
        wait = None if timeout is None else min(max(0.0, timeout), threading.TIMEOUT_MAX)
        if not self._done.wait(wait):
            raise TimeoutError(f"launch {self.id} is still running after {timeout} s")
        assert self._outcome is not None
        ok, value = self._outcome
        if ok and value is None:
            raise LaunchError(
                f"the values of launch {self.id} were returned by the .distributed() call that ran "
                "it and are not kept; use .submit(...).result() to keep a handle with its values."
            )
        if ok:
            return list(value)
        raise value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The launch's error once it has ended, None if it succeeded (as a future's
        ``exception()``); ``TimeoutError`` if it is still running after ``timeout`` s."""
        wait = None if timeout is None else min(max(0.0, timeout), threading.TIMEOUT_MAX)
        if self._outcome is None and not self._done.wait(wait) or self._outcome is None:
            raise TimeoutError(f"launch {self.id} is still running after {timeout} s")
        ok, value = self._outcome
        return None if ok else value  # type: ignore[no-any-return]

    def notify(self, line: str, stream: str = "stdout") -> None:
        """A line for the cell from a background thread (an observer's): printed by the
        thread that waits for the launch, so that threads of air_magic never write to the
        kernel's streams themselves."""
        self._notices.append((line, stream))

    def _print_notices(self) -> None:
        while self._notices:
            line, stream = self._notices.popleft()
            out = sys.stdout if stream == "stdout" else sys.stderr
            out.write(line + "\n")
            out.flush()

    @property
    def waiting_for(self) -> str:
        """What a launch that has not started its ranks yet waits for ('' once they run)."""
        if self.status != "starting":
            return ""
        helper = self._helper
        if helper is not None and not helper.ready.is_set():
            return "waiting for the helper process to import torch"
        return f"forking {self.world_size} rank{'s' * (self.world_size != 1)}"

    def cancel(self) -> bool:
        """Stop every rank (SIGINT, then SIGTERM, then SIGKILL). False if it had already ended."""
        if self._done.is_set():
            return False
        self._cancel_requested = True
        self.launcher._send(("stop", self.id, "cancel"))
        return True

    def stacks(self, timeout: float = 2.0) -> dict[int, str]:
        """Every running rank's Python stacks, all threads, by rank (cell names as in the
        notebook).  The ranks write them from a signal handler, so this works while they
        are blocked in a collective or in native code.

        >>> print(handle.stacks()[1])     # doctest: +SKIP
        """
        running = {state.rank: state.pid for state in self.ranks if state.pid and state.returncode is None}
        for rank, pid in running.items():
            try:
                os.truncate(stack_path(self.work_dir, rank), 0)
                os.kill(pid, STACK_SIGNAL)
            except OSError:  # ended meanwhile, or not yet listening
                pass
        deadline = time.monotonic() + timeout
        sizes: dict[int, int] = {}
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = {rank: _file_size(stack_path(self.work_dir, rank)) for rank in running}
            if all(now[r] > 0 and now[r] == sizes.get(r) for r in running):
                break
            sizes = now
        return self._read_stacks(running)

    def where(self, stacks: dict[int, str]) -> str:
        """One line per rank: where it was, and which rank the others wait for."""
        return describe_stacks(stacks, self.world_size)

    def _read_stacks(self, ranks: Any = None) -> dict[int, str]:
        found = {}
        for rank in ranks if ranks is not None else range(self.world_size):
            try:
                with open(stack_path(self.work_dir, rank), encoding="utf-8", errors="replace") as handle:
                    text = handle.read()
            except OSError:
                continue
            if text.strip():
                for filename, (display, _) in self.sources.items():
                    text = text.replace(f'File "{filename}"', display)
                found[rank] = text
        return found

    def __repr__(self) -> str:
        took = (self.ended_at or time.time()) - self.started_at
        where = f"{self.world_size} {'GPU' if self.placement.device == 'cuda' else 'CPU'} rank{'s' * (self.world_size != 1)}"
        run = f", MLflow run {self.run_id}" if self.run_id else ""
        return f"<Launch {self.id} {self.label}: {self.status} after {took:.1f} s on {where}{run}>"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """In a notebook a launch shows as its live panel (a summary once it has ended)."""
        from .panel import launch_mimebundle

        return launch_mimebundle(self)

    # -- blocking wait, from the main thread ------------------------------------------------

    def wait_streaming(self) -> list[Any]:
        """Wait in short slices, copying rank 0's output into the cell; Ctrl-C stops the ranks."""
        pump = _OutputPump(self.ranks[0].log_path, OUTPUT_LIMIT)
        stall = _StallWatch(self, STALL_SECONDS)
        self._waiter = True
        try:
            while not self._done.wait(_POLL):
                self._print_notices()
                pump.pump()
                stall.check()
        except KeyboardInterrupt:
            where = self.where(self.stacks(timeout=1.0))
            self.cancel()
            if where:
                sys.stderr.write(where + "\n")
                sys.stderr.flush()
            try:
                while not self._done.wait(_POLL):
                    pump.pump()
            except KeyboardInterrupt:  # a second interrupt: no more grace
                self.launcher._send(("stop", self.id, "kill"))
                self._kill_now()
                self._done.wait(10)
            pump.pump(final=True)
            self._print_notices()
            raise KeyboardInterrupt(
                f"the launch of {self.label} was interrupted; {_stopped(self.world_size)}"
            ) from None
        pump.pump(final=True)
        self._print_notices()
        values = self.result()
        # The caller owns the values now; the handle (kept as .last_launch) must not pin
        # hundreds of MB of returned tensors in the kernel.
        self._outcome = (True, None)
        self.timings["returned"] = time.monotonic()
        return values

    # -- events from the helper (reader thread) ---------------------------------------------

    def _on_started(self, pids: dict[int, int]) -> None:
        self.timings["started"] = time.monotonic()
        for rank, pid in pids.items():
            self.ranks[rank].pid = pid
        if self.status == "starting":
            self.status = "running"

    def _on_exit(self, rank: int, returncode: int, at: float | None = None) -> None:
        state = self.ranks[rank]
        state.returncode = returncode
        state.ended_at = at
        # A stop signal after the stop began: air_magic ended it, not its own failure.
        state.stopped = returncode in _STOP_EXITS and self._stop_at is not None and (at is None or at >= self._stop_at)
        # Exit code 0 without a result (os._exit(0)): its peers would wait for it in
        # init_process_group or a collective until the timeout. A failure: stop them now.
        state.left = returncode == 0 and not os.path.exists(_results.result_path(self.work_dir, rank))
        if returncode == 0 and not state.left and self._left_before_the_rendezvous(rank):
            state.left = state.returned_early = True
        if (returncode != 0 or state.left) and self._stop_reason is None:
            self._failures.append(rank)
            if state.left and self.world_size > 1:
                self.launcher._send(("stop", self.id, "failure"))

    def _left_before_the_rendezvous(self, rank: int) -> bool:
        """``rank`` returned without entering init_process_group(): mark it for ranks that
        enter later (they fail at once), and say whether ranks already wait in it."""
        if os.path.exists(joined_path(self.work_dir, rank)):
            return False
        try:
            os.close(os.open(os.path.join(self.work_dir, f"left-{rank}"), os.O_WRONLY | os.O_CREAT, 0o600))
            waiting = [
                r
                for r in range(self.world_size)
                if r != rank and self.ranks[r].returncode is None and os.path.exists(joined_path(self.work_dir, r))
            ]
        except OSError:
            return False
        return bool(waiting)

    def _on_stopping(self, reason: str, at: float | None = None) -> None:
        self._stop_reason = self._stop_reason or reason
        if self._stop_at is None:
            self._stop_at = at if at is not None else time.monotonic()
        self.status = "stopping"

    def _on_error(self, text: str) -> None:
        self._error_text = text

    def _on_done(self) -> None:
        self.timings["done"] = time.monotonic()
        try:
            outcome = self._build_outcome()
        except BaseException as exc:  # never leave a waiter hanging
            outcome = (False, exc)
        self.timings["outcome"] = time.monotonic()
        for state in self.ranks:  # before the observers: MLflow keeps the bounded log too
            _bound_log(state.log_path, LOG_LIMIT)
        try:
            from ._teardown import check

            held = check(self)
        except Exception:  # pragma: no cover - a check must never hide the outcome
            held = None
        if held:
            sys.stderr.write(held + "\n")
            if not outcome[0] and isinstance(outcome[1], BaseException):
                outcome[1].add_note(held)
        self._outcome = outcome
        self.ended_at = time.time()
        for observer in self.observers:
            before_end = getattr(observer, "before_end", None)
            if before_end is not None:
                try:
                    with self._timed(observer, "before_end"):
                        before_end(self)
                except Exception as exc:  # as after_end: never hides the outcome
                    sys.stderr.write(f"[air_magic] {type(observer).__name__} failed at the end: {exc}\n")
        for observer in self.observers:
            try:
                with self._timed(observer, "after_end"):
                    observer.after_end(self)
            except Exception as exc:  # an observer must never hide the launch's outcome
                sys.stderr.write(f"[air_magic] {type(observer).__name__} failed at the end: {exc}\n")
        self._cleanup_files()
        if not self._waiter:  # a submitted launch: nobody else prints them
            self._print_notices()
        self._done.set()

    @contextlib.contextmanager
    def _timed(self, observer: Any, hook: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            name = getattr(observer, "timing_name", type(observer).__name__)
            self.timings[f"{name}.{hook}"] = time.perf_counter() - began

    def _kill_now(self) -> None:
        for state in self.ranks:
            if state.pid and state.returncode is None:
                try:
                    os.killpg(state.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _helper_died(self, returncode: int | None) -> None:
        self._kill_now()
        self._error_text = (
            f"the air_magic helper process died (exit {returncode}); the ranks were stopped. "
            "The next launch starts a new helper."
        )
        self._on_done()

    # -- outcome ------------------------------------------------------------------------------

    def _build_outcome(self) -> tuple[bool, Any]:
        n = self.world_size
        if self._error_text is not None:
            self.status = "failed"
            return False, LaunchError(f"could not run {self.label}: {self._error_text}")
        if self._stop_reason == "timeout":
            self.status = "timed out"
            timeout = self.spec.timeout
            error = LaunchTimeoutError(
                f"{self.label} ran past its timeout of {timeout:g} s; {_stopped(n, 'all')}. "
                "Pass a larger timeout (seconds) or "
                "timeout=None for no limit (%%distributed --timeout SECONDS|none)."
            )
            where = self.where(self._read_stacks())
            if where:
                error.add_note(where)
            return False, error
        if self._stop_reason in ("cancel", "kill") or (self._cancel_requested and not self._failures):
            self.status = "cancelled"
            return False, LaunchCancelledError(f"the launch of {self.label} was cancelled; {_stopped(n)}.")
        if self._failures:
            self.status = "failed"
            return False, self._rank_error(self._root_failure())
        values = []
        for state in self.ranks:
            try:
                record = _results.read_record(_results.result_path(self.work_dir, state.rank))
            except FileNotFoundError:
                self.status = "failed"
                return False, RankCrashedError(
                    f"rank {state.rank} of {n} exited (code {state.returncode}) without returning a "
                    "result: something in the code ended the process early (os._exit). "
                    f"Its log: {state.log_path}",
                    rank=state.rank,
                    world_size=n,
                    returncode=state.returncode or 0,
                    log_path=state.log_path,
                )
            except Exception as exc:  # pickled on the rank, but cannot be loaded here
                return False, self._result_error(
                    state.rank, f"a value that cannot be loaded in the kernel ({type(exc).__name__}: {exc})"
                )
            if record[0] == "unpicklable":
                return False, self._result_error(
                    state.rank, f"a {record[1]}, which cannot be sent back to the kernel ({record[2]})"
                )
            values.append(record[1])
        self.status = "finished"
        return True, values

    def _result_error(self, rank: int, what: str) -> ResultError:
        self.status = "failed"
        error = ResultError(
            f"rank {rank} of {self.world_size} returned {what}. Return plain data instead (numbers, "
            "lists, tensors, a state_dict()), or save it to a file on the rank."
        )
        error.rank, error.world_size = rank, self.world_size
        return error

    def _failed_at(self, rank: int) -> float:
        """When ``rank`` failed: the moment its exception was caught, else its exit
        (``time.monotonic()`` is one clock for every process of the machine)."""
        record = self._error_record(rank)
        if record is not None and len(record) > 5:
            return float(record[5])
        ended = self.ranks[rank].ended_at
        return ended if ended is not None else float("inf")

    def _ending(self, rank: int) -> str:
        """How ``rank`` ended: ``finished``, ``stopped`` (by air_magic, after the stop
        began) or ``failed`` (on its own)."""
        state = self.ranks[rank]
        if state.returncode == 0 and not state.left:
            return "finished"
        return "stopped" if state.stopped and self._error_record(rank) is None else "failed"

    def _root_failure(self) -> int:
        """The first rank to fail, by when it failed.  A failure that only echoes another
        one ("connection closed by peer" inside a collective) is never the cause while a
        rank failed otherwise."""
        failed = [r for r in range(self.world_size) if self._ending(r) == "failed"]
        if not failed:  # pragma: no cover - only called after a failure was seen
            return self._failures[0]
        causes = [r for r in failed if not self._is_echo_failure(r)]
        return min(causes or failed, key=lambda r: (self._failed_at(r), r))

    def _is_echo_failure(self, rank: int) -> bool:
        record = self._error_record(rank)
        return record is not None and _is_echo(record[2], record[3])

    def _others_ended(self, root: int) -> str:
        """``'rank 0 finished; ranks 2, 3 were stopped; rank 1 failed too (...)'``."""
        groups: dict[str, list[int]] = {}
        for rank in range(self.world_size):
            if rank == root:
                continue
            ending = self._ending(rank)
            if ending == "failed":
                ending = f"failed too ({self._short_failure(rank)})"
            groups.setdefault(ending, []).append(rank)
        parts = []
        for ending, ranks in groups.items():
            many = len(ranks) != 1
            who = f"{'ranks' if many else 'rank'} {', '.join(map(str, ranks))}"
            if ending == "stopped":
                parts.append(f"{who} {'were' if many else 'was'} stopped by air_magic")
            else:
                parts.append(f"{who} {ending}")
        return "; ".join(parts)

    def _short_failure(self, rank: int) -> str:
        record = self._error_record(rank)
        if record is not None:
            first = (str(record[3]).strip().splitlines() or [""])[0]
            first = _SOURCE_PREFIX.sub("", first)  # gloo's "[.../pair.cc:553] Connection closed..."
            first = first if len(first) <= 80 else first[:77] + "..."
            return f"{record[2]}: {first}" if first else str(record[2])
        code = self.ranks[rank].returncode or 0
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def _error_record(self, rank: int) -> tuple[Any, ...] | None:
        if rank in self._records:
            return self._records[rank]
        try:
            record = _results.read_record(_results.result_path(self.work_dir, rank))
        except Exception:  # missing, cut short by a kill, or unreadable: no record
            record = None
        found = record if record is not None and record[0] == "error" else None
        self._records[rank] = found
        return found

    def _rank_error(self, rank: int) -> BaseException:
        n = self.world_size
        state = self.ranks[rank]
        others = self._others_ended(rank)
        first = ", the first to fail," if any(self._ending(r) == "failed" for r in range(n) if r != rank) else ""
        stopped = f"; {others}" if others else ""
        record = self._error_record(rank)
        log_text = _tail(state.log_path, 200)
        if record is None:
            tail = _tail(state.log_path)
            how = describe_exit(state.returncode or 0)
            if state.returned_early:
                how = (
                    "returned without joining the process group that the other ranks wait for it in "
                    "(every rank must call init_process_group())"
                )
            message = f"rank {rank} of {n}{first} {how}{stopped}."
            if tail:
                message += f"\nIts last lines ({state.log_path}):\n{tail}"
            error: BaseException = RankCrashedError(
                message, rank=rank, world_size=n, returncode=state.returncode or 0, log_path=state.log_path
            )
            for hint in hints_for(log_text, device=self.placement.device):
                error.add_note(hint)
            return error
        blob, type_name, text, traceback_text = record[1:5]
        hints = hints_for(traceback_text + "\n" + log_text, device=self.placement.device)
        rebuilt: BaseException | None = None
        if blob is not None:
            try:
                import cloudpickle

                rebuilt = cloudpickle.loads(blob)
            except Exception:
                rebuilt = None
        note = f"[air_magic] raised on rank {rank} of {n}{first.rstrip(',')}{stopped}. Full log: {state.log_path}"
        if isinstance(rebuilt, BaseException) and not isinstance(rebuilt, (KeyboardInterrupt, SystemExit)):
            rebuilt.__cause__ = RankTraceback(traceback_text)
            rebuilt.__suppress_context__ = True
            rebuilt.__traceback__ = None
            rebuilt.__notes__ = [note, *hints]  # replaces notes the rank added (they are in the traceback)
            return attach_rank_rendering(rebuilt)
        error = RankFailedError(
            f"rank {rank} of {n}{first} raised {type_name}: {text}{stopped}.",
            rank=rank,
            world_size=n,
            exc_type=type_name,
            exc_message=text,
            traceback_text=traceback_text,
            log_path=state.log_path,
        )
        for hint in hints:
            error.add_note(hint)
        return error

    def _cleanup_files(self) -> None:
        for name in os.listdir(self.work_dir) if os.path.isdir(self.work_dir) else ():
            if name != "logs":
                path = os.path.join(self.work_dir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
        if self.shm_dir:
            shutil.rmtree(self.shm_dir, ignore_errors=True)


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*")
#: Exit codes of a rank that air_magic's own stop ended (SIGINT, SIGTERM, SIGKILL).
_STOP_EXITS = (-signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL)

_ECHO_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistNetworkError",
    "DistBackendError",
    "NCCL communicator was aborted",
)


def _is_echo(type_name: str, message: str) -> bool:
    return any(marker in type_name or marker in message for marker in _ECHO_MARKERS)


class _Helper:
    """The running helper process and the reader thread of its control channel."""

    def __init__(self, launcher: "Launcher") -> None:
        parent_sock, child_sock = socket.socketpair()
        alive_r, self.alive_w = os.pipe()  # both ends non-inheritable; passed explicitly below
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
        env.pop("MPLBACKEND", None)
        log = open(os.path.join(launcher.session_dir, "helper.log"), "ab")
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "air_magic._zygote",
                    str(child_sock.fileno()),
                    str(alive_r),
                    launcher.session_dir,
                    launcher.shm_root or "",
                ],
                pass_fds=(child_sock.fileno(), alive_r),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=launcher.session_dir,
            )
        finally:
            log.close()
            child_sock.close()
            os.close(alive_r)
        self.conn = Connection(parent_sock.detach())
        self.send_lock = threading.Lock()
        self.ready = threading.Event()  # its preload (torch) is done
        self.alive = True
        self.launcher = launcher
        self.thread = threading.Thread(target=self._read, name="air_magic-helper-reader", daemon=True)
        self.thread.start()

    def send(self, message: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            try:
                self.launcher._dispatch(self, message)
            except Exception as exc:  # pragma: no cover - a bug must not kill the reader
                sys.stderr.write(f"[air_magic] internal error handling {message[0]!r}: {exc}\n")
        self.alive = False
        self.launcher._helper_gone(self)

    def close(self, wait: float = 3.0) -> None:
        # EOF on the alive pipe first: a helper still importing torch leaves at once,
        # and ranks take themselves down even before the helper's own shutdown.
        try:
            os.close(self.alive_w)
        except OSError:
            pass
        if self.alive:
            try:
                self.send(("shutdown",))
            except OSError:
                pass
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            self.conn.close()
        except OSError:
            pass
        if threading.current_thread() is not self.thread:
            self.thread.join(2)


class Launcher:
    """Owns the helper process, the session's private folders and every launch of this kernel."""

    _observer_factories: list[ObserverFactory] = []

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._helper: _Helper | None = None
        self._counter = itertools.count(1)
        self.launches: dict[str, Launch] = {}
        self.session_dir = tempfile.mkdtemp(prefix=f"air_magic-{os.getpid()}-")
        self.shm_root: str | None = None
        shm = os.environ.get("AIR_MAGIC_SHM_DIR", "/dev/shm")  # where large result tensors travel
        if os.path.isdir(shm) and os.access(shm, os.W_OK):
            self.shm_root = tempfile.mkdtemp(prefix=f"air_magic-{os.getpid()}-", dir=shm)
        self._closed = False
        atexit.register(self.shutdown)

    def is_active(self, launch: Launch) -> bool:
        """Whether ``launch`` is one of this launcher's, not yet ended or given up."""
        return self.launches.get(launch.id) is launch

    @classmethod
    def add_observer(cls, factory: ObserverFactory) -> None:
        """Register ``factory(launch) -> observer | None``, called for every launch."""
        if factory not in cls._observer_factories:
            cls._observer_factories.append(factory)

    def warm(self) -> None:
        """Start the helper now (it imports torch in the background) so launches start fast.

        ``AIR_MAGIC_WARM=0`` leaves it to the first launch (tests of code that never launches).
        """
        if os.environ.get("AIR_MAGIC_WARM", "1") != "0":
            self._ensure_helper()

    def _ensure_helper(self) -> _Helper:
        with self._lock:
            if self._closed:
                raise LaunchError("the launcher was shut down; restart the kernel to launch again")
            if self._helper is None or not self._helper.alive:
                self._helper = _Helper(self)
            return self._helper

    def _send(self, message: tuple[Any, ...]) -> None:
        helper = self._helper
        if helper is not None and helper.alive:
            try:
                helper.send(message)
            except OSError:
                pass

    def start(self, spec: LaunchSpec, payload: Payload) -> Launch:
        """Start ``payload`` on the ranks ``spec`` asks for; returns at once."""
        called = time.monotonic()
        placement = spec.resolve(detect_hardware())
        cwd = _working_directory()
        self._ensure_session_folders()
        helper = self._ensure_helper()
        launch = Launch(self, spec, placement, payload)
        launch.timings["call"] = called
        launch._helper = helper  # before the observers: the panel says what the launch waits for
        try:
            request = self._prepare(launch, payload, cwd)
            with self._lock:
                self.launches[launch.id] = launch
            try:
                helper.send(("launch", request))
            except OSError:
                # The helper went away just now (SIGTERM, a crash) and its reader has not seen
                # it yet: the launch goes to a new one.
                helper = self._replace_helper(helper)
                launch._helper = helper
                helper.send(("launch", request))
            launch.timings["sent"] = time.monotonic()
        except BaseException as exc:  # an interrupt too: nothing of a launch that never started stays
            with self._lock:
                self.launches.pop(launch.id, None)
            launch.status = "cancelled" if isinstance(exc, KeyboardInterrupt) else "failed"
            launch.ended_at = time.time()
            for observer in launch.observers:
                try:
                    observer.after_end(launch)
                except Exception:
                    pass
            shutil.rmtree(launch.work_dir, ignore_errors=True)
            if launch.shm_dir:
                shutil.rmtree(launch.shm_dir, ignore_errors=True)
            if isinstance(exc, OSError):
                raise LaunchError(f"could not reach the air_magic helper process: {exc}. Try again.") from exc
            raise
        return launch

    def _prepare(self, launch: Launch, payload: Payload, cwd: str) -> dict[str, Any]:
        """The launch's private folders, its payload file and observers; the helper's request."""
        os.mkdir(launch.work_dir, mode=0o700)  # makedirs' mode applies to the leaf only
        os.mkdir(launch.log_dir, mode=0o700)
        if launch.shm_dir:
            os.makedirs(launch.shm_dir, mode=0o700)
        payload_path = os.path.join(launch.work_dir, "payload.pkl")
        fd = os.open(payload_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload.dumps())
        env = self._rank_environment(launch)
        for factory in self._observer_factories:
            try:
                observer = factory(launch)
                if observer is not None:
                    with launch._timed(observer, "before_start"):
                        observer.before_start(launch, env)
                    launch.observers.append(observer)
            except Exception as exc:  # optional pieces never stop a launch
                print(
                    f"[air_magic] {getattr(factory, '__name__', 'observer')} is off for this launch: "
                    f"{type(exc).__name__}: {exc}",
                    file=sys.stderr,
                )
        if not launch.spec.tracking:
            print("[air_magic] tracking is off: no MLflow run; mlflow calls in the ranks do nothing.")
        return {
            "launch_id": launch.id,
            "world_size": launch.world_size,
            "env": env,
            "cwd": cwd,
            "sys_path": [p if p else cwd for p in sys.path],
            "payload_path": payload_path,
            "work_dir": launch.work_dir,
            "shm_dir": launch.shm_dir,
            "log_paths": launch.log_paths,
            "timeout": launch.spec.timeout,
            "sources": payload.sources,
            "argv": payload.argv,
            "umask": _current_umask(),
            "rlimits": _soft_limits(),
        }

    def _ensure_session_folders(self) -> None:
        """The session's private folders, made again if something deleted them (a temp
        cleaner; a helper stopped with SIGTERM removes them on its way out)."""
        with self._lock:
            for path in (self.session_dir, self.shm_root):
                if path and not os.path.isdir(path):
                    os.makedirs(path, mode=0o700, exist_ok=True)

    def _rank_environment(self, launch: Launch) -> dict[str, str]:
        env = dict(os.environ)
        # The kernel's inline plotting backend means nothing in a rank.
        if env.get("MPLBACKEND", "").startswith("module://"):
            env["MPLBACKEND"] = "Agg"
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if launch.world_size > 1:  # torchrun's rule: one thread per rank unless set
            env.setdefault("OMP_NUM_THREADS", "1")
        env["AIR_MAGIC_LAUNCH_ID"] = launch.id
        if launch.placement.device == "cpu":
            # DeepSpeed reads DS_ACCELERATOR (else it looks for a GPU); ACCELERATE_USE_CPU
            # is what `accelerate launch --cpu` sets: without it the Hugging Face Trainer
            # runs every CPU rank on its own instead of joining them with gloo.
            env.setdefault("DS_ACCELERATOR", "cpu")
            env.setdefault("ACCELERATE_USE_CPU", "true")
            if launch.placement.hardware.gpu_count:
                env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks asked for on a GPU machine
        return env

    # -- messages from the helper (reader thread) ----------------------------------------------

    def _dispatch(self, helper: _Helper, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            helper.ready.set()
            return
        launch = self.launches.get(message[1])
        if launch is None:
            return
        if kind == "started":
            launch._on_started(message[2])
        elif kind == "exit":
            launch._on_exit(message[2], message[3], message[4])
        elif kind == "stopping":
            launch._on_stopping(message[2], message[3])
        elif kind == "error":
            launch._on_error(message[2])
            self._finish(launch)
        elif kind == "done":
            self._finish(launch)

    def _finish(self, launch: Launch) -> None:
        with self._lock:
            self.launches.pop(launch.id, None)
        launch._on_done()

    def _replace_helper(self, helper: _Helper) -> _Helper:
        with self._lock:
            helper.alive = False
            if self._helper is helper:
                self._helper = None
        return self._ensure_helper()

    def _helper_gone(self, helper: _Helper) -> None:
        returncode = helper.proc.poll()
        with self._lock:
            orphans = [launch for launch in self.launches.values() if launch._helper is helper]
            for launch in orphans:
                self.launches.pop(launch.id, None)
            if self._helper is helper:
                self._helper = None
        for launch in orphans:
            launch._helper_died(returncode)

    def shutdown(self) -> None:
        """Stop every rank and the helper; delete the session's files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.close()
        for path in (self.session_dir, self.shm_root):
            if path:
                shutil.rmtree(path, ignore_errors=True)


def _working_directory() -> str:
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise LaunchError(
            "the notebook's working directory no longer exists (it was deleted or moved), and the "
            "ranks start in it. Change to a folder that exists first, e.g. %cd ~ (or os.chdir(...))."
        ) from None


def _stopped(n: int, every: str = "its") -> str:
    """``'its 2 ranks were stopped'`` / ``'its rank was stopped'``."""
    return f"{every} {n} ranks were stopped" if n != 1 else "its rank was stopped"


def _current_umask() -> int | None:
    """The kernel's umask, read without changing it (another thread may be creating files)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def _soft_limits() -> dict[str, int]:
    """The kernel's soft resource limits now, by name (a rank takes them as its own)."""
    import resource

    limits = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            try:
                limits[name] = resource.getrlimit(getattr(resource, name))[0]
            except (OSError, ValueError):
                pass
    return limits


def tracking(launch: Launch) -> LaunchObserver | None:
    """MLflow tracking (imported only when a launch has tracking on)."""
    if not launch.spec.tracking:
        return None
    from .tracking import tracking_observer

    return tracking_observer(launch)


def panel(launch: Launch) -> LaunchObserver | None:
    """The live panel (ipywidgets imported only where widgets are shown)."""
    from .panel import panel_observer

    return panel_observer(launch)


Launcher.add_observer(tracking)
Launcher.add_observer(panel)

_launcher: Launcher | None = None
_launcher_lock = threading.Lock()


def get_launcher() -> Launcher:
    """The kernel's launcher (created on first use)."""
    global _launcher
    with _launcher_lock:
        if _launcher is None or _launcher._closed:
            _launcher = Launcher()
        return _launcher
