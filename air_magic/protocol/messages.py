"""What the kernel and the helper say to each other, the launch request, and the ranks' result records."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, ClassVar, NamedTuple, Union

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
    #: A pool's launch (its ranks stay across cells): a backend that places agents for its
    #: ranks (Ray) keeps them for the pool's life, for its restarts and for other launches.
    pool: bool = False


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
