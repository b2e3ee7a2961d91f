"""The kernel-side launcher: the :class:`Launcher` that starts launches (one per kernel,
shared by ``@distributed`` and ``%%distributed``), and the :class:`Launch` handle it returns
(defined in :mod:`air_magic.kernel.launch`, re-exported here).

Data flow (messages and records: :mod:`air_magic.protocol`)::

    kernel (this module)                    helper process (_zygote)          ranks (_rank)
    --------------------                    ------------------------          -------------
    LaunchSpec + Payload
      |  resolve against hardware
      |  payload.pkl  -> work dir (0700)
      |  StartLaunch(LaunchRequest) ----->  bind 127.0.0.1:0, fork N -------> setsid, log file,
      |     (through _helper.Helper)                                           env/cwd/sys.path,
      |  <------------ Started(pids)                                           run code,
      |                                     pidfd per rank <----- exit ------  result-<r>.pkl
      |  <------------ Exited(rank, rc)     first rc != 0: stop the others     (+ /dev/shm tensors)
      |  <------------ Done
      |  read result-<r>.pkl -> _outcome.decide() -> list, or one exception naming the rank
      v
    observers (MLflow run, panel) see start and end through LaunchObserver; they are
    registered from outside with Launcher.add_observer (air_magic.plugins)

Rank 0's log is copied into the cell while a blocking launch waits (from the main
thread, in short slices, so an interrupt is handled at once); every rank's full log
stays in the launch's log folder.  A kernel that dies takes everything with it: the
helper sees EOF on its control socket, each rank sees EOF on a pipe whose only write
end is in the kernel.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time

from air_magic.backends.base import Backend
from air_magic.backends.local import Helper
from air_magic.capture import Payload
from air_magic.errors import ConfigurationError, LaunchError
from air_magic.kernel import logs as _logs
from air_magic.kernel import request as _request
from air_magic.kernel.launch import Launch, LaunchObserver, ObserverFactory
from air_magic.kernel.outcome import RankState, describe_exit
from air_magic.protocol import (
    Done,
    LaunchRequest,
    Ready,
    StartFailed,
    StartLaunch,
    Stop,
    ToKernel,
    payload_path,
    pids_room,
)
from air_magic.settings import settings
from air_magic.spec import LaunchSpec

__all__ = ["Launcher", "Launch", "LaunchObserver", "RankState", "get_launcher", "describe_exit"]

# How much of rank 0's output reaches the cell, when a quiet launch is looked at, and how
# much of each log is kept: read from ``settings`` (AIR_MAGIC_OUTPUT_LIMIT,
# AIR_MAGIC_STALL_SECONDS, AIR_MAGIC_LOG_LIMIT) at each launch.


class Launcher:
    """Owns the helper process, the session's private folders and every launch of this kernel."""

    _observer_factories: list[ObserverFactory] = []

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._helper: Helper | None = None
        self._backends: dict[str, Backend] = {}  # other backends than the local helper, by name
        self._counter = itertools.count(1)
        self.launches: dict[str, Launch] = {}
        self.session_dir = tempfile.mkdtemp(prefix=f"air_magic-{os.getpid()}-")
        self.shm_root: str | None = None
        shm = settings.shm_dir  # where large result tensors travel
        if os.path.isdir(shm) and os.access(shm, os.W_OK):
            self.shm_root = tempfile.mkdtemp(prefix=f"air_magic-{os.getpid()}-", dir=shm)
        self._closed = False
        self.log_folder = _logs.LogFolder()  # where the launches' logs are kept
        atexit.register(self.shutdown)

    def next_number(self) -> int:
        """The next launch's number in this kernel (1, 2, ...)."""
        return next(self._counter)

    def is_active(self, launch: Launch) -> bool:
        """Whether ``launch`` is one of this launcher's, not yet ended or given up."""
        return self.launches.get(launch.id) is launch

    @classmethod
    def add_observer(cls, factory: ObserverFactory) -> None:
        """Register ``factory(launch) -> observer | None``, called for every launch."""
        if factory not in cls._observer_factories:
            cls._observer_factories.append(factory)

    def warm(self) -> None:
        """Start the helper now (it imports torch in the background) so launches start fast.

        ``AIR_MAGIC_WARM=0`` leaves it to the first launch (tests of code that never launches).
        """
        try:
            warm = settings.warm
        except ConfigurationError:  # the first launch says what is wrong with it
            return
        if warm:
            self._ensure_helper()

    def _ensure_helper(self) -> Helper:
        with self._lock:
            if self._closed:
                raise LaunchError("the launcher was shut down; restart the kernel to launch again")
            # A helper that has exited is gone even before its reader thread has read the
            # end of its socket: a launch sent to it now would be lost with it.
            if self._helper is not None and self._helper.returncode() is not None:
                self._helper.alive = False
            if self._helper is None or not self._helper.alive:
                self._helper = Helper(self.session_dir, self.shm_root, self._dispatch, self._helper_gone)
            return self._helper

    def backend_for(self, name: str) -> Backend:
        """The backend called ``name`` (``LaunchSpec.backend``), started or connected on first use."""
        if name == "local":
            return self._ensure_helper()
        with self._lock:
            if self._closed:
                raise LaunchError("the launcher was shut down; restart the kernel to launch again")
            backend = self._backends.get(name)
            if backend is None or not backend.alive:
                if name != "ray":
                    raise LaunchError(f"no backend called {name!r}")
                from air_magic.backends.ray.backend import RayBackend

                backend = self._backends[name] = RayBackend(self._dispatch, self._helper_gone)
            return backend

    def send(self, message: Stop) -> None:
        """Send to the backend that runs the launch (one that went away ended its launches)."""
        launch = self.launches.get(message.launch_id)
        backend = launch.helper if launch is not None and launch.helper is not None else self._helper
        if backend is not None:
            backend.try_send(message)

    def start(self, spec: LaunchSpec, payload: Payload, background: bool = False) -> Launch:
        """Start ``payload`` on the ranks ``spec`` asks for; returns at once.  ``background``:
        nobody waits for it now (``.submit()``, ``--async``): a breakpoint in a rank waits for
        ``launch.debug()`` a while (``AIR_MAGIC_BREAKPOINT_WAIT``) instead of 5 s."""
        called = time.monotonic()
        settings.check()  # a bad AIR_MAGIC_* value stops the launch here, before anything starts
        cwd = _request.working_directory()
        self._ensure_session_folders()  # before a new helper, which logs into the session folder
        helper = self.backend_for(spec.backend)
        placement = spec.resolve(helper.hardware())  # this machine's, or the cluster's
        if helper.local_processes:
            _check_room_for(placement.world_size, payload.label)
        launch = Launch(self, spec, placement, payload)
        launch.background = background
        launch.timings["call"] = called
        launch.helper = helper  # before the observers: the panel says what the launch waits for
        try:
            request = launch.request = self._prepare(launch, payload, cwd)
            with self._lock:
                self.launches[launch.id] = launch
            try:
                helper.send(StartLaunch(request))
            except OSError:
                # The helper went away just now (SIGTERM, a crash) and its reader has not seen
                # it yet: the launch goes to a new one.
                helper = self._replace_helper(helper)
                launch.helper = helper
                helper.send(StartLaunch(request))
            launch.timings["sent"] = time.monotonic()
        except BaseException as exc:  # an interrupt too: nothing of a launch that never started stays
            with self._lock:
                self.launches.pop(launch.id, None)
            launch.status = "cancelled" if isinstance(exc, KeyboardInterrupt) else "failed"
            launch.ended_at = time.time()
            for observer in launch.observers:
                try:
                    observer.after_end(launch)
                except Exception:  # an observer's failure must not replace the launch's own error
                    pass
            shutil.rmtree(launch.work_dir, ignore_errors=True)
            if launch.shm_dir:
                shutil.rmtree(launch.shm_dir, ignore_errors=True)
            if isinstance(exc, OSError):
                raise LaunchError(f"could not reach the air_magic helper process: {exc}. Try again.") from exc
            raise
        return launch

    def _prepare(self, launch: Launch, payload: Payload, cwd: str) -> LaunchRequest:
        """The launch's private folders, its payload file and observers; the helper's request."""
        os.mkdir(launch.work_dir, mode=0o700)  # makedirs' mode applies to the leaf only
        os.mkdir(launch.log_dir, mode=0o700)
        if launch.shm_dir:
            os.makedirs(launch.shm_dir, mode=0o700)
        payload_file = payload_path(launch.work_dir)
        fd = os.open(payload_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload.dumps())
        env = _request.rank_environment(launch)
        for factory in self._observer_factories:
            try:
                observer = factory(launch)
                if observer is not None:
                    with launch.timed(observer, "before_start"):
                        observer.before_start(launch, env)
                    launch.observers.append(observer)
            except LaunchError:  # the GPUs' claim refused the launch (GPUsBusyError): its words
                raise
            except Exception as exc:  # optional pieces (any error of theirs) never stop a launch
                print(
                    f"[air_magic] {getattr(factory, '__name__', 'observer')} is off for this launch: "
                    f"{type(exc).__name__}: {exc}",
                    file=sys.stderr,
                )
        return _request.request(launch, payload, env, cwd, payload_file)

    def _ensure_session_folders(self) -> None:
        """The session's private folders, made again if something deleted them (a temp
        cleaner; a helper stopped with SIGTERM removes them on its way out)."""
        with self._lock:
            if self._closed:  # shut down (the kernel is exiting): nothing is made again
                return
            for path in (self.session_dir, self.shm_root):
                if path and not os.path.isdir(path):
                    os.makedirs(path, mode=0o700, exist_ok=True)

    # -- messages from the helper (reader thread) ----------------------------------------------

    def _dispatch(self, helper: Backend, message: ToKernel) -> None:
        if isinstance(message, Ready):
            helper.ready.set()
            return
        launch = self.launches.get(message.launch_id)
        if launch is None:
            return
        try:
            launch.handle(message)
            ended = isinstance(message, (StartFailed, Done))
        except Exception as exc:  # a bug of air_magic's: it ends this launch, not the reader
            ended = True
            launch.fail_inside(exc, f"reading the helper's {message.KIND!r} message")
        if ended:
            with self._lock:
                self.launches.pop(launch.id, None)
            launch.finish()

    def _replace_helper(self, helper: Backend) -> Backend:
        with self._lock:
            helper.alive = False
            if self._helper is helper:
                self._helper = None
        return self._ensure_helper()

    def _helper_gone(self, helper: Backend) -> None:
        returncode = helper.returncode()
        with self._lock:
            orphans = [launch for launch in self.launches.values() if launch.helper is helper]
            for launch in orphans:
                self.launches.pop(launch.id, None)
            if self._helper is helper:
                self._helper = None
        for launch in orphans:
            if not self._start_again(launch):
                launch.helper_died(returncode)

    def _start_again(self, launch: Launch) -> bool:
        """A launch the helper never said it started (it was stopped with the request still
        unread, or had just read it): no rank of it runs — a rank dies with its helper
        (PDEATHSIG) — so it goes to a new helper.  False when it cannot."""
        if "started" in launch.timings or launch.request is None or launch.status != "starting":
            return False
        if launch.sent_again:  # once: a helper that dies on this very request is an error
            return False
        launch.sent_again = True
        try:
            helper = self._ensure_helper()
            with self._lock:
                self.launches[launch.id] = launch
            launch.helper = helper
            helper.send(StartLaunch(launch.request))
        except (OSError, LaunchError):  # no new helper either (the launcher was shut down)
            with self._lock:
                self.launches.pop(launch.id, None)
            return False
        return True

    def shutdown(self) -> None:
        """Stop every rank and the helper; delete the session's files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            helper, self._helper = self._helper, None
            others, self._backends = list(self._backends.values()), {}
        if helper is not None:
            helper.close()
        for backend in others:
            backend.close()
        for path in (self.session_dir, self.shm_root):
            if path:
                shutil.rmtree(path, ignore_errors=True)


def _check_room_for(world_size: int, label: str) -> None:
    """Refuse at once a launch of more ranks than the system lets start (a cgroup's pids.max),
    before anything is made for each of them: it would fail at the first fork it is refused,
    after work that grows with the number of ranks."""
    room = pids_room()
    if room is not None and world_size > room[0]:
        raise LaunchError(
            f"could not run {label}: it needs {world_size} rank processes, and the system lets {room[0]} more "
            f"start: {room[1]}. Ask for fewer ranks, or raise the limit."
        )


_launcher: Launcher | None = None
_launcher_lock = threading.Lock()


_exiting = False


def _at_exit() -> None:
    """The interpreter is exiting: the launcher ends, and no new one is made (a thread that
    asks for one now would leave folders that no exit handler removes)."""
    global _exiting
    with _launcher_lock:
        _exiting = True
        found = _launcher
    if found is not None:
        found.shutdown()


atexit.register(_at_exit)


def get_launcher() -> Launcher:
    """The kernel's launcher (created on first use)."""
    global _launcher
    with _launcher_lock:
        if _exiting:
            raise LaunchError("the kernel is shutting down; no launch can start now")
        if _launcher is None or _launcher._closed:
            _launcher = Launcher()
        return _launcher
