"""One call's wait on a pool, kernel side: the replies, the faults and the outcome of one call
(the pool's face and life are :mod:`air_magic.kernel.pool.engine`'s; an interrupt of the call,
:mod:`air_magic.kernel.pool.interrupts.interrupt`'s)::

    CallWait(engine, call, pump, watchers, desk).collect(timeout)
      each look (50 ms): the ranks' replies (take_replies), rank 0's output, the watchers
        (the panel), the hang watch, the prompts of ranks at a breakpoint
      a rank gone, an error not followed by the others within GRACE s, the timeout
        -> _fault / the timeout's error: the pool is broken, saying where each rank was
      Ctrl-C -> Interrupt(engine, wait, desk).run()
    .outcome(kind)   the values in rank order, or the error of the rank that failed first

The engine keeps the ranks; one of these lives as long as its call.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, NoReturn, Protocol

from air_magic.errors import AirMagicError, LaunchError, LaunchTimeoutError, ResultError, interrupted
from air_magic.kernel import outcome as _outcome
from air_magic.kernel.inspect.debugger import BreakpointDesk
from air_magic.kernel.inspect.hangs import HangWatch, ReportShown
from air_magic.kernel.inspect.stacks import describe_stacks, read_stacks, request_stacks, user_frame
from air_magic.kernel.pool.call import Call, RankCallState, Ranks
from air_magic.kernel.pool.decide import CLOSED_GRACE, first_failure, first_gone, interrupted_all
from air_magic.kernel.pool.interrupts import regroup as pool_regroup
from air_magic.kernel.pool.interrupts.interrupt import GRACE, Engine, Interrupt
from air_magic.kernel.pool.mirror import KernelMirror
from air_magic.kernel.pool.view import PoolCallView
from air_magic.kernel.pool.wire import OutOfStep, replies
from air_magic.kernel.rank_output import OutputPump, bound_log_in_place
from air_magic.protocol import ErrorRecord, UnpicklableRecord, ValueRecord

__all__ = ["CallWait", "PoolBrokenError", "run_call", "CALL_WATCHERS"]

#: Factories called as a pool's cell or call begins in the caller's thread (not a
#: ``submit``), with the call seen as a launch (:class:`~air_magic.kernel.pool.view.PoolCallView`):
#: each returns a watcher, or None.  Its ``tick()`` is called from the call's wait loop (every
#: few tens of ms: it must be cheap) and its ``end()`` once the call is over and the view says
#: how (the live panel registers one: :mod:`air_magic.panel._pool`; plugins.py wires it).
#: While its ``holds_output()`` is true, rank 0's output waits (the panel shows above it).
CALL_WATCHERS: list[Callable[[PoolCallView], Any]] = []


class PoolBrokenError(AirMagicError):
    """A pool's ranks could not go on: a cell of a broken pool starts fresh ranks first."""


class PoolEngine(Engine, Protocol):
    """What one call asks of the pool's engine (:class:`air_magic.kernel.pool.engine.PoolEngine`)
    beyond what its interrupt asks (:class:`Engine`); named here so that the engine imports
    this module and not the other way round."""

    mirror: KernelMirror  # (the ranks' own names, from their replies)
    sources: dict[str, tuple[str, str]]  # the cells every call so far ran
    last_failed_rank: int | None
    cells: int


class CallWait:
    """One call's wait for its ranks (see the module's docstring)."""

    def __init__(
        self,
        engine: PoolEngine,
        call: Call,
        pump: OutputPump,
        watchers: list[Any] | None = None,
        desk: BreakpointDesk | None = None,
    ) -> None:
        self.engine = engine
        self.call = call
        self.pump = pump
        self.watchers = watchers or []
        self.desk = desk
        self.records: dict[int, Any] = {}  # rank -> its reply's record
        self.pending: dict[int, Connection] = dict(enumerate(call.ranks.conns))  # ranks not back yet

    def collect(self, timeout: float | None, interrupted: bool = False) -> dict[int, Any]:
        """Every rank's record, waiting for them (serving the prompts of ranks stopped at a
        breakpoint, through ``desk``); a fault breaks the pool.  ``interrupted``: a Ctrl-C came
        while the call went out (held until every rank had it): the call is interrupted at once."""
        ranks = self.call.ranks
        grace_until: float | None = None
        unheeded = False
        cancelled_at: float | None = None
        try:
            if interrupted:
                raise KeyboardInterrupt
            self.call.hangs = self._hang_watch()
            while self.pending:
                self.check_retired()
                if self.call.background and self.call.wanted:
                    # A cancelled pool.submit call whose ranks do not all come back (one waits in a
                    # collective its peers will not make): the way out of Ctrl-C's, after a grace.
                    cancelled_at = cancelled_at or time.monotonic()
                    if time.monotonic() - cancelled_at > GRACE and not interrupted_all(self.records):
                        raise KeyboardInterrupt
                if self.desk is not None:
                    self.desk.poll()
                for reply in self.take_replies():
                    names = self.engine.mirror.names
                    self.engine.mirror.names = set(reply.names) if reply.rank == 0 else names & set(reply.names)
                    if reply.forked:
                        self.call.forked[reply.rank] = reply.forked
                    if isinstance(reply.record, ErrorRecord) and grace_until is None:
                        grace_until = time.monotonic() + GRACE
                if not any(_holds_output(watcher) for watcher in self.watchers):
                    self.pump.pump()
                if not self.pending:
                    break
                for watcher in self.watchers:
                    try:
                        watcher.tick()
                    except Exception:  # a watcher (the panel) never changes the call's outcome
                        pass
                if self.call.hangs is not None:
                    self.call.hangs.check()
                self.check_retired()
                gone = self._first_gone()
                if gone is not None:
                    self._fault(self._gone_reason(gone))
                if grace_until is not None and time.monotonic() > grace_until:
                    if self.call.wanted and interrupted_all(self.records):  # a cancel some did not heed
                        unheeded = True
                        break
                    failed = min(r for r, rec in self.records.items() if isinstance(rec, ErrorRecord))
                    self._fault(f"rank {failed} failed while the others did not come back")
                if timeout is not None and time.monotonic() - self.call.began > timeout:
                    where = self._where()
                    self.engine.break_ranks(ranks, f"{self.call.label} ran past its timeout of {timeout:g} s")
                    error = LaunchTimeoutError(
                        f"{self.call.label} ran past its timeout of {timeout:g} s on the pool; its ranks were stopped "
                        "and the next pool cell starts fresh ones (their state is lost). Pass --timeout SECONDS|none."
                    )
                    if where:
                        error.add_note(where)
                    raise error
        except KeyboardInterrupt:
            self.check_retired()
            Interrupt(self.engine, self, self.desk).run()
        if unheeded:  # out of the try: the KeyboardInterrupt raised is the cancel's outcome
            self.not_stopped("the pool's call was cancelled")
        if pool_regroup.broke_the_group(self.records):  # gloo closed the group's connections (a timeout)
            why = self.engine.rebuild_group(self.call)
            if why:
                self.engine.break_ranks(
                    ranks, f"a collective broke the process group, which could not be rebuilt ({why})"
                )
                self.call.regrouped = (
                    f"[air_magic] the collective's failure closed the process group's connections and it could not "
                    f"be rebuilt ({why}): the pool is broken, and the next pool cell starts it again."
                )
            else:
                self.call.regrouped = f"[air_magic] the collective's failure closed the process group's connections: {pool_regroup.REBUILT}."
        return self.records

    def _hang_watch(self) -> HangWatch | None:
        """The cell's hang watch: a rank that has answered the call waits in no collective (it
        ended it: "finished the call"); the others' collectives are looked at each second."""
        launch = self.call.ranks.launch

        def ended() -> dict[int, str]:
            gone = {r: f"exit {s.returncode}" for r, s in enumerate(launch.ranks) if s.returncode is not None}
            for rank, record in self.records.items():
                gone.setdefault(rank, _ended_call(record))
            return gone

        shown = ReportShown(
            os.path.join(launch.log_dir, f"hang-report-call-{self.call.id}"),
            before=self.pump.pump,
            quiet=self.call.background,
        )
        return launch.hang_watch(shown, ended=ended, sources={**self.engine.sources, **self.call.sources})

    def check_retired(self) -> None:
        """The pool was restarted or closed while this call ran (from another thread): the
        call ends here, saying so; the pool's new ranks are none of its business."""
        why = self.call.ranks.retired
        if not why:
            return
        how = {
            "restarted": " (pool.restart() or %distributed_pool --restart)",
            "closed": " (pool.close() or %distributed_pool --stop)",
        }.get(why, "")
        raise PoolBrokenError(
            f"the pool was {why} while {self.call.label} ran on it{how}; its ranks were stopped, so this call has no values."
        )

    def take_replies(self) -> list[Any]:
        """One look (50 ms at most) for the pending ranks' replies to the call: each one
        recorded, and taken out of ``pending``; a reply out of step breaks the pool."""
        try:
            launch = self.call.ranks.launch
            answers = replies(
                self.pending,
                self.call.id,
                0.05,
                lambda rank, _id: self.call.on_began(rank),
                self.call.closed,
                (launch.shm_dir, launch.work_dir),
                self.call.assembled,
            )
        except OutOfStep as exc:
            self._out_of_step(exc)
        for reply in answers:
            self.records[reply.rank] = reply.record
            self.call.states[reply.rank] = _state_of(reply.record)
            self.call.ended[reply.rank] = time.monotonic()
        return answers

    def _out_of_step(self, exc: OutOfStep) -> NoReturn:
        self.engine.break_ranks(self.call.ranks, f"rank {exc.rank}'s connection is out of step")
        n = len(self.call.ranks.conns)
        raise PoolBrokenError(
            f"{self.call.label}: {exc}. Its values cannot be trusted, so the pool is broken: the next pool cell starts "
            f"{n} fresh rank{'s' * (n != 1)} (the state of these is lost)."
        ) from None

    def _gone_reason(self, rank: int) -> str:
        code = self.call.ranks.launch.ranks[rank].returncode
        if code is None:
            return f"rank {rank} closed its connection to the kernel"
        return f"rank {rank} ended (exit {code})"

    def _first_gone(self) -> int | None:
        """The pending rank that ended first (:func:`~air_magic.kernel.pool.decide.first_gone`)."""
        launch = self.call.ranks.launch
        return first_gone(launch.ranks, self.pending, self.call.closed, launch.done(), time.monotonic())

    def not_stopped(self, what: str) -> NoReturn:
        """Some ranks did not stop within GRACE s of their interrupt: the pool is broken."""
        where = self._where()
        ranks = ", ".join(map(str, sorted(self.pending)))
        self.engine.break_ranks(self.call.ranks, "interrupted, and some ranks did not stop")
        message = (
            f"{what}; rank{'s' * (len(self.pending) != 1)} {ranks} did not stop within {GRACE:g} s "
            "(its code caught the KeyboardInterrupt, or waits in a collective or in C), so the pool is broken: "
            "the next pool cell starts fresh ranks."
        )
        if where:
            message += "\n" + where
        raise interrupted(message)

    def _fault(self, because: str) -> NoReturn:
        ranks = self.call.ranks
        if ranks.launch.local_processes and ranks.launch.stopped_from_outside():
            # air-magic stop (or the sidebar's Stop) ended its ranks: a stop, said with who asked.
            for rank in self.pending:
                self.call.states[rank] = RankCallState.STOPPED
            self.engine.break_ranks(ranks, f"it was stopped from outside: {ranks.launch.stopped_by}")
            n = len(ranks.conns)
            raise PoolBrokenError(
                f"the pool was stopped from outside while {self.call.label} ran on it: {ranks.launch.stopped_by}; "
                f"its {n} rank{'s' * (n != 1)} were stopped, so this call has no values, and the next pool cell "
                "starts fresh ones (the state of these is lost)."
            )
        errors = {r: rec for r, rec in self.records.items() if isinstance(rec, ErrorRecord)}
        own = {r: e for r, e in errors.items() if not _outcome.is_echo(e.type_name, e.message)}
        # Who ended on its own, read before the others are stopped (their exits would blur it);
        # errors that only echo a peer's end (gloo's "Connection closed by peer") wait a moment
        # for that end to be reported.
        gone = self._first_gone()
        deadline = time.monotonic() + CLOSED_GRACE
        while not own and gone is None and time.monotonic() < deadline:
            time.sleep(0.02)
            gone = self._first_gone()
        ended: dict[int, int] = {}
        for rank in self.pending:
            code = ranks.launch.ranks[rank].returncode
            if code is not None:
                ended[rank] = code
        where = self._where()
        for rank in self.pending:
            self.call.states[rank] = RankCallState.ENDED if rank in ended else RankCallState.STOPPED
        self.engine.break_ranks(ranks, because)
        n = len(ranks.conns)
        tail = (
            f"the pool is broken ({because}); the next pool cell starts {n} fresh rank{'s' * (n != 1)} "
            "(the state of these is lost)."
        )
        if own or (errors and gone is None):
            first = first_failure(errors)
            error = self._rank_exception(first, ended)
            error.add_note("[air_magic] " + tail)
        else:  # a rank ended; any error of the others only followed from it (a broken collective)
            gone = min(self.pending) if gone is None else gone
            code = ended.get(gone)
            if code is None:
                how = "closed its connection to the kernel (its process had not ended)"
            else:
                how = _outcome.describe_exit(code, n)
            error = LaunchError(f"rank {gone} of {n} of the pool {how}; {tail}")
            for rank, record in sorted(errors.items()):
                error.add_note(f"[air_magic] rank {rank}'s {record.type_name} followed from it: {record.message[:200]}")
        if where:
            error.add_note(where)
        raise error

    def _where(self) -> str:
        """Where each rank that has not come back is (its stack, with the cell's names), and
        what the others did of the call."""
        launch = self.call.ranks.launch
        if not self.pending:
            return ""
        try:
            if launch.local_processes:
                running = {r: launch.ranks[r].pid for r in self.pending if launch.ranks[r].pid}
                stacks = {}
                for _look in range(2):
                    # A rank read on its way (between the call's start and the cell's first line,
                    # or a busy machine's late answer) shows neither the cell nor a collective:
                    # looked at again, once.
                    request_stacks(launch.work_dir, running, 3.0, thread_wait=1.5)  # type: ignore[arg-type]
                    stacks.update(read_stacks(launch.work_dir, running, {**self.engine.sources, **self.call.sources}))
                    running = {r: pid for r, pid in running.items() if user_frame(stacks.get(r, "")) == ("", False)}
                    if not running:
                        break
                    time.sleep(0.3)
            else:
                stacks = {r: s for r, s in launch.stacks(timeout=1.0).items() if r in self.pending}
                for filename, (display, _) in {**self.engine.sources, **self.call.sources}.items():
                    stacks = {r: s.replace(f'File "{filename}"', display) for r, s in stacks.items()}
            absent = {
                r: _came_back(self.records.get(r)) for r in range(len(self.call.ranks.conns)) if r not in self.pending
            }
            stacks = {r: s for r, s in stacks.items() if r in self.pending}
            waiting = self.call.hangs.waiting() if self.call.hangs is not None else {}
            where = describe_stacks(stacks, len(self.call.ranks.conns), absent, waiting)
            if self.call.hangs is not None and self.call.hangs.current is not None:  # the hang, as the cell showed it
                where += "\n" + self.call.hangs.current.text()
            return where
        except Exception:  # the stacks are a courtesy: the fault is said anyway
            return ""

    def _rank_exception(self, rank: int, ended: dict[int, int] | None = None) -> BaseException:
        """The error of a call whose first failure was ``rank``'s; ``ended``: ranks that
        ended on their own (by exit code) before the others were stopped."""
        launch = self.call.ranks.launch
        n = len(self.call.ranks.pids)
        ended = ended or {}

        def state(r: int) -> _outcome.RankState:
            if r in self.records:  # it answered: 1 for an error, 0 for a value
                code, stopped = (1 if isinstance(self.records[r], ErrorRecord) else 0), False
            elif r in ended:  # it ended by itself (its exit says how)
                code, stopped = ended[r], False
            else:  # it was still in the call: air_magic stopped it
                code, stopped = -signal.SIGKILL, True
            return _outcome.RankState(
                r, launch.ranks[r].log_path, self.call.ranks.pids[r], returncode=code, stopped=stopped
            )

        ending = _outcome.Ending(
            label="the pool's cell",
            world_size=n,
            ranks=tuple(state(r) for r in range(n)),
            failures=(rank,),
            device=launch.placement.device,
        )
        return _outcome.rank_error(ending, self.records, rank, "")

    def outcome(self, kind: str) -> list[Any]:
        errors = {r: rec for r, rec in self.records.items() if isinstance(rec, ErrorRecord)}
        if errors:
            first = first_failure(errors)
            if errors[first].type_name == "KeyboardInterrupt":
                raise interrupted("the pool's cell was interrupted on its ranks; the pool and its state are intact.")
            error = self._rank_exception(first)
            if self.call.regrouped:
                error.add_note(self.call.regrouped)
            if self.call.hangs is not None and self.call.hangs.last is not None:
                error.add_note(self.call.hangs.last.text())
            if kind in ("cell", "call") and self.call.ranks.launch.local_processes:
                self.engine.last_failed_rank = first
                error.add_note(
                    f"[air_magic] %distributed_debug opens rank {first}'s post-mortem (pdb in its frames) until the "
                    "next pool cell."
                )
            raise error
        n = len(self.call.ranks.conns)
        values = []
        for rank in range(n):
            record = self.records.get(rank)
            if isinstance(record, UnpicklableRecord):
                if kind == "pull":
                    error = _outcome.result_error(
                        rank,
                        n,
                        f"a {record.value_type} for {self.call.label}, which cannot be sent back ({record.reason})",
                    )
                    error.add_note(
                        "[air_magic] a module (DDP, FSDP2, DeepSpeed...) comes back with pool.state_dict(name) or "
                        "pool.model(name, factory)."
                    )
                    raise error
                raise _outcome.result_error(
                    rank, n, f"a {record.value_type}, which cannot be sent back ({record.reason})"
                )
            if isinstance(record, BaseException):
                if kind == "pull":
                    raise _pulled_error(self.call.label, rank, n, record)
                raise _outcome.result_error(rank, n, f"a value that cannot be loaded here ({record})")
            assert isinstance(record, ValueRecord)
            values.append(record.value)
        return values


def run_call(
    engine: PoolEngine, call: Call, kind: str, message: bytes, timeout: float | None, ended: Callable[[], None]
) -> list[Any]:
    """Send the call's ``message`` to every rank and wait for them (:meth:`CallWait.collect`);
    their values.  ``ended()`` is called once the call is over, before its watchers end."""
    ranks = call.ranks
    launch = ranks.launch
    log = launch.ranks[0].log_path
    for state in launch.ranks:  # bounded as a launch's are, between two calls
        bound_log_in_place(state.log_path, launch.limits.log)
    pump = OutputPump(log, launch.limits.output)
    try:
        pump.reader.offset = os.path.getsize(log)  # before the ranks get the call: all of its output
    except OSError:
        pass
    desk = None  # breakpoint(): a prompt in this cell; from what the ranks say after this
    if not call.background and launch.local_processes:
        desk = BreakpointDesk(launch.work_dir, len(ranks.conns), from_now=True)
    call.states = {r: RankCallState.RUNNING for r in range(len(ranks.conns))}
    wait = CallWait(engine, call, pump, desk=desk)
    if kind in ("cell", "call"):
        launch.set_machine_state(f"running {call.label}")
    view: PoolCallView | None = None
    outcome, error = "done", None
    try:
        with _held_sigint() as came:
            for conn in ranks.conns:
                try:
                    conn.send_bytes(message)
                except OSError:
                    wait.check_retired()
                    engine.break_ranks(ranks, "a rank's connection closed")
                    raise PoolBrokenError("the pool's ranks are gone; the next call starts fresh ones.") from None
            if kind in ("cell", "call") and not call.background and CALL_WATCHERS:
                view = PoolCallView(engine, launch, call, engine.cells)
                wait.watchers = _watch(view)
        try:
            records = wait.collect(timeout, interrupted=bool(came))
            if call.hangs is not None and not any(isinstance(r, ErrorRecord) for r in records.values()):
                call.hangs.finish()  # a notice still shown says the wait is over
        finally:
            pump.pump(final=True)
            _tell_forked(call)
        return wait.outcome(kind)
    except BaseException as exc:
        outcome, error = _outcome_text(ranks, exc), exc
        raise
    finally:
        if desk is not None:
            desk.close()
        if kind in ("cell", "call") and not ranks.broken:
            launch.set_machine_state("idle")
        ended()
        # The call is kept (what its ranks did of it), its watch is not: the watch reads the
        # replies, and the values they hold are the user's to drop.
        call.hangs = None
        if view is not None:
            view.finish(outcome, error)
        for watcher in wait.watchers:
            try:
                watcher.end()
            except Exception:  # a watcher (the panel) never changes the call's outcome
                pass


def _watch(view: PoolCallView) -> list[Any]:
    watchers = []
    for factory in CALL_WATCHERS:
        try:
            watcher = factory(view)
        except Exception:  # a watcher (the panel) never stops a call
            continue
        if watcher is not None:
            watchers.append(watcher)
    return watchers


@contextlib.contextmanager
def _held_sigint() -> Iterator[list[bool]]:
    """SIGINT held while a call goes out to the ranks (a message cut half-way, or sent to some
    ranks only, would leave the connections out of step and the pool broken): a Ctrl-C then is
    noted, and the call is interrupted as soon as every rank has it.  Only where Python's
    default handler is in place (the main thread; a user's own handler is left as it is)."""
    came: list[bool] = []
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is not signal.default_int_handler:
        yield came
        return
    signal.signal(signal.SIGINT, lambda *_: came.append(True))
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, previous)


def _outcome_text(ranks: Ranks, exc: BaseException) -> str:
    """How a call that raised ended, in a few words (the panel's last line)."""
    if ranks.retired:
        return f"the pool was {ranks.retired}"
    if ranks.broken:
        return f"the pool is broken ({ranks.broken})"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"failed ({type(exc).__name__})"


def _holds_output(watcher: Any) -> bool:
    """Whether ``watcher`` (the panel) wants rank 0's output held until it has shown itself."""
    try:
        return bool(watcher.holds_output())
    except Exception:  # a watcher (the panel) never changes the call's outcome
        return False


def _tell_forked(call: Call) -> None:
    """One line when the call's code forked processes with ``os.fork()``: their values are
    not the call's, and they end when they come to its end."""
    if not call.forked:
        return
    ranks = sorted(call.forked)
    pids = ", ".join(str(pid) for rank in ranks for pid in call.forked[rank])
    who = f"rank{'s' * (len(ranks) != 1)} {', '.join(map(str, ranks))}"
    print(
        f"[air_magic] {call.label} forked process{'es' * (pids.count(',') > 0)} {pids} on {who} with os.fork(): "
        "only the rank itself answers the kernel (these values are its own), and a forked process that runs on "
        "to the end of the cell ends there.",
        file=sys.stderr,
    )


def _state_of(record: Any) -> RankCallState:
    """What a rank did of the call, from its reply."""
    if isinstance(record, ErrorRecord):
        return RankCallState.INTERRUPTED if record.type_name == "KeyboardInterrupt" else RankCallState.FAILED
    return RankCallState.DONE


def _ended_call(record: Any) -> str:
    """How a rank that answered the call ended it, for a hang report's row."""
    if isinstance(record, ErrorRecord):
        return "interrupted" if record.type_name == "KeyboardInterrupt" else f"raised {record.type_name}"
    return "finished the call"


def _came_back(record: Any) -> str:
    """How a rank that answered the call ended it, for the lines that say where each rank was."""
    if isinstance(record, ErrorRecord):
        if record.type_name == "KeyboardInterrupt":
            return "had come back, interrupted"
        return f"had raised {record.type_name} (its error is above)"
    return "had come back (done with the call)"


def _pulled_error(label: str, rank: int, n: int, exc: BaseException) -> BaseException:
    """A pulled value the kernel cannot load: which name, from which rank, and what to pull instead."""
    text = str(exc)
    hint = ""
    if "process group" in text.lower():
        hint = (
            " It holds the ranks' process group (a DistributedDataParallel or FSDP module does): pull "
            "what it wraps (.module), or its state_dict()."
        )
    error = ResultError(
        f"{label}: the value on rank {rank} of {n} cannot be loaded in the kernel ({type(exc).__name__}: {text})."
        + hint
    )
    error.rank, error.world_size = rank, n
    return error
