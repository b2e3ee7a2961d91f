"""The handle of one launch (:class:`Launch`): its state, the blocking wait from the
cell, what the helper tells of its ranks, and its outcome.  :mod:`air_magic.kernel.launcher`
starts launches and re-exports this class.

Messages from the helper (read by the helper's reader thread) -> ``Launch.handle`` ->
the ranks' states; ``Done`` -> ``finish()``: the records read (``_rank_output``) and
turned into values or one error (``_outcome``), the observers' ``before_end`` and
``after_end``, the session files removed, ``done()`` true.  The cell's thread meanwhile
waits in ``wait_streaming()``, copying rank 0's output and printing the observers'
notices.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import threading
import time
import traceback
import uuid
from typing import Any, Callable, ClassVar, Iterator, Mapping, Protocol

from air_magic.backends.base import Backend
from air_magic.capture import Payload
from air_magic.errors import LaunchCancelledError, LaunchError, interrupted
from air_magic.kernel import logs as _logs
from air_magic.kernel import outcome as _outcome
from air_magic.kernel.inspect.debugger import BreakpointDesk
from air_magic.kernel.inspect.hang_report import HangReport
from air_magic.kernel.inspect.hangs import HangWatch, ReportShown, watch_launch
from air_magic.kernel.inspect.stacks import StallWatch, describe_stacks, read_stacks, request_stacks
from air_magic.kernel.outcome import RankState, describe_exit
from air_magic.kernel.rank_output import OutputPump, bound_log, collapse_log, log_end, read_records
from air_magic.protocol import (
    INTERRUPTED_EXIT,
    Exited,
    LaunchRequest,
    Started,
    StartFailed,
    Stop,
    Stopping,
    ToKernel,
    end_carriers,
    joined_path,
    left_path,
    log_dir,
    log_path,
    printable,
    signal_rank,
)
from air_magic.rank import results as _results
from air_magic.settings import settings
from air_magic.spec import LaunchSpec, Placement

__all__ = ["Launch", "LaunchObserver", "ObserverFactory"]

_POLL = 0.05
#: A launch's status while its ranks may still run; any other status is its outcome.
LIVE_STATUSES = ("starting", "running", "stopping")


@dataclasses.dataclass(frozen=True)
class _Limits:
    output: int  # bytes of rank 0's output copied into the cell (AIR_MAGIC_OUTPUT_LIMIT)
    stall_seconds: float  # quiet seconds before the ranks' stacks are looked at
    hang_seconds: float  # seconds no collective completes before a hang report (AIR_MAGIC_HANG_SECONDS)
    log: int  # bytes of each rank's log kept (AIR_MAGIC_LOG_LIMIT)


class LaunchOwner(Protocol):
    """What a launch uses of the launcher that started it (:class:`~air_magic.kernel.launcher.Launcher`)."""

    session_dir: str  # each launch's private work folder is made in it
    shm_root: str | None  # the same in /dev/shm, for large tensors (None: no room there)
    log_folder: _logs.LogFolder  # where the ranks' logs are kept

    def next_number(self) -> int:
        """The next launch's number in this kernel."""

    def send(self, message: Stop) -> None:
        """Send a stop to the launch's backend."""

    def is_active(self, launch: Launch) -> bool:
        """Whether ``launch`` has not yet ended (nor been given up)."""


class LaunchObserver(Protocol):
    """What optional pieces (MLflow tracking, the panel) see of a launch."""

    def before_start(self, launch: "Launch", env: dict[str, str]) -> None:
        """Called before the ranks start; may add environment variables for them."""

    def after_end(self, launch: "Launch") -> None:
        """Called once every rank has ended and the outcome is known (an observer may also
        have ``before_end(launch)``, called for every observer before the first
        ``after_end``: to read what another observer's ``after_end`` cleans up)."""


ObserverFactory = Callable[["Launch"], "LaunchObserver | None"]


class Launch:
    """One launch of a function or cell on N ranks, running in the background.

    What ``train.submit(...)`` and ``%%distributed --async`` return; shown in a cell, it is the
    launch's live panel. ``result()`` waits for it (``.distributed()`` does exactly that),
    ``cancel()`` stops it, ``done()`` and ``status`` tell where it is.

    Attributes read by users:

    - ``status``: ``"starting"``, ``"running"``, ``"stopping"``, then ``"finished"``,
      ``"failed"``, ``"cancelled"`` or ``"timed out"``.
    - ``ranks``: one entry per rank with ``rank``, ``state``, ``pid``, ``returncode`` and
      ``log_path``.
    - ``id``, ``label`` (the cell or the function), ``world_size``, ``log_dir``.
    - ``run_id``, ``run_name``, ``run_url`` (on a tracking server) and ``run_command`` (the
      ``mlflow ui`` command of a local store): the launch's MLflow run, once it exists.
    - ``timings``: where the launch's time went, in seconds.

    Example::

        h = train.submit(lr=1e-3)
        h.status, h.done()          # ('running', False)
        h.result(timeout=600)       # the per-rank values, or the launch's exception
    """

    #: How a launch shows in a notebook: set by the panel's plug-in (``air_magic.plugins``).
    render: ClassVar[Callable[["Launch"], dict[str, Any]] | None] = None

    def __init__(self, launcher: LaunchOwner, spec: LaunchSpec, placement: Placement, payload: Payload) -> None:
        self.launcher = launcher
        self.spec = spec
        #: The settings it runs with, read as it starts (a change of ``AIR_MAGIC_*`` while it
        #: runs is for the next launch; a bad value never reaches one that runs).
        self.limits = _Limits(settings.output_limit, settings.stall_seconds, settings.hang_seconds, settings.log_limit)
        self.placement = placement
        self.label = payload.label
        self.kind = payload.kind
        self.id = f"{launcher.next_number():04d}-{uuid.uuid4().hex[:8]}"
        #: The item lists show it as: a pool's key (one item across its restarts), else its id.
        self.group = payload.group or self.id
        self.work_dir = os.path.join(launcher.session_dir, self.id)
        self.started_at = time.time()
        # Kept after the kernel exits (the user's log folder), else in the session folder.
        logs = launcher.log_folder.root()
        self.log_dir = _logs.launch_log_dir(logs, self.id, self.started_at) if logs else log_dir(self.work_dir)
        self.shm_dir = os.path.join(launcher.shm_root, self.id) if launcher.shm_root else None
        self.world_size = placement.world_size
        self.ranks = [RankState(r, log_path(self.log_dir, r)) for r in range(self.world_size)]
        #: The launch's MLflow run, once tracking has made it (set by the tracking plug-in):
        #: its id, its name, a link to it on an http(s) server, and the command that opens
        #: it where there is no server (``mlflow ui --backend-store-uri ...``).
        self.run_id: str | None = None
        self.run_name: str | None = None
        self.run_url: str | None = None
        self.run_command: str | None = None
        #: A panel says the run (live, and in its summary): the tracking plug-in then prints
        #: no announcement of its own, so that the run is said once in the cell.
        self.run_shown = False
        #: What an observer still stores after the end ("storing 1,234 points…", set by the
        #: tracking plug-in): the values come back at once, the rest is stored behind them.
        #: None once stored; :meth:`when_stored` runs its hooks then.
        self.storing: str | None = None
        self._stored_hooks: list[Callable[[list[tuple[str, str]]], None]] = []
        self._stored_lock = threading.Lock()
        self.ended_at: float | None = None
        self.status = "starting"
        # Only the cell/function sources stay (for the panel's linter): the pickled
        # arguments and globals are not pinned in the kernel by `last_launch`.
        self.sources = payload.sources
        self._stop_reason: str | None = None
        self._failures: list[int] = []
        self._stops: list[tuple[str, float]] = []  # every stop the helper began: (reason, when)
        #: What runs its ranks: the helper process they are forked from, or another backend
        #: (:class:`air_magic.backends.ray.backend.RayBackend`) that speaks the same messages.
        self.helper: Backend | None = None
        self.request: LaunchRequest | None = None  # what the helper was sent
        self.sent_again = False  # to a new helper, the first having gone before starting it
        self._cancel_requested = False
        #: Who stopped it from outside (``air-magic stop by alice (pid 42 on gpu-box) at
        #: 12:00:01``), once a rank ended by that stop.
        self.stopped_by: str | None = None
        #: A pool's ranks: what cancel() (a panel's Stop) does instead of stopping them; it
        #: interrupts the pool's running call as Ctrl-C does (True if there was one).
        self.cancel_instead: Callable[[], bool] | None = None
        #: Nobody waits for it as it starts (``.submit()``, ``--async``): see :meth:`debug`.
        self.background = False
        self._done = threading.Event()
        self._outcome: tuple[bool, Any] | None = None
        self._error_text: str | None = None
        self.observers: list[LaunchObserver] = []
        #: Environment of one rank only, set before the ranks start (the GPU claims: on MIG
        #: instances, each rank's own ``CUDA_VISIBLE_DEVICES``).
        self.rank_env: dict[int, dict[str, str]] = {}
        self._notices: collections.deque[tuple[str | Callable[[], None], str]] = collections.deque()
        #: Where the time of the launch went, for ``benchmarks/launch`` and the curious:
        #: ``time.monotonic()`` (one clock for every process of the machine) at ``call``,
        #: ``sent`` (the helper has the request), ``started`` (its ranks are forked),
        #: ``done`` (every rank has ended), ``outcome`` (the values are read) and
        #: ``returned``; and seconds spent in each observer's hooks (``tracking.before_start``...).
        self.timings: dict[str, float] = {"call": time.monotonic()}
        self._waiter = False  # a blocking wait (the cell) prints the notices; else the launcher
        self._interrupted = False  # the user interrupted the cell that waited for it
        self._interrupt_text: str | None = None
        self._pump: OutputPump | None = None
        self._hangs: HangWatch | None = None  # the waiting cell's hang watch
        self._internal_error: LaunchError | None = None  # air_magic's own failure (fail_inside)

    # -- public handle ----------------------------------------------------------------------

    def done(self) -> bool:
        """Whether every rank has ended and the outcome is known."""
        return self._done.is_set()

    @property
    def log_paths(self) -> list[str]:
        """Each rank's log file (its stdout and stderr) in rank order, readable while it runs
        and after the kernel has gone."""
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

    def set_machine_state(self, state: str) -> None:
        """What the machine's list (``air-magic ps``, the sidebar's "On this machine") says the
        launch does now: a pool's ``idle`` between calls, ``running Cell In[5]`` during one."""
        for observer in self.observers:
            changed = getattr(observer, "state_changed", None)
            if changed is None:
                continue
            try:
                changed(self, state)
            except Exception:  # the list is a description: never a call's failure
                pass

    def notify_call(self, show: Callable[[], None]) -> None:
        """Like :meth:`notify`, for an observer's display (the panel's summary): ``show()``
        is called, in turn with the lines, by the thread that prints them; for a cell that
        waits, after the last of rank 0's output and before the cell's value."""
        self._notices.append((show, ""))

    def set_storing(self, text: str | None, notes: list[tuple[str, str]] | None = None) -> None:
        """What is still stored after the end (``text``), or None once it is; ``notes``: the
        lines to tell then, as (line, "stdout" or "stderr"): the run made after the end, what
        the store refused or kept for later.  The hooks show them; without hooks they are
        printed here."""
        with self._stored_lock:
            self.storing = text
            hooks = [] if text is not None else self._stored_hooks
            if text is None:
                self._stored_hooks = []
        if text is None and not hooks:
            for line, stream in notes or ():
                out = sys.stdout if stream == "stdout" else sys.stderr
                out.write(line + "\n")
                out.flush()
        for hook in hooks:
            try:
                hook(list(notes or ()))
            except Exception as exc:  # a display must never stop the others' hooks
                sys.stderr.write(f"[air_magic] could not show that launch {self.id} was stored: {exc}\n")

    def when_stored(self, hook: Callable[[list[tuple[str, str]]], None]) -> bool:
        """Call ``hook(notes)`` once nothing is left to store (from the thread that stored it);
        False, and nothing registered, if nothing is being stored now."""
        with self._stored_lock:
            if self.storing is None:
                return False
            self._stored_hooks.append(hook)
            return True

    def print_notices(self, final: bool = True) -> None:
        """Print the lines :meth:`notify` queued (from the thread that shows the launch);
        before ``final`` (the last of rank 0's output is written), up to a display of
        :meth:`notify_call` only: that one comes after rank 0's output."""
        while self._notices:
            if not final and callable(self._notices[0][0]):
                return
            item, stream = self._notices.popleft()
            if self._pump is not None:
                self._pump.end_line()  # in a terminal: not over the end of a progress bar
            if callable(item):
                try:
                    item()
                except Exception as exc:  # an observer's display must never hide the outcome
                    sys.stderr.write(f"[air_magic] could not show the end of the launch: {exc}\n")
                continue
            out = sys.stdout if stream == "stdout" else sys.stderr
            out.write(item + "\n")
            out.flush()

    @property
    def waiting_for(self) -> str:
        """What a launch that has not started its ranks yet waits for ('' once they run)."""
        if self.status != "starting":
            return ""
        if self.helper is not None:
            return self.helper.waiting_for(self.world_size)
        return f"forking {self.world_size} rank{'s' * (self.world_size != 1)}"

    def cancel(self) -> bool:
        """Stop every rank (SIGINT, then SIGTERM, then SIGKILL). False if it had already ended
        (its outcome is known, even while the observers are still told of its end).  A pool's
        launch is not stopped: the pool's running call is interrupted, as Ctrl-C interrupts it
        (False when none runs)."""
        if self._done.is_set() or self.status not in LIVE_STATUSES:
            return False
        if self.cancel_instead is not None:
            return self.cancel_instead()
        self._cancel_requested = True
        self.launcher.send(Stop(self.id, "cancel"))
        return True

    def stacks(self, timeout: float = 2.0) -> dict[int, str]:
        """Every running rank's Python stacks, all threads, by rank (cell names as in the
        notebook).  The ranks write them from a signal handler, so this works while they
        are blocked in a collective or in native code.

        >>> print(handle.stacks()[1])     # doctest: +SKIP
        """
        if self.helper is not None and not self.helper.local_processes:  # its backend asks them
            return read_stacks(self.work_dir, self.helper.stacks(self.id, timeout), self.sources)
        running = {state.rank: state.pid for state in self.ranks if state.pid and state.returncode is None}
        request_stacks(self.work_dir, running, timeout)
        return read_stacks(self.work_dir, running, self.sources)

    def signal_ranks(self, ranks: list[int], signum: int) -> None:
        """Send ``signum`` to these running ranks (the user's code sees it: a pool's SIGINT)."""
        if self.helper is not None and not self.helper.local_processes:
            self.helper.signal_ranks(self.id, ranks, signum)
            return
        for rank in ranks:
            state = self.ranks[rank]
            if state.pid and state.returncode is None:
                signal_rank(state.pid, signum)

    @property
    def local_processes(self) -> bool:
        """Whether the ranks are processes of this machine (their pids mean something here)."""
        return self.helper is None or self.helper.local_processes

    def hang_report(self) -> HangReport | None:
        """Why the ranks are stuck, as data: a row per rank (state, group, sequence number,
        op, shapes, file:line) and a verdict, read now from torch's Flight Recorder in each
        rank (a Ray launch's through its agents); None when no rank waits in a collective.
        ``print()`` it for the table; a notebook shows it as one.

        >>> launch.hang_report()          # doctest: +SKIP
        """
        return self.hang_watch(lambda report: None).look()

    def hang_watch(
        self,
        show: Callable[[HangReport], None],
        ended: Callable[[], Mapping[int, str]] | None = None,
        sources: dict[str, tuple[str, str]] | None = None,
    ) -> HangWatch:
        """A :class:`~air_magic.kernel.inspect.hangs.HangWatch` of this launch's ranks (``sources``:
        the cells whose names its report says; a pool's call has its own)."""
        return watch_launch(self, show, ended, self.sources if sources is None else sources)

    def where(self, stacks: dict[int, str], absent: str = "had ended") -> str:
        """One line per rank: where it was, and which rank the others wait for (one
        without a stack is ``absent``; one its hang watch saw waiting in a hook's collective
        says so)."""
        waiting = self._hangs.waiting() if self._hangs is not None else {}
        return describe_stacks(stacks, self.world_size, absent, waiting)

    def __repr__(self) -> str:
        took = (self.ended_at or time.time()) - self.started_at
        where = f"{self.world_size} {'GPU' if self.placement.device == 'cuda' else 'CPU'} rank{'s' * (self.world_size != 1)}"
        run = f", MLflow run {self.run_id}" if self.run_id else ""
        return f"<Launch {self.id} {self.label}: {self.status} after {took:.1f} s on {where}{run}>"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """In a notebook a launch shows as its live panel (a summary once it has ended),
        when the panel plugged itself in (``Launch.render``); else as its repr."""
        render = Launch.render
        bundle = render(self) if render is not None else {}
        return bundle or {"text/plain": repr(self)}

    @property
    def _ipython_display_(self) -> Callable[[], None] | None:
        """IPython's hook, present only where the panel says the launch is shown already
        (its own cell: ``Launch.render`` gives ``{}``): the handle then adds no second,
        soon stale, line (``Out[n]: <Launch ... starting ...>``) under its panel.  Elsewhere
        it is None and IPython uses :meth:`_repr_mimebundle_`."""
        render = Launch.render
        if render is not None and not render(self):
            return _shown_already
        return None

    # -- blocking wait, from the main thread ------------------------------------------------

    def debug(self) -> None:
        """Open, in this cell, the pdb prompts of this launch's ranks stopped at a breakpoint
        (a background launch: ``.submit()``, ``%%distributed --async``), and go on serving them
        until the launch ends; Ctrl-C (or ``q``) stops every rank, as it does in a waited cell.

        A rank of a background launch waits ``AIR_MAGIC_BREAKPOINT_WAIT`` seconds (300) at a
        breakpoint for this call, shown as paused in the panel, then goes on with one line."""
        if not self.local_processes:
            raise LaunchError(f"{self.label} runs on another machine's ranks: its breakpoints are skipped there.")
        desk = BreakpointDesk(self.work_dir, self.world_size, only_paused=True)
        with _interrupt_flag() as interrupt:
            try:
                while not self._done.wait(_POLL):
                    interrupt.raise_if_set()
                    desk.poll()
            except KeyboardInterrupt:
                self.cancel()
                self._done.wait(10)
                raise interrupted(f"you stopped {self.label} from its debugger; every rank was stopped.") from None
            finally:
                desk.close()

    def wait_streaming(self) -> list[Any]:
        """Wait in short slices, copying rank 0's output into the cell; Ctrl-C stops the ranks."""
        # Ctrl-C is a flag from here on: one that comes while the wait gets ready (the flush
        # below waits for the kernel's output thread, seconds on a loaded machine) is the
        # loop's first look, and stops the ranks, rather than leaving them running.
        with _interrupt_flag() as interrupt:
            try:
                pump = OutputPump(self.ranks[0].log_path, self.limits.output, terminal=_is_terminal(sys.stdout))
                stall = StallWatch(self, self.limits.stall_seconds)
            except Exception as exc:  # never a launch that runs on with nobody waiting for it
                return self._failed_wait(exc)
            self._pump = pump  # finish() has it read the rest before the logs are rewritten
            self._waiter = True
            sys.stdout.flush()  # what the observers printed at the start comes before the ranks' output
            try:
                return self._wait_streaming(pump, stall, interrupt)
            except Exception as exc:
                if self._done.is_set():  # the launch's own outcome (a rank's error), or after it
                    raise
                return self._failed_wait(exc)  # air_magic's own failure while ranks ran: as above

    def _failed_wait(self, exc: Exception) -> list[Any]:
        self.fail_inside(exc, "waiting for the ranks")
        self._done.wait(10)  # the helper reports the killed ranks; finish() ends the launch
        assert self._internal_error is not None
        raise self._internal_error

    def _wait_streaming(self, pump: OutputPump, stall: StallWatch, interrupt: "_InterruptFlag") -> list[Any]:
        # A rank stopped at a breakpoint: its pdb prompt in this cell (ranks of this machine).
        desk = BreakpointDesk(self.work_dir, self.world_size) if self.local_processes else None

        # No collective completes while some rank waits in one: a hang report in the cell.
        def before_report() -> None:  # rank 0's lines so far come first
            pump.pump()
            pump.end_line()

        shown = ReportShown(os.path.join(self.log_dir, "hang-report"), before=before_report)
        hangs = self.hang_watch(shown)
        self._hangs = hangs
        try:
            return self._serve_until_done(pump, stall, interrupt, desk, hangs)
        finally:
            if desk is not None:
                desk.close()

    def _serve_until_done(
        self,
        pump: OutputPump,
        stall: StallWatch,
        interrupt: "_InterruptFlag",
        desk: BreakpointDesk | None,
        hangs: HangWatch | None,
    ) -> list[Any]:
        try:
            while not self._done.wait(_POLL):
                interrupt.raise_if_set()
                self.print_notices(final=False)
                pump.pump()
                if desk is not None:
                    desk.poll()
                stall.check()
                if hangs is not None:
                    hangs.check()
        except KeyboardInterrupt:
            self._interrupted = True  # before the stop: the outcome says who stopped it
            where = self.where(self.stacks(timeout=1.0))
            if hangs is not None and hangs.current is not None:  # the hang it stopped, as the cell showed it
                where = (where + "\n" + hangs.current.text()).strip()
            self.cancel()
            self.print_notices(final=False)  # the lines that came before the interrupt
            if where:
                pump.end_line()
                sys.stderr.write(where + "\n")
                sys.stderr.flush()
            try:
                while not self._done.wait(_POLL):
                    interrupt.raise_if_set()
                    pump.pump()
                    self.print_notices(final=False)
            except KeyboardInterrupt:  # a second interrupt: no more grace
                self.launcher.send(Stop(self.id, "kill"))
                self._kill_now()
                self._done.wait(10)
            pump.pump(final=True)
            self.print_notices()
            raise interrupted(self._interrupt_text or self.interrupt_message()) from None
        if hangs is not None and self.status == "finished":
            hangs.finish()  # a notice still shown says the wait is over
        pump.pump(final=True)
        self.print_notices()
        values = self.result()
        # The caller owns the values now; the handle (kept as .last_launch) must not pin
        # hundreds of MB of returned tensors in the kernel.
        self._outcome = (True, None)
        self.timings["returned"] = time.monotonic()
        return values

    # -- events from the helper (reader thread) ---------------------------------------------

    def handle(self, message: ToKernel) -> None:
        """A message from the helper about this launch (the helper's reader thread)."""
        if isinstance(message, Started):
            self._on_started(message.pids, message.nodes or {})
        elif isinstance(message, Exited):
            self._on_exit(message.rank, message.returncode, message.at)
        elif isinstance(message, Stopping):
            self._on_stopping(message.reason, message.at)
        elif isinstance(message, StartFailed):
            self._error_text = message.text  # the launcher then calls finish()

    def _on_started(self, pids: dict[int, int], nodes: dict[int, str]) -> None:
        self.timings["started"] = time.monotonic()
        for rank, pid in pids.items():
            self.ranks[rank].pid = pid
            self.ranks[rank].node = nodes.get(rank)
        if self.status == "starting":
            self.status = "running"
        for observer in self.observers:  # an observer may say what the ranks are (the machine's list)
            hook = getattr(observer, "after_start", None)
            if hook is not None:
                try:
                    hook(self)
                except Exception:  # never the launch's outcome
                    pass

    def _on_exit(self, rank: int, returncode: int, at: float | None = None) -> None:
        state = self.ranks[rank]
        state.returncode = returncode
        state.ended_at = at
        state.stopped = _outcome.is_stopped_exit(returncode, at, self._stop_at, self._stops)
        # Exit code 0 without a result (os._exit(0)): its peers would wait for it in
        # init_process_group or a collective until the timeout. A failure: stop them now.
        state.left = returncode == 0 and not os.path.exists(_results.result_path(self.work_dir, rank))
        if returncode == 0 and not state.left and self._left_before_the_rendezvous(rank):
            state.left = state.returned_early = True
        if returncode != 0 and self._stop_reason is None and self.stopped_from_outside():
            # air-magic stop (or the sidebar's Stop) ended it: a stop, said with who asked.
            state.stopped = True
            self._cancel_requested = True
            self.launcher.send(Stop(self.id, "cancel"))
            return
        if returncode == INTERRUPTED_EXIT and self._stop_reason is None:
            # Its code was interrupted (q at its breakpoint): the launch is cancelled, not failed.
            state.stopped = True
            self._cancel_requested = True
            self.launcher.send(Stop(self.id, "cancel"))
            return
        if (returncode != 0 or state.left) and self._stop_reason is None:
            self._failures.append(rank)
            if state.left and self.world_size > 1:
                self.launcher.send(Stop(self.id, "failure"))

    def stopped_from_outside(self) -> bool:
        """Whether someone allowed to stop this launch asked it (``air-magic stop``, the
        sidebar): who, kept for the outcome's message."""
        if self.stopped_by is None:
            from air_magic.protocol import registry

            try:
                request = registry.stop_request(self.id)
            except OSError:  # (the list's folder cannot be trusted: no request there)
                request = None
            if request is not None:
                self.stopped_by = registry.describe_stop(request)
        return self.stopped_by is not None

    def _left_before_the_rendezvous(self, rank: int) -> bool:
        """``rank`` returned without entering init_process_group(): mark it for ranks that
        enter later (they fail at once), and say whether ranks already wait in it."""
        if os.path.exists(joined_path(self.work_dir, rank)):
            return False
        try:
            os.close(os.open(left_path(self.work_dir, rank), os.O_WRONLY | os.O_CREAT, 0o600))
            waiting = [
                r
                for r in range(self.world_size)
                if r != rank and self.ranks[r].returncode is None and os.path.exists(joined_path(self.work_dir, r))
            ]
        except OSError:
            return False
        return bool(waiting)

    @property
    def _stop_at(self) -> float | None:
        """time.monotonic() when the helper began to stop the launch (its first stop)."""
        return self._stops[0][1] if self._stops else None

    def _on_stopping(self, reason: str, at: float | None = None) -> None:
        self._stop_reason = self._stop_reason or reason
        began = at if at is not None else time.monotonic()
        self._stops.append((reason, began))  # each stop's signals, by when they could be sent
        self.status = "stopping"
        # A rank the stop ended whose exit was told first (the helper's messages cross): stopped,
        # not failed, as the cell says (a pool broken by its interrupt showed "r1 failed").
        for state in self.ranks:
            if state.returncode is not None and not state.stopped:
                state.stopped = _outcome.is_stopped_exit(state.returncode, state.ended_at, self._stop_at, self._stops)

    def finish(self) -> None:
        """Every rank has ended: the outcome, the observers' end, the files' cleanup.

        Whatever fails in here (a bug of air_magic's, not the user's code) still ends the
        launch: its ranks are stopped, it fails with an error that says so and where the
        traceback was written, and the next launch works."""
        if self._done.is_set():
            return
        try:
            self._finish()
        except BaseException as exc:
            self.fail_inside(exc, "ending the launch")
            self._end_failed()

    def fail_inside(self, exc: BaseException, during: str) -> None:
        """air_magic itself failed while ``during`` (on the reader thread, in ``finish()``):
        the ranks are stopped, and the launch's outcome is a ``LaunchError`` that says so,
        with the traceback kept in the launch's log folder."""
        if self._internal_error is not None:
            return
        self.launcher.send(Stop(self.id, "kill"))
        self._kill_now()
        where = os.path.join(self.log_dir, "air_magic-error.log")
        try:
            os.makedirs(self.log_dir, mode=0o700, exist_ok=True)
            with open(os.open(where, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "w") as handle:
                handle.write(f"launch {self.id}, while {during}:\n")
                traceback.print_exception(type(exc), exc, exc.__traceback__, file=handle)
            told = f"Its traceback is in {where}."
        except OSError:
            told = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
        self._internal_error = LaunchError(
            f"air_magic failed while {during} of {self.label} ({type(exc).__name__}: {printable(exc)}); "
            f"its ranks were stopped. This is a bug of air_magic, not of your code; the next launch "
            f"works. {told}"
        )
        self._internal_error.__cause__ = exc

    def _end_failed(self) -> None:
        """The end of a launch whose ``_finish()`` failed: its error is the outcome; each of
        the remaining steps is tried on its own, and ``done()`` is true whatever happens."""
        try:
            self.status = "failed"
            self._outcome = (False, self._internal_error)
            self.ended_at = self.ended_at or time.time()
            for observer in self.observers:
                try:
                    observer.after_end(self)
                except Exception:  # an observer that failed already: told once, above
                    pass
            self._cleanup_files()
            if not self._waiter:
                self.print_notices()
        except BaseException:  # nothing more to do: the waiter must not hang
            pass
        finally:
            self._done.set()

    def _finish(self) -> None:
        self.timings["done"] = time.monotonic()
        try:
            outcome = self._build_outcome()
        except BaseException as exc:  # never leave a waiter hanging
            outcome = (False, exc)
        if self._internal_error is not None:  # the reader failed on one of its messages
            outcome = (False, self._internal_error)
            self.status = "failed"
        self.timings["outcome"] = time.monotonic()
        if self._pump is not None:
            self._pump.hold_rest()  # what rank 0 printed last reaches the cell as printed
        for state in self.ranks:  # before the observers: MLflow keeps the bounded log too
            bound_log(state.log_path, self.limits.log)
        try:
            from air_magic.kernel.teardown import check

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
                    with self.timed(observer, "before_end"):
                        before_end(self)
                except Exception as exc:  # as after_end: never hides the outcome
                    sys.stderr.write(f"[air_magic] {type(observer).__name__} failed at the end: {exc}\n")
        # The panel has read the logs whole (before_end); MLflow keeps them (after_end) with
        # each progress bar at its last state.
        for state in self.ranks:
            collapse_log(state.log_path)
        for observer in self.observers:
            try:
                with self.timed(observer, "after_end"):
                    observer.after_end(self)
            except Exception as exc:  # an observer must never hide the launch's outcome
                sys.stderr.write(f"[air_magic] {type(observer).__name__} failed at the end: {exc}\n")
        self._cleanup_files()
        if not self._waiter:  # a submitted launch: nobody else prints them
            self.print_notices()
        self._done.set()

    @property
    def waited_on(self) -> bool:
        """Whether a cell waits for this launch (it then prints the launch's notices)."""
        return self._waiter

    @contextlib.contextmanager
    def timed(self, observer: Any, hook: str) -> Iterator[None]:
        """Time an observer's hook into ``timings`` (``<name>.<hook>``, seconds)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            name = getattr(observer, "timing_name", type(observer).__name__)
            self.timings[f"{name}.{hook}"] = time.perf_counter() - began

    def _kill_now(self) -> None:
        if not self.local_processes:
            return  # the backend was sent Stop(kill)
        for state in self.ranks:
            if state.pid and state.returncode is None:
                try:
                    os.killpg(state.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def helper_died(self, returncode: int | None) -> None:
        """The helper went away with this launch running: its ranks are killed, it fails.

        What its ranks started in sessions of their own is no longer the helper's to reap
        (it was their subreaper): every process that carries the launch's id ends too."""
        self._kill_now()
        if self.local_processes:
            end_carriers(self.id)
        if returncode is not None and returncode < 0:
            how = ": it " + describe_exit(returncode).replace(": ", ", ", 1)
        else:
            how = f" (exit {returncode})" if returncode is not None else " (its exit status is not known)"
        self._error_text = (
            f"the air_magic helper process died{how}; the ranks were stopped. The next launch starts a new helper."
        )
        self.finish()

    # -- outcome (the decision itself: _outcome) ------------------------------------------------

    def _build_outcome(self) -> tuple[bool, Any]:
        ending = _outcome.Ending(
            label=self.label,
            world_size=self.world_size,
            ranks=tuple(dataclasses.replace(state) for state in self.ranks),  # a snapshot
            timeout=self.spec.timeout,
            device=self.placement.device,
            error_text=self._error_text,
            stop_reason=self._stop_reason,
            cancel_requested=self._cancel_requested,
            stopped_by=self.stopped_by,
            failures=tuple(self._failures),
            shown_rank=0 if self._pump is not None else None,
        )
        records = read_records(self.work_dir, ending, self.shm_dir) if _outcome.needs_records(ending) else {}
        where = ""
        if ending.error_text is None and ending.stop_reason == "timeout":
            where = self.where(read_stacks(self.work_dir, range(self.world_size), self.sources))
            hangs = self._hangs
            if hangs is not None and hangs.current is not None:  # the hang it ran out of time in
                where = (where + "\n" + hangs.current.text()).strip()
        tails = {}
        if ending.failures and _outcome.needs_records(ending):
            tails = {r: log_end(self.ranks[r].log_path) for r in _outcome.failed_ranks(ending, records)}
        outcome = _outcome.decide(ending, records, where, tails)
        self.status = outcome.status
        if self._interrupted and outcome.status == "cancelled":
            # The summary and the cell's error say the same thing, in the same words.
            self._interrupt_text = self.interrupt_message()
            return False, LaunchCancelledError(self._interrupt_text)
        return outcome.ok, outcome.value

    def interrupt_message(self) -> str:
        """What an interrupted launch says, in its summary and as the cell's error."""
        took = (self.ended_at or time.time()) - self.started_at
        # A rank the stop reached exits with KeyboardInterrupt (1) or a signal; one that had
        # finished on its own exits with 0.
        stopped = [state.rank for state in self.ranks if state.returncode != 0]
        if not stopped or len(stopped) == self.world_size:
            which = _outcome.stopped(self.world_size)
        else:
            ranks = ", ".join(map(str, stopped))
            were = "were" if len(stopped) != 1 else "was"
            which = f"rank{'s' * (len(stopped) != 1)} {ranks} of its {self.world_size} {were} stopped"
        return f"{self.label} was cancelled: you interrupted it after {took:.1f} s; {which}."

    def _cleanup_files(self) -> None:
        if os.path.dirname(self.log_dir) != self.work_dir:  # the logs are kept elsewhere
            shutil.rmtree(self.work_dir, ignore_errors=True)
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


def _is_terminal(stream: Any) -> bool:
    """Whether rank 0's output is copied to a terminal (terminal IPython, a script run in
    one), where a carriage return only moves the cursor; not a Jupyter kernel's stream."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # a replaced or closed stream
        return False


def _shown_already() -> None:
    """What displaying a launch does where its panel is shown already: nothing."""


class _InterruptFlag:
    """Ctrl-C (SIGINT) while a launch is waited on, as a flag the wait loop reads.

    Python's own handler raises KeyboardInterrupt wherever the main thread happens to be,
    and an exception raised inside a finalizer (``__del__``, a weakref callback, a garbage
    collection) is printed as "Exception ignored" and lost: the interrupt would never reach
    the loop and the ranks would run on.  This handler only records the signal; the loop
    raises KeyboardInterrupt at a point of its own, within ``_POLL`` seconds.
    """

    def __init__(self) -> None:
        self._set = threading.Event()

    def handle(self, signum: int, frame: Any) -> None:
        self._set.set()

    def raise_if_set(self) -> None:
        if self._set.is_set():
            self._set.clear()
            raise KeyboardInterrupt


@contextlib.contextmanager
def _interrupt_flag() -> Iterator[_InterruptFlag]:
    """Catch SIGINT as a flag while the block runs, where Python's default handler is in
    place (the main thread; a user's own handler, or an ignored SIGINT, is left as it is)."""
    flag = _InterruptFlag()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is not signal.default_int_handler:
        yield flag
        return
    signal.signal(signal.SIGINT, flag.handle)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
    # One that came after the loop's last look is not lost (an error on its way out, the
    # cancelled launch's included, already says what happened).
    flag.raise_if_set()
