"""One pool call seen as a launch: what the panel reads of a launch, for a cell on the pool.

A pool's ranks stay from one call to the next; the panel (its widgets, its text lines, its
summary) is drawn from a :class:`~air_magic.kernel.launch.Launch`.  A :class:`PoolCallView`
is that launch's face for one call, so that a pool cell shows exactly what a launch shows,
drawn by the same code::

    PoolEngine (its launch: the ranks, their logs, the MLflow run; the _Call running now:
    what each rank did of it and when)
        --> PoolCallView: id "<launch>-<call>", label, status running --> finished / failed /
            cancelled, started_at / ended_at of the call, ranks as PoolRankView
            (state: running / finished / failed / stopped, the log and metrics offsets
            where the call began), the run of the pool, cancel() --> engine.stop_call()
        --> the panel (panel/_pool.py builds the launch's PanelObserver on it): rows, bars,
            Stop, Where?, logs, chart, summary
        <-- notify() / notify_call(): queued here; the cell's own wait loop prints them
            (take_notices), as a launch's waiting cell does

Nothing here renders; nothing here runs a thread.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from air_magic.kernel.pool.call import RankCallState
from air_magic.protocol import file_size, spool_file

if TYPE_CHECKING:
    from air_magic.kernel.launch import Launch
    from air_magic.kernel.outcome import RankState

__all__ = ["PoolCallView", "PoolRankView", "CALL_STATES"]

#: What a rank did of a call (the engine's words) as a launch's rank says it.
CALL_STATES = {
    RankCallState.RUNNING: "running",
    RankCallState.DONE: "finished",
    RankCallState.FAILED: "failed",
    RankCallState.INTERRUPTED: "stopped",
    RankCallState.STOPPED: "stopped",
    RankCallState.ENDED: "ended",
}


class PoolRankView:
    """One rank in one call: the pool launch's rank (pid, node, exit), the call's state of it."""

    def __init__(self, view: "PoolCallView", state: "RankState", metrics_path: str) -> None:
        self._view = view
        self._state = state
        self.rank = state.rank
        self.log_path = state.log_path
        self.log_start = file_size(state.log_path)  # the call's own lines begin here
        self.metrics_start = file_size(metrics_path)  # likewise its points

    @property
    def pid(self) -> int | None:
        return self._state.pid

    @property
    def node(self) -> str | None:
        return self._state.node

    @property
    def returncode(self) -> int | None:
        return self._state.returncode

    @property
    def state(self) -> str:
        """``running``, ``finished``, ``failed``, ``stopped`` (interrupted, or stopped by air_magic) or
        ``ended`` (its process ended by itself while the pool broke)."""
        said = self._view.call_states.get(self.rank, RankCallState.RUNNING)
        if said is RankCallState.RUNNING and self._view.ended_at is not None:
            # The call ended without this rank's answer: the pool broke under it.
            return "stopped" if self._view.status in ("cancelled", "failed") else "finished"
        return CALL_STATES[said]

    @property
    def took(self) -> float | None:
        """Seconds this rank took for the call, once it answered."""
        ended = self._view.call_ended.get(self.rank)
        return None if ended is None else max(0.0, ended - self._view.began)


class PoolCallView:
    """One call of a pool, with the attributes and methods the panel reads of a launch."""

    kind = "pool call"
    noun = "pool call"  # what the panel calls it ("launch" for a launch)
    storing: str | None = None
    run_shown = False
    waited_on = True  # the cell's own thread waits for it, and prints what is queued

    def __init__(self, engine: Any, launch: "Launch", call: Any, number: int) -> None:
        self.engine = engine
        self.pool = launch
        self.call = call
        self.number = number
        self.id = f"{launch.id}-{number}"
        self.label = call.label
        self.spec = launch.spec
        self.placement = launch.placement
        self.world_size = len(call.ranks.conns) or launch.world_size
        self.work_dir = launch.work_dir
        self.sources = call.sources
        self.started_at = time.time()
        self.began = call.began  # time.monotonic(), as the engine's own times of the call
        self.ended_at: float | None = None
        self.status = "running"
        self.ranks = [
            PoolRankView(self, state, spool_file(launch.work_dir, state.rank))
            for state in launch.ranks[: self.world_size]
        ]
        self.observers: list[Any] = []
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._notices: collections.deque[tuple[str | Callable[[], None], str]] = collections.deque()
        self._waiter = threading.get_ident()  # the thread that waits for the call (the cell's)

    # -- what the call's engine knows --------------------------------------------------------

    @property
    def call_states(self) -> dict[int, RankCallState]:
        return dict(self.call.states)

    @property
    def call_ended(self) -> dict[int, float]:
        return dict(getattr(self.call, "ended", {}))

    @property
    def log_paths(self) -> list[str]:
        return [r.log_path for r in self.ranks]

    @property
    def local_processes(self) -> bool:
        return bool(self.pool.local_processes)

    @property
    def timings(self) -> dict[str, float]:
        return {}

    # The pool's MLflow run: the call's points go to a child run of it.
    @property
    def run_id(self) -> str | None:
        return self.pool.run_id

    @property
    def run_name(self) -> str | None:
        return self.pool.run_name

    @property
    def run_url(self) -> str | None:
        return self.pool.run_url

    @property
    def run_command(self) -> str | None:
        return self.pool.run_command

    @property
    def context(self) -> str:
        """The pool itself, on a line of its own above the call: ranks, calls run, age, restarts."""
        n = self.world_size
        device = "GPU" if self.placement.device == "cuda" else "CPU"
        up = max(0.0, time.time() - (self.engine.started_at or self.started_at))
        parts = [
            f"pool of {n} {device} rank{'s' * (n != 1)} (launch {self.pool.id})",
            f"call {self.number}",
            f"up {_clock(up)}",
        ]
        if self.engine.restarts:
            parts.append(f"restarted {self.engine.restarts} time{'s' * (self.engine.restarts != 1)}")
        return " · ".join(parts)

    # -- the launch's interface --------------------------------------------------------------

    @property
    def launcher(self) -> "PoolCallView":
        return self  # is_active(): the panel's thread stops once the call is over

    def is_active(self, launch: Any) -> bool:
        return launch is self and not self._done.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"pool call {self.id} is still running after {timeout} s")
        return self._error

    def cancel(self) -> bool:
        """What a panel's Stop does: the call is interrupted as Ctrl-C interrupts it; the ranks stay."""
        if self._done.is_set():
            return False
        return bool(self.engine.stop_call())

    def stacks(self, timeout: float = 2.0) -> dict[int, str]:
        return self.pool.stacks(timeout)

    def where(self, stacks: dict[int, str], absent: str = "had ended") -> str:
        return self.pool.where(stacks, absent)

    def when_stored(self, hook: Callable[[list[tuple[str, str]]], None]) -> bool:
        return False  # a call's points are stored with the pool's run, as they come

    def print_notices(self, final: bool = True) -> None:
        """(A background launch's panel prints from its thread; a call's cell prints them.)"""

    def notify(self, line: str, stream: str = "stdout") -> None:
        self._notices.append((line, stream))

    def notify_call(self, show: Callable[[], None]) -> None:
        if threading.get_ident() == self._waiter:  # the call's own thread, at its end: now
            show()
        else:
            self._notices.append((show, ""))

    def take_notices(self) -> list[tuple[str | Callable[[], None], str]]:
        """What was queued for the cell (from the cell's thread)."""
        taken = []
        while self._notices:
            taken.append(self._notices.popleft())
        return taken

    def finish(self, outcome: str, error: BaseException | None) -> None:
        """The call is over: ``outcome`` as the engine says it (``done``, ``interrupted``, ...)."""
        self._error = None if outcome == "done" else error
        if outcome == "done":
            self.status = "finished"
        elif outcome == "interrupted":
            self.status = "cancelled"
        else:
            self.status = "failed"
        self.ended_at = time.time()
        self._done.set()

    def __repr__(self) -> str:
        took = (self.ended_at or time.time()) - self.started_at
        return f"<pool call {self.id} {self.label}: {self.status} after {took:.1f} s>"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
