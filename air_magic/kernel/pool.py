"""A pool of ranks that stays across cells: the kernel side (the rank side is
:mod:`air_magic.rank.pool`).

A pool is a launch that stays: its ranks are forked by the helper as for any launch (so a
kernel's shutdown, restart or death takes them along), join the default process group
once, and then run what the kernel sends them over one connection each::

    PoolEngine.start()   a Unix socket in the kernel's private session folder (auth key),
                         a launch whose payload is "serve the pool"; every rank connects
    run_cell / call      ("cell" | "call", id, ...) to every rank; rank 0's log into the cell;
                         each rank's record back -> the values in rank order, or its error
    push / pull          names set in, or read from, every rank's namespace
    broken               a rank died, or did not come back from an error, an interrupt or
                         the timeout within a few seconds: the ranks are killed (their
                         stacks shown first) and the next use starts fresh ones, saying so
    close                ("close",) to every rank; the launch ends
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
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from typing import Any, Callable, Iterator

import cloudpickle

from air_magic import capture
from air_magic.errors import AirMagicError, LaunchError, LaunchTimeoutError, interrupted
from air_magic.kernel import outcome as _outcome
from air_magic.kernel.launch import Launch
from air_magic.kernel.launcher import Launcher
from air_magic.kernel.rank_output import OutputPump
from air_magic.protocol import RESULT_NAME, ErrorRecord, Stop, UnpicklableRecord, ValueRecord
from air_magic.spec import LaunchSpec

__all__ = ["PoolEngine", "PoolBrokenError", "PoolBusyError", "PoolCall", "current_pool", "POOL_START_TIMEOUT", "GRACE"]

#: Seconds a pool waits for its ranks to connect (the helper may still be importing torch).
POOL_START_TIMEOUT = 300.0
#: Seconds the other ranks have to come back once one failed, or after an interrupt or a
#: timeout, before the pool is broken (they wait in a collective, or in C).
GRACE = 3.0

#: Factories called as a pool's cell or call begins in the caller's thread (not a
#: ``submit``), with the engine and the call's label: each returns a watcher, or None.  Its
#: ``tick()`` is called from the call's wait loop (every few tens of ms: it must be cheap)
#: and its ``end(outcome)`` once the call is over (the live panel registers one:
#: :mod:`air_magic.panel._pool`; plugins.py wires it).
CALL_WATCHERS: list[Callable[["PoolEngine", str], Any]] = []

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
        return self._future.done()

    def result(self, timeout: float | None = None) -> list[Any]:
        """The values in rank order (waits at most ``timeout`` s); a rank's error is raised."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
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


class PoolEngine:
    """N ranks that keep their namespace and their process group from one call to the next."""

    def __init__(self, spec: LaunchSpec, launcher: Callable[[], Launcher], *, timeout: float | None = None) -> None:
        self.spec = spec
        self.timeout = timeout
        self._launcher = launcher
        self.launch: Launch | None = None
        self.conns: list[Connection] = []
        self.pids: list[int] = []
        self.rank_names: set[str] = set()  # names every rank's own code assigned (or push set)
        self.state = "new"  # "starting", "idle", "running", "broken", "closed"
        self.current = ""  # the call running now (``Cell In[5]``, a function's name), or the last one
        self.busy: set[int] = set()  # the ranks still in the current call
        self.broken_because = ""
        self.cells = 0
        self.started_at = 0.0
        self.restarts = 0
        self._told_shadowed: set[str] = set()
        self.last_had_value = False
        self.start_seconds = 0.0
        self._ids = 0
        self._lock = threading.Lock()  # one call at a time
        # The current call's interrupts: the ranks that began it (a SIGINT raises in them),
        # those to interrupt, and those sent one (a cancel runs in another thread than the wait).
        self._signal_lock = threading.Lock()
        self._began: set[int] = set()
        self._interrupt_wanted: set[int] = set()
        self._signalled: set[int] = set()
        self._nvml: Any = None  # NVML, once a pool of GPU ranks was asked for its memory

    # -- life ------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.conns) if self.conns else (self.launch.world_size if self.launch else 0)

    def start(self) -> "PoolEngine":
        """Start the ranks and wait until every one is connected."""
        launcher = self._launcher()
        launcher._ensure_session_folders()
        backend = launcher.backend_for(self.spec.backend)
        authkey = os.urandom(32)
        address: str | tuple[str, int]
        if backend.local_processes:  # a Unix socket in the kernel's private session folder
            address = os.path.join(launcher.session_dir, f"pool-{uuid.uuid4().hex[:12]}.sock")
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(address)
            os.chmod(address, 0o600)
        else:  # ranks on other machines: a TCP port at the address they reach the kernel at
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.bind((backend.kernel_address(), 0))
            address = server.getsockname()[:2]
        server.listen(1024)
        server.settimeout(0.05)
        placement = self.spec.resolve(backend.hardware())
        payload = capture.Payload(
            kind="pool",
            label="pool",
            data={"address": address, "authkey": authkey, "device": placement.device},
            argv=["pool"],
        )
        self.state = "starting"
        began = time.monotonic()
        hello: dict[int, tuple[Connection, int]] = {}
        try:
            self.launch = launcher.start(self.spec, payload)
            while len(hello) < self.launch.world_size:
                if self.launch.done():
                    self.launch.result()  # its error: the ranks could not start
                    raise LaunchError("the pool's ranks ended before they connected")
                if time.monotonic() - began > POOL_START_TIMEOUT:
                    raise LaunchError(
                        f"the pool's ranks did not connect within {POOL_START_TIMEOUT:g} s "
                        f"({len(hello)} of {self.launch.world_size} did)"
                    )
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    continue
                sock.settimeout(None)
                conn = Connection(sock.detach())
                deliver_challenge(conn, authkey)
                answer_challenge(conn, authkey)
                if not conn.poll(30):
                    conn.close()
                    continue
                _, rank, pid = conn.recv()
                hello[rank] = (conn, pid)
        except BaseException:
            self._kill()
            for conn, _ in hello.values():
                conn.close()
            self.state = "closed"
            raise
        finally:
            server.close()
            if isinstance(address, str):
                try:
                    os.unlink(address)
                except OSError:
                    pass
        self.conns = [hello[r][0] for r in range(len(hello))]
        self.pids = [hello[r][1] for r in range(len(hello))]
        if self.launch.helper is not None:
            self.launch.helper.pool_started(self.launch.id)  # Ray: the agents' spares start now
        self.rank_names = set()
        self.state = "idle"
        self.started_at = time.time()
        self.start_seconds = time.monotonic() - began
        with _pools_lock:
            if self not in _pools:
                _pools.append(self)
        return self

    def restart(self) -> None:
        """Fresh ranks: the old ones (and their state) are gone."""
        self._end(close_first=self.state == "idle")
        self.restarts += 1
        self._told_shadowed.clear()
        self.start()

    def close(self) -> None:
        """Stop the ranks (each ends its loop; the launch ends)."""
        if self.state == "closed":
            return
        self._end(close_first=self.state == "idle")
        self.state = "closed"
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None
        if self.launch is not None and self.launch.helper is not None:
            self.launch.helper.release_pool(self.launch.id)  # Ray: the agents kept for the pool
        with _pools_lock:
            if self in _pools:
                _pools.remove(self)

    def _end(self, close_first: bool) -> None:
        if close_first:
            for conn in self.conns:
                try:
                    conn.send_bytes(cloudpickle.dumps(("close",)))
                except OSError:
                    pass
            if self.launch is not None:
                deadline = time.monotonic() + 5.0
                while not self.launch.done() and time.monotonic() < deadline:
                    time.sleep(0.01)
        self._kill()
        for conn in self.conns:
            conn.close()
        self.conns, self.pids = [], []

    def _kill(self) -> None:
        launch = self.launch
        if launch is None or launch.done():
            return
        try:
            launch.launcher.send(Stop(launch.id, "kill"))
        except OSError:
            pass
        deadline = time.monotonic() + 10.0
        while not launch.done() and time.monotonic() < deadline:
            time.sleep(0.01)

    def interrupt(self, ranks: list[int]) -> None:
        """KeyboardInterrupt in these ranks' code.  A rank that has not begun the call yet (it
        was not scheduled: a loaded machine) is interrupted as it begins it: a SIGINT sent
        before would find it idle, and be ignored."""
        with self._signal_lock:
            self._interrupt_wanted.update(ranks)
            now = sorted(set(ranks) & self._began)
            self._signalled.update(now)
        if now and self.launch is not None:
            self.launch.signal_ranks(now, signal.SIGINT)

    def _on_began(self, rank: int, call_id: int) -> None:
        """A rank began the call: from now on a SIGINT raises in it."""
        if call_id != self._ids:
            return
        with self._signal_lock:
            self._began.add(rank)
            late = rank in self._interrupt_wanted and rank not in self._signalled
            if late:
                self._signalled.add(rank)
        if late and self.launch is not None:
            self.launch.signal_ranks([rank], signal.SIGINT)

    def _break(self, because: str) -> None:
        self.state = "broken"
        self.broken_because = because
        self._kill()

    def _ready(self) -> None:
        """A pool that is usable now: a broken one gets fresh ranks first, and says so."""
        if self.state == "closed":
            raise PoolBrokenError(
                "this pool is closed; start a new one (air_magic.Pool(...), or %distributed_pool -n N)."
            )
        if self.state == "broken" or self._ranks_gone():
            because = self.broken_because or "its ranks ended"
            n = self.world_size
            print(
                f"[air_magic] the pool was broken ({because}); starting {n} fresh rank{'s' * (n != 1)}: "
                "the state of the old ones (their names, models, data) is lost.",
                file=sys.stderr,
            )
            self._end(close_first=False)
            self.restarts += 1
            self._told_shadowed.clear()
            self.start()

    def _ranks_gone(self) -> bool:
        return self.launch is None or self.launch.done()

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
            self._ready()
            read = capture.free_names(tree)
            shadowed = sorted(
                n for n in read if n in namespace and n in self.rank_names and n not in self._told_shadowed
            )
            for name in shadowed:
                self._told_shadowed.add(name)
                print(
                    f"[air_magic] {name}: the pool's ranks have their own (a pool cell or pool.push set it), so "
                    f"the notebook's {name} is not sent; pool.push({name}=...) sends it.",
                    file=sys.stderr,
                )
            visible = {k: v for k, v in namespace.items() if k not in self.rank_names}
            payload = capture.cell_payload(cell, visible, display=display, filename=filename, header=header, argv=argv)
            data = payload.data | {"sources": payload.sources, "argv": payload.argv}
            return self._call("cell", data, display, timeout)

    def call(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``func(*args, **kwargs)`` on every rank; one value per rank."""
        with self._turn():
            self._ready()
            payload = capture.function_payload(func, args, kwargs)
            label = getattr(func, "__qualname__", repr(func))
            return self._call("call", payload.data | {"sources": payload.sources}, label)

    def submit(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> PoolCall:
        """``func(*args, **kwargs)`` on every rank in the background; a handle at once."""
        label = getattr(func, "__qualname__", repr(func))
        handle = PoolCall(self, label)
        if not self._lock.acquire(blocking=False):
            raise self._busy()

        def run() -> None:
            try:
                self._ready()
                payload = capture.function_payload(func, args, kwargs)
                data = payload.data | {"sources": payload.sources}
                handle._future.set_result(self._call("call", data, label, background=True))
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
            self._ready()
            blobs = {name: cloudpickle.dumps(value) for name, value in values.items()}
            self._call("push", {"names": blobs}, "push")

    def pull(self, name: str) -> list[Any]:
        """The value of ``name`` on every rank, in rank order."""
        with self._turn():
            self._ready()
            return self._call("pull", {"name": name}, f"pull({name!r})")

    def _call(
        self, kind: str, data: dict[str, Any], label: str, timeout: float | None = None, background: bool = False
    ) -> list[Any]:
        assert self.launch is not None
        self._ids += 1
        log = self.launch.ranks[0].log_path
        pump = OutputPump(log, self.launch.limits.output)
        try:
            pump.reader.offset = os.path.getsize(log)  # before the ranks get the call: all of its output
        except OSError:
            pass
        with self._signal_lock:
            self._began, self._interrupt_wanted, self._signalled = set(), set(), set()
        message = capture.dumps((kind, self._ids, data | {"label": label}))  # once, for every rank
        for conn in self.conns:
            try:
                conn.send_bytes(message)
            except OSError:
                self._break("a rank's connection closed")
                raise PoolBrokenError("the pool's ranks are gone; the next call starts fresh ones.") from None
        self.state = "running"
        self.current = label
        self.busy = set(range(len(self.conns)))
        self.cells += 1
        watchers = _watch(self, label) if kind in ("cell", "call") and not background else []
        outcome = "done"
        try:
            try:
                records = self._collect(pump, label, timeout if timeout is not None else self.timeout, watchers)
            finally:
                pump.pump(final=True)
            if self.state == "running":
                self.state = "idle"
            self.busy = set()
            return self._outcome(records, label)
        except BaseException as exc:
            outcome = _outcome_text(self, exc)
            raise
        finally:
            self.busy = set()
            for watcher in watchers:
                try:
                    watcher.end(outcome)
                except Exception:  # a watcher (the panel) never changes the call's outcome
                    pass

    def _collect(
        self,
        pump: OutputPump,
        label: str,
        timeout: float | None,
        watchers: list[Any] = [],  # noqa: B006 - read only
    ) -> dict[int, Any]:
        """Every rank's record, waiting for them; a fault breaks the pool."""
        assert self.launch is not None
        records: dict[int, Any] = {}
        pending = dict(enumerate(self.conns))
        began = time.monotonic()
        grace_until: float | None = None
        unheeded = False
        try:
            while pending:
                for rank, record, names in _replies(pending, 0.05, self._on_began):
                    records[rank] = record
                    self.busy.discard(rank)
                    self.rank_names = set(names) if rank == 0 else self.rank_names & set(names)
                    if isinstance(record, ErrorRecord) and grace_until is None:
                        grace_until = time.monotonic() + GRACE
                pump.pump()
                if not pending:
                    break
                for watcher in watchers:
                    try:
                        watcher.tick()
                    except Exception:  # a watcher (the panel) never changes the call's outcome
                        pass
                gone = self._first_gone(pending)
                if gone is not None:
                    self._fault(records, pending, f"rank {gone} ended (exit {self.launch.ranks[gone].returncode})")
                if grace_until is not None and time.monotonic() > grace_until:
                    if self._interrupt_wanted and _interrupted_all(records):  # a cancel some did not heed
                        unheeded = True
                        break
                    failed = min(r for r, rec in records.items() if isinstance(rec, ErrorRecord))
                    self._fault(records, pending, f"rank {failed} failed while the others did not come back")
                if timeout is not None and time.monotonic() - began > timeout:
                    where = self._where(pending)
                    self._break(f"{label} ran past its timeout of {timeout:g} s")
                    error = LaunchTimeoutError(
                        f"{label} ran past its timeout of {timeout:g} s on the pool; its ranks were stopped and "
                        "the next pool cell starts fresh ones (their state is lost). Pass --timeout SECONDS|none."
                    )
                    if where:
                        error.add_note(where)
                    raise error
        except KeyboardInterrupt:
            self._interrupt(records, pending)
        if unheeded:  # out of the try: the KeyboardInterrupt raised is the cancel's outcome
            self._not_stopped(pending, "the pool's call was cancelled")
        return records

    def _first_gone(self, pending: dict[int, Connection]) -> int | None:
        """The pending rank that ended first (not one stopped because another ended), if any."""
        assert self.launch is not None
        states = self.launch.ranks
        gone = [r for r in pending if states[r].returncode is not None]
        if not gone:
            return min(pending) if self.launch.done() and pending else None
        first = [r for r in gone if not states[r].stopped] or gone
        return min(first, key=lambda r: (states[r].ended_at or 0.0, r))

    def _interrupt(self, records: dict[int, Any], pending: dict[int, Connection]) -> None:
        """Ctrl-C: KeyboardInterrupt in every rank's code; an intact pool if they all come back."""
        self.interrupt(list(pending))
        deadline = time.monotonic() + GRACE
        while pending and time.monotonic() < deadline:
            for rank, record, _names in _replies(pending, 0.05, self._on_began):
                records[rank] = record
        if not pending:
            self.state = "idle"
            raise interrupted(
                "you interrupted the pool's cell; every rank stopped it, and the pool and its state are intact."
            )
        self._not_stopped(pending, "you interrupted the pool's cell")

    def _not_stopped(self, pending: dict[int, Connection], what: str) -> None:
        """Some ranks did not stop within GRACE s of their interrupt: the pool is broken."""
        where = self._where(pending)
        ranks = ", ".join(map(str, sorted(pending)))
        self._break("interrupted, and some ranks did not stop")
        message = (
            f"{what}; rank{'s' * (len(pending) != 1)} {ranks} did not stop within {GRACE:g} s "
            "(its code caught the KeyboardInterrupt, or waits in a collective or in C), so the pool is broken: "
            "the next pool cell starts fresh ranks."
        )
        if where:
            message += "\n" + where
        raise interrupted(message)

    def _fault(self, records: dict[int, Any], pending: dict[int, Connection], because: str) -> None:
        where = self._where(pending)
        self._break(because)
        n = self.world_size or len(self.pids)
        errors = {r: rec for r, rec in records.items() if isinstance(rec, ErrorRecord)}
        tail = (
            f"the pool is broken ({because}); the next pool cell starts {n} fresh rank{'s' * (n != 1)} "
            "(the state of these is lost)."
        )
        own = {r: e for r, e in errors.items() if not _outcome.is_echo(e.type_name, e.message)}
        gone = self._first_gone(pending)
        if own or (errors and gone is None):
            first = _first_failure(errors)
            error = self._rank_exception(records, first)
            error.add_note("[air_magic] " + tail)
        else:  # a rank ended; any error of the others only followed from it (a broken collective)
            gone = min(pending) if gone is None else gone
            assert self.launch is not None
            state = self.launch.ranks[gone]
            error = LaunchError(
                f"rank {gone} of {n} of the pool {_outcome.describe_exit(state.returncode or -9, n)}; {tail}"
            )
            for rank, record in sorted(errors.items()):
                error.add_note(f"[air_magic] rank {rank}'s {record.type_name} followed from it: {record.message[:200]}")
        if where:
            error.add_note(where)
        raise error

    def _where(self, pending: dict[int, Connection]) -> str:
        if self.launch is None or not pending:
            return ""
        try:
            stacks = self.launch.stacks(timeout=1.0)
            absent = "had come back (done with the call)"
            return self.launch.where({r: s for r, s in stacks.items() if r in pending}, absent)
        except Exception:  # the stacks are a courtesy: the fault is said anyway
            return ""

    def _rank_exception(self, records: dict[int, Any], rank: int) -> BaseException:
        assert self.launch is not None
        n = len(self.pids)
        states = tuple(
            _outcome.RankState(
                r,
                self.launch.ranks[r].log_path,
                self.pids[r],
                returncode=(1 if isinstance(records[r], ErrorRecord) else 0) if r in records else None,
            )
            for r in range(n)
        )
        ending = _outcome.Ending(
            label="the pool's cell", world_size=n, ranks=states, failures=(rank,), device=self.launch.placement.device
        )
        return _outcome.rank_error(ending, records, rank, "")

    def _outcome(self, records: dict[int, Any], label: str) -> list[Any]:
        errors = {r: rec for r, rec in records.items() if isinstance(rec, ErrorRecord)}
        if errors:
            first = _first_failure(errors)
            if errors[first].type_name == "KeyboardInterrupt":
                raise interrupted("the pool's cell was interrupted on its ranks; the pool and its state are intact.")
            raise self._rank_exception(records, first)
        values = []
        for rank in range(len(self.conns)):
            record = records.get(rank)
            if isinstance(record, UnpicklableRecord):
                raise _outcome.result_error(
                    rank, len(self.conns), f"a {record.value_type}, which cannot be sent back ({record.reason})"
                )
            if isinstance(record, BaseException):
                raise _outcome.result_error(rank, len(self.conns), f"a value that cannot be loaded here ({record})")
            assert isinstance(record, ValueRecord)
            values.append(record.value)
        return values

    # -- status ----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What ``%distributed_pool`` shows: ranks, state, memory per rank, cells run, uptime."""
        import psutil

        memory: list[int | None] = []
        local = self.launch is None or self.launch.local_processes
        for pid in self.pids:
            try:
                memory.append(psutil.Process(pid).memory_info().rss if local else None)
            except psutil.Error:
                memory.append(None)

        gpu_memory = self._gpu_memory() if local else [None] * len(self.pids)

        def rank_state(rank: int) -> str:
            if self.state in ("broken", "closed", "starting"):
                return self.state
            return "running" if rank in self.busy else "idle"

        return {
            "ranks": len(self.pids),
            "pids": list(self.pids),
            "state": self.state,
            "rank_states": [rank_state(r) for r in range(len(self.pids))],
            "call": self.current,
            "device": self.launch.placement.device if self.launch else None,
            "backend": self.spec.backend,
            "memory": memory,
            "gpu_memory": gpu_memory,
            "cells": self.cells,
            "uptime": time.time() - self.started_at if self.started_at and self.state != "closed" else 0.0,
            "restarts": self.restarts,
        }

    def _gpu_memory(self) -> list[int | None]:
        """Each rank's GPU memory (NVML, with its child processes'), for a pool of GPU ranks."""
        found: list[int | None] = [None] * len(self.pids)
        if self.launch is None or self.launch.placement.device != "cuda" or not self.pids:
            return found
        try:
            import psutil

            from air_magic.accelerators import NvmlDevices

            family: dict[int, list[int]] = {}
            for rank, pid in enumerate(self.pids):
                try:
                    family[rank] = [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
                except psutil.Error:
                    family[rank] = [pid]
            if self._nvml is None:
                self._nvml = NvmlDevices()  # kept open: the panel asks every half second
            sampled = self._nvml.sample(family)
            return [sampled.get(rank, (None, None, None, None))[2] for rank in range(len(self.pids))]
        except Exception:  # no NVML (a missing driver or nvidia-ml-py): the GPU numbers are left out
            return found

    def table(self) -> tuple[str, str]:
        """The pool's ranks as text and as HTML: state, memory, the call they run (or ran last)."""
        import html

        info = self.status()
        rows = []
        for rank in range(info["ranks"]):
            memory, gpu = info["memory"][rank], info["gpu_memory"][rank]
            mem = "" if memory is None else f"{memory / 2**20:.0f} MiB"
            if gpu is not None:
                mem = f"GPU {gpu / 2**30:.1f} GiB" + (f" · {mem}" if mem else "")
            state = info["rank_states"][rank]
            call = info["call"] if state == "running" else ""
            rows.append((str(rank), state, mem, call))
        text = "\n".join(
            f"  rank {r}: " + (f"running {call}" if call else state) + (f", {mem}" if mem else "")
            for r, state, mem, call in rows
        )
        cells = "".join(
            "<tr>" + "".join(f"<td style='padding:0 12px 0 0'>{html.escape(v)}</td>" for v in row) + "</tr>"
            for row in rows
        )
        head = "".join(
            f"<th style='text-align:left;padding:0 12px 0 0'>{h}</th>" for h in ("rank", "state", "memory", "running")
        )
        return text, f"<table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>"

    def describe(self) -> str:
        info = self.status()
        mem = (
            ", ".join("?" if m is None else f"{m / 2**20:.0f} MiB" for m in info["memory"])
            if any(m is not None for m in info["memory"])
            else ""
        )
        where = f" on {self.spec.backend}" if self.spec.backend != "local" else ""
        gpus = info["gpu_memory"]
        gpu = (
            "; GPU memory per rank: " + ", ".join("?" if g is None else f"{g / 2**30:.1f} GiB" for g in gpus)
            if any(g is not None for g in gpus)
            else ""
        )
        return (
            f"[air_magic] pool of {info['ranks']} {str(info['device']).upper()} rank{'s' * (info['ranks'] != 1)}{where}: "
            f"{info['state']}, {info['cells']} call{'s' * (info['cells'] != 1)} run, up {info['uptime']:.0f} s"
            + (f", restarted {info['restarts']} time{'s' * (info['restarts'] != 1)}" if info["restarts"] else "")
            + (f"; memory per rank: {mem}" if mem else "")
            + gpu
            + (self._run_text() if self.launch is not None and self.launch.run_id else "")
        )

    def _run_text(self) -> str:
        assert self.launch is not None
        name = getattr(self.launch, "run_name", None)
        named = f"'{name}' " if name else ""
        return f"; MLflow run {named}(id {self.launch.run_id}) has a child run for each cell that logs"


def _watch(engine: "PoolEngine", label: str) -> list[Any]:
    watchers = []
    for factory in CALL_WATCHERS:
        try:
            watcher = factory(engine, label)
        except Exception:  # a watcher (the panel) never stops a call
            continue
        if watcher is not None:
            watchers.append(watcher)
    return watchers


def _outcome_text(engine: "PoolEngine", exc: BaseException) -> str:
    """How a call that raised ended, in a few words (the panel's last line)."""
    if engine.state == "broken":
        return f"the pool is broken ({engine.broken_because})"
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


def _replies(
    pending: dict[int, Connection], timeout: float, began: Callable[[int, int], None]
) -> list[tuple[int, Any, list[str]]]:
    """The replies that came within ``timeout`` s, as (rank, record, the rank's names); a
    rank that answered leaves ``pending`` (a closed connection is left there: the rank's
    end is seen by the caller).  A rank's ("began", id) goes to ``began(rank, id)``."""
    by_conn = {id(conn): rank for rank, conn in pending.items()}
    found = []
    for conn in wait(list(pending.values()), timeout=timeout):
        rank = by_conn[id(conn)]
        try:
            message = pending[rank].recv()
        except (EOFError, OSError):
            continue
        if message[0] == "began":
            began(rank, message[1])
            continue
        _, _, blob, names = message
        found.append((rank, _load(blob), list(names)))
        del pending[rank]
    return found


def _load(blob: bytes) -> Any:
    try:
        return cloudpickle.loads(blob)
    except Exception as exc:  # a value the kernel cannot load (a class the notebook does not have)
        return exc
