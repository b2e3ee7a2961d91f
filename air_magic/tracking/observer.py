"""The kernel's MLflow observer of launches: one run per launch, made beside the ranks by the
launch's writer thread (:mod:`air_magic.tracking.writer`), which sends the ranks' spool lines
to it (see the package's docstring)."""

from __future__ import annotations

import os
import shlex
import sys
import threading
from typing import TYPE_CHECKING, Any

from air_magic.errors import ConfigurationError
from air_magic.protocol.spool import (
    SPOOL_DIR_ENV,
    STATE_DIR_ENV,
    PrivateFolderError,
    Spool,
    state_dir,
)
from air_magic.settings import settings
from air_magic.tracking.recovery import recover_in_background
from air_magic.tracking.writer import FLUSH_AT_EXIT, _say, _Writer

if TYPE_CHECKING:
    from air_magic.kernel.launcher import Launch


#: How long a rank's MLflow call that needs the run's id (log_artifacts, log_figure, autolog...)
#: waits for the run: the writer retries a store that does not answer every few seconds.
#: Nothing else waits for the run.
RUN_WAIT = 30.0
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

    def show_run(self, run_id: str) -> None:
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
