"""A launch's MLflow writer: the thread that makes its run, sends the ranks' spool lines to it
and ends it (the observer that starts one per launch is :mod:`air_magic.tracking.observer`),
and the waits for every writer's points (``flush``, at each launch and at the kernel's exit)::

    _Writer.start()   a thread: the run made (retried while the store does not answer),
                      MLflow's system metrics after a while, every _INTERVAL s the ranks'
                      new spool lines sent (SpoolUploader); at the end the rest, the logs,
                      the status; a store that does not answer keeps the spool for later
    flush()           until every ended launch's points are stored, or the timeout
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from air_magic.protocol.spool import Spool, publish_run, run_text

if TYPE_CHECKING:
    from air_magic.kernel.launcher import Launch
    from air_magic.tracking.upload import SpoolUploader

__all__ = ["pending", "flush", "unreachable_line", "FLUSH_BEFORE_LAUNCH", "FLUSH_AT_EXIT", "SAY_AFTER"]

_INTERVAL = 0.5  # seconds between two reads of the ranks' files
_RETRY = 5.0  # seconds between two tries while the store does not answer
#: MLflow's system metrics (CPU, memory, GPU) start once a launch has run this long: a
#: shorter one would get one sample, and its stop costs every launch milliseconds.
_MONITOR_AFTER = 2.0
#: How long the next launch waits for the last one's points to be stored (seconds); it then
#: goes on, and the rest stays on disk for the writer that still sends it.
FLUSH_BEFORE_LAUNCH = 60.0
#: How long the kernel's exit (shutdown, %unload_ext, the end of a script) waits for them.
FLUSH_AT_EXIT = 30.0
#: A wait longer than this says what it waits for, on a line of its own.
SAY_AFTER = 1.0
#: Put before the reason of a store that is there but not to be used as it is (StoreUnusable).
_UNUSABLE = "unusable: "


def _say(line: str, stream: Any = None) -> None:
    stream = stream or sys.stderr
    stream.write(line + "\n")
    stream.flush()


def unreachable_line(uri: str, reason: str) -> str:
    from air_magic.tracking.store import store_name

    if reason.startswith(_UNUSABLE):  # not a store that does not answer: one to fix
        return (
            f"[air_magic] {store_name(uri)} cannot be used: {reason[len(_UNUSABLE) :]}. This launch's points "
            "stay on disk and are sent once it is fixed, at the next launch or %load_ext, or with "
            "air_magic.tracking.upload_pending()."
        )
    return (
        f"[air_magic] {store_name(uri)} is unreachable ({reason}): this launch's points stay on disk and "
        "are sent when it is back, at the next launch or %load_ext, or with air_magic.tracking.upload_pending()."
    )


class Observed(Protocol):
    """What a writer reads of its launch's observer (:class:`air_magic.tracking.observer.TrackingObserver`)."""

    launch: Launch
    store_uri: str

    def show_run(self, run_id: str) -> None: ...


class _Writer:
    """The launch's writer thread: makes the run, sends the lines, ends the run."""

    def __init__(self, observer: Observed, spool: Spool) -> None:
        self.observer = observer
        self.spool = spool
        self.lock = threading.Lock()
        self.finished = threading.Event()
        self._wake = threading.Event()
        self.status: str | None = None
        self.log_paths: list[str] = []
        self.uploader: SpoolUploader | None = None
        self.unreachable: str | None = None  # how the store fails to answer, while it does
        self.fatal: Exception | None = None  # no run can be made (a bad URI or experiment)
        self.error: str | None = None  # the first unexpected failure, told at the end
        self._told = False
        self._kept_for_later = False  # the end found the store unreachable: the spool stays
        self._fatal_line: str | None = None  # no run could be made, found after the end
        self.late_lines: list[tuple[str, str]] = []  # the run's announcement, made after the end
        self._monitor: Any = None
        self._monitor_tried = False
        launch = observer.launch
        self.log_path = os.path.join(launch.log_dir, "mlflow.log")  # MLflow's own lines
        self._thread = threading.Thread(target=self._run, name=f"air_magic-mlflow-writer-{launch.id}", daemon=True)

    @property
    def run_id(self) -> str | None:
        return self.spool.journal.get("run_id")  # type: ignore[no-any-return]

    def start(self) -> None:
        with _pending_lock:
            _live.add(self)
        self._thread.start()

    def written(self) -> dict[int, int]:
        """How far each rank's file is written now (what a flush waits to see stored)."""
        from air_magic.protocol import spool_file

        sizes = {}
        for rank in self.spool.ranks():
            try:
                sizes[rank] = os.path.getsize(spool_file(self.spool.folder, rank))
            except OSError:
                continue
        return sizes

    def stored(self, sizes: dict[int, int]) -> bool:
        """Whether the lines up to ``sizes`` are in the store, or kept on disk for a store that
        does not answer (or the writer is done)."""
        if self.finished.is_set() or self.unreachable is not None or self.fatal is not None:
            return True
        try:
            return self.run_id is not None and all(self.spool.sent(r) >= size for r, size in sizes.items())
        except (KeyError, ValueError):
            return True

    def wake(self) -> None:
        self._wake.set()

    # -- from the launcher's threads ---------------------------------------------------------

    def end(self, status: str, log_paths: list[str]) -> None:
        """The launch ended: the rest of its points, its logs and its status are stored behind
        the values (the kernel's exit and the next launch wait for them: :func:`flush`)."""
        with _pending_lock:
            _pending.add(self)
        _flush_at_exit()
        self.log_paths = list(log_paths)
        # What recovery marks the run with and sends, if it comes to that (the logs are in
        # the user's log folder, which outlives the kernel).
        self.spool.update(status=status, log_paths=self.log_paths)
        self.status = status
        self._wake.set()

    def storing_text(self) -> str:
        """What is left to store, for the summary: ``MLflow: storing 1,234 points…``."""
        if self.uploader is None or self.run_id is None:
            return "MLflow: opening the store…"
        try:
            points = self.spool.pending_points()
        except OSError:  # the writer removed the folder meanwhile: all sent
            points = 0
        if points:
            return f"MLflow: storing {points:,} point{'s' * (points != 1)}…"
        return "MLflow: storing the logs and the run's status…"

    def unsent(self) -> int:
        """Points not stored yet (0 once the spool is gone)."""
        try:
            return self.spool.pending_points()
        except OSError:
            return 0

    def tell_unreachable(self, reason: str) -> None:
        if self.status is not None:  # after the end: said once when the storing is over
            return
        with self.lock:
            if self._told:
                return
            self._told = True
        self.observer.launch.notify(self.kept_line(reason), "stderr")

    def kept_line(self, reason: str) -> str:
        if self.spool.durable:
            line = unreachable_line(self.observer.store_uri, reason)
        else:
            from air_magic.tracking.store import store_name

            line = (
                f"[air_magic] {store_name(self.observer.store_uri)} is unreachable ({reason}): this launch's "
                "points are only in the kernel's session folder and are lost if it does not answer by the end."
            )
        return line

    def report(self) -> list[tuple[str, str]]:
        """The run, where it was made after the end, then what did not reach it, told once,
        when the storing is over: (line, stream)."""
        notes = list(self.late_lines)
        uploader = self.uploader
        if uploader is not None and uploader.skipped:
            notes.append(
                (
                    f"[air_magic] not everything the ranks logged reached MLflow run {self.run_id}: skipped what "
                    f"the store refused: {uploader.skipped_text()}. Everything else was stored.",
                    "stderr",
                )
            )
        if self.error is not None:
            notes.append(
                (
                    f"[air_magic] not everything the ranks logged reached MLflow run {self.run_id}: {self.error}",
                    "stderr",
                )
            )
        if self.fatal is None and self._kept_for_later and not self._told:
            notes.append((self.kept_line(self.unreachable or "no answer"), "stderr"))
        if self._fatal_line is not None:
            notes.append((self._fatal_line, "stderr"))
        return notes

    def _note(self, exc: BaseException) -> None:
        if self.error is None:  # the first failure is the one to fix
            self.error = f"{type(exc).__name__}: {exc}"

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        from air_magic.tracking import mlflow_logs as _mlflow_logs
        from air_magic.tracking.store import bounded_requests

        try:
            with _mlflow_logs.log_to(self.log_path), bounded_requests():
                self._loop()
        except Exception as exc:  # a bug: say so at the end, keep the lines for recovery
            self._note(exc)
            self._leave()
        finally:
            if self.fatal is not None:
                self.spool.remove()  # no run to send them to: the configuration is what to fix
            # The hooks first (the summary shown again with the run): flush() returns after them.
            try:
                self.observer.launch.set_storing(None, self.report())
            finally:
                self.finished.set()
                with _pending_lock:
                    _pending.discard(self)
                    _live.discard(self)

    def _loop(self) -> None:
        from air_magic.tracking import mlflow_logs as _mlflow_logs
        from air_magic.tracking.store import StoreUnusable, Unreachable, make_client
        from air_magic.tracking.upload import SpoolUploader

        stuck = False  # something unexpected failed: the rest of the lines are not sent
        while True:
            ended = self.status is not None
            try:
                if self.uploader is None:
                    import mlflow  # noqa: F401 - imported at %load_ext already, in the background

                    _mlflow_logs.divert()
                    self.uploader = SpoolUploader(self.spool, make_client(self.observer.store_uri))
                    if not self.spool.journal.get("store_existed"):
                        self.spool.update(store_existed=True)  # made now: a later absence is a deletion
                if self.run_id is None:
                    self._make_run()
                if not self._monitor_tried and not ended and self._running_for() >= _MONITOR_AFTER:
                    self._start_monitor(str(self.run_id))
                if not stuck:
                    try:
                        self.uploader.pump(until_empty=ended)
                    except Unreachable:
                        raise
                    except Exception as exc:  # MLflow's errors are of any type: named at the end
                        self._note(exc)
                        stuck = True
                self.unreachable = None
                if ended:
                    self._end()
                    return
            except Unreachable as exc:
                if isinstance(exc, StoreUnusable):  # the fix it names may remove the file: still send
                    self.spool.update(store_unusable=exc.reason)
                self.unreachable = (_UNUSABLE if isinstance(exc, StoreUnusable) else "") + exc.reason
                self.tell_unreachable(self.unreachable)
                if ended:
                    self._leave()
                    return
            except Exception as exc:  # MLflow's errors are of any type: no run means tracking off
                if self.run_id is None:
                    self._no_run(exc)
                    # The ranks read why from the spool folder: it goes once they are done.
                    while self.status is None:
                        self._wake.wait(_INTERVAL)
                        self._wake.clear()
                    return
                raise
            self._wake.wait(_INTERVAL if self.unreachable is None else _RETRY)
            self._wake.clear()

    def _running_for(self) -> float:
        return time.monotonic() - self.observer.launch.timings.get("call", time.monotonic())

    def _no_run(self, exc: Exception) -> None:
        """No run can be made (a URI MLflow does not know, a deleted experiment...): tracking
        is off for this launch; the ranks' calls that need the run are told why."""
        self.fatal = exc
        reason = f"{type(exc).__name__}: {exc}"
        try:
            publish_run(self.spool.folder, "!" + reason)
        except OSError:
            pass
        line = f"[air_magic] tracking is off for this launch: MLflow could not make its run: {reason}"
        if self.status is not None:  # the launch has ended: said when the storing is over
            self._fatal_line = line
        else:
            self.observer.launch.notify(line, "stderr")

    def _make_run(self) -> None:
        assert self.uploader is not None
        run_id = self.uploader.ensure_run()
        journal = self.spool.journal
        details = {k: journal.get(k) for k in ("experiment_id", "artifact_uri", "run_name", "user_id", "start_time")}
        publish_run(self.spool.folder, run_text(run_id, {k: v for k, v in details.items() if v is not None}))
        self.observer.show_run(run_id)

    def _start_monitor(self, run_id: str) -> None:
        self._monitor_tried = True
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            from air_magic.tracking.store import bounded

            # Its start/stop INFO lines would land in every launch's cell.
            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
            monitor = SystemMetricsMonitor(
                run_id, sampling_interval=2, samples_before_logging=1, tracking_uri=self.observer.store_uri
            )
            monitor.monitor = bounded(monitor.monitor)  # type: ignore[method-assign]  # its requests are cut short like ours
            monitor.start()
            self._monitor = monitor
        except Exception:
            self._monitor = None  # system metrics are a bonus, never a reason to fail

    def _stop_monitor(self, wait: bool) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        from air_magic.tracking.store import bounded

        if wait:
            try:
                monitor.finish()
            except Exception:  # system metrics are a bonus (MLflow's errors are of any type)
                pass
        else:  # the store does not answer: let it give up on its own
            threading.Thread(target=bounded(monitor.finish), name="air_magic-mlflow-monitor-stop", daemon=True).start()

    def _end(self) -> None:
        assert self.uploader is not None and self.status is not None
        self._stop_monitor(wait=True)
        if not self.spool.journal.get("logs_sent"):
            self.uploader.send_logs(self.spool.logs() or self.log_paths)
            self.spool.update(logs_sent=True)
        self.uploader.finish(self.status)
        self.spool.remove()

    def _leave(self) -> None:
        """Keep the spool (and the ranks' logs) for recovery, and let go of it."""
        self._kept_for_later = True
        self._stop_monitor(wait=False)
        try:
            if self.status is not None:
                self.spool.copy_logs(self.log_paths)
        except OSError as exc:
            self._note(exc)
        self.spool.release()


_pending_lock = threading.Lock()
_pending: set[_Writer] = set()  # writers still storing an ended launch's points
_live: set[_Writer] = set()  # writers of launches that run (a pool's: its cells log into it)
_exit_registered = False


def pending() -> list["Launch"]:
    """The ended launches whose points, logs or status are still being stored."""
    with _pending_lock:
        return [writer.observer.launch for writer in _pending]


def flush(timeout: float | None = 60.0, *, quiet: bool = False) -> bool:
    """Wait until every ended launch's points, logs and status are in MLflow (or, a store
    that does not answer, kept on disk for later); True if nothing is left to wait for.

    A wait longer than a second says what it waits for, on stderr (``quiet``: not).
    After ``timeout`` seconds it returns False; the writers go on in the background and
    nothing is lost (see :func:`air_magic.tracking.upload_pending`)."""
    with _pending_lock:
        writers = list(_pending)
        running = [w for w in _live if w not in _pending and w.status is None]
    began = time.monotonic()
    deadline = None if timeout is None else began + max(0.0, timeout)
    # A launch still running (a pool between its cells): what its ranks logged until now.
    targets = {writer: writer.written() for writer in running}
    for writer in running:
        writer.wake()
    for writer, sizes in targets.items():
        while not writer.stored(sizes):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
    if not writers:
        return True
    told = quiet
    for writer in writers:
        while not writer.finished.wait(0.05):
            now = time.monotonic()
            if not told and now - began >= SAY_AFTER:
                told = True
                _say(f"[air_magic] waiting for {_waiting_for(writers)}")
            if deadline is not None and now >= deadline:
                if told and not quiet:
                    _say(
                        f"[air_magic] gave up waiting after {timeout:g} s: {_waiting_for(writers)} goes on "
                        "in the background; nothing is lost."
                    )
                return False
    return True


def _waiting_for(writers: list[_Writer]) -> str:
    left = [w for w in writers if not w.finished.is_set()] or writers
    points = sum(w.unsent() for w in left)
    ids = ", ".join(w.observer.launch.id for w in left)
    what = f"{points:,} point{'s' * (points != 1)}" if points else "the logs and the run's status"
    if any(w.uploader is None for w in left):
        return f"MLflow to open the store and store {what} of launch {ids}…"
    return f"MLflow to store {what} of launch {ids}…"


def _flush_at_exit() -> None:
    """Once: the interpreter's exit (a kernel's shutdown, a script's end) waits, bounded."""
    global _exit_registered
    with _pending_lock:
        if _exit_registered:
            return
        _exit_registered = True
    import atexit

    atexit.register(flush, FLUSH_AT_EXIT)
