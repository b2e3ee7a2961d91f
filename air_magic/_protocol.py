"""The protocol between the kernel, the helper process and the ranks, in one place.

Imports nothing but the standard library: the kernel, the helper (``_zygote``), every
rank (``_rank``, ``_rank_tracking``) and the panel read it, and a rank pays nothing for it.

What travels, and where::

    kernel (launcher, _helper)              helper (_zygote)                 rank (_rank)
    --------------------------              ----------------                 ------------
    StartLaunch(LaunchRequest) ---------->  fork world_size ranks ------->  reads the request
    Stop(id, reason), Shutdown() -------->  signals them
           <-------------------  Ready(), Started(id, pids), Exited(id, rank, rc, at),
                                 Stopping(id, reason, at), Done(id), StartFailed(id, text)
    reads result_path(work_dir, r)  <---------------------------------------  ValueRecord /
                                                                             ErrorRecord /
                                                                             UnpicklableRecord
    tails log files and spool files <----------  rank-<r>.log, tracking-<r>.tsv (spool lines)

Messages go over a ``multiprocessing`` connection as plain tuples ``(KIND, *fields)``
(:func:`encode` / :func:`decode`): either side works with the named types, and the
wire stays what it always was.  Records are pickled into the launch's private folder.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, ClassVar, NamedTuple, Union

# -- shared constants ------------------------------------------------------------------------------

#: The signal that makes a rank write every thread's Python stack to its stack file
#: (``faulthandler``; a real-time signal no library is known to use).
STACK_SIGNAL = signal.SIGRTMAX - 3
#: The same, once a launch's time is up: the rank writes its stacks and then ends by this
#: signal (faulthandler chained to the default action), so no user code runs after the
#: limit has passed -- a C call that the signal cut short cannot return a value.
FINAL_STACK_SIGNAL = signal.SIGRTMAX - 4

#: How a backend stops a launch's ranks, by the stop's reason: (delay in seconds, signal).
STOP_ESCALATION: dict[str, list[tuple[float, signal.Signals]]] = {
    # A user's interrupt first reaches Python code as KeyboardInterrupt (finally blocks run).
    "cancel": [(0.0, signal.SIGINT), (1.0, signal.SIGTERM), (3.0, signal.SIGKILL)],
    # The other ranks are most likely blocked inside a collective: terminate them.
    "failure": [(0.0, signal.SIGTERM), (2.0, signal.SIGKILL)],
    "timeout": [(0.0, signal.SIGTERM), (2.0, signal.SIGKILL)],
    "kill": [(0.0, signal.SIGKILL)],
}


def signal_rank(pid: int, signum: int) -> None:
    """Send ``signum`` to a rank's process group (the rank and what it started), or to the
    rank alone while it has no group yet.  A rank calls ``setsid()`` first thing, and a
    stop can come before that: a peer that failed at once, on a loaded machine."""
    try:
        os.killpg(pid, signum)
        return
    except ProcessLookupError:  # no group of that id (yet; or the rank has been reaped)
        pass
    except PermissionError:
        return
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


#: Every process of a launch carries its id in this variable (set in the ranks'
#: environment and inherited by whatever they start, in a session of its own or not).
LAUNCH_ID_ENV = "AIR_MAGIC_LAUNCH_ID"


def carriers(launch_id: str) -> list[int]:
    """This user's processes (not this one) whose environment carries ``launch_id``: the
    ranks and everything they started, also what left their process group and session."""
    mark = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    uid, me, found = os.getuid(), os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/environ", "rb") as handle:
                if mark in handle.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


def end_carriers(launch_id: str, rounds: int = 5) -> list[int]:
    """SIGKILL every process that carries ``launch_id`` (see :func:`carriers`), looking
    again a few times for what one of them forked meanwhile; the pids killed."""
    killed: list[int] = []
    for _ in range(rounds):
        found = [pid for pid in carriers(launch_id) if pid not in killed]
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        killed.extend(found)
    return killed


def printable(exc: BaseException) -> str:
    """``str(exc)``, or ``<unprintable ValueError>`` when its ``__str__`` raises."""
    try:
        return str(exc)
    except BaseException:
        return f"<unprintable {type(exc).__name__}>"


#: Name the cell's last expression is stored under in the rank's namespace.
RESULT_NAME = "__air_magic_result__"
#: Line written to a rank's log before the traceback of its failure: the cell shows
#: that traceback as the error, so the live copy of the log stops here.
TRACEBACK_MARK = "[air_magic] this rank failed; its traceback follows\n"
#: In place of TRACEBACK_MARK when air_magic stopped the rank (SIGINT: a cancel, a timeout,
#: the panel's Stop, another rank's failure): the stack of where it was follows.
STOP_MARK = (
    "[air_magic] this rank was stopped by air_magic (the launch was cancelled, timed out, or "
    "another rank failed); where it was:\n"
)

# -- paths in a launch's private work folder -----------------------------------------------------


def payload_path(work_dir: str) -> str:
    """The pickled function or cell, written by the kernel, read by every rank."""
    return os.path.join(work_dir, "payload.pkl")


def log_dir(work_dir: str) -> str:
    """The folder of the ranks' logs (kept after the launch; the rest is deleted)."""
    return os.path.join(work_dir, "logs")


def log_path(logs: str, rank: int) -> str:
    """``rank``'s stdout and stderr, in the launch's log folder."""
    return os.path.join(logs, f"rank-{rank}.log")


def result_path(work_dir: str, rank: int) -> str:
    """Where ``rank`` of the launch with this work folder leaves its record."""
    return os.path.join(work_dir, f"result-{rank}.pkl")


def stack_path(work_dir: str, rank: int) -> str:
    """Where ``rank`` writes its threads' stacks when it gets ``STACK_SIGNAL``."""
    return os.path.join(work_dir, f"stack-{rank}.txt")


def stack_request_path(work_dir: str, rank: int) -> str:
    """The named pipe on which ``rank`` takes stack requests: a thread of the rank waits
    on it and answers without touching the thread that runs the user's code."""
    return os.path.join(work_dir, f"stack-{rank}.ask")


#: How long a rank's answering thread has to write its stacks before the request is made
#: again by signal (the thread waits for the GIL, which a C call may hold).
THREAD_ANSWER_SECONDS = 0.3


def ask_for_stacks(work_dir: str, rank: int, pid: int, *, by_signal: bool = False) -> bool:
    """Ask ``rank`` (process ``pid``) to write its threads' stacks to its stack file,
    emptied first.  Through its stack pipe when its answering thread is listening (the
    user's code is not interrupted: a C call such as ``sleep()`` computes what it would
    have); else, or with ``by_signal``, by ``STACK_SIGNAL`` (works while a C call holds
    the GIL, but cuts a system call such as ``nanosleep`` short).  True when asked."""
    try:
        os.truncate(stack_path(work_dir, rank), 0)
    except OSError:
        return False  # the rank has not made it yet, or its launch is gone
    if not by_signal:
        try:
            fd = os.open(stack_request_path(work_dir, rank), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no pipe, or nobody reading it (ENXIO): the signal then
            pass
        else:
            try:
                os.write(fd, b"?")
                return True
            except OSError:
                pass
            finally:
                os.close(fd)
    try:
        os.kill(pid, STACK_SIGNAL)
        return True
    except OSError:  # ended meanwhile
        return False


def format_thread_stacks(skip: int | None = None) -> str:
    """Every Python thread's stack but ``skip``'s, in faulthandler's layout (the main
    thread first, most recent call first), as the stack file holds them."""
    import sys
    import threading

    frames = sys._current_frames()
    main = threading.main_thread().ident
    order = sorted(frames, key=lambda ident: ident != main)
    lines = []
    for ident in order:
        if ident == skip:
            continue
        lines.append(f"Thread 0x{ident:016x} (most recent call first):")
        frame: Any = frames[ident]
        while frame is not None:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
            frame = frame.f_back
        lines.append("")
    return "\n".join(lines) + "\n"


def joined_path(work_dir: str, rank: int) -> str:
    """Made when ``rank`` enters init_process_group(): the kernel tells a rank that ended
    without joining (the others would wait for it until the timeout) by its absence."""
    return os.path.join(work_dir, f"joined-{rank}")


LEFT_PREFIX = "left-"


def left_path(work_dir: str, rank: int) -> str:
    """Made by the kernel when ``rank`` returned without joining the process group: a
    rank that enters it later fails at once instead of waiting."""
    return os.path.join(work_dir, f"{LEFT_PREFIX}{rank}")


def rendezvous_path(work_dir: str) -> str:
    """The ranks' ``FileStore`` for ``init_process_group()``."""
    return os.path.join(work_dir, "rendezvous.store")


def elastic_error_path(work_dir: str, rank: int) -> str:
    """Where torch.distributed.elastic's ``@record`` would write ``rank``'s failure."""
    return os.path.join(work_dir, f"elastic-error-{rank}.json")


def spool_file_name(rank: int) -> str:
    """The name of ``rank``'s tracking spool file (its MLflow calls, a line each)."""
    return f"tracking-{rank}.tsv"


def spool_file(folder: str, rank: int) -> str:
    return os.path.join(folder, spool_file_name(rank))


def spool_file_rank(name: str) -> int | None:
    """``'tracking-3.tsv'`` -> 3; None for any other name."""
    if name.startswith("tracking-") and name.endswith(".tsv"):
        try:
            return int(name[len("tracking-") : -len(".tsv")])
        except ValueError:
            return None
    return None


# -- the launch request ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchRequest:
    """Everything the helper and the ranks need to run one launch (pickled to the helper)."""

    launch_id: str
    world_size: int
    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    payload_path: str
    work_dir: str
    shm_dir: str | None
    log_paths: list[str]
    timeout: float | None
    sources: dict[str, tuple[str, str]]  # filename -> (display name, source)
    argv: list[str] | None
    umask: int | None
    rlimits: dict[str, int]
    #: What a backend that places ranks on several machines sets per rank, over what a
    #: local rank gets (``NODE_RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``...): ``{rank: {name: value}}``.
    rank_env: dict[int, dict[str, str]] | None = None
    #: Whether ``init_process_group()`` meets in a ``FileStore`` in ``work_dir`` (one machine)
    #: rather than torch's own TCP store at ``MASTER_ADDR:MASTER_PORT`` (several machines).
    private_rendezvous: bool = True
    #: ``"cuda"`` (one GPU per rank) or ``"cpu"``.
    device: str = "cpu"


# -- messages --------------------------------------------------------------------------------------
# Each is a small frozen dataclass whose class attribute KIND is its name on the wire.


@dataclass(frozen=True)
class StartLaunch:
    """Kernel -> helper: fork the ranks of this launch."""

    KIND: ClassVar[str] = "launch"
    request: LaunchRequest


@dataclass(frozen=True)
class Stop:
    """Kernel -> helper: stop a launch's ranks (``cancel``, ``failure``, ``timeout``, or
    ``kill``: SIGKILL at once)."""

    KIND: ClassVar[str] = "stop"
    launch_id: str
    reason: str


@dataclass(frozen=True)
class Shutdown:
    """Kernel -> helper: kill every rank and leave."""

    KIND: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class Ready:
    """Helper -> kernel: its preload (torch) is done."""

    KIND: ClassVar[str] = "ready"


@dataclass(frozen=True)
class Started:
    """Helper -> kernel: the launch's ranks are forked, ``{rank: pid}``."""

    KIND: ClassVar[str] = "started"
    launch_id: str
    pids: dict[int, int]
    #: Where each rank runs, for ranks on other machines (``{rank: "node 1 (10.0.0.7)"}``).
    nodes: dict[int, str] | None = None


@dataclass(frozen=True)
class Exited:
    """Helper -> kernel: a rank exited (``at``: ``time.monotonic()``, one clock for every process)."""

    KIND: ClassVar[str] = "exit"
    launch_id: str
    rank: int
    returncode: int
    at: float | None = None


@dataclass(frozen=True)
class Stopping:
    """Helper -> kernel: the helper began to stop the launch's ranks."""

    KIND: ClassVar[str] = "stopping"
    launch_id: str
    reason: str
    at: float | None = None


@dataclass(frozen=True)
class Done:
    """Helper -> kernel: every rank of the launch has ended and been reaped."""

    KIND: ClassVar[str] = "done"
    launch_id: str


@dataclass(frozen=True)
class StartFailed:
    """Helper -> kernel: the launch could not be started (a traceback's text)."""

    KIND: ClassVar[str] = "error"
    launch_id: str
    text: str


ToHelper = Union[StartLaunch, Stop, Shutdown]
ToKernel = Union[Ready, Started, Exited, Stopping, Done, StartFailed]
Message = Union[ToHelper, ToKernel]

_BY_KIND: dict[str, Callable[..., Any]] = {
    cls.KIND: cls for cls in (StartLaunch, Stop, Shutdown, Ready, Started, Exited, Stopping, Done, StartFailed)
}


def encode(message: Message) -> tuple[Any, ...]:
    """``Exited("L", 1, 3, 5.0)`` -> ``("exit", "L", 1, 3, 5.0)``: what the connection carries.
    Trailing fields left at their default are not sent (a field added later, such as
    ``Started.nodes``, leaves the tuples of the messages that do not use it as they were)."""
    values = [(getattr(message, f.name), f.default) for f in fields(message)]
    while values and values[-1][1] is not MISSING and values[-1][0] == values[-1][1]:
        values.pop()
    return (message.KIND, *(value for value, _ in values))


def decode(wire: tuple[Any, ...]) -> Message:
    """The inverse of :func:`encode`; ``ValueError`` for an unknown kind."""
    try:
        cls = _BY_KIND[wire[0]]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"not a message of air_magic's protocol: {wire!r}") from None
    try:
        return cls(*wire[1:])  # type: ignore[no-any-return]
    except TypeError:  # the wrong number of fields
        raise ValueError(f"not a message of air_magic's protocol: {wire!r}") from None


# -- result records (one per rank, pickled to result_path) ----------------------------------------


class ValueRecord(NamedTuple):
    """The function's return value / the cell's last expression."""

    value: Any


class ErrorRecord(NamedTuple):
    """The rank raised: the exception pickled (None when it cannot travel), its type's
    name, its message, the user's traceback, and when it was caught (``time.monotonic()``)."""

    blob: bytes | None
    type_name: str
    message: str
    traceback: str
    failed_at: float


class UnpicklableRecord(NamedTuple):
    """The rank returned a value that cannot be pickled: its type and why."""

    value_type: str
    reason: str


Record = Union[ValueRecord, ErrorRecord, UnpicklableRecord]

# -- tracking spool lines ----------------------------------------------------------------------
#
# ``tracking-<rank>.tsv``: tab-separated fields, the first is the kind::
#
#     m <key> <value> <step> <timestamp ms>      a metric point (float repr, whole numbers)
#     p <key> <value>                            a param
#     t <key> <value>                            a tag
#     a <local path> <artifact path>             a file to upload ("" for the run's root)
#
# A text field that is not a plain MLflow name is written as a JSON string (it starts with
# ``"``, which no MLflow name does), so any text round-trips.  Lines end with ``\n`` only.

METRIC, PARAM, TAG, ARTIFACT = "m", "p", "t", "a"


def text_field(value: str) -> str:
    """``value`` as one field of a line: itself when it is a plain name, else a JSON string."""
    if value.isascii() and value.isprintable() and "\t" not in value and not value.startswith('"'):
        return value
    return json.dumps(value)


def _text(field: str) -> str:
    return json.loads(field) if field.startswith('"') else field  # type: ignore[no-any-return]


def metric_line(key_field: str, value: float, step: int, timestamp_ms: float) -> str:
    """One metric line; ``key_field`` is already a :func:`text_field` (ranks cache it)."""
    return f"{METRIC}\t{key_field}\t{float(value)!r}\t{int(step)}\t{int(timestamp_ms)}\n"


def text_line(kind: str, key: str, value: str) -> str:
    """A param, tag or artifact line: two text fields."""
    return f"{kind}\t{text_field(key)}\t{text_field(value)}\n"


def parse_line(line: bytes) -> tuple[Any, ...] | None:
    """One spool line -> ``("m", key, value, step, ts)`` / ``("p"|"t", key, value)`` /
    ``("a", local_path, artifact_path | None)``; None for a line that cannot be read."""
    fields = line.decode("utf-8", "surrogateescape").split("\t")
    try:
        kind = fields[0]
        if kind == METRIC and len(fields) == 5:
            return (METRIC, _text(fields[1]), float(fields[2]), int(fields[3]), int(fields[4]))
        if kind in (PARAM, TAG) and len(fields) == 3:
            return (kind, _text(fields[1]), _text(fields[2]))
        if kind == ARTIFACT and len(fields) == 3:
            return (ARTIFACT, _text(fields[1]), _text(fields[2]) or None)
    except ValueError:  # json.JSONDecodeError included
        pass
    return None


# -- reading what a process appends to a file -------------------------------------------------


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
