"""tracking/: MLflow, as an observer of launches (``observer``) -- the kernel's writer thread,
one run per launch (``writer``), reaching and trusting a store, the upload of spooled points, recovery of what dead kernels
left, MLflow's own log lines.
Imports kernel/ (types), protocol/ (the spool) and settings; nothing imports it but plugins.py.

MLflow tracking of launches: one run per launch, the kernel as the single writer.

Plugs into the launcher as a :class:`~air_magic.kernel.launcher.LaunchObserver`.  MLflow is never
on the launch's path: the ranks start at once and the run is made beside them::

    kernel, before_start (no MLflow)        writer thread                          ranks
    --------------------------------        -------------                          -----
    spool folder: lock + journal  ------->  (MLflow imported and the store opened
      (air_magic.protocol.spool)                    at %load_ext, in the background)
    env: AIR_MAGIC_TRACKING_DIR  ------------------------------------------------>  start at once
                                            client, experiment, create_run,        mlflow.log_*: a
                                            the launch's configuration as params   line each in
                                            run id -> <spool>/run  ---------------> tracking-<r>.tsv
                                            "MLflow run ..." for the cell          (a call that needs
                                            every 0.5 s: new lines -> log_batch <--  the run's id
                                            (air_magic.tracking.upload)               reads <spool>/run)
    after_end: the launch's status  ------> last lines, system metrics, rank logs,
    returns at once; launch.storing says    status; the spool folder is deleted;
      "MLflow: storing 1,234 points…"       launch.set_storing(None): the summary
                                            turns into the run line, in place
    the next launch, flush(), the exit  -->  wait for the writers (bounded, said after 1 s)

MLflow's own log lines from these threads go to the launch's log folder
(:mod:`air_magic.tracking.mlflow_logs`), never into a cell.

Several ranks, one run: rank 0's metrics are stored under the keys as written, rank ``r``'s
under ``rank<r>/<key>`` (so the chart of ``loss`` is rank 0's curve, and ``rank1/loss`` is
rank 1's); a param or tag key holds the first value sent, and another rank's other value is
kept under ``rank<r>/<key>``.  The uploader names them (:mod:`air_magic.tracking.upload` has
the rules), for a live launch and a recovered one alike; the spool keeps the keys as written.

The run is announced with its name and id, then, on a line of its own, the link to it on a
tracking server, or the command that opens a local store in MLflow's UI with the kernel's
own Python (:func:`open_command`); ``Launch.run_name``/``run_url``/``run_command`` hold them::

    [air_magic] MLflow run 'bright-owl-123' (id 5e6f..., experiment 1, in /home/me/mlflow.db). To see it, ...
        /home/me/.venv/bin/python -m mlflow ui --backend-store-uri 'sqlite:////home/me/mlflow.db'

Nothing is lost when something fails half-way:

* the store does not answer (a server down or dying): requests are cut short (seconds,
  MLflow's own ``MLFLOW_HTTP_REQUEST_*`` settings, in air_magic's threads only), the user
  is told once, the launch goes on and ends on time; the lines stay in the spool;
* the kernel dies (out-of-memory killer, restart): the spool is in a private folder that
  outlives it (not the kernel's session folder), and its journal says where the points go;
* later, the next launch or ``%load_ext air_magic`` in any kernel of this user (or ``upload_pending()``) finds the
  spools whose kernel let go of them and sends the rest (:mod:`air_magic.tracking.recovery`);
* the store refuses an item: only that item is skipped, and named.

Only MLflow's own APIs are used (``MlflowClient``, entities, ``log_batch``, the
system-metrics monitor); there is no parallel tracking store.
"""

from __future__ import annotations

from air_magic.tracking.observer import (
    TrackingObserver,
    current_uri,
    open_command,
    tracking_observer,
    tracking_off_notice,
    warm_in_background,
)
from air_magic.tracking.recovery import Recovered, recover_in_background, upload_pending
from air_magic.tracking.writer import flush, pending, unreachable_line

__all__ = [
    "TrackingObserver",
    "flush",
    "pending",
    "tracking_observer",
    "tracking_off_notice",
    "upload_pending",
    "recover_in_background",
    "Recovered",
    "current_uri",
    "open_command",
    "unreachable_line",
    "warm_in_background",
]
