"""A pool of ranks that stays across cells: the kernel side (the rank side is
:mod:`air_magic.rank.pool.serve`; what travels between them, :mod:`air_magic.kernel.pool.wire`;
what the pool says of itself, :mod:`air_magic.kernel.pool.status`; a call seen as a
launch, for the panel, :mod:`air_magic.kernel.pool.view`; where the ranks connect and how
each is known as one of the pool's, :mod:`air_magic.kernel.pool.listener`).

A pool is a launch that stays: its ranks are forked by the helper as for any launch (so a
kernel's shutdown, restart or death takes them along), join the default process group
once, and then run what the kernel sends them over one connection each::

    PoolEngine.start()   a Unix socket in a private folder (auth key), a launch whose
                         payload is "serve the pool"; every rank connects -> _Ranks
    run_cell / call      ("cell" | "call", id, data + the kernel's cwd, sys.path and
                         changed environment) to every rank; rank 0's log into the cell;
                         each rank's reply to call #id -> the values in rank order, or its
                         error (a reply to another call breaks the pool: never a wrong value)
    push / pull          names set in, or read from, every rank's namespace
    broken               a rank died, or did not come back from an error, an interrupt or
                         the timeout within a few seconds: its ranks are killed (their
                         stacks shown first) and the next use starts fresh ones, saying so
    restart / close      the old _Ranks are retired: a call still running on them ends
                         with an error that says so, and never touches the new ones

One pool per kernel: a new ``air_magic.Pool(...)`` closes the kernel's earlier one, saying so.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, NoReturn

import cloudpickle

from air_magic import capture
from air_magic.errors import AirMagicError, LaunchError, LaunchTimeoutError, ResultError, interrupted
from air_magic.kernel import outcome as _outcome
from air_magic.kernel.inspect.debugger import BreakpointDesk, post_mortem_on
from air_magic.kernel.inspect.hangs import HangReport, HangWatch, ReportShown
from air_magic.kernel.launch import Launch
from air_magic.kernel.launcher import Launcher
from air_magic.kernel.pool import regroup as pool_regroup
from air_magic.kernel.pool import status as _status
from air_magic.kernel.pool.call import Call as _Call
from air_magic.kernel.pool.call import RankCallState
from air_magic.kernel.pool.call import Ranks as _Ranks
from air_magic.kernel.pool.decide import CLOSED_GRACE, first_gone
from air_magic.kernel.pool.interrupt import GRACE, Interrupt
from air_magic.kernel.pool.listener import greet as _greet
from air_magic.kernel.pool.listener import listener as _listener
from air_magic.kernel.pool.view import PoolCallView
from air_magic.kernel.pool.wire import OutOfStep, replies
from air_magic.kernel.rank_output import (
    OutputPump,
    bound_log_in_place,
    describe_stacks,
    read_stacks,
    request_stacks,
    user_frame,
)
from air_magic.kernel.request import working_directory
from air_magic.protocol import RESULT_NAME, ErrorRecord, Stop, UnpicklableRecord, ValueRecord
from air_magic.settings import settings
from air_magic.spec import LaunchSpec

__all__ = [
    "PoolEngine",
    "PoolBrokenError",
    "PoolBusyError",
    "PoolCall",
    "current_pool",
    "open_pools",
    "pool_of",
    "close_all",
    "POOL_START_TIMEOUT",
    "GRACE",
]

#: Seconds a pool waits for its ranks to connect (the helper may still be importing torch).
POOL_START_TIMEOUT = 300.0
#: Factories called as a pool's cell or call begins in the caller's thread (not a
#: ``submit``), with the call seen as a launch (:class:`~air_magic.kernel.pool.view.PoolCallView`):
#: each returns a watcher, or None.  Its ``tick()`` is called from the call's wait loop (every
#: few tens of ms: it must be cheap) and its ``end()`` once the call is over and the view says
#: how (the live panel registers one: :mod:`air_magic.panel._pool`; plugins.py wires it).
#: While its ``holds_output()`` is true, rank 0's output waits (the panel shows above it).
CALL_WATCHERS: list[Callable[[PoolCallView], Any]] = []

_pools: list["PoolEngine"] = []  # open pools of this kernel, the most recently started last
_pools_lock = threading.Lock()


class PoolBrokenError(AirMagicError):
    """A pool's ranks could not go on: a cell of a broken pool starts fresh ranks first."""


class PoolBusyError(AirMagicError):
    """The pool is running another call (a ``pool.submit(...)`` not yet done)."""


class PoolCall:
    """A call running on a pool in the background (``pool.submit``): ``result()``,
    ``exception()``, ``done()`` and ``cancel()``, as a launch's handle has them."""

    def __init__(self, engine: "PoolEngine", label: str) -> None:
        self._engine = engine
        self.label = label
        self._future: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()

    def done(self) -> bool:
        """Whether the call has ended on every rank."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> list[Any]:
        """The values in rank order (waits at most ``timeout`` s); a rank's error is raised."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's error once it has ended (waits at most ``timeout`` s), ``None`` if it succeeded."""
        return self._future.exception(timeout)

    def cancel(self) -> bool:
        """Interrupt the call on every rank (KeyboardInterrupt in its code); False if it had ended."""
        if self._future.done():
            return False
        self._engine.interrupt(list(range(self._engine.world_size)))
        return True

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<PoolCall {self.label} on {self._engine.world_size} ranks: {state}>"


def current_pool() -> "PoolEngine | None":
    """The most recently started open pool of this kernel, or None."""
    with _pools_lock:
        return _pools[-1] if _pools else None


def open_pools() -> list["PoolEngine"]:
    """Every open pool of this kernel, the oldest first."""
    with _pools_lock:
        return list(_pools)


def pool_of(launch_id: str) -> "PoolEngine | None":
    """The open pool whose ranks are the launch ``launch_id``, or None."""
    for engine in open_pools():
        launch = engine.launch
        if launch is not None and launch.id == launch_id:
            return engine
    return None


def close_all() -> int:
    """Close every pool of this kernel (its shutdown, ``%distributed_pool --stop``); how many."""
    closed = 0
    for engine in reversed(open_pools()):
        try:
            engine.close()
            closed += 1
        except Exception:  # one pool's failure to end cleanly never keeps the others open
            pass
    return closed


class PoolEngine:
    """N ranks that keep their namespace and their process group from one call to the next."""

    def __init__(self, spec: LaunchSpec, launcher: Callable[[], Launcher], *, timeout: float | None = None) -> None:
        self.spec = spec
        self.timeout = timeout
        self._launcher = launcher
        self._ranks: _Ranks | None = None
        self._call_now: _Call | None = None
        self._last_call: _Call | None = None  # the call that ran last (what its ranks did of it)
        self._starting = False
        self._closed = False
        self.rank_names: set[str] = set()  # names every rank's own code assigned (or push set)
        self.current = ""  # the call running now (``Cell In[5]``, a function's name), or the last one
        self.cells = 0
        self.started_at = 0.0
        self.restarts = 0
        self.last_failed_rank: int | None = None  # the rank that failed first in the last call
        #: The pool's own name in lists (the lab sidebar): its launches, one per start, share it.
        self.key = f"pool-{uuid.uuid4().hex[:8]}"
        self.last_had_value = False
        self.start_seconds = 0.0
        self._told_shadowed: set[str] = set()
        self._ids = 0
        self._lock = threading.Lock()  # one call at a time
        self._sent_env: dict[str, str] = {}  # the kernel's environment as the ranks have it
        self._sent_path: list[str] = []  # likewise its sys.path
        self._nvml: Any = None  # NVML, once a pool of GPU ranks was asked for its memory
        #: The cells every call so far ran (file name -> (the notebook's name, source)): a
        #: function an earlier cell defined is named by its cell in what the pool says.
        self.sources: dict[str, tuple[str, str]] = {}

    # -- what it is now ----------------------------------------------------------------------

    @property
    def launch(self) -> Launch | None:
        return self._ranks.launch if self._ranks is not None else None

    @property
    def conns(self) -> list[Connection]:
        return self._ranks.conns if self._ranks is not None else []

    @property
    def pids(self) -> list[int]:
        return self._ranks.pids if self._ranks is not None else []

    @property
    def world_size(self) -> int:
        if self._ranks is not None:
            return len(self._ranks.conns) or self._ranks.launch.world_size
        return 0

    @property
    def state(self) -> str:
        """``new``, ``starting``, ``idle``, ``running``, ``broken`` or ``closed``."""
        if self._closed:
            return "closed"
        if self._starting:
            return "starting"
        ranks = self._ranks
        if ranks is None:
            return "new"
        if ranks.broken or ranks.launch.done():
            return "broken"
        return "running" if self._call_now is not None else "idle"

    @property
    def broken_because(self) -> str:
        ranks = self._ranks
        if ranks is None:
            return ""
        if ranks.broken:
            return ranks.broken
        return "its ranks ended" if ranks.launch.done() else ""

    @property
    def busy(self) -> set[int]:
        """The ranks still in the current call."""
        call = self._call_now
        return {r for r, s in call.states.items() if s is RankCallState.RUNNING} if call is not None else set()

    def rank_state(self, rank: int) -> str:
        """One rank's state: the pool's, or during a call, what the rank did of it (and for a
        pool a call broke, what each rank did of that call: failed, stopped, ended)."""
        state = self.state
        if state == "broken" and self._last_call is not None and self._last_call.ranks is self._ranks:
            return str(self._last_call.states.get(rank, state))  # (the plain word: status() shows it)
        if state in ("broken", "closed", "starting", "new"):
            return state
        call = self._call_now
        if call is None:
            return "idle"
        return str(call.states.get(rank, RankCallState.RUNNING))

    # -- life ------------------------------------------------------------------------------------

    def start(self) -> "PoolEngine":
        """Start the ranks and wait until every one is connected.  A start that fails (or that
        is interrupted) leaves nothing running and the pool closed."""
        self._starting = True
        try:
            self._ranks = self._start()
        except KeyboardInterrupt:
            self._give_up()
            raise interrupted("you interrupted the pool's start; none of its ranks is left running.") from None
        except BaseException:
            self._give_up()
            raise
        finally:
            self._starting = False
        self.rank_names = set()
        self._told_shadowed.clear()
        self.started_at = time.time()
        self._ranks.launch.set_machine_state("idle")  # (the machine's list: no call runs yet)
        with _pools_lock:
            if self not in _pools:
                _pools.append(self)
        return self

    def _give_up(self) -> None:
        self._closed = True
        self._ranks = None
        self._forget()

    def _start(self) -> _Ranks:
        launcher = self._launcher()
        launcher._ensure_session_folders()
        importing = _import_torch_meanwhile()
        backend = launcher.backend_for(self.spec.backend)
        authkey = os.urandom(32)
        placement = self.spec.resolve(backend.hardware())
        began = time.monotonic()
        hello: dict[int, tuple[Connection, int]] = {}
        launch: Launch | None = None
        with _listener(backend, launcher.session_dir) as (server, address):
            payload = capture.Payload(
                kind="pool",
                label="pool",
                data={"address": address, "authkey": authkey, "device": placement.device},
                argv=["pool"],
                group=self.key,
            )
            try:
                self._sent_env = dict(os.environ)
                self._sent_path = _sys_path()
                launch = launcher.start(self.spec, payload)
                while len(hello) < launch.world_size:
                    if launch.done():
                        launch.result()  # its error: the ranks could not start
                        raise LaunchError("the pool's ranks ended before they connected")
                    if time.monotonic() - began > POOL_START_TIMEOUT:
                        raise LaunchError(
                            f"the pool's ranks did not connect within {POOL_START_TIMEOUT:g} s "
                            f"({len(hello)} of {launch.world_size} did)"
                        )
                    try:
                        sock, _ = server.accept()
                    except socket.timeout:
                        continue
                    greeted = _greet(sock, authkey, launch.world_size)
                    if greeted is not None and greeted[0] not in hello:
                        hello[greeted[0]] = greeted[1:]
                    elif greeted is not None:
                        greeted[1].close()
            except BaseException:
                if launch is not None:
                    _kill(launch)
                for conn, _ in hello.values():
                    conn.close()
                if importing is not None:
                    importing.join()
                raise
        ranks = _Ranks(launch, [hello[r][0] for r in range(len(hello))], [hello[r][1] for r in range(len(hello))])
        launch.cancel_instead = self.stop_call  # a panel's Stop interrupts the call; the ranks stay
        if launch.helper is not None:
            launch.helper.pool_started(launch.id)  # Ray: the agents' spares start now
        if importing is not None:  # done before any call: a torch half imported is no torch
            importing.join()
        self.start_seconds = time.monotonic() - began
        return ranks

    def restart(self) -> None:
        """Fresh ranks: the old ones (and their state) are gone.  A call running on the old
        ones ends with an error that says so."""
        if self._closed:
            raise PoolBrokenError(
                "this pool is closed; start a new one (air_magic.Pool(...), or %distributed_pool -n N)."
            )
        self._retire("restarted")
        self.restarts += 1
        try:
            self.start()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            exc.add_note(
                "[air_magic] the pool's restart failed, so the pool is closed: start a new one "
                "(air_magic.Pool(...), or %distributed_pool -n N)."
            )
            raise

    def close(self, why: str = "closed") -> None:
        """Stop the ranks (each ends its loop; the launch ends).  A call running on them ends
        with an error that says so (``the pool was {why} while ...``)."""
        if self._closed:
            return
        launch = self.launch
        self._retire(why)
        self._closed = True
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None
        if launch is not None and launch.helper is not None:
            launch.helper.release_pool(launch.id)  # Ray: the agents kept for the pool
        self._forget()

    def _forget(self) -> None:
        with _pools_lock:
            if self in _pools:
                _pools.remove(self)

    def _retire(self, why: str) -> None:
        """End the current ranks: a call still running on them sees ``why`` and ends."""
        ranks, self._ranks = self._ranks, None
        if ranks is None:
            return
        running = self._call_now is not None and self._call_now.ranks is ranks
        ranks.retired = why
        _end(ranks, close_first=not running and not ranks.broken)

    def interrupt(self, ranks: list[int]) -> None:
        """KeyboardInterrupt in these ranks' code, for the call running now.  A rank that has
        not begun the call yet (it was not scheduled: a loaded machine) is interrupted as it
        begins it: a SIGINT sent before would find it idle, and be ignored."""
        call = self._call_now
        if call is None:
            return
        with call.lock:
            call.wanted.update(ranks)
            now = sorted((set(ranks) & call.started) - call.signalled)
            call.signalled.update(now)
        if now:
            call.ranks.launch.signal_ranks(now, signal.SIGINT)

    def stop_call(self) -> bool:
        """What a panel's Stop does to the pool (its launch's ``cancel()``): the call running
        now is interrupted as Ctrl-C interrupts it, and the ranks and their state stay.  A call
        the kernel's main thread waits for (a pool cell, ``pool.run``) gets the SIGINT that
        Jupyter's interrupt sends the kernel, so it ends exactly as after Ctrl-C; a
        ``pool.submit`` call is cancelled (:meth:`PoolCall.cancel`).  False when none runs."""
        call = self._call_now
        if call is None:
            return False
        if not call.background and call.waiter == threading.main_thread().ident:
            os.kill(os.getpid(), signal.SIGINT)
        else:
            self.interrupt(list(range(len(call.ranks.conns))))
        return True

    def _on_began(self, call: _Call, rank: int) -> None:
        """A rank began the call: from now on a SIGINT raises in it."""
        with call.lock:
            call.started.add(rank)
            late = rank in call.wanted and rank not in call.signalled
            if late:
                call.signalled.add(rank)
        if late:
            call.ranks.launch.signal_ranks([rank], signal.SIGINT)

    def break_ranks(self, ranks: _Ranks, because: str) -> None:
        """These ranks cannot go on: they are killed; the pool's next call starts fresh ones."""
        if not ranks.broken:
            ranks.broken = because
        _kill(ranks.launch)

    def _ready(self) -> _Ranks:
        """The ranks a call runs on now: a broken pool gets fresh ones first, and says so."""
        if self._closed:
            raise PoolBrokenError(
                "this pool is closed; start a new one (air_magic.Pool(...), or %distributed_pool -n N)."
            )
        if self.state == "broken" or self._ranks is None:
            because = self.broken_because or "its ranks ended"
            n = self.world_size or self.spec.num_accelerators or 0
            print(
                f"[air_magic] the pool was broken ({because}); starting {n} fresh rank{'s' * (n != 1)}: "
                "the state of the old ones (their names, models, data) is lost.",
                file=sys.stderr,
            )
            self._retire("restarted")
            self.restarts += 1
            self.start()
        assert self._ranks is not None
        return self._ranks

    # -- calls -----------------------------------------------------------------------------------

    def run_cell(
        self,
        cell: str,
        namespace: dict[str, Any],
        *,
        display: str,
        filename: str,
        header: str,
        argv: list[str],
        timeout: float | None = None,
    ) -> list[Any]:
        """Run a cell's code on every rank, in its namespace; the last expression per rank
        (``last_had_value`` says whether the cell ended with an expression)."""
        with self._turn():
            try:
                code, tree = capture.compile_cell(cell, display, filename)
            except SyntaxError as exc:
                if exc.filename == filename:
                    exc.filename = display
                raise
            self.last_had_value = RESULT_NAME in code.co_names
            ranks = self._ready()
            read = capture.free_names(tree)
            for name in sorted(read):
                if name in namespace and name in self.rank_names and name not in self._told_shadowed:
                    if isinstance(namespace[name], type(sys)):
                        continue  # a module is the same module on the ranks: nothing to say
                    self._told_shadowed.add(name)
                    print(
                        f"[air_magic] {name}: the pool's ranks have their own (a pool cell or pool.push set it), so "
                        f"the notebook's {name} is not sent; pool.push({name}=...) sends it.",
                        file=sys.stderr,
                    )
            visible = {k: v for k, v in namespace.items() if k not in self.rank_names}
            with _not_sent_yet():
                payload = capture.cell_payload(
                    cell, visible, display=display, filename=filename, header=header, argv=argv
                )
            data = payload.data | {"sources": payload.sources, "argv": payload.argv}
            return self._call(ranks, "cell", data, display, timeout)

    def call(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``func(*args, **kwargs)`` on every rank; one value per rank."""
        with self._turn():
            ranks = self._ready()
            with _not_sent_yet():
                payload = capture.function_payload(func, args, kwargs)
            label = getattr(func, "__qualname__", repr(func))
            return self._call(ranks, "call", payload.data | {"sources": payload.sources}, label)

    def submit(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> PoolCall:
        """``func(*args, **kwargs)`` on every rank in the background; a handle at once."""
        label = getattr(func, "__qualname__", repr(func))
        handle = PoolCall(self, label)
        if not self._lock.acquire(blocking=False):
            raise self._busy()

        def run() -> None:
            try:
                ranks = self._ready()
                payload = capture.function_payload(func, args, kwargs)
                data = payload.data | {"sources": payload.sources}
                handle._future.set_result(self._call(ranks, "call", data, label, background=True))
            except BaseException as exc:  # the call's outcome, for result()
                handle._future.set_exception(exc)
            finally:
                self._lock.release()

        threading.Thread(target=run, name=f"air_magic pool call {label}", daemon=True).start()
        return handle

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """One call at a time; another while one runs (a ``submit`` not done) is refused, not queued."""
        if not self._lock.acquire(blocking=False):
            raise self._busy()
        try:
            yield
        finally:
            self._lock.release()

    def _busy(self) -> PoolBusyError:
        return PoolBusyError(
            "the pool is running another call (a pool.submit(...) not yet done); wait for its .result() or "
            ".cancel() it, then run this."
        )

    def push(self, **values: Any) -> None:
        """Set ``name = value`` in every rank's namespace."""
        with self._turn():
            with _not_sent_yet():
                blobs, problems = capture.pickle_each(values.items())
            if problems:
                capture.raise_problems(problems, "a pool cell (or the function pool.run runs)")
            ranks = self._ready()
            self._call(ranks, "push", {"names": blobs}, "push")

    def pull(self, name: str, ranks: list[int] | None = None) -> list[Any]:
        """The value of ``name`` on every rank, in rank order; on ``ranks`` only (the others
        send nothing), in that order."""
        with self._turn():
            ready = self._ready()
            if ranks is None:
                return self._call(ready, "pull", {"name": name}, f"pull({name!r})")
            values = self._call(ready, "pull", {"name": name, "ranks": sorted(set(ranks))}, f"pull({name!r})")
            return [values[r] for r in ranks]

    def ask(self, kind: str, data: dict[str, Any], label: str) -> list[Any]:
        """A message of air_magic's own on every rank (``"model"``: the model back, answered by
        :mod:`air_magic.rank.pool.model_back`); one value per rank."""
        with self._turn():
            return self._call(self._ready(), kind, data, label)

    def next_id(self) -> int:
        """A new message id (a call's, or air_magic's own between calls)."""
        self._ids += 1
        return self._ids

    def sync(self, names: list[str], src: int) -> list[str]:
        """``names`` copied from rank ``src`` to every other (:func:`air_magic.rank.pool.state.sync`);
        what was copied.  A name that cannot be copied raises ``ValueError`` (the rank's why)."""
        with self._turn():
            values = self._call(self._ready(), "sync", {"names": names, "src": src}, f"pool.sync({src=})")
        said = [v["refused"] for v in values if isinstance(v, dict) and "refused" in v]
        refused = next((r for r in said if not r.startswith("another rank")), said[0] if said else None)
        if refused:
            raise ValueError(f"pool.sync: {refused}")
        return list(values[src])

    def debug(self, rank: int | None = None) -> bool:
        """The post-mortem of ``rank``'s exception in the last call (default: the rank that
        failed first), in pdb through the kernel's stdin; the rank lets the traceback go after
        it.  False where that rank keeps no exception (the last call did not fail there)."""
        with self._turn():
            ranks = self._ready()
            wanted = self.last_failed_rank if rank is None else rank
            if wanted is None or not 0 <= wanted < len(ranks.conns):
                return False
            self.last_failed_rank = None
            values = self._call(ranks, "debug", {"rank": wanted}, f"%distributed_debug {wanted}")
            return bool(values[wanted])

    def _kernel_state(self) -> dict[str, Any]:
        """What a launch takes from the kernel at each launch, for this call: the working
        directory, and ``sys.path`` and the environment where they changed since the last call;
        whether the kernel's ``%pdb`` is on."""
        state: dict[str, Any] = {"cwd": working_directory(), "postmortem": post_mortem_on()}
        path = _sys_path()
        if path != self._sent_path:
            state["sys_path"] = self._sent_path = path
        now = dict(os.environ)
        if now != self._sent_env:
            changed = {k: v for k, v in now.items() if self._sent_env.get(k) != v}
            removed = [k for k in self._sent_env if k not in now]
            state["env"] = (changed, removed)
            self._sent_env = now
        return state

    def _call(
        self,
        ranks: _Ranks,
        kind: str,
        data: dict[str, Any],
        label: str,
        timeout: float | None = None,
        background: bool = False,
    ) -> list[Any]:
        self._ids += 1
        call = _Call(ranks, self._ids, label, data.get("sources") or {}, background=background)
        self.sources.update(call.sources)
        launch = ranks.launch
        log = launch.ranks[0].log_path
        for state in launch.ranks:  # bounded as a launch's are, between two calls
            bound_log_in_place(state.log_path, launch.limits.log)
        pump = OutputPump(log, launch.limits.output)
        try:
            pump.reader.offset = os.path.getsize(log)  # before the ranks get the call: all of its output
        except OSError:
            pass
        with _not_sent_yet():
            message = capture.dumps((kind, call.id, data | {"label": label} | self._kernel_state()))  # once
        desk = None  # breakpoint(): a prompt in this cell; from what the ranks say after this
        if not background and launch.local_processes:
            desk = BreakpointDesk(launch.work_dir, len(ranks.conns), from_now=True)
        call.states = {r: RankCallState.RUNNING for r in range(len(ranks.conns))}
        self._call_now = self._last_call = call
        if kind in ("cell", "call"):
            launch.set_machine_state(f"running {label}")
        self.current = label
        self.cells += 1
        watchers: list[Any] = []
        view: PoolCallView | None = None
        outcome, error = "done", None
        try:
            with _held_sigint() as came:
                for conn in ranks.conns:
                    try:
                        conn.send_bytes(message)
                    except OSError:
                        self.check_retired(call)
                        self.break_ranks(ranks, "a rank's connection closed")
                        raise PoolBrokenError("the pool's ranks are gone; the next call starts fresh ones.") from None
                if kind in ("cell", "call") and not background and CALL_WATCHERS:
                    view = PoolCallView(self, launch, call, self.cells)
                    watchers = _watch(view)
            try:
                limit = timeout if timeout is not None else self.timeout
                records = self._collect(call, pump, limit, watchers, desk, interrupted=bool(came))
                if call.hangs is not None and not any(isinstance(r, ErrorRecord) for r in records.values()):
                    call.hangs.finish()  # a notice still shown says the wait is over
            finally:
                pump.pump(final=True)
                _tell_forked(call)
            return self._outcome(call, kind, records)
        except BaseException as exc:
            outcome, error = _outcome_text(self, ranks, exc), exc
            raise
        finally:
            if desk is not None:
                desk.close()
            if kind in ("cell", "call") and not ranks.broken:
                launch.set_machine_state("idle")
            if self._call_now is call:
                self._call_now = None
            # The call is kept (self._last_call: what its ranks did of it), its watch is not: the
            # watch reads the replies, and the values they hold are the user's to drop.
            call.hangs = None
            if view is not None:
                view.finish(outcome, error)
            for watcher in watchers:
                try:
                    watcher.end()
                except Exception:  # a watcher (the panel) never changes the call's outcome
                    pass

    def _collect(
        self,
        call: _Call,
        pump: OutputPump,
        timeout: float | None,
        watchers: list[Any] = [],  # noqa: B006 - read only
        desk: BreakpointDesk | None = None,
        interrupted: bool = False,
    ) -> dict[int, Any]:
        """Every rank's record, waiting for them (serving the prompts of ranks stopped at a
        breakpoint, through ``desk``); a fault breaks the pool.  ``interrupted``: a Ctrl-C came
        while the call went out (held until every rank had it): the call is interrupted at once."""
        ranks = call.ranks
        records: dict[int, Any] = {}
        pending = dict(enumerate(ranks.conns))
        grace_until: float | None = None
        unheeded = False
        cancelled_at: float | None = None
        try:
            if interrupted:
                raise KeyboardInterrupt
            call.hangs = self._hang_watch(call, pump, records)
            while pending:
                self.check_retired(call)
                if call.background and call.wanted:
                    # A cancelled pool.submit call whose ranks do not all come back (one waits in a
                    # collective its peers will not make): the way out of Ctrl-C's, after a grace.
                    cancelled_at = cancelled_at or time.monotonic()
                    if time.monotonic() - cancelled_at > GRACE and not _interrupted_all(records):
                        raise KeyboardInterrupt
                if desk is not None:
                    desk.poll()
                for reply in self.take_replies(call, pending, records):
                    self.rank_names = set(reply.names) if reply.rank == 0 else self.rank_names & set(reply.names)
                    if reply.forked:
                        call.forked[reply.rank] = reply.forked
                    if isinstance(reply.record, ErrorRecord) and grace_until is None:
                        grace_until = time.monotonic() + GRACE
                if not any(_holds_output(watcher) for watcher in watchers):
                    pump.pump()
                if not pending:
                    break
                for watcher in watchers:
                    try:
                        watcher.tick()
                    except Exception:  # a watcher (the panel) never changes the call's outcome
                        pass
                if call.hangs is not None:
                    call.hangs.check()
                self.check_retired(call)
                gone = self._first_gone(ranks, pending, call.closed)
                if gone is not None:
                    self._fault(call, records, pending, self._gone_reason(ranks, gone))
                if grace_until is not None and time.monotonic() > grace_until:
                    if call.wanted and _interrupted_all(records):  # a cancel some did not heed
                        unheeded = True
                        break
                    failed = min(r for r, rec in records.items() if isinstance(rec, ErrorRecord))
                    self._fault(call, records, pending, f"rank {failed} failed while the others did not come back")
                if timeout is not None and time.monotonic() - call.began > timeout:
                    where = self._where(call, pending, records)
                    self.break_ranks(ranks, f"{call.label} ran past its timeout of {timeout:g} s")
                    error = LaunchTimeoutError(
                        f"{call.label} ran past its timeout of {timeout:g} s on the pool; its ranks were stopped "
                        "and the next pool cell starts fresh ones (their state is lost). Pass --timeout SECONDS|none."
                    )
                    if where:
                        error.add_note(where)
                    raise error
        except KeyboardInterrupt:
            self.check_retired(call)
            Interrupt(self, call, records, pending, desk).run()
        if unheeded:  # out of the try: the KeyboardInterrupt raised is the cancel's outcome
            self.not_stopped(call, pending, records, "the pool's call was cancelled")
        if pool_regroup.broke_the_group(records):  # gloo closed the group's connections (a timeout)
            why = self.rebuild_group(call)
            if why:
                self.break_ranks(ranks, f"a collective broke the process group, which could not be rebuilt ({why})")
                call.regrouped = (
                    f"[air_magic] the collective's failure closed the process group's connections and it could not "
                    f"be rebuilt ({why}): the pool is broken, and the next pool cell starts it again."
                )
            else:
                call.regrouped = f"[air_magic] the collective's failure closed the process group's connections: {pool_regroup.REBUILT}."
        return records

    def _hang_watch(self, call: _Call, pump: OutputPump, records: dict[int, Any]) -> HangWatch | None:
        """The cell's hang watch: a rank that has answered the call waits in no collective (it
        ended it: "finished the call"); the others' collectives are looked at each second."""
        launch = call.ranks.launch

        def ended() -> dict[int, str]:
            gone = {r: f"exit {s.returncode}" for r, s in enumerate(launch.ranks) if s.returncode is not None}
            for rank, record in records.items():
                gone.setdefault(rank, _ended_call(record))
            return gone

        shown = ReportShown(
            os.path.join(launch.log_dir, f"hang-report-call-{call.id}"), before=pump.pump, quiet=call.background
        )
        return launch.hang_watch(shown, ended=ended, sources={**self.sources, **call.sources})

    def hang_report(self) -> HangReport | None:
        """The hang report of the call running now, while its hang lasts (``%distributed_pool``
        shows it: a ``pool.submit`` call has no cell of its own to show it in)."""
        call = self._call_now
        return call.hangs.current if call is not None and call.hangs is not None else None

    def check_retired(self, call: _Call) -> None:
        """The pool was restarted or closed while this call ran (from another thread): the
        call ends here, saying so; the pool's new ranks are none of its business."""
        why = call.ranks.retired
        if not why:
            return
        how = {
            "restarted": " (pool.restart() or %distributed_pool --restart)",
            "closed": " (pool.close() or %distributed_pool --stop)",
        }.get(why, "")
        raise PoolBrokenError(
            f"the pool was {why} while {call.label} ran on it{how}; its ranks were stopped, so this call has no values."
        )

    def take_replies(self, call: _Call, pending: dict[int, Connection], records: dict[int, Any]) -> list[Any]:
        """One look (50 ms at most) for the pending ranks' replies to the call: each one
        recorded, and taken out of ``pending``; a reply out of step breaks the pool."""
        try:
            launch = call.ranks.launch
            answers = replies(
                pending,
                call.id,
                0.05,
                lambda rank, _id: self._on_began(call, rank),
                call.closed,
                (launch.shm_dir, launch.work_dir),
                call.assembled,
            )
        except OutOfStep as exc:
            self._out_of_step(call, pending, exc)
        for reply in answers:
            records[reply.rank] = reply.record
            call.states[reply.rank] = _state_of(reply.record)
            call.ended[reply.rank] = time.monotonic()
        return answers

    def _out_of_step(self, call: _Call, pending: dict[int, Connection], exc: OutOfStep) -> NoReturn:
        self.break_ranks(call.ranks, f"rank {exc.rank}'s connection is out of step")
        n = len(call.ranks.conns)
        raise PoolBrokenError(
            f"{call.label}: {exc}. Its values cannot be trusted, so the pool is broken: the next pool cell starts "
            f"{n} fresh rank{'s' * (n != 1)} (the state of these is lost)."
        ) from None

    def _gone_reason(self, ranks: _Ranks, rank: int) -> str:
        code = ranks.launch.ranks[rank].returncode
        if code is None:
            return f"rank {rank} closed its connection to the kernel"
        return f"rank {rank} ended (exit {code})"

    def _first_gone(
        self, ranks: _Ranks, pending: dict[int, Connection], closed: dict[int, float] | None = None
    ) -> int | None:
        """The pending rank that ended first (:func:`~air_magic.kernel.pool.decide.first_gone`)."""
        launch = ranks.launch
        return first_gone(launch.ranks, pending, closed or {}, launch.done(), time.monotonic())

    def rebuild_group(self, call: _Call) -> str:
        """Fresh connections for the ranks' default group (every rank idle); ``''`` when it
        was rebuilt, else why not."""
        ranks = call.ranks
        launch = ranks.launch
        why = pool_regroup.can_rebuild(launch.placement.device, launch.local_processes)
        if why:
            return why
        pool_regroup.cut(launch.work_dir, len(ranks.conns))  # (those of ranks that came back by themselves)
        ranks.regroups += 1
        self._ids += 1
        return pool_regroup.rebuild(ranks.conns, self._ids, ranks.regroups)

    def not_stopped(self, call: _Call, pending: dict[int, Connection], records: dict[int, Any], what: str) -> None:
        """Some ranks did not stop within GRACE s of their interrupt: the pool is broken."""
        where = self._where(call, pending, records)
        ranks = ", ".join(map(str, sorted(pending)))
        self.break_ranks(call.ranks, "interrupted, and some ranks did not stop")
        message = (
            f"{what}; rank{'s' * (len(pending) != 1)} {ranks} did not stop within {GRACE:g} s "
            "(its code caught the KeyboardInterrupt, or waits in a collective or in C), so the pool is broken: "
            "the next pool cell starts fresh ranks."
        )
        if where:
            message += "\n" + where
        raise interrupted(message)

    def _fault(self, call: _Call, records: dict[int, Any], pending: dict[int, Connection], because: str) -> None:
        ranks = call.ranks
        if ranks.launch.local_processes and ranks.launch.stopped_from_outside():
            # air-magic stop (or the sidebar's Stop) ended its ranks: a stop, said with who asked.
            for rank in pending:
                call.states[rank] = RankCallState.STOPPED
            self.break_ranks(ranks, f"it was stopped from outside: {ranks.launch.stopped_by}")
            n = len(ranks.conns)
            raise PoolBrokenError(
                f"the pool was stopped from outside while {call.label} ran on it: {ranks.launch.stopped_by}; "
                f"its {n} rank{'s' * (n != 1)} were stopped, so this call has no values, and the next pool cell "
                "starts fresh ones (the state of these is lost)."
            )
        errors = {r: rec for r, rec in records.items() if isinstance(rec, ErrorRecord)}
        own = {r: e for r, e in errors.items() if not _outcome.is_echo(e.type_name, e.message)}
        # Who ended on its own, read before the others are stopped (their exits would blur it);
        # errors that only echo a peer's end (gloo's "Connection closed by peer") wait a moment
        # for that end to be reported.
        gone = self._first_gone(ranks, pending, call.closed)
        deadline = time.monotonic() + CLOSED_GRACE
        while not own and gone is None and time.monotonic() < deadline:
            time.sleep(0.02)
            gone = self._first_gone(ranks, pending, call.closed)
        ended: dict[int, int] = {}
        for rank in pending:
            code = ranks.launch.ranks[rank].returncode
            if code is not None:
                ended[rank] = code
        where = self._where(call, pending, records)
        for rank in pending:
            call.states[rank] = RankCallState.ENDED if rank in ended else RankCallState.STOPPED
        self.break_ranks(ranks, because)
        n = len(ranks.conns)
        tail = (
            f"the pool is broken ({because}); the next pool cell starts {n} fresh rank{'s' * (n != 1)} "
            "(the state of these is lost)."
        )
        if own or (errors and gone is None):
            first = _first_failure(errors)
            error = self._rank_exception(call, records, first, ended)
            error.add_note("[air_magic] " + tail)
        else:  # a rank ended; any error of the others only followed from it (a broken collective)
            gone = min(pending) if gone is None else gone
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

    def _where(self, call: _Call, pending: dict[int, Connection], records: dict[int, Any]) -> str:
        """Where each rank that has not come back is (its stack, with the cell's names), and
        what the others did of the call."""
        launch = call.ranks.launch
        if not pending:
            return ""
        try:
            if launch.local_processes:
                running = {r: launch.ranks[r].pid for r in pending if launch.ranks[r].pid}
                stacks = {}
                for _look in range(2):
                    # A rank read on its way (between the call's start and the cell's first line,
                    # or a busy machine's late answer) shows neither the cell nor a collective:
                    # looked at again, once.
                    request_stacks(launch.work_dir, running, 3.0, thread_wait=1.5)  # type: ignore[arg-type]
                    stacks.update(read_stacks(launch.work_dir, running, {**self.sources, **call.sources}))
                    running = {r: pid for r, pid in running.items() if user_frame(stacks.get(r, "")) == ("", False)}
                    if not running:
                        break
                    time.sleep(0.3)
            else:
                stacks = {r: s for r, s in launch.stacks(timeout=1.0).items() if r in pending}
                for filename, (display, _) in {**self.sources, **call.sources}.items():
                    stacks = {r: s.replace(f'File "{filename}"', display) for r, s in stacks.items()}
            absent = {r: _came_back(records.get(r)) for r in range(len(call.ranks.conns)) if r not in pending}
            stacks = {r: s for r, s in stacks.items() if r in pending}
            waiting = call.hangs.waiting() if call.hangs is not None else {}
            where = describe_stacks(stacks, len(call.ranks.conns), absent, waiting)
            if call.hangs is not None and call.hangs.current is not None:  # the hang, as the cell showed it
                where += "\n" + call.hangs.current.text()
            return where
        except Exception:  # the stacks are a courtesy: the fault is said anyway
            return ""

    def _rank_exception(
        self, call: _Call, records: dict[int, Any], rank: int, ended: dict[int, int] | None = None
    ) -> BaseException:
        """The error of a call whose first failure was ``rank``'s; ``ended``: ranks that
        ended on their own (by exit code) before the others were stopped."""
        launch = call.ranks.launch
        n = len(call.ranks.pids)
        ended = ended or {}

        def state(r: int) -> _outcome.RankState:
            if r in records:  # it answered: 1 for an error, 0 for a value
                code, stopped = (1 if isinstance(records[r], ErrorRecord) else 0), False
            elif r in ended:  # it ended by itself (its exit says how)
                code, stopped = ended[r], False
            else:  # it was still in the call: air_magic stopped it
                code, stopped = -signal.SIGKILL, True
            return _outcome.RankState(r, launch.ranks[r].log_path, call.ranks.pids[r], returncode=code, stopped=stopped)

        ending = _outcome.Ending(
            label="the pool's cell",
            world_size=n,
            ranks=tuple(state(r) for r in range(n)),
            failures=(rank,),
            device=launch.placement.device,
        )
        return _outcome.rank_error(ending, records, rank, "")

    def _outcome(self, call: _Call, kind: str, records: dict[int, Any]) -> list[Any]:
        errors = {r: rec for r, rec in records.items() if isinstance(rec, ErrorRecord)}
        if errors:
            first = _first_failure(errors)
            if errors[first].type_name == "KeyboardInterrupt":
                raise interrupted("the pool's cell was interrupted on its ranks; the pool and its state are intact.")
            error = self._rank_exception(call, records, first)
            if call.regrouped:
                error.add_note(call.regrouped)
            if call.hangs is not None and call.hangs.last is not None:
                error.add_note(call.hangs.last.text())
            if kind in ("cell", "call") and call.ranks.launch.local_processes:
                self.last_failed_rank = first
                error.add_note(
                    f"[air_magic] %distributed_debug opens rank {first}'s post-mortem (pdb in its frames) until the "
                    "next pool cell."
                )
            raise error
        n = len(call.ranks.conns)
        values = []
        for rank in range(n):
            record = records.get(rank)
            if isinstance(record, UnpicklableRecord):
                if kind == "pull":
                    error = _outcome.result_error(
                        rank, n, f"a {record.value_type} for {call.label}, which cannot be sent back ({record.reason})"
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
                    raise _pulled_error(call.label, rank, n, record)
                raise _outcome.result_error(rank, n, f"a value that cannot be loaded here ({record})")
            assert isinstance(record, ValueRecord)
            values.append(record.value)
        return values

    # -- status ----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What ``%distributed_pool`` shows: ranks, state, memory per rank, cells run, uptime."""
        return _status.status(self)

    def facts(self) -> _status.PoolFacts:
        """What every surface says of the pool (drawn as text and as HTML)."""
        return _status.facts(self)

    def text(self) -> str:
        """The pool's line, then a line per rank."""
        return _status.text(self)

    def describe(self) -> str:
        """The pool's one line."""
        return _status.describe(self)

    def gpu_memory(self) -> list[int | None]:
        """Each rank's GPU memory (NVML, with its child processes'), for a pool of GPU ranks."""
        pids = self.pids
        found: list[int | None] = [None] * len(pids)
        launch = self.launch
        if launch is None or launch.placement.device != "cuda" or not pids:
            return found
        try:
            import psutil

            from air_magic.accelerators import NvmlDevices

            family: dict[int, list[int]] = {}
            for rank, pid in enumerate(pids):
                try:
                    family[rank] = [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
                except psutil.Error:
                    family[rank] = [pid]
            if self._nvml is None:
                self._nvml = NvmlDevices()  # kept open: the panel asks every half second
            sampled = self._nvml.sample(family)
            return [sampled.get(rank, (None, None, None, None))[2] for rank in range(len(pids))]
        except Exception:  # no NVML (a missing driver or nvidia-ml-py): the GPU numbers are left out
            return found


# -- helpers -----------------------------------------------------------------------------------------


def _end(ranks: _Ranks, close_first: bool) -> None:
    """Stop these ranks: ask each to leave its loop first (an idle pool), then kill what is left."""
    if close_first:
        for conn in ranks.conns:
            try:
                conn.send_bytes(cloudpickle.dumps(("close",)))
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        while not ranks.launch.done() and time.monotonic() < deadline:
            time.sleep(0.01)
    _kill(ranks.launch)
    for conn in ranks.conns:
        conn.close()


def _kill(launch: Launch) -> None:
    if launch.done():
        return
    try:
        launch.launcher.send(Stop(launch.id, "kill"))
    except OSError:
        pass
    deadline = time.monotonic() + 10.0
    while not launch.done() and time.monotonic() < deadline:
        time.sleep(0.01)


def _sys_path() -> list[str]:
    cwd = os.getcwd() if os.path.isdir(".") else "/"
    return [p if p else cwd for p in sys.path]


def _holds_output(watcher: Any) -> bool:
    """Whether ``watcher`` (the panel) wants rank 0's output held until it has shown itself."""
    try:
        return bool(watcher.holds_output())
    except Exception:  # a watcher (the panel) never changes the call's outcome
        return False


def _tell_forked(call: _Call) -> None:
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


def _import_torch_meanwhile() -> threading.Thread | None:
    """The kernel imports torch while the pool's ranks start (it waits for them anyway; the
    start joins the thread before the first call, as code that finds torch half imported in
    ``sys.modules`` fails): the pool's first ``state_dict``, ``model`` or ``pull`` of a tensor
    then costs what the next does.  ``AIR_MAGIC_WARM=0`` leaves it to the first use."""
    if "torch" in sys.modules:
        return None
    try:
        if not settings.warm:
            return None
    except Exception:  # (a bad setting is said by what reads it)
        return None

    def work() -> None:
        try:
            import torch  # noqa: F401
        except Exception:  # no torch here: what needs it says so
            pass

    thread = threading.Thread(target=work, name="air_magic-import-torch", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def _not_sent_yet() -> Iterator[None]:
    """A Ctrl-C while a call is made ready (its names pickled: seconds for large ones): nothing
    has gone to the ranks, and the cell says so in one line, not with the pickler's traceback."""
    try:
        yield
    except KeyboardInterrupt:
        raise interrupted(
            "you interrupted the pool's cell before it reached the ranks: nothing ran there, and the pool and its "
            "state are as they were."
        ) from None


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


def _outcome_text(engine: "PoolEngine", ranks: _Ranks, exc: BaseException) -> str:
    """How a call that raised ended, in a few words (the panel's last line)."""
    if ranks.retired:
        return f"the pool was {ranks.retired}"
    if ranks.broken:
        return f"the pool is broken ({ranks.broken})"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"failed ({type(exc).__name__})"


#: Failures this close together are one failure of every rank (the same line failed on each):
#: the lowest rank's is said, as a user reading rank 0's output expects.
_TOGETHER = 0.5


def _first_failure(errors: dict[int, ErrorRecord]) -> int:
    """The rank whose error the call raises: the first to fail; of ranks that failed
    together, the lowest; a failure that echoes another's (a collective broken by a peer)
    is never chosen over an error of the user's code."""
    own = {r: e for r, e in errors.items() if not _outcome.is_echo(e.type_name, e.message)} or errors
    first = min(e.failed_at for e in own.values())
    return min(r for r, e in own.items() if e.failed_at <= first + _TOGETHER)


def _interrupted_all(records: dict[int, Any]) -> bool:
    """Whether every rank that came back with an error came back interrupted."""
    errors = [rec for rec in records.values() if isinstance(rec, ErrorRecord)]
    return bool(errors) and all(rec.type_name == "KeyboardInterrupt" for rec in errors)
