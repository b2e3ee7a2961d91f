"""One start of a pool's ranks, and one call running on them: what the engine
(:mod:`air_magic.kernel.pool.engine`) and a call's interrupt (:mod:`air_magic.kernel.pool.interrupts.interrupt`)
share of them."""

from __future__ import annotations

import enum
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from air_magic.kernel.inspect.hangs import HangWatch
from air_magic.kernel.launch import Launch

__all__ = ["Ranks", "Call", "RankCallState", "PoolState"]


class PoolState(str, enum.Enum):
    """How a pool stands (``PoolEngine.state``; ``Pool.state`` says the plain word)."""

    NEW = "new"  # made, not started
    STARTING = "starting"  # its ranks start and connect
    IDLE = "idle"  # its ranks wait for a call
    RUNNING = "running"  # a call runs on them
    BROKEN = "broken"  # its ranks cannot go on: the next call starts fresh ones
    CLOSED = "closed"  # closed for good

    def __str__(self) -> str:
        return self.value


class RankCallState(str, enum.Enum):
    """What one rank did of a pool call: the engine's word for it (a ``str``, so status dicts
    and their JSON carry the plain word).  A launch's rank says it as ``PoolRankView.state``."""

    RUNNING = "running"  # still in the call
    DONE = "done"  # answered with a value
    FAILED = "failed"  # answered with an error of its code
    INTERRUPTED = "interrupted"  # answered with the KeyboardInterrupt of an interrupt (or cut free by one)
    STOPPED = "stopped"  # did not answer: air_magic stopped it (stuck, the pool broken under it)
    ENDED = "ended"  # did not answer: its process had ended by itself when the pool broke

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Ranks:
    """One start of the pool's ranks (a restart makes new ones): what a call runs on."""

    launch: Launch
    conns: list[Connection]
    pids: list[int]
    broken: str = ""  # why they cannot go on ('' while they can)
    #: "restarted" or "closed": the pool moved on while a call still ran on these ranks
    retired: str = ""
    regroups: int = 0  # how many times their default group was rebuilt (a hang's way out)


@dataclass(eq=False)
class Call:
    """One call running on the pool, with what each rank did of it."""

    ranks: Ranks
    id: int
    label: str
    sources: dict[str, tuple[str, str]]
    began: float = field(default_factory=time.monotonic)
    states: dict[int, RankCallState] = field(default_factory=dict)
    forked: dict[int, list[int]] = field(default_factory=dict)  # rank -> pids its code forked
    closed: dict[int, float] = field(default_factory=dict)  # rank -> when its connection was seen closed
    ended: dict[int, float] = field(default_factory=dict)  # rank -> time.monotonic() of its answer
    # Interrupts: the ranks that began it (a SIGINT raises in them), those to interrupt, and
    # those sent one (a cancel runs in another thread than the wait).
    started: set[int] = field(default_factory=set)
    wanted: set[int] = field(default_factory=set)
    signalled: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    background: bool = False  # a pool.submit call: no thread of the user's waits for it
    hangs: HangWatch | None = None  # the waiting cell's hang watch
    regrouped: str = ""  # the note of a group rebuilt after the call (its collective timed out)
    assembled: dict[int, Any] = field(default_factory=dict)  # DTensors' full tensors, shared by the replies
    waiter: int = field(default_factory=threading.get_ident)  # the thread that waits for it

    def interrupt(self, ranks: list[int]) -> None:
        """KeyboardInterrupt in these ranks' code.  A rank that has not begun the call yet (it
        was not scheduled: a loaded machine) is interrupted as it begins it (:meth:`on_began`):
        a SIGINT sent before would find it idle, and be ignored."""
        with self.lock:
            self.wanted.update(ranks)
            now = sorted((set(ranks) & self.started) - self.signalled)
            self.signalled.update(now)
        if now:
            self.ranks.launch.signal_ranks(now, signal.SIGINT)

    def on_began(self, rank: int) -> None:
        """A rank began the call: from now on a SIGINT raises in it."""
        with self.lock:
            self.started.add(rank)
            late = rank in self.wanted and rank not in self.signalled
            if late:
                self.signalled.add(rank)
        if late:
            self.ranks.launch.signal_ranks([rank], signal.SIGINT)

    def stop(self) -> bool:
        """A panel's Stop (:meth:`~air_magic.kernel.pool.engine.PoolEngine.stop_call`): a call
        the kernel's main thread waits for gets the SIGINT that Jupyter's interrupt sends the
        kernel, so it ends exactly as after Ctrl-C; another (a ``pool.submit``) interrupts
        every rank."""
        if not self.background and self.waiter == threading.main_thread().ident:
            os.kill(os.getpid(), signal.SIGINT)
        else:
            self.interrupt(list(range(len(self.ranks.conns))))
        return True
