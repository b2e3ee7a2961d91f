"""MLflow tracking of launches: one run per launch, the kernel as the single writer.

Plugs into the launcher as a :class:`~air_magic.launcher.LaunchObserver`::

    kernel, before_start                    writer thread                          ranks
    --------------------                    -------------                          -----
    spool folder: lock + journal  ------->  client, experiment, create_run,
      (air_magic._spool)                    the launch's configuration as params
    waits for the run (5 s at most) <-----  run id  (a later one is printed when made)
    env: AIR_MAGIC_TRACKING_DIR, run id ----------------------------------------->  mlflow.log_*:
    prints the run's line                   every 0.5 s: new lines -> log_batch <---  a line each in
                                            (air_magic._mlflow_upload)                tracking-<r>.tsv
    after_end: the launch's status  ------> last lines, system metrics, rank logs,
    waits while the store takes things <--  status; the spool folder is deleted

Nothing is lost when something fails half-way:

* the store does not answer (a server down or dying): requests are cut short (seconds,
  MLflow's own ``MLFLOW_HTTP_REQUEST_*`` settings, in air_magic's threads only), the user
  is told once, the launch goes on and ends on time; the lines stay in the spool;
* the kernel dies (out-of-memory killer, restart): the spool is in a private folder that
  outlives it (not the kernel's session folder), and its journal says where the points go;
* later, the next launch or ``%load_ext air_magic`` in any kernel of this user (or ``upload_pending()``) finds the
  spools whose kernel let go of them and sends the rest (:mod:`air_magic._tracking_recovery`);
* the store refuses an item: only that item is skipped, and named.

Only MLflow's own APIs are used (``MlflowClient``, entities, ``log_batch``, the
system-metrics monitor); there is no parallel tracking store.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from ._spool import SPOOL_DIR_ENV, STATE_DIR_ENV, PrivateFolderError, Spool, state_dir
from ._tracking_recovery import Recovered, recover_in_background, upload_pending

if TYPE_CHECKING:
    from ._mlflow_upload import SpoolUploader
    from .launcher import Launch

__all__ = ["TrackingObserver", "tracking_observer", "upload_pending", "recover_in_background", "Recovered"]

_INTERVAL = 0.5  # seconds between two reads of the ranks' files
_RETRY = 5.0  # seconds between two tries while the store does not answer
#: How long a launch waits for its run before the ranks start without its id.  A local
#: store gets longer: a new sqlite file runs MLflow's migrations first (seconds).
START_WAIT = {"server": 5.0, "local": 15.0}
#: At the end, how long without anything taken by the store before the launch returns.
END_WAIT = 5.0

_STATUS = {"finished": "FINISHED", "cancelled": "KILLED", "timed out": "KILLED"}


def _notebook_name() -> str:
    path = os.environ.get("JPY_SESSION_NAME")
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if not path and shell is not None:
        path = shell.user_ns.get("__session__") or shell.user_ns.get("__vsc_ipynb_file__")
    if path:
        return os.path.splitext(os.path.basename(str(path)))[0] or "air_magic"
    return "air_magic"


def _say(line: str, stream: Any = None) -> None:
    stream = stream or sys.stderr
    stream.write(line + "\n")
    stream.flush()


def unreachable_line(uri: str, reason: str) -> str:
    from ._mlflow_upload import store_name

    return (
        f"[air_magic] {store_name(uri)} is unreachable ({reason}): this launch's points stay on disk and "
        "are sent when it is back, at the next launch or %load_ext, or with air_magic.tracking.upload_pending()."
    )


class TrackingObserver:
    """One launch's MLflow run; see the module's docstring."""

    def __init__(self, launch: "Launch") -> None:
        import mlflow

        from ._mlflow_upload import absolute_uri

        self.mlflow = mlflow
        self.launch = launch
        self.uri = mlflow.get_tracking_uri()
        self.store_uri = absolute_uri(self.uri)
        self.writer: _Writer | None = None

    def _experiment(self) -> tuple[str | None, str | None]:
        """(id, None) when the kernel chose one, else (None, name): read locally, no request."""
        name = self.launch.spec.experiment
        if name is None:
            active = self.mlflow.active_run()
            if active is not None:
                return str(active.info.experiment_id), None
            from mlflow.tracking import fluent

            chosen = getattr(fluent, "_active_experiment_id", None)
            if chosen:
                return str(chosen), None
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or _notebook_name()
        return None, name

    def _journal(self, launch: "Launch") -> dict[str, Any]:
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        experiment_id, experiment_name = self._experiment()
        tags = {"air_magic.launch_id": launch.id}
        parent = self.mlflow.active_run()
        if parent is not None:
            tags[MLFLOW_PARENT_RUN_ID] = parent.info.run_id
        placement = launch.placement
        config = {
            "air_magic.num_accelerators": placement.world_size,
            "air_magic.accelerator_type": placement.accelerator_type.value,
            "air_magic.device": placement.device,
            "air_magic.code": f"{launch.kind} {launch.label}",
            "air_magic.timeout": launch.spec.timeout,
        }
        return {
            "tracking_uri": self.store_uri, "experiment_id": experiment_id, "experiment_name": experiment_name,
            "run_name": launch.spec.run_name, "tags": tags, "params": {k: str(v) for k, v in config.items()},
            "run_id": None, "params_logged": False,
            "sent": {str(rank): 0 for rank in range(launch.world_size)},  # one file per rank
        }

    # -- observer ----------------------------------------------------------------------------

    def before_start(self, launch: "Launch", env: dict[str, str]) -> None:
        journal = self._journal(launch)
        # Without the state folder tracking still works; only a dead kernel's points are lost.
        try:
            spool = Spool.create(launch.id, journal)
        except OSError as exc:  # PrivateFolderError included; a full disk
            reason = str(exc) if isinstance(exc, PrivateFolderError) else f"cannot use {state_dir()}: {exc}."
            _say(f"[air_magic] {reason} Set {STATE_DIR_ENV} to a folder only you can use; until then this "
                 "launch's points are kept in the kernel's session folder and are lost if the kernel dies.")
            spool = Spool.in_session(launch.id, launch.work_dir, journal)
        if spool.durable:
            _link_for_the_panel(launch, spool)
        writer = self.writer = _Writer(self, spool)
        env[SPOOL_DIR_ENV] = spool.folder
        env["MLFLOW_TRACKING_URI"] = self.uri
        writer.start()
        wait = START_WAIT["server" if self.store_uri.startswith(("http://", "https://")) else "local"]
        try:
            writer.first_try.wait(wait)
        except BaseException:  # an interrupt: the launch never starts, its run ends KILLED
            writer.end("KILLED", [])
            raise
        with writer.lock:
            writer.ranks_started = True  # from here on the spool stays until the launch ends
            fatal, run_id = writer.fatal, writer.run_id
            if run_id is None and fatal is None:
                writer.show_run_when_made = True
        if fatal is not None:
            spool.remove()
            del env[SPOOL_DIR_ENV]
            raise fatal
        if run_id is not None:
            env["MLFLOW_RUN_ID"] = env["AIR_MAGIC_MLFLOW_RUN_ID"] = run_id
            self._show_run(run_id)
        else:
            # The ranks keep their calls all the same; the run gets them once it exists.
            env.pop("MLFLOW_RUN_ID", None)
            env["AIR_MAGIC_MLFLOW_RUN_ID"] = ""
            writer.tell_unreachable(writer.unreachable or f"no answer in {wait:g} s")
        recover_in_background()

    def _show_run(self, run_id: str) -> None:
        self.launch.run_id = run_id
        self.launch.run_url = self._run_url(run_id)
        _say(self.describe(), sys.stdout)

    def after_end(self, launch: "Launch") -> None:
        writer = self.writer
        if writer is None:
            return
        writer.end(_STATUS.get(launch.status, "FAILED"), launch.log_paths)
        deadline = time.monotonic() + END_WAIT
        while not writer.finished.wait(0.1):
            # A store that takes things keeps the launch waiting: everything is stored before
            # .distributed() returns.  One that stops answering does not.
            deadline = max(deadline, writer.progress_at() + END_WAIT)
            if time.monotonic() > deadline:
                writer.abandon(f"no answer in {END_WAIT:g} s")
                break
        writer.report()

    # -- showing the run ---------------------------------------------------------------------

    def _run_url(self, run_id: str) -> str | None:
        if self.uri.startswith(("http://", "https://")) and self.writer is not None:
            experiment_id = self.writer.spool.journal.get("experiment_id")
            return f"{self.uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
        return None

    def describe(self) -> str:
        run_id = self.launch.run_id
        if self.launch.run_url:
            return f"[air_magic] MLflow run {run_id}: {self.launch.run_url}"
        experiment_id = self.writer.spool.journal.get("experiment_id") if self.writer else None
        return (
            f"[air_magic] MLflow run {run_id} (experiment {experiment_id}, {self.uri}); "
            f"see it with: mlflow ui --backend-store-uri {self.uri}"
        )


def _link_for_the_panel(launch: "Launch", spool: Spool) -> None:
    # The live panel reads the ranks' metrics from tracking-<rank>.tsv in the launch's
    # work folder; the files live in the spool now.  The links are the panel's only: the
    # ranks write to the spool folder they are given, and never follow a link.
    from ._spool import spool_file

    for rank in range(launch.world_size):
        try:
            os.symlink(spool_file(spool.folder, rank), os.path.join(launch.work_dir, f"tracking-{rank}.tsv"))
        except OSError:
            pass  # the panel then shows no metrics; tracking is unaffected


class _Writer:
    """The launch's writer thread: makes the run, sends the lines, ends the run."""

    def __init__(self, observer: TrackingObserver, spool: Spool) -> None:
        self.observer = observer
        self.spool = spool
        self.lock = threading.Lock()
        self.first_try = threading.Event()  # the run was made, or the first try failed
        self.finished = threading.Event()
        self._wake = threading.Event()
        self.status: str | None = None
        self.log_paths: list[str] = []
        self.uploader: SpoolUploader | None = None
        self.unreachable: str | None = None  # how the store fails to answer, while it does
        self.fatal: Exception | None = None  # no run can be made (a bad URI or experiment)
        self.error: str | None = None  # the first unexpected failure, told at the end
        self.show_run_when_made = False
        self.ranks_started = False
        self._told = False
        self._monitor: Any = None
        self._thread = threading.Thread(target=self._run, name="air_magic-mlflow-writer", daemon=True)

    @property
    def run_id(self) -> str | None:
        return self.spool.journal.get("run_id")  # type: ignore[no-any-return]

    def start(self) -> None:
        self._thread.start()

    def progress_at(self) -> float:
        return self.uploader.progress_at if self.uploader is not None else 0.0

    # -- from the launcher's threads ---------------------------------------------------------

    def end(self, status: str, log_paths: list[str]) -> None:
        self.log_paths = list(log_paths)
        self.spool.update(status=status)  # what recovery marks the run with, if it comes to that
        self.status = status
        self._wake.set()

    def abandon(self, reason: str) -> None:
        """The launch returns now; the writer keeps what it has not sent for later."""
        try:
            self.spool.copy_logs(self.log_paths)  # the kernel may exit before the writer can
        except OSError:
            pass  # the writer finished meanwhile and deleted the folder, or copies them itself
        self.tell_unreachable(self.unreachable or reason)

    def tell_unreachable(self, reason: str) -> None:
        with self.lock:
            if self._told:
                return
            self._told = True
        if self.spool.durable:
            _say(unreachable_line(self.observer.store_uri, reason))
        else:
            from ._mlflow_upload import store_name

            _say(f"[air_magic] {store_name(self.observer.store_uri)} is unreachable ({reason}): this launch's "
                 "points are only in the kernel's session folder and are lost if it does not answer by the end.")

    def report(self) -> None:
        """What did not reach the run, told once, at the end of the launch."""
        uploader = self.uploader
        if uploader is not None and uploader.skipped:
            _say(f"[air_magic] not everything the ranks logged reached MLflow run {self.run_id}: skipped what "
                 f"the store refused: {uploader.skipped_text()}. Everything else was stored.")
        if self.error is not None:
            _say(f"[air_magic] not everything the ranks logged reached MLflow run {self.run_id}: {self.error}")

    def _note(self, exc: BaseException) -> None:
        if self.error is None:  # the first failure is the one to fix
            self.error = f"{type(exc).__name__}: {exc}"

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        from ._mlflow_upload import bounded_requests

        try:
            with bounded_requests():
                self._loop()
        except Exception as exc:  # a bug: say so at the end, keep the lines for recovery
            self._note(exc)
            self._leave()
        finally:
            self.first_try.set()
            self.finished.set()

    def _loop(self) -> None:
        from ._mlflow_upload import SpoolUploader, Unreachable, make_client

        stuck = False  # something unexpected failed: the rest of the lines are not sent
        while True:
            ended = self.status is not None
            try:
                if self.uploader is None:
                    self.uploader = SpoolUploader(self.spool, make_client(self.observer.store_uri))
                if self.run_id is None:
                    self._make_run()
                if not stuck:
                    try:
                        self.uploader.pump(until_empty=ended)
                    except Unreachable:
                        raise
                    except Exception as exc:
                        self._note(exc)
                        stuck = True
                self.unreachable = None
                if ended:
                    self._end()
                    return
            except Unreachable as exc:
                self.unreachable = exc.reason
                if self.first_try.is_set():
                    self.tell_unreachable(exc.reason)
                if ended:
                    self._leave()
                    return
            except Exception as exc:
                with self.lock:
                    if self.run_id is None and not self.ranks_started:
                        self.fatal = exc  # no run can be made: tracking is off for this launch
                        return
                raise
            self.first_try.set()
            self._wake.wait(_INTERVAL if self.unreachable is None else _RETRY)
            self._wake.clear()

    def _make_run(self) -> None:
        assert self.uploader is not None
        run_id = self.uploader.ensure_run()
        self.first_try.set()
        self._start_monitor(run_id)
        with self.lock:
            show = self.show_run_when_made
        if show:
            self.observer._show_run(run_id)

    def _start_monitor(self, run_id: str) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            from ._mlflow_upload import bounded

            # Its start/stop INFO lines would land in every launch's cell.
            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
            monitor = SystemMetricsMonitor(run_id, sampling_interval=2, samples_before_logging=1,
                                           tracking_uri=self.observer.store_uri)
            monitor.monitor = bounded(monitor.monitor)  # its requests are cut short like ours
            monitor.start()
            self._monitor = monitor
        except Exception:
            self._monitor = None  # system metrics are a bonus, never a reason to fail

    def _stop_monitor(self, wait: bool) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        from ._mlflow_upload import bounded

        if wait:
            try:
                monitor.finish()
            except Exception:
                pass
        else:  # the store does not answer: let it give up on its own
            threading.Thread(target=bounded(monitor.finish), name="air_magic-mlflow-monitor-stop",
                             daemon=True).start()

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
        self._stop_monitor(wait=False)
        try:
            if self.status is not None:
                self.spool.copy_logs(self.log_paths)
        except OSError as exc:
            self._note(exc)
        self.spool.release()


def tracking_observer(launch: "Launch") -> TrackingObserver | None:
    """The launcher's factory: an observer for launches with tracking on."""
    if not launch.spec.tracking:
        return None
    return TrackingObserver(launch)
