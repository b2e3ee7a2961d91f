"""A pool of ranks that stays across cells: the kernel side's face and life (the rank side is
:mod:`air_magic.rank.pool.serve`).  The engine is in parts, each a module of its own::

    engine    PoolEngine: the face (run_cell, call, submit, push, pull, sync, debug) and the
              ranks' life (start, restart, close, broken -> fresh ranks at the next call)
    start     the ranks started (a launch whose payload is "serve the pool"; each rank
              connects to a Unix socket in a private folder, with an auth key) and ended
    mirror    what the ranks know of the kernel: cwd, sys.path, environment, their own names
    wait      one call: sent to every rank (SIGINT held while it goes out), then its wait
              (CallWait: the replies, rank 0's output, the hang watch, the faults) and its
              values in rank order, or the error of the rank that failed first
    interrupt one call's Ctrl-C, q or Stop: every rank stopped at one point, state compared
    decide    the decisions as pure functions (which rank ended first, whose error is raised)
    status    what the pool says of itself (the notebook, the panel, the sidebar)

A pool is a launch that stays: its ranks are forked by the helper as for any launch (so a
kernel's shutdown, restart or death takes them along), join the default process group
once, and then run what the kernel sends them over one connection each (what travels,
:mod:`air_magic.kernel.pool.wire`).  A reply to another call breaks the pool: never a wrong
value.  A rank that died, or did not come back from an error, an interrupt or the timeout
within a few seconds, breaks it too: its ranks are killed (where each was is shown first) and
the next use starts fresh ones, saying so.  A restart or close retires the old ranks: a call
still running on them ends with an error that says so, and never touches the new ones.

One pool per kernel: a new ``air_magic.Pool(...)`` closes the kernel's earlier one, saying so.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator

from air_magic import capture
from air_magic.errors import AirMagicError, interrupted
from air_magic.kernel.inspect.hang_report import HangReport
from air_magic.kernel.launch import Launch
from air_magic.kernel.launcher import Launcher
from air_magic.kernel.pool import status as _status
from air_magic.kernel.pool.call import Call as _Call
from air_magic.kernel.pool.call import PoolState, RankCallState
from air_magic.kernel.pool.call import Ranks as _Ranks
from air_magic.kernel.pool.interrupts import regroup as pool_regroup
from air_magic.kernel.pool.interrupts.interrupt import GRACE
from air_magic.kernel.pool.mirror import KernelMirror
from air_magic.kernel.pool.start import POOL_START_TIMEOUT, end_ranks, kill, start_ranks
from air_magic.kernel.pool.wait import PoolBrokenError, run_call
from air_magic.protocol import RESULT_NAME
from air_magic.protocol.pool import PoolKind, PoolRequest
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


_pools: list["PoolEngine"] = []  # open pools of this kernel, the most recently started last
_pools_lock = threading.Lock()


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
        self.current = ""  # the call running now (``Cell In[5]``, a function's name), or the last one
        self.cells = 0
        self.started_at = 0.0
        self.restarts = 0
        self.last_failed_rank: int | None = None  # the rank that failed first in the last call
        #: The pool's own name in lists (the lab sidebar): its launches, one per start, share it.
        self.key = f"pool-{uuid.uuid4().hex[:8]}"
        self.last_had_value = False
        self.start_seconds = 0.0
        self._ids = 0
        self._lock = threading.Lock()  # one call at a time
        #: The kernel's environment, sys.path and names as the ranks have them.
        self.mirror = KernelMirror()
        self._gpu = _status.GpuMemory()  # NVML, once a pool of GPU ranks was asked for its memory
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
    def state(self) -> PoolState:
        """How the pool stands (:class:`~air_magic.kernel.pool.call.PoolState`)."""
        if self._closed:
            return PoolState.CLOSED
        if self._starting:
            return PoolState.STARTING
        ranks = self._ranks
        if ranks is None:
            return PoolState.NEW
        if ranks.broken or ranks.launch.done():
            return PoolState.BROKEN
        return PoolState.RUNNING if self._call_now is not None else PoolState.IDLE

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
        if state is PoolState.BROKEN and self._last_call is not None and self._last_call.ranks is self._ranks:
            return str(self._last_call.states.get(rank, state))  # (the plain word: status() shows it)
        if state in (PoolState.BROKEN, PoolState.CLOSED, PoolState.STARTING, PoolState.NEW):
            return str(state)
        call = self._call_now
        if call is None:
            return str(PoolState.IDLE)
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
        self.mirror.forget_names()
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
        ranks, self.start_seconds = start_ranks(self.spec, self._launcher(), self.key, self.mirror)
        ranks.launch.cancel_instead = self.stop_call  # a panel's Stop interrupts the call; the ranks stay
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
        self._gpu.close()
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
        end_ranks(ranks, close_first=not running and not ranks.broken)

    def interrupt(self, ranks: list[int]) -> None:
        """KeyboardInterrupt in these ranks' code, for the call running now
        (:meth:`~air_magic.kernel.pool.call.Call.interrupt`)."""
        call = self._call_now
        if call is not None:
            call.interrupt(ranks)

    def stop_call(self) -> bool:
        """What a panel's Stop does to the pool (its launch's ``cancel()``): the call running
        now is interrupted as Ctrl-C interrupts it, and the ranks and their state stay.  A call
        the kernel's main thread waits for (a pool cell, ``pool.run``) gets the SIGINT that
        Jupyter's interrupt sends the kernel, so it ends exactly as after Ctrl-C; a
        ``pool.submit`` call is cancelled (:meth:`PoolCall.cancel`).  False when none runs."""
        call = self._call_now
        return call is not None and call.stop()

    def break_ranks(self, ranks: _Ranks, because: str) -> None:
        """These ranks cannot go on: they are killed; the pool's next call starts fresh ones."""
        if not ranks.broken:
            ranks.broken = because
        kill(ranks.launch)

    def _ready(self) -> _Ranks:
        """The ranks a call runs on now: a broken pool gets fresh ones first, and says so."""
        if self._closed:
            raise PoolBrokenError(
                "this pool is closed; start a new one (air_magic.Pool(...), or %distributed_pool -n N)."
            )
        if self.state is PoolState.BROKEN or self._ranks is None:
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
            visible = self.mirror.visible(namespace, capture.free_names(tree))
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
        """``names`` copied from rank ``src`` to every other (:func:`air_magic.rank.pool.interrupts.state.sync`);
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

    def _call(
        self,
        ranks: _Ranks,
        kind: str,
        data: dict[str, Any],
        label: str,
        timeout: float | None = None,
        background: bool = False,
    ) -> list[Any]:
        call = _Call(ranks, self.next_id(), label, data.get("sources") or {}, background=background)
        self.sources.update(call.sources)
        with _not_sent_yet():
            message = capture.dumps(PoolRequest(PoolKind(kind), call.id, data | {"label": label} | self.mirror.state()))
        self._call_now = self._last_call = call
        self.current = label
        self.cells += 1

        def ended() -> None:  # the call kept (what its ranks did of it) while the pool says idle
            if self._call_now is call:
                self._call_now = None

        return run_call(self, call, kind, message, timeout if timeout is not None else self.timeout, ended)

    def hang_report(self) -> HangReport | None:
        """The hang report of the call running now, while its hang lasts (``%distributed_pool``
        shows it: a ``pool.submit`` call has no cell of its own to show it in)."""
        call = self._call_now
        return call.hangs.current if call is not None and call.hangs is not None else None

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

    # -- status (what it says of itself: :mod:`air_magic.kernel.pool.status`) ----------------------------

    def gpu_memory(self) -> list[int | None]:
        """Each rank's GPU memory (NVML, with its child processes'), for a pool of GPU ranks."""
        return self._gpu.sample(self.launch, self.pids)


# -- helpers -----------------------------------------------------------------------------------------


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
