"""The helper process that ranks are forked from (``python -m air_magic.rank.zygote``).

One per kernel, started by :mod:`air_magic.kernel.launcher` with ``start_new_session=True``.
It imports torch once, then waits.  For each launch it reserves a loopback port
(bound, never listening: ``MASTER_PORT``, unique on the machine) and forks one child
per rank (each child calls :func:`air_magic.rank.main.child_main` and never returns here).
The ranks' ``init_process_group()`` meets in a ``FileStore`` in the launch's private
folder (see ``_rank._private_rendezvous``): no socket another local user could
connect to, read or write.

Why a helper and not ``fork()`` of the kernel: the kernel has threads, ZMQ sockets
and maybe CUDA state, none of which survive a fork.  This process stays
single-threaded between launches and never touches CUDA, so a fork of it is clean,
and ranks start in milliseconds with torch already imported.

The kernel talks to it over an inherited socketpair (no listening socket, so no
one else can connect and nothing unauthenticated is ever unpickled).  It watches:

* the control socket: EOF means the kernel is gone -> kill every rank, delete the
  session's files, exit;
* one pidfd per rank: a rank exits -> kill what is left of its process group
  (DataLoader workers), reap it, report the exit code; the first non-zero exit
  stops the other ranks of that launch (fail fast);
* timers: a launch's timeout, and the SIGINT -> SIGTERM -> SIGKILL escalation.

It is a child subreaper: a process a rank started in a session of its own
(``start_new_session=True``), which the rank's group kill cannot reach, becomes the
helper's child when the rank ends, and is killed with the rank (``_reap_orphans``).

Messages (the types of :mod:`air_magic.protocol`, as tuples on the wire): to the
kernel ``Ready``, ``Started``, ``Exited``, ``Stopping``, ``Done``, ``StartFailed``; from
it ``StartLaunch`` (a :class:`~air_magic.protocol.LaunchRequest`), ``Stop``, ``Shutdown``.
"""

from __future__ import annotations

import collections
import functools
import importlib
import os
import select
import selectors
import shutil
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Callable

from air_magic.protocol import (
    FINAL_STACK_SIGNAL,
    STOP_ESCALATION,
    Done,
    Exited,
    LaunchRequest,
    Ready,
    Shutdown,
    Started,
    StartFailed,
    StartLaunch,
    Stop,
    Stopping,
    ToKernel,
    decode,
    encode,
    end_carriers,
    signal_rank,
)
from air_magic.rank import system as _system
from air_magic.settings import settings

#: The longest single wait of the main loop: selectors refuse waits of ~25 days or more
#: (OverflowError), and a timer further away is simply waited for in several steps.
_MAX_WAIT = 3600.0
#: How long ranks get to write their stacks before a timeout stops them.
_STACK_GRACE = 0.5


#: How often a launch that forks many ranks looks at the kernel between two forks (s).
_LOOK_EVERY = 0.05


class _KernelGone(Exception):
    """The kernel died, or said to shut down, while ranks were being forked."""


class _CannotFork(Exception):
    """The system refused to create a rank's process; the text says which limit."""


def _release_port(launch: _Launch) -> None:
    """The launch's ranks are gone: free its port and what its ranks named after it."""
    if launch.port is not None:
        _system.remove_peer_segments(launch.port.getsockname()[1])
        launch.port.close()
        launch.port = None


class _StoppedWhileStarting(Exception):
    """The launch whose ranks were being forked was stopped (``reason``: the stop's)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Launch:
    launch_id: str
    running: dict[int, int] = field(default_factory=dict)  # rank -> pid
    pidfds: dict[int, int] = field(default_factory=dict)  # rank -> pidfd
    port: socket.socket | None = None  # bound, not listening: reserves MASTER_PORT
    stopping: str | None = None
    deadline: float | None = None  # time.monotonic() when its timeout passes


class Zygote:
    def __init__(self, conn: Connection, alive_fd: int, session_dir: str, shm_dir: str) -> None:
        self.conn = conn
        self.alive_fd = alive_fd
        self.session_dir = session_dir
        self.shm_dir = shm_dir
        self.selector = selectors.DefaultSelector()
        self.launches: dict[str, _Launch] = {}
        self.timers: list[tuple[float, str, Callable[[], None]]] = []
        self.use_pidfd = _system.pidfds_work()
        #: Messages read while a launch's ranks were being forked, handled after it.
        self.pending: collections.deque[StartLaunch | Stop] = collections.deque()
        self._next_look = 0.0  # time.monotonic() of the next look at the kernel between forks

    # -- start-up -------------------------------------------------------------------

    def preload(self) -> None:
        names = settings.preload
        for name in filter(None, (n.strip() for n in names.split(","))):
            try:
                importlib.import_module(name)
            except Exception as exc:  # any import error of an optional module must not stop the helper
                print(
                    f"[air_magic] helper: could not preload {name}: {type(exc).__name__}: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
        # Import what every rank needs before it runs user code.
        from air_magic.rank import main as _rank  # noqa: F401

    # -- main loop --------------------------------------------------------------------

    def serve(self) -> None:
        self.selector.register(self.conn.fileno(), selectors.EVENT_READ, None)
        while True:
            timeout = self._next_timer_delay()
            if timeout is not None:
                timeout = min(timeout, _MAX_WAIT)
            if not self.use_pidfd and self.launches:
                timeout = 0.05 if timeout is None else min(timeout, 0.05)
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    try:
                        wire = self.conn.recv()
                    except (EOFError, OSError):
                        return  # the kernel is gone
                    try:
                        message = decode(wire)
                    except ValueError:
                        continue  # not a message of this version: ignored, as ever
                    if isinstance(message, Shutdown):
                        return
                    if isinstance(message, (StartLaunch, Stop)):
                        try:
                            self._handle(message)
                        except _KernelGone:
                            return
                else:
                    launch_id, rank = key.data
                    self._on_rank_exit(launch_id, rank)
            if not self.use_pidfd:
                self._poll_exits()
            self._run_timers()

    def _handle(self, message: StartLaunch | Stop) -> None:
        self.pending.append(message)
        while self.pending:
            self._handle_one(self.pending.popleft())

    def _handle_one(self, message: StartLaunch | Stop) -> None:
        if isinstance(message, StartLaunch):
            request = message.request
            try:
                self._start(request)
            except _StoppedWhileStarting:  # told, and each rank forked so far taken back
                pass
            except _KernelGone:
                raise
            except _CannotFork as exc:  # said in words, without the helper's traceback
                self._send(StartFailed(request.launch_id, str(exc)))
            except Exception:  # any failure to start is the launch's error, told to the kernel
                self._send(StartFailed(request.launch_id, traceback.format_exc()))
        elif isinstance(message, Stop):
            launch = self.launches.get(message.launch_id)
            if launch is not None and message.reason == "kill":
                # Said first (unless a stop is under way already), so the kernel reads every exit
                # that follows as stopped, not as a rank that failed; then SIGKILL at once.
                if launch.stopping is None and launch.running:
                    launch.stopping = "kill"
                    self._send(Stopping(launch.launch_id, "kill", time.monotonic()))
                self._signal(launch, signal.SIGKILL)
            elif launch is not None:
                self._stop(launch, message.reason)

    # -- launches -----------------------------------------------------------------------

    def _start(self, request: LaunchRequest) -> None:
        launch = _Launch(request.launch_id)
        self.launches[launch.launch_id] = launch
        try:
            self._fork_ranks(launch, request)
        except _StoppedWhileStarting as stop:
            # The kernel waits for this answer (a Ctrl-C): it is told before the killed ranks
            # are reaped, which takes a while for thousands of them.
            reason = stop.reason
            self._abort(launch, lambda: self._send_stopped(launch.launch_id, reason))
            raise
        except BaseException:  # take back the ranks forked so far, then re-raise
            self._abort(launch)
            raise
        self._send(Started(launch.launch_id, dict(launch.running)))
        timeout = request.timeout
        if timeout is not None:
            launch.deadline = time.monotonic() + timeout
            self._after(timeout, launch.launch_id, lambda: self._time_up(launch))

    def _fork_ranks(self, launch: _Launch, request: LaunchRequest) -> None:
        reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        reserved.bind(("127.0.0.1", 0))
        launch.port = reserved
        port = reserved.getsockname()[1]
        _system.remove_peer_segments(port)  # a launch of this user that drew the port before and died
        close_in_child = [self.conn.fileno(), reserved.fileno(), self.selector_fd()]
        for other in self.launches.values():
            if other is launch:
                continue
            close_in_child.extend(other.pidfds.values())
            if other.port is not None:
                close_in_child.append(other.port.fileno())
        from air_magic.rank import main as _rank

        for rank in range(request.world_size):
            if rank:
                self._between_forks(launch)
            # Every signal is held across the fork: until the rank has its own handlers, a
            # stop must not run this helper's (its SIGTERM handler would shut the helper's
            # launches down from inside the rank). The rank lets them in when it is ready.
            held = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            try:
                pid = os.fork()
                if pid == 0:  # the rank; child_main never returns
                    _rank.child_main(request, rank, port, self.alive_fd, close_in_child)
            except BlockingIOError as exc:  # EAGAIN: a limit on processes (pids.max, ulimit -u)
                raise _CannotFork(_system.fork_refused(rank, request.world_size, exc)) from exc
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
            launch.running[rank] = pid
            if self.use_pidfd:
                fd = os.pidfd_open(pid)
                launch.pidfds[rank] = fd
                close_in_child.append(fd)
                self.selector.register(fd, selectors.EVENT_READ, (launch.launch_id, rank))

    def _between_forks(self, launch: _Launch) -> None:
        """A look at the kernel between two forks of a large launch (thousands of ranks take
        seconds): the kernel's death ends the helper now, and a stop of this launch (Ctrl-C,
        cancel) ends its start-up now.  Other messages wait for the main loop."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + _LOOK_EVERY
        readable, _, _ = select.select([self.alive_fd, self.conn.fileno()], [], [], 0)
        if self.alive_fd in readable:  # nobody writes to it: readable means the kernel is gone
            raise _KernelGone
        while self.conn.fileno() in readable:
            try:
                wire = self.conn.recv()
            except (EOFError, OSError):
                raise _KernelGone from None
            try:
                message = decode(wire)
            except ValueError:
                message = None
            if isinstance(message, Shutdown):
                raise _KernelGone
            if isinstance(message, Stop) and message.launch_id == launch.launch_id:
                raise _StoppedWhileStarting(message.reason)
            if isinstance(message, (StartLaunch, Stop)):
                self.pending.append(message)
            readable, _, _ = select.select([self.conn.fileno()], [], [], 0)

    def _send_stopped(self, launch_id: str, reason: str) -> None:
        self._send(Stopping(launch_id, reason, time.monotonic()))
        self._send(Done(launch_id))

    def _abort(self, launch: _Launch, before_reaping: Callable[[], None] | None = None) -> None:
        """A launch that failed to start: take back whatever of it was started, silently
        (the kernel is told of the failure as one error, or by ``before_reaping``)."""
        self.launches.pop(launch.launch_id, None)
        for pid in launch.running.values():  # every one first, then reap: they die together
            signal_rank(pid, signal.SIGKILL)  # the rank alone if it has no group yet
        if before_reaping is not None:
            before_reaping()
        for pid in launch.running.values():
            try:
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for fd in launch.pidfds.values():
            self.selector.unregister(fd)
            os.close(fd)
        launch.running.clear()
        launch.pidfds.clear()
        _release_port(launch)

    def selector_fd(self) -> int:
        fileno = getattr(self.selector, "fileno", None)
        return fileno() if callable(fileno) else -1

    def _on_rank_exit(self, launch_id: str, rank: int) -> None:
        launch = self.launches.get(launch_id)
        if launch is None or rank not in launch.running:
            return
        pid = launch.running[rank]
        if launch.deadline is not None and time.monotonic() >= launch.deadline:
            self._time_up(launch)  # its time was up before this exit was seen: a timeout
        # The rank is a zombie until reaped, so its process-group id cannot be reused yet:
        # kill whatever it left behind (DataLoader workers, shells) before reaping it.
        signal_rank(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        self._reap_orphans()
        self._reaped(launch, rank, os.waitstatus_to_exitcode(status))

    def _poll_exits(self) -> None:
        """Without pidfds: find ranks that have exited, leaving them unreaped (WNOWAIT) so
        that ``_on_rank_exit`` kills their group before its id can be reused."""
        for launch in list(self.launches.values()):
            for rank, pid in list(launch.running.items()):
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    self._on_rank_exit(launch.launch_id, rank)

    def _reaped(self, launch: _Launch, rank: int, returncode: int) -> None:
        del launch.running[rank]
        fd = launch.pidfds.pop(rank, None)
        if fd is not None:
            self.selector.unregister(fd)
            os.close(fd)
        self._send(Exited(launch.launch_id, rank, returncode, time.monotonic()))
        if returncode != 0 and launch.stopping is None:
            self._stop(launch, "failure")
        if not launch.running:
            self._finish(launch)

    def _time_up(self, launch: _Launch) -> None:
        """The launch's timeout has passed: it is stopping from this moment (whatever its ranks
        do from now on, its outcome is the timeout).  Every rank writes its stacks (where was
        each one?) and ends at once; the escalation follows a moment later for a rank that
        could not (not yet set up, or stuck in the kernel)."""
        launch.deadline = None
        if launch.stopping is not None or not launch.running:
            return
        self._stop(launch, "timeout", after=_STACK_GRACE)
        for pid in launch.running.values():
            try:
                os.kill(pid, FINAL_STACK_SIGNAL)
            except ProcessLookupError:
                pass

    def _stop(self, launch: _Launch, reason: str, after: float = 0.0) -> None:
        if launch.stopping is not None or not launch.running:
            return
        launch.stopping = reason
        self._send(Stopping(launch.launch_id, reason, time.monotonic()))
        for delay, signum in STOP_ESCALATION.get(reason, STOP_ESCALATION["failure"]):
            self._after(after + delay, launch.launch_id, functools.partial(self._signal, launch, signum))

    def _signal(self, launch: _Launch, signum: int) -> None:
        for pid in launch.running.values():
            signal_rank(pid, signum)

    def _finish(self, launch: _Launch) -> None:
        self.launches.pop(launch.launch_id, None)
        self.timers = [timer for timer in self.timers if timer[1] != launch.launch_id]
        _release_port(launch)
        self._send(Done(launch.launch_id))

    def _reap_orphans(self) -> None:
        """Kill and reap the helper's children that are not ranks: processes a rank left
        in a session of their own, handed to the helper (a subreaper) when their parent
        ended.  Their own children come next, as they are handed over in turn."""
        ranks = {pid for launch in self.launches.values() for pid in launch.running.values()}
        for _ in range(8):
            orphans = [pid for pid in _system.children(os.getpid()) if pid not in ranks]
            if not orphans:
                return
            for pid in orphans:
                signal_rank(pid, signal.SIGKILL)
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass

    def shutdown(self) -> None:
        for launch in list(self.launches.values()):
            for pid in launch.running.values():
                signal_rank(pid, signal.SIGKILL)
            for pid in launch.running.values():
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
        ended = list(self.launches)
        for launch in self.launches.values():
            _release_port(launch)
        self.launches.clear()
        self._reap_orphans()
        for launch_id in ended:  # what left the ranks' sessions and was not handed to us yet
            end_carriers(launch_id)
        self._reap_orphans()
        for path in (self.session_dir, self.shm_dir):
            if path:
                shutil.rmtree(path, ignore_errors=True)

    # -- timers and messages ---------------------------------------------------------

    def _after(self, delay: float, owner: str, fn: Callable[[], None]) -> None:
        self.timers.append((time.monotonic() + delay, owner, fn))
        self.timers.sort(key=lambda item: item[0])

    def _next_timer_delay(self) -> float | None:
        if not self.timers:
            return None
        return max(0.0, self.timers[0][0] - time.monotonic())

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, _, fn = self.timers.pop(0)
            fn()

    def _send(self, message: ToKernel) -> None:
        try:
            self.conn.send(encode(message))
        except OSError:
            pass  # the kernel is gone; the next recv() ends the loop


def _watch_kernel_while_preloading(alive_fd: int, session_dir: str, shm_dir: str) -> Callable[[], None]:
    """Leave at once if the kernel dies while the preload runs (seconds, or minutes for a
    heavy ``AIR_MAGIC_PRELOAD``): the control socket is only read after it.

    Watches the kernel's alive pipe (EOF: the kernel is gone) from a thread that the
    returned function stops and joins, so no thread is left when ranks are forked.
    """
    import select
    import threading

    wake_r, wake_w = os.pipe()

    def watch() -> None:
        readable, _, _ = select.select([alive_fd, wake_r], [], [])
        if alive_fd in readable:
            for path in (session_dir, shm_dir):
                if path:
                    shutil.rmtree(path, ignore_errors=True)
            os._exit(0)

    thread = threading.Thread(target=watch, name="air_magic-preload-watch", daemon=True)
    thread.start()

    def stop() -> None:
        os.write(wake_w, b"x")
        thread.join()
        os.close(wake_r)
        os.close(wake_w)

    return stop


def main(argv: list[str]) -> int:
    ctrl_fd, alive_fd = int(argv[0]), int(argv[1])
    session_dir, shm_dir = argv[2], argv[3]
    # Interrupts are the kernel's to handle: it tells us what to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _system.become_subreaper()
    os.set_inheritable(alive_fd, True)
    conn = Connection(ctrl_fd)
    zygote = Zygote(conn, alive_fd, session_dir, shm_dir)

    # On SIGTERM (a kernel manager cleaning up) still take every rank along.
    def on_sigterm(*_: object) -> None:
        zygote.shutdown()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        stop_watch = _watch_kernel_while_preloading(alive_fd, session_dir, shm_dir)
        zygote.preload()
        stop_watch()  # single-threaded again before the first fork
        zygote._send(Ready())  # the kernel's panel stops saying "importing torch"
        zygote.serve()
    finally:
        zygote.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
