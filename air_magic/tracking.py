"""MLflow tracking of launches: one run per launch, the kernel as the single writer.

Plugs into the launcher as a :class:`~air_magic.launcher.LaunchObserver`:

* ``before_start`` (kernel main thread): pick the experiment (the kernel's
  ``mlflow.set_experiment``, else ``MLFLOW_EXPERIMENT_NAME``, else the notebook's
  name), create the run (nested under the kernel's active run), log the launch's
  configuration as params, start MLflow's system-metrics monitor, start a writer
  thread, print where to see the run;
* ranks append their fluent calls to ``tracking-<rank>.tsv``
  (:mod:`air_magic._rank_tracking`); the writer thread reads those files and sends
  them with ``MlflowClient.log_batch``;
* ``after_end`` (before ``.distributed()`` returns): last batch, rank logs and
  artifacts uploaded, status FINISHED / FAILED / KILLED.

Only MLflow's own APIs are used (``MlflowClient``, entities, ``log_batch``, the
system-metrics monitor); there is no parallel tracking store.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from .launcher import Launch

__all__ = ["TrackingObserver", "tracking_observer"]

_BATCH = 1000  # MLflow's limit of metrics per log_batch call
_INTERVAL = 0.5


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """Serialise MLflow's first-time set-up of a sqlite store across processes."""
    path = None
    if uri.startswith("sqlite:///"):
        path = os.path.abspath(uri[len("sqlite:///"):]) + ".air_magic.lock"
    if path is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _notebook_name() -> str:
    path = os.environ.get("JPY_SESSION_NAME")
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if not path and shell is not None:
        path = shell.user_ns.get("__session__") or shell.user_ns.get("__vsc_ipynb_file__")
    if path:
        return os.path.splitext(os.path.basename(str(path)))[0] or "air_magic"
    return "air_magic"


class TrackingObserver:
    def __init__(self, launch: "Launch") -> None:
        import mlflow
        from mlflow import MlflowClient

        self.mlflow = mlflow
        self.launch = launch
        self.uri = mlflow.get_tracking_uri()
        with _store_lock(self.uri):
            self.client = MlflowClient(self.uri)
            self.experiment_id = self._experiment_id()
        self.run_id: str | None = None
        self.offsets: dict[int, int] = {}
        self.params: dict[str, str] = {}
        self.monitor: Any = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: str | None = None

    def _experiment_id(self) -> str:
        spec = self.launch.spec
        name = spec.experiment
        if name is None:
            active = self.mlflow.active_run()
            if active is not None:
                return str(active.info.experiment_id)
            from mlflow.tracking import fluent

            chosen = getattr(fluent, "_active_experiment_id", None)
            if chosen:
                return str(chosen)
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or _notebook_name()
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return str(experiment.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except Exception:  # created meanwhile by another kernel
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return str(experiment.experiment_id)

    # -- observer ----------------------------------------------------------------------------

    def before_start(self, launch: "Launch", env: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        tags = {"air_magic.launch_id": launch.id}
        parent = self.mlflow.active_run()
        if parent is not None:
            tags[MLFLOW_PARENT_RUN_ID] = parent.info.run_id
        run = self.client.create_run(self.experiment_id, run_name=launch.spec.run_name, tags=tags)
        self.run_id = run.info.run_id
        launch.run_id = self.run_id
        launch.run_url = self._run_url()
        placement = launch.placement
        config = {
            "air_magic.num_accelerators": placement.world_size,
            "air_magic.accelerator_type": placement.accelerator_type.value,
            "air_magic.device": placement.device,
            "air_magic.code": f"{launch.kind} {launch.label}",
            "air_magic.timeout": launch.spec.timeout,
        }
        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in config.items()])
        env["MLFLOW_RUN_ID"] = self.run_id
        env["MLFLOW_TRACKING_URI"] = self.uri
        env["AIR_MAGIC_MLFLOW_RUN_ID"] = self.run_id
        self._start_monitor()
        self.thread = threading.Thread(target=self._pump, name="air_magic-mlflow-writer", daemon=True)
        self.thread.start()
        print(self.describe(), flush=True)

    def after_end(self, launch: "Launch") -> None:
        from mlflow.entities import RunStatus

        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        # Whatever the store refuses, the run still gets its logs and its status.
        try:
            self._drain()
        except Exception as exc:
            self._note(exc)
        if self.monitor is not None:
            try:
                self.monitor.finish()
            except Exception:
                pass
        try:
            for state in launch.ranks:
                if os.path.exists(state.log_path):
                    self.client.log_artifact(self.run_id, state.log_path, "logs")
        except Exception as exc:
            self._note(exc)
        status = {"finished": "FINISHED", "cancelled": "KILLED", "timed out": "KILLED"}.get(launch.status, "FAILED")
        self.client.set_terminated(self.run_id, RunStatus.to_string(getattr(RunStatus, status)))
        if self.error is not None:
            sys.stderr.write(
                f"[air_magic] not everything the ranks logged reached MLflow run {self.run_id}: {self.error}\n"
            )
            sys.stderr.flush()

    def _note(self, exc: Exception) -> None:
        if self.error is None:  # the first failure is the one to fix
            self.error = f"{type(exc).__name__}: {exc}"

    # -- writing -----------------------------------------------------------------------------

    def _start_monitor(self) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # Its start/stop INFO lines would land in every launch's cell.
            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)

            self.monitor = SystemMetricsMonitor(self.run_id, sampling_interval=2, samples_before_logging=1)
            self.monitor.start()
        except Exception:
            self.monitor = None  # system metrics are a bonus, never a reason to fail

    def _pump(self) -> None:
        while not self.stop.wait(_INTERVAL):
            try:
                self._drain()
            except Exception as exc:
                self._note(exc)

    def _drain(self) -> None:
        from mlflow.entities import Metric, Param, RunTag

        metrics: list[Any] = []
        params: list[Any] = []
        tags: list[Any] = []
        for rank in range(self.launch.world_size):
            for fields in self._new_lines(rank):
                kind = fields[0]
                if kind == "m" and len(fields) == 5:
                    try:
                        metrics.append(Metric(fields[1], float(fields[2]), int(fields[4]), int(fields[3])))
                    except ValueError:  # one bad line must not take the others along
                        continue
                elif kind == "p" and len(fields) == 3:
                    # The same parameter from several ranks: the first value is kept.
                    if fields[1] not in self.params:
                        self.params[fields[1]] = fields[2]
                        params.append(Param(fields[1], fields[2]))
                elif kind == "t" and len(fields) == 3:
                    tags.append(RunTag(fields[1], fields[2]))
                elif kind == "a" and len(fields) == 3:
                    self.client.log_artifact(self.run_id, fields[1], fields[2] or None)
        for start in range(0, len(metrics), _BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + _BATCH])
        if params or tags:
            # Sent apart from the points: a parameter the store refuses (a value changed)
            # must not take them along.
            self.client.log_batch(self.run_id, params=params, tags=tags)

    def _new_lines(self, rank: int) -> list[list[str]]:
        path = os.path.join(self.launch.work_dir, f"tracking-{rank}.tsv")
        offset = self.offsets.get(rank, 0)
        try:
            with open(path, "rb") as handle:
                handle.seek(offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offsets[rank] = offset + end
        return [line.split("\t") for line in data[:end].decode("utf-8", "replace").splitlines()]

    # -- showing the run ---------------------------------------------------------------------

    def _run_url(self) -> str | None:
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return None

    def describe(self) -> str:
        if self.launch.run_url:
            return f"[air_magic] MLflow run {self.run_id}: {self.launch.run_url}"
        return (
            f"[air_magic] MLflow run {self.run_id} (experiment {self.experiment_id}, {self.uri}); "
            f"see it with: mlflow ui --backend-store-uri {self.uri}"
        )


def tracking_observer(launch: "Launch") -> TrackingObserver | None:
    """The launcher's factory: an observer for launches with tracking on."""
    if not launch.spec.tracking:
        return None
    return TrackingObserver(launch)
