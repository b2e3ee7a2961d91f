"""The kernel's MLflow observer of launches: one run per launch, made beside the ranks, and
the writer thread that sends the ranks' spool lines to it (see the package's docstring)."""

from __future__ import annotations

import logging
import os
import shlex
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from air_magic.errors import ConfigurationError
from air_magic.protocol.spool import (
    SPOOL_DIR_ENV,
    STATE_DIR_ENV,
    PrivateFolderError,
    Spool,
    publish_run,
    run_text,
    state_dir,
)
from air_magic.settings import settings
from air_magic.tracking.recovery import recover_in_background

if TYPE_CHECKING:
    from air_magic.kernel.launcher import Launch
    from air_magic.tracking.upload import SpoolUploader


_INTERVAL = 0.5  # seconds between two reads of the ranks' files
_RETRY = 5.0  # seconds between two tries while the store does not answer
#: MLflow's system metrics (CPU, memory, GPU) start once a launch has run this long: a
#: shorter one would get one sample, and its stop costs every launch milliseconds.
_MONITOR_AFTER = 2.0
#: How long a rank's MLflow call that needs the run's id (log_artifacts, log_figure, autolog...)
#: waits for the run: the writer retries a store that does not answer every few seconds.
#: Nothing else waits for the run.
RUN_WAIT = 30.0
#: How long the next launch waits for the last one's points to be stored (seconds); it then
#: goes on, and the rest stays on disk for the writer that still sends it.
FLUSH_BEFORE_LAUNCH = 60.0
#: How long the kernel's exit (shutdown, %unload_ext, the end of a script) waits for them.
FLUSH_AT_EXIT = 30.0
#: A wait longer than this says what it waits for, on a line of its own.
SAY_AFTER = 1.0
#: Set for the ranks: how long their calls that need the run's id wait for it (seconds).
RUN_WAIT_ENV = "AIR_MAGIC_RUN_WAIT"

_STATUS = {"finished": "FINISHED", "cancelled": "KILLED", "timed out": "KILLED"}
_PARENT_RUN_TAG = "mlflow.parentRunId"  # mlflow.utils.mlflow_tags.MLFLOW_PARENT_RUN_ID


def _notebook_name() -> str:
    path = os.environ.get("JPY_SESSION_NAME")
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if not path and shell is not None:
        path = shell.user_ns.get("__session__") or shell.user_ns.get("__vsc_ipynb_file__")
    if path:
        return os.path.splitext(os.path.basename(str(path)))[0] or "air_magic"
    return "air_magic"


def _origin(launch: "Launch") -> str:
    """What a recovery line names: ``train in work/train.ipynb`` (the notebook's path, where
    the server tells it), ``Cell In[4] in a notebook in /home/me/work``, or ``train.py, run
    from /home/me/work`` (a script, ``air-magic run``)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = "?"
    if shell is None:
        return f"{launch.label}, run from {cwd}"
    path = (
        os.environ.get("JPY_SESSION_NAME")
        or shell.user_ns.get("__session__")
        or shell.user_ns.get("__vsc_ipynb_file__")
    )
    return f"{launch.label} in {path}" if path else f"{launch.label} in a notebook in {cwd}"


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


#: Put before the reason of a store that is there but not to be used as it is (StoreUnusable).
_UNUSABLE = "unusable: "


# -- the kernel's MLflow state, read without importing MLflow -------------------------------------


def _loaded_mlflow() -> Any:
    """The kernel's ``mlflow`` module once fully imported, else None.

    A user who set a tracking URI, an experiment or an active run has imported MLflow
    (the import ends before their call).  While MLflow is not imported, or is being
    imported by air_magic's warm-up thread, none of that can have happened: the launch
    then reads the environment and MLflow's default, and never waits for the import.
    """
    module = sys.modules.get("mlflow")
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False) or not hasattr(module, "get_tracking_uri"):
        return None
    return module


def _default_uri() -> str:
    """MLflow's default store when no URI is set (``get_tracking_uri()`` of MLflow 3): the
    ``./mlruns`` file store when it holds experiments, else ``sqlite:///mlflow.db``; both
    relative to the working folder."""
    try:
        with os.scandir("mlruns") as entries:
            for entry in entries:
                if entry.is_dir() and entry.name.isdigit() and os.path.lexists(os.path.join(entry.path, "meta.yaml")):
                    return "file://" + os.path.abspath("mlruns")
    except OSError:
        pass
    return "sqlite:///" + os.path.abspath("mlflow.db")


def current_uri() -> str:
    """The tracking URI a launch uses now (absolute), MLflow imported or not."""
    from air_magic.tracking.store import absolute_uri

    mlflow = _loaded_mlflow()
    if mlflow is not None:
        return absolute_uri(mlflow.get_tracking_uri())
    return absolute_uri(os.environ.get("MLFLOW_TRACKING_URI") or _default_uri())


_warm_lock = threading.Lock()
_warmed: set[str] = set()  # store URIs opened (or being opened) by this kernel


def warm_in_background(log_dir: str | None = None) -> None:
    """Import MLflow and open (or create) the store now, in a thread, so that the first
    launch's run is made at once.  Its log lines go to ``log_dir/mlflow.log``."""
    try:
        if not settings.warm:
            return
    except ConfigurationError:  # the first launch says what is wrong with AIR_MAGIC_WARM
        return
    uri = current_uri()
    with _warm_lock:
        if uri in _warmed:
            return
        _warmed.add(uri)
    path = os.path.join(log_dir, "mlflow.log") if log_dir else None
    threading.Thread(target=_warm, args=(uri, path), name="air_magic-mlflow-warm", daemon=True).start()


def _warm(uri: str, log_path: str | None) -> None:
    from air_magic.tracking import mlflow_logs as _mlflow_logs

    with _mlflow_logs.log_to(log_path):
        try:
            import mlflow  # noqa: F401

            _mlflow_logs.divert()
            if uri.startswith(("http://", "https://")):
                return  # a server: nothing to open ahead, and no request before a launch
            from air_magic.tracking.store import bounded_requests, make_client

            with bounded_requests():
                make_client(uri)._tracking_client.store  # noqa: B018 - creates a new store's tables
        except Exception:  # the launch's writer tries again, and reports what fails
            with _warm_lock:
                _warmed.discard(uri)


class TrackingObserver:
    """One launch's MLflow run; see the module's docstring."""

    timing_name = "mlflow"  # in Launch.timings

    def __init__(self, launch: "Launch") -> None:
        self.launch = launch
        self.store_uri = self.uri = current_uri()
        self.writer: _Writer | None = None

    def _experiment(self) -> tuple[str | None, str | None]:
        """(id, None) when the kernel chose one, else (None, name): read locally, no request."""
        name = self.launch.spec.experiment
        if name is None:
            mlflow = _loaded_mlflow()
            if mlflow is not None:
                active = mlflow.active_run()
                if active is not None:
                    return str(active.info.experiment_id), None
                from mlflow.tracking import fluent

                chosen = getattr(fluent, "_active_experiment_id", None)
                if chosen:
                    return str(chosen), None
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or _notebook_name()
        return None, name

    def _journal(self, launch: "Launch") -> dict[str, Any]:
        experiment_id, experiment_name = self._experiment()
        tags = {"air_magic.launch_id": launch.id}
        mlflow = _loaded_mlflow()
        parent = mlflow.active_run() if mlflow is not None else None
        if parent is not None:
            tags[_PARENT_RUN_TAG] = parent.info.run_id
        placement = launch.placement
        config = {
            "air_magic.num_accelerators": placement.world_size,
            "air_magic.accelerator_type": placement.accelerator_type.value,
            "air_magic.device": placement.device,
            "air_magic.code": f"{launch.kind} {launch.label}",
            "air_magic.timeout": launch.spec.timeout,
        }
        from air_magic.tracking.store import local_store_path

        store = local_store_path(self.store_uri)
        return {
            "tracking_uri": self.store_uri,
            # A local store that does not exist yet is made by this launch's writer: recovery
            # makes it too if the kernel died first (one that existed and is gone was deleted).
            "store_existed": bool(store and os.path.exists(store)),
            # Where it came from, for a recovery's line in another kernel or folder.
            "origin": _origin(launch),
            "experiment_id": experiment_id,
            "experiment_name": experiment_name,
            "run_name": launch.spec.run_name,
            "tags": tags,
            "params": {k: str(v) for k, v in config.items()},
            "run_id": None,
            "params_logged": False,
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
            _say(
                f"[air_magic] {reason} Set {STATE_DIR_ENV} to a folder only you can use; until then this "
                "launch's points are kept in the kernel's session folder and are lost if the kernel dies."
            )
            spool = Spool.in_session(launch.id, launch.work_dir, journal)
        if spool.durable:
            _link_for_the_panel(launch, spool)
        self.writer = _Writer(self, spool)
        env[SPOOL_DIR_ENV] = spool.folder
        env["MLFLOW_TRACKING_URI"] = self.store_uri
        # The ranks never wait for the run: their calls go to the spool, and the few that
        # need the run's id read it from there when the writer has made the run.
        env.pop("MLFLOW_RUN_ID", None)
        env["AIR_MAGIC_MLFLOW_RUN_ID"] = ""
        env[RUN_WAIT_ENV] = os.environ.get(RUN_WAIT_ENV) or str(RUN_WAIT)  # the user may set it shorter
        self.writer.start()
        recover_in_background()

    def _show_run(self, run_id: str) -> None:
        launch = self.launch
        launch.run_id = run_id
        launch.run_name = self.writer.spool.journal.get("run_name") if self.writer is not None else None
        launch.run_url = self._run_url(run_id)
        launch.run_command = None if launch.run_url else open_command(self.uri)
        if launch.run_shown:  # the launch's panel says it, in its place
            return
        if self.writer is not None and self.writer.status is not None:  # made after the end
            self.writer.late_lines.append((self.describe(), "stdout"))
        else:
            launch.notify(self.describe(), "stdout")

    def after_end(self, launch: "Launch") -> None:
        """The values come back now: the last points, the logs and the run's status are
        stored behind them by the writer; ``launch.storing`` says so until it is done.
        The spool is the write-ahead log: a kernel that dies meanwhile loses nothing."""
        writer = self.writer
        if writer is None:
            return
        launch.set_storing(writer.storing_text())  # before the end: the writer may finish at once
        with _pending_lock:
            _pending.add(writer)
        _flush_at_exit()
        writer.end(_STATUS.get(launch.status, "FAILED"), launch.log_paths)
        if not writer.spool.durable:
            # Its files are in the launch's session folder, which goes with the launch: the
            # values wait for them (bounded), as they did before there was a spool of its own.
            writer.finished.wait(FLUSH_AT_EXIT)

    # -- showing the run ---------------------------------------------------------------------

    def _run_url(self, run_id: str) -> str | None:
        if self.uri.startswith(("http://", "https://")) and self.writer is not None:
            experiment_id = self.writer.spool.journal.get("experiment_id")
            return f"{self.uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
        return None

    def describe(self) -> str:
        """The lines that announce the run: its name and id, then on a line of its own the
        link to it (a server) or the command that opens its store (see :func:`open_command`)."""
        launch = self.launch
        experiment_id = self.writer.spool.journal.get("experiment_id") if self.writer else None
        named = f"{launch.run_name!r} " if launch.run_name else ""
        head = f"[air_magic] MLflow run {named}(id {launch.run_id}, experiment {experiment_id}"
        if launch.run_url:
            return f"{head}), open it at:\n    {launch.run_url}"
        from air_magic.tracking.store import local_store_path

        path = local_store_path(self.uri)
        head += f", in {path})" if path else ")"
        if launch.run_command is None:
            return head
        return (
            f"{head}. To see it, run in a terminal (with the mlflow of the kernel's environment):\n"
            f"    {launch.run_command}"
        )


def open_command(uri: str) -> str | None:
    """The shell command that opens the store ``uri`` in MLflow's UI, with the kernel's own
    Python (``mlflow`` may not be on PATH, or be another environment's); None for a server
    (it has its own UI) and for Databricks."""
    if uri.startswith(("http://", "https://", "databricks")):
        return None
    python = shlex.quote(sys.executable or "python3")
    return f"{python} -m mlflow ui --backend-store-uri {single_quoted(uri)}"


def single_quoted(text: str) -> str:
    """``text`` in single quotes for a POSIX shell, always (so that the argument reads as
    one, whatever it holds)."""
    return "'" + text.replace("'", "'\\''") + "'"


def _link_for_the_panel(launch: "Launch", spool: Spool) -> None:
    # The live panel reads the ranks' metrics from tracking-<rank>.tsv in the launch's
    # work folder; the files live in the spool now.  The links are the panel's only: the
    # ranks write to the spool folder they are given, and never follow a link.
    from air_magic.protocol import spool_file

    for rank in range(launch.world_size):
        try:
            os.symlink(spool_file(spool.folder, rank), spool_file(launch.work_dir, rank))
        except OSError:
            pass  # the panel then shows no metrics; tracking is unaffected


class _Writer:
    """The launch's writer thread: makes the run, sends the lines, ends the run."""

    def __init__(self, observer: TrackingObserver, spool: Spool) -> None:
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
        self.observer._show_run(run_id)

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


def tracking_observer(launch: "Launch") -> TrackingObserver | None:
    """The launcher's factory: an observer for launches with tracking on."""
    if not launch.spec.tracking:
        return None
    return TrackingObserver(launch)


def tracking_off_notice(launch: "Launch") -> None:
    """For a launch with tracking off: the line that says so in its cell (printed once the
    launch's observers have started, by the launcher's plug-in wiring, ``_plugins``)."""
    if not launch.spec.tracking:
        # In a notebook, the cell's line; elsewhere (a script, ``air-magic run``) a status line
        # on stderr, with air_magic's others: stdout is the program's.
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
        out = sys.stdout if shell is not None else sys.stderr
        print("[air_magic] tracking is off: no MLflow run; mlflow calls in the ranks do nothing.", file=out)
