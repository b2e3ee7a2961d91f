"""How a launch ended, said as the values it returns or the one exception it raises.

Pure functions, no files and no processes: the launch (:mod:`air_magic.kernel.launcher`) reads
what they need and hands it over::

    Ending (label, world size, stop reason, every rank's RankState)
      + records  {rank: ValueRecord | ErrorRecord | UnpicklableRecord | MISSING | the load error}
      + where    (the ranks' stacks, described; for a timeout)
      + tails    {rank: the end of its log (16 KiB); for a rank that failed}
        |
        v
    decide() -> Outcome(status, ok, value): the values in rank order, or the exception
                (LaunchError, LaunchTimeoutError, LaunchCancelledError, RankCrashedError,
                RankFailedError, ResultError, or the rank's own exception rebuilt)
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from air_magic.errors import (
    LaunchCancelledError,
    LaunchError,
    LaunchTimeoutError,
    RankCrashedError,
    RankFailedError,
    RankTraceback,
    ResultError,
    attach_rank_rendering,
)
from air_magic.hints import hints_for
from air_magic.protocol import (
    FINAL_STACK_SIGNAL,
    INTERRUPTED_EXIT,
    STOP_ESCALATION,
    TRACEBACK_MARK,
    ErrorRecord,
    UnpicklableRecord,
)

#: A rank's entry in ``records`` when it left no result file.
MISSING = object()

#: Exit codes of a rank that air_magic's own stop ended (SIGINT, SIGTERM, SIGKILL, the
#: timeout's last request for stacks, and 130: the KeyboardInterrupt its SIGINT raised in the
#: rank's code, which the rank reports as a shell does).
STOP_EXITS = (-signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL, -FINAL_STACK_SIGNAL, INTERRUPTED_EXIT)

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

_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*")

_ECHO_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistNetworkError",
    "DistBackendError",
    "NCCL communicator was aborted",
)


@dataclass
class RankState:
    """One rank of a launch, as the kernel sees it (updated from the helper's messages)."""

    rank: int
    log_path: str
    pid: int | None = None
    node: str | None = None  # the machine it runs on, when that is not this one (a Ray node)
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


@dataclass(frozen=True)
class Ending:
    """What the kernel knows of a launch once every rank has ended."""

    label: str
    world_size: int
    ranks: tuple[RankState, ...]  # copies, taken once every rank has ended
    timeout: float | None = None
    device: str = "cpu"
    error_text: str | None = None  # the launch could not run (the helper said why, or died)
    stop_reason: str | None = None  # "failure", "timeout", "cancel", "kill"
    cancel_requested: bool = False
    failures: tuple[int, ...] = ()  # ranks that failed on their own, in the order seen
    shown_rank: int | None = None  # the rank whose output the cell showed as it ran (rank 0)
    stopped_by: str | None = None  # who stopped it from outside (air-magic stop, the sidebar)


@dataclass(frozen=True)
class Outcome:
    status: str  # "finished", "failed", "timed out", "cancelled"
    ok: bool
    value: Any  # the values in rank order, or the exception to raise


def describe_exit(returncode: int, world_size: int = 2) -> str:
    """``-9`` -> ``'was killed by SIGKILL (exit -9), possibly out of memory ...'``."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"was killed by signal {-returncode} (exit {returncode})"
        note = _SIGNAL_NOTES.get(sig)
        return f"was killed by {sig.name} (exit {returncode})" + (f": {note}" if note else "")
    if returncode == 0:
        early = "exited (code 0) without returning: something ended the process early (os._exit(0), or a library that exits)"
        return early + (", so the other ranks would have waited for it" if world_size > 1 else "")
    return f"exited with code {returncode} without reporting an exception (os._exit() or a crash in native code)"


def stopped(n: int, every: str = "its") -> str:
    """``'its 2 ranks were stopped'`` / ``'its rank was stopped'``."""
    return f"{every} {n} ranks were stopped" if n != 1 else "its rank was stopped"


def is_stopped_exit(
    returncode: int, at: float | None, stop_at: float | None, stops: Sequence[tuple[str, float]] = ()
) -> bool:
    """A stop signal after the stop began: air_magic ended the rank, not its own failure.

    With the stops begun (``(reason, when)``, the helper's clock), a SIGTERM or SIGKILL counts
    only once one of them could have sent it (a failure's SIGKILL comes 2 s after its SIGTERM):
    a rank killed from outside just before a stop, whose exit the helper saw just after it on a
    loaded machine, is the failure, not one of the ranks stopped because of it."""
    if returncode not in STOP_EXITS or stop_at is None or (at is not None and at < stop_at):
        return False
    if not stops or at is None or returncode not in (-signal.SIGTERM, -signal.SIGKILL):
        return True
    for reason, began in stops:
        steps = STOP_ESCALATION.get(reason)
        if not steps:
            return True  # a stop whose signals are not known here: as before
        if any(-int(signum) == returncode and at >= began + delay - _ESCALATION_SLACK for delay, signum in steps):
            return True
    return False


#: Seconds a stop's signal may be seen before its step's time (the helper's timer and clock).
_ESCALATION_SLACK = 0.1


def needs_records(ending: Ending) -> bool:
    """Whether :func:`decide` reads the ranks' records (not for a launch that could not
    run, timed out or was cancelled)."""
    return ending.error_text is None and ending.stop_reason != "timeout" and not _cancelled(ending)


def _cancelled(ending: Ending) -> bool:
    return ending.stop_reason in ("cancel", "kill") or (ending.cancel_requested and not ending.failures)


def error_record(records: Mapping[int, Any], rank: int) -> ErrorRecord | None:
    record = records.get(rank)
    return record if isinstance(record, ErrorRecord) else None


def ending_of(ending: Ending, records: Mapping[int, Any], rank: int) -> str:
    """How ``rank`` ended: ``finished``, ``stopped`` (by air_magic, after the stop
    began) or ``failed`` (on its own)."""
    state = ending.ranks[rank]
    if state.returncode == 0 and not state.left:
        return "finished"
    return "stopped" if state.stopped and error_record(records, rank) is None else "failed"


def failed_ranks(ending: Ending, records: Mapping[int, Any]) -> list[int]:
    return [r for r in range(ending.world_size) if ending_of(ending, records, r) == "failed"]


def root_failure(ending: Ending, records: Mapping[int, Any]) -> int:
    """The first rank to fail, by when it failed.  A failure that only echoes another
    one ("connection closed by peer" inside a collective) is never the cause while a
    rank failed otherwise."""
    failed = failed_ranks(ending, records)
    if not failed:  # pragma: no cover - only called after a failure was seen
        return ending.failures[0]
    causes = [r for r in failed if not _is_echo_failure(records, r)]
    return min(causes or failed, key=lambda r: (_failed_at(ending, records, r), r))


def _failed_at(ending: Ending, records: Mapping[int, Any], rank: int) -> float:
    """When ``rank`` failed: the moment its exception was caught, else its exit
    (``time.monotonic()`` is one clock for every process of the machine)."""
    record = error_record(records, rank)
    if record is not None:
        return float(record.failed_at)
    ended = ending.ranks[rank].ended_at
    return ended if ended is not None else float("inf")


def is_echo(type_name: str, message: str) -> bool:
    return any(marker in type_name or marker in message for marker in _ECHO_MARKERS)


def _is_echo_failure(records: Mapping[int, Any], rank: int) -> bool:
    record = error_record(records, rank)
    return record is not None and is_echo(record.type_name, record.message)


def decide(
    ending: Ending,
    records: Mapping[int, Any],
    where: str = "",
    tails: Mapping[int, str] | None = None,
) -> Outcome:
    """The launch's outcome.  ``records``: as :func:`needs_records` says (else ``{}``);
    ``where``: the ranks' stacks described (timeout); ``tails``: the end of the log of
    each failed rank (:func:`failed_ranks`), its last 16 KiB decoded."""
    n = ending.world_size
    if ending.error_text is not None:
        return Outcome("failed", False, LaunchError(f"could not run {ending.label}: {ending.error_text}"))
    if ending.stop_reason == "timeout":
        timeout = ending.timeout
        error = LaunchTimeoutError(
            f"{ending.label} ran past its timeout of {timeout:g} s; {stopped(n, 'all')}. "
            "Pass a larger timeout (seconds) or "
            "timeout=None for no limit (%%distributed --timeout SECONDS|none)."
        )
        if where:
            error.add_note(where)
        return Outcome("timed out", False, error)
    if _cancelled(ending):
        if ending.stopped_by:
            return Outcome(
                "cancelled",
                False,
                LaunchCancelledError(f"{ending.label} was stopped from outside: {ending.stopped_by}; {stopped(n)}."),
            )
        return Outcome(
            "cancelled", False, LaunchCancelledError(f"the launch of {ending.label} was cancelled; {stopped(n)}.")
        )
    if ending.failures:
        root = root_failure(ending, records)
        return Outcome("failed", False, rank_error(ending, records, root, (tails or {}).get(root, "")))
    values = []
    for state in ending.ranks:
        record = records.get(state.rank, MISSING)
        if record is MISSING:
            return Outcome(
                "failed",
                False,
                RankCrashedError(
                    f"rank {state.rank} of {n} exited (code {state.returncode}) without returning a "
                    "result: something in the code ended the process early (os._exit). "
                    f"Its log: {state.log_path}",
                    rank=state.rank,
                    world_size=n,
                    returncode=state.returncode or 0,
                    log_path=state.log_path,
                ),
            )
        if isinstance(record, BaseException):  # pickled on the rank, but cannot be loaded here
            what = f"a value that cannot be loaded in the kernel ({type(record).__name__}: {record})"
            return Outcome("failed", False, result_error(state.rank, n, what))
        if isinstance(record, UnpicklableRecord):
            what = f"a {record.value_type}, which cannot be sent back to the kernel ({record.reason})"
            return Outcome("failed", False, result_error(state.rank, n, what))
        values.append(record[0])
    return Outcome("finished", True, values)


def result_error(rank: int, world_size: int, what: str) -> ResultError:
    error = ResultError(
        f"rank {rank} of {world_size} returned {what}. Return plain data instead (numbers, "
        "lists, tensors, a state_dict()), or save it to a file on the rank."
    )
    error.rank, error.world_size = rank, world_size
    return error


def others_ended(ending: Ending, records: Mapping[int, Any], root: int) -> str:
    """``'rank 0 finished; ranks 2, 3 were stopped; rank 1 failed too (...)'``."""
    groups: dict[str, list[int]] = {}
    for rank in range(ending.world_size):
        if rank == root:
            continue
        how = ending_of(ending, records, rank)
        if how == "failed":
            how = f"failed too ({short_failure(ending, records, rank)})"
        groups.setdefault(how, []).append(rank)
    parts = []
    for how, ranks in groups.items():
        many = len(ranks) != 1
        who = f"{'ranks' if many else 'rank'} {', '.join(map(str, ranks))}"
        if how == "stopped":
            parts.append(f"{who} {'were' if many else 'was'} stopped by air_magic")
        else:
            parts.append(f"{who} {how}")
    return "; ".join(parts)


def short_failure(ending: Ending, records: Mapping[int, Any], rank: int) -> str:
    record = error_record(records, rank)
    if record is not None:
        first = (str(record.message).strip().splitlines() or [""])[0]
        first = _SOURCE_PREFIX.sub("", first)  # gloo's "[.../pair.cc:553] Connection closed..."
        first = first if len(first) <= 80 else first[:77] + "..."
        return f"{record.type_name}: {first}" if first else str(record.type_name)
    code = ending.ranks[rank].returncode or 0
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def rank_error(ending: Ending, records: Mapping[int, Any], rank: int, log_end: str) -> BaseException:
    """The exception for a launch whose first failure was ``rank``'s; ``log_end``: the
    end of its log (hints are looked for in its last 200 lines; the last 20 are quoted)."""
    n = ending.world_size
    state = ending.ranks[rank]
    others = others_ended(ending, records, rank)
    first = (
        ", the first to fail," if any(ending_of(ending, records, r) == "failed" for r in range(n) if r != rank) else ""
    )
    ended = f"; {others}" if others else ""
    record = error_record(records, rank)
    lines = log_end.splitlines()
    log_text = "\n".join(lines[-200:])
    if record is None:
        tail = last_lines(log_end)
        how = describe_exit(state.returncode or 0, n)
        if state.returned_early:
            how = (
                "returned without joining the process group that the other ranks wait for it in "
                "(every rank must call init_process_group())"
            )
        message = f"rank {rank} of {n}{first} {how}{ended}."
        if tail:
            message += f"\nIts last lines ({state.log_path}):\n{tail}"
        error: BaseException = RankCrashedError(
            message, rank=rank, world_size=n, returncode=state.returncode or 0, log_path=state.log_path
        )
        for hint in hints_for(log_text, device=ending.device):
            error.add_note(hint)
        return error
    hints = hints_for(record.traceback + "\n" + log_text, device=ending.device)
    rebuilt = _rebuild(record.blob)
    note = f"[air_magic] raised on rank {rank} of {n}{first.rstrip(',')}{ended}. Full log: {state.log_path}"
    if isinstance(rebuilt, BaseException) and not isinstance(rebuilt, (KeyboardInterrupt, SystemExit)):
        rebuilt = _printable(rebuilt, record.message)
        rebuilt.__cause__ = RankTraceback(record.traceback)
        rebuilt.__suppress_context__ = True
        rebuilt.__traceback__ = None
        rebuilt.__notes__ = [note, *hints]  # replaces notes the rank added (they are in the traceback)
        return attach_rank_rendering(rebuilt)
    error = RankFailedError(
        f"rank {rank} of {n}{first} raised {record.type_name}: {record.message}{ended}.",
        rank=rank,
        world_size=n,
        exc_type=record.type_name,
        exc_message=record.message,
        traceback_text=record.traceback,
        log_path=state.log_path,
    )
    printed = printed_before_exit(log_end) if record.type_name == "SystemExit" and rank != ending.shown_rank else ""
    if printed:  # a program says why it exits on stderr (argparse's usage error), not in SystemExit
        error.add_note(f"[air_magic] rank {rank} printed before it exited ({state.log_path}):\n{printed}")
    for hint in hints:
        error.add_note(hint)
    return error


def last_lines(text: str, lines: int = 20) -> str:
    """The last ``lines`` lines of a log's text, as the errors quote them."""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def printed_before_exit(log_end: str) -> str:
    """The last lines a rank printed before the traceback of its failure."""
    before, marked, _ = log_end.rpartition(TRACEBACK_MARK)
    return last_lines(before if marked else log_end)


def _printable(exc: BaseException, text: str) -> BaseException:
    """``exc``, made printable when its own ``__str__`` raises (IPython, logging and the
    panel all print it): its class becomes a subclass of its own, of the same name, whose
    ``__str__`` says ``text`` (``<unprintable ValueError>``); ``except`` clauses and
    ``isinstance`` see the user's class as before."""
    try:
        str(exc)
        return exc
    except BaseException:
        pass
    cls = type(exc)
    try:
        printable = type(cls.__name__, (cls,), {"__str__": lambda self: text, "__module__": cls.__module__})
        printable.__qualname__ = cls.__qualname__
        exc.__class__ = printable
    except TypeError:  # a class whose instances cannot change class (a C type's layout)
        pass
    return exc


def _rebuild(blob: bytes | None) -> Any:
    """The rank's exception, unpickled; None when it cannot be."""
    if blob is None:
        return None
    try:
        import cloudpickle

        return cloudpickle.loads(blob)
    except Exception:  # any error the exception's own __reduce__/__init__ raises: the text is used
        return None
