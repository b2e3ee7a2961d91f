"""A pool call's interrupt, kernel side: Ctrl-C, ``q`` at a breakpoint, the panel's Stop or a
hang's Ctrl-C.  Every rank stops at one point; the pool says "intact" only once it has
checked (the rank side is :mod:`air_magic.rank.pool.interrupts.safe_point`, :mod:`air_magic.rank.pool.interrupts.fence` and
:mod:`air_magic.rank.pool.interrupts.state`)::

    Interrupt(engine, wait, desk).run()   (always raises KeyboardInterrupt)
      prompts waiting at breakpoints answered as q answers them
      SIGINT to every rank still in the call; their replies taken for GRACE s, and each look:
        stuck(): a rank waits in a collective that a rank back from the call never started
                 -> the group's connections cut: its collective raises there (never completed
                    with data no rank sent)
      still there after GRACE: SIGINT again (a rank in a C call such as sleep() stops at a
        safe point), GRACE s more, the same looks; then the pool is broken, saying where each
        rank is
      every rank back:
        the group rebuilt if it was cut, or if its ranks started different collectives
        settle(): each rank puts back what was left half-way (FSDP2, DDP) and answers its
          modules', optimizers' and engines' fingerprints
        compare() -> "intact", or what differs and how to repair it (pool.sync)

The engine (:class:`air_magic.kernel.pool.engine.PoolEngine`) owns the ranks, the call's wait
(:class:`air_magic.kernel.pool.wait.CallWait`) its replies; this object owns one interrupt of one call.
"""

from __future__ import annotations

import signal
import time
from multiprocessing.connection import Connection
from typing import Any, NoReturn, Protocol

from air_magic.errors import interrupted
from air_magic.kernel.inspect import collectives as _collectives
from air_magic.kernel.inspect.debugger import BreakpointDesk
from air_magic.kernel.pool.call import Call, RankCallState, Ranks
from air_magic.kernel.pool.interrupts import regroup as pool_regroup
from air_magic.kernel.pool.interrupts import state as _state
from air_magic.protocol import ErrorRecord

__all__ = ["Interrupt", "GRACE", "STUCK_LOOK", "INTACT"]

#: Seconds the ranks have to come back after a SIGINT, before the next step (a second SIGINT,
#: then a broken pool).
GRACE = 3.0
#: Seconds between looks at the ranks' collectives while some are back and some are not.
STUCK_LOOK = 0.2
#: The headline of an interrupt that left every rank at one point with equal state.
INTACT = "you interrupted the pool's cell; every rank stopped it, and the pool and its state are intact."


class Engine(Protocol):
    """What an interrupt asks of the pool's engine (:class:`air_magic.kernel.pool.engine.PoolEngine`)."""

    def break_ranks(self, ranks: Ranks, because: str) -> None: ...
    def rebuild_group(self, call: Call) -> str: ...
    def next_id(self) -> int: ...


class Wait(Protocol):
    """What it asks of the call's wait (:class:`air_magic.kernel.pool.wait.CallWait`)."""

    call: Call
    records: dict[int, Any]  # rank -> its reply's record
    pending: dict[int, Connection]  # ranks not back yet

    def take_replies(self) -> list[Any]: ...
    def check_retired(self) -> None: ...
    def not_stopped(self, what: str) -> NoReturn: ...


class Interrupt:
    """One interrupt of one pool call (see the module's docstring)."""

    def __init__(self, engine: Engine, wait: Wait, desk: BreakpointDesk | None = None) -> None:
        self.engine = engine
        self.wait = wait
        self.call = call = wait.call
        self.records = wait.records
        self.pending = wait.pending
        self.desk = desk
        self.launch = call.ranks.launch
        self.n = len(call.ranks.conns)
        self.cut: list[int] = []  # the ranks freed by cutting the group's connections
        self.cut_why = ""  # what they waited in

    def run(self) -> NoReturn:
        if self.desk is not None:
            self.desk.release()
        self.call.interrupt(list(self.pending))
        for attempt in range(2):
            if attempt:  # a rank in a C call (sleep()), past its wait for its peers: told again
                if not self.pending or not self.launch.local_processes:
                    break
                self._cut_hung()
                self.launch.signal_ranks(sorted(self.pending), signal.SIGINT)
            self._wait(GRACE)
        if self.pending:
            self.wait.not_stopped("you interrupted the pool's cell")
        self._finish()

    # -- waiting for the ranks ---------------------------------------------------------------------

    def _wait(self, seconds: float) -> None:
        """The ranks' replies for ``seconds``; each look, the ranks left in collectives that a
        rank back from the call never started are cut free."""
        deadline = time.monotonic() + seconds
        next_look = time.monotonic() + STUCK_LOOK
        while self.pending and time.monotonic() < deadline:
            self.wait.check_retired()
            self.wait.take_replies()
            if self.pending and len(self.pending) < self.n and time.monotonic() >= next_look:
                next_look = time.monotonic() + STUCK_LOOK
                if self._cut_free():
                    deadline = max(deadline, time.monotonic() + GRACE)

    def _cut_free(self) -> bool:
        """Cut the group's connections where ranks still in the call wait in collectives that
        cannot complete; True when it was cut."""
        if self.cut or not self.launch.local_processes:
            return False
        if pool_regroup.can_rebuild(self.launch.placement.device, True):
            return False  # a group that cannot be rebuilt is not cut (the pool breaks instead)
        seen = _collectives.ask(self.launch.work_dir, list(range(self.n)), timeout=0.5, how="q")
        back = set(range(self.n)) - set(self.pending)
        stuck = _collectives.stuck(seen, back)
        if not stuck:
            return False
        self.cut = stuck
        self.cut_why = _not_made_by(back, self.records)
        pool_regroup.cut(self.launch.work_dir, self.n)
        return True

    def _cut_hung(self) -> None:
        """No rank came back in GRACE s and every one still in the call waits in a collective
        (they disagree, or one is missing that no rank will make): a hang's way out."""
        if self.cut or not self.launch.local_processes:
            return
        if pool_regroup.can_rebuild(self.launch.placement.device, True):
            return
        seen = _collectives.ask(self.launch.work_dir, sorted(self.pending), timeout=1.0, how="q")
        if not seen or not all(data and data.get("pending") for data in seen.values()):
            return
        self.cut = sorted(self.pending)
        self.cut_why = (
            "a collective that no peer would complete (a hang)"
            if len(self.cut) == 1
            else "collectives that no peer would complete (a hang)"
        )
        pool_regroup.cut(self.launch.work_dir, self.n)

    # -- every rank back ---------------------------------------------------------------------------

    def _finish(self) -> NoReturn:
        for rank in self.cut:  # (its collective raised because it was cut: the interrupt stopped it)
            self.call.states[rank] = RankCallState.INTERRUPTED
        why_rebuilt = self._why_rebuild()
        if why_rebuilt:
            why = self.engine.rebuild_group(self.call)
            if why:
                self.engine.break_ranks(
                    self.call.ranks, f"an interrupt left the group unusable and it could not be rebuilt ({why})"
                )
                raise interrupted(
                    f"you interrupted the pool's cell; {why_rebuilt}, and the process group could not be rebuilt "
                    f"({why}): the pool is broken, and the next pool cell starts it again."
                )
        answers = _state.settle(self.call.ranks.conns, self.engine.next_id())
        if isinstance(answers, str):
            self.engine.break_ranks(
                self.call.ranks, f"after an interrupt its ranks could not check their state ({answers})"
            )
            raise interrupted(
                f"you interrupted the pool's cell; every rank stopped it, but their state could not be checked "
                f"({answers}): the pool is broken, and the next pool cell starts it again."
            )
        check = _state.compare(answers)
        error = interrupted(headline(why_rebuilt, check))
        note = check.note()
        if note:
            error.add_note(note)
        if self.call.hangs is not None and self.call.hangs.current is not None:
            error.add_note(self.call.hangs.current.text())
        raise error

    def _why_rebuild(self) -> str:
        """Why the group must be rebuilt before the next call ('' when it need not be)."""
        if self.cut:
            one = len(self.cut) == 1
            return f"{_ranks(self.cut)} waited in {self.cut_why}, so {'it was' if one else 'they were'} stopped there"
        if pool_regroup.broke_the_group(self.records):
            return "a collective's connections closed as the ranks stopped"
        if not self.launch.local_processes:
            return ""
        seen = _collectives.ask(self.launch.work_dir, list(range(self.n)), timeout=1.0, how="q")
        left = _collectives.uneven(seen)
        if left:
            return f"its ranks stopped at different collectives ({'; '.join(left)})"
        return ""


def headline(rebuilt: str, check: _state.StateCheck) -> str:
    """What the cell says of an interrupt: how the ranks stopped (``rebuilt``: why the group was
    rebuilt, '' when it was not), and whether their state is one."""
    if not rebuilt:
        if check.intact:
            return INTACT
        return "you interrupted the pool's cell; every rank stopped it, but their state differs: " + _differs(check)
    state = "and their state is intact." if check.intact else "but their state differs: " + _differs(check)
    return f"you interrupted the pool's cell; {rebuilt}: {pool_regroup.REBUILT}, {state}"


def _differs(check: _state.StateCheck) -> str:
    return "; ".join(check.differs) + f". {check.repair_hint()}."


def _not_made_by(back: set[int], records: dict[int, Any]) -> str:
    """``a collective that rank 1 had stopped before``: what the ranks back from the call did
    instead of the collective the others wait in (stopped by the interrupt, finished the
    call, or failed)."""
    how: dict[str, list[int]] = {}
    for rank in sorted(back):
        record = records.get(rank)
        if isinstance(record, ErrorRecord) and record.type_name == "KeyboardInterrupt":
            how.setdefault("had stopped before", []).append(rank)
        elif isinstance(record, ErrorRecord):
            how.setdefault("had failed before", []).append(rank)
        else:
            how.setdefault("never made (it had finished the call)", []).append(rank)
    return "a collective that " + " and ".join(f"{_ranks(ranks)} {words}" for words, ranks in how.items())


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
