"""MLflow is never on a launch's path: the ranks start at once, the run is made beside them.

* a first launch in a fresh notebook folder shows its panel at once (saying what it waits
  for), prints nothing of MLflow's own logging, and still stores every point;
* a rank's MLflow calls never wait for the run; a call that needs the run's id
  (``log_artifacts``, ``active_run().info.run_id``) gets it as soon as the run exists;
* when no run can be made, such a call says why, and the cell says tracking is off;
* the launch reads the tracking URI without importing MLflow, as MLflow itself would.

Speed is measured in ``benchmarks/launch``, not here.
"""

from __future__ import annotations

import glob
import os
import shlex
import sqlite3
import sys
import time
from typing import Any

import cloudpickle
import pytest
from harness import CellResult, Kernel, wait_until
from tracking_support import Store, one_run_id, shown, sqlite_uri, stored

from air_magic import distributed

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FIRST_CELL = """\
%%distributed -n 2
import os, time, mlflow
rank = int(os.environ["RANK"])
for step in range(50):
    mlflow.log_metric("loss", rank + step / 100, step=step)
time.sleep(1.0)
print("ranks done", flush=True)
mlflow.active_run().info.run_id
"""


def cell_messages(kernel: Kernel, msg_id: str, timeout: float = 240) -> list[dict[str, Any]]:
    """Every iopub message of one cell, in the order the front end gets them."""
    messages = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=1.0)
        except Exception:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages
    raise TimeoutError(f"the cell did not end in {timeout} s")


@pytest.mark.kernel
def test_first_launch_in_a_fresh_folder_shows_the_panel_at_once_and_nothing_of_mlflows_logging(
    tmp_path: Any,
) -> None:
    folder = tmp_path / "notebook"
    folder.mkdir()
    # A machine where MLflow never made a store: its own cache (the empty store's template).
    kernel = Kernel(
        str(folder),
        {
            "AIR_MAGIC_STATE_DIR": str(tmp_path / "state"),
            "AIR_MAGIC_LOG_DIR": str(tmp_path / "logs"),
            "XDG_CACHE_HOME": str(tmp_path / "cache"),
        },
    )
    try:
        # The launch straight after %load_ext: torch, MLflow and the new store are still loading.
        load = kernel.execute("%load_ext air_magic")
        launch = kernel.execute(FIRST_CELL)
        loaded = cell_messages(kernel, load)
        messages = cell_messages(kernel, launch)
        kinds = [m["msg_type"] for m in messages]
        first_display = kinds.index("display_data")
        streams = [(i, m["content"]["text"]) for i, m in enumerate(messages) if m["msg_type"] == "stream"]
        done_at = next(i for i, text in streams if "ranks done" in text)
        assert first_display < done_at, "the panel came after the ranks had finished"
        start = messages[first_display]["content"]["data"]["text/plain"]
        assert start.endswith(": starting (waiting for the helper process to import torch)"), start

        # Nothing but air_magic's own lines and the rank's output: none of MLflow's logging.
        lines = [
            line for m in loaded + messages if m["msg_type"] == "stream" for line in m["content"]["text"].splitlines()
        ]
        ours = [line for line in lines if line.startswith("[air_magic]")]
        assert [line for line in lines if line not in ours] == ["ranks done"], lines
        assert not [line for line in lines if "MLflow run" in line], lines  # the summary says it

        # Every point stored once the kernel's storing is over, in the run the cell's summary
        # names (updated in place when the run's last points are stored).
        res = CellResult()
        for message in messages:
            res.record(message)
        run_id = one_run_id(stored(kernel, launch, res, timeout=120))
        command = f"{shlex.quote(sys.executable)} -m mlflow ui --backend-store-uri '{sqlite_uri(folder)}'"
        assert f"({run_id}); open it with: {command}" in shown(res)
        [result] = [m for m in messages if m["msg_type"] == "execute_result"]
        assert result["content"]["data"]["text/plain"] == repr([run_id, run_id])
        store = Store(sqlite_uri(folder))
        assert store.run(run_id).info.status == "FINISHED"
        assert store.by_rank(run_id, "loss", 2) == {
            rank: [(step, rank + step / 100) for step in range(50)] for rank in (0, 1)
        }
        # MLflow's lines (the tables of the empty store, made once on this machine, that the
        # new store is a copy of) went to a log file: the session's, when the warm-up at
        # %load_ext made it, else the launch's, when its writer did.
        session = kernel.value("__import__('air_magic.kernel.launcher').kernel.launcher.get_launcher().session_dir")
        logs = glob.glob(os.path.join(session, "mlflow.log")) + glob.glob(
            os.path.join(str(tmp_path / "logs"), "*", "mlflow.log")
        )
        text = ""
        for path in logs:
            with open(path, encoding="utf-8") as handle:
                text += handle.read()
        assert text.count("Creating initial MLflow database tables") == 1, logs
    finally:
        kernel.shutdown()


# -- the ranks never wait for the run ----------------------------------------------------------


@distributed(num_accelerators=2)
def log_then_need_the_run(folder: str) -> tuple[str, str]:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(20):
        mlflow.log_metric("early", rank * 100 + step, step=step)
    mlflow.log_param("batch", 32)
    open(os.path.join(folder, f"logged-{rank}"), "w").close()
    files = os.path.join(folder, f"files-{rank}")
    os.makedirs(files)
    with open(os.path.join(files, "note.txt"), "w") as handle:
        handle.write(f"rank {rank}")
    mlflow.log_artifacts(files, artifact_path=f"rank-{rank}")  # MLflow's own call: needs the run
    from mlflow.tracking import fluent

    return mlflow.active_run().info.run_id, fluent.active_run().info.run_id  # ours, and MLflow's own


def test_ranks_log_before_the_run_exists_and_a_call_that_needs_it_gets_it_once_made(
    store: Store, tmp_path: Any
) -> None:
    # Hold the store in an exclusive transaction of another connection: the kernel's writer
    # cannot open it ("database is locked"), so the run cannot be made, until it is let go.
    store.runs()  # the store exists, with its tables
    holder = sqlite3.connect(store.uri[len("sqlite:///") :], isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        launch = log_then_need_the_run.submit(str(tmp_path))
        logged = [tmp_path / f"logged-{rank}" for rank in (0, 1)]
        assert wait_until(lambda: all(p.exists() for p in logged), timeout=120), "the ranks never got going"
        time.sleep(0.5)
        # The ranks logged their points with no run; now they wait in log_artifacts for it.
        assert launch.run_id is None and not launch.done()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    values = launch.result(timeout=120)
    run_id = launch.run_id
    assert values == [(run_id, run_id), (run_id, run_id)]
    run = store.run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["batch"] == "32"
    assert {rank: [v for _, v in points] for rank, points in store.by_rank(run_id, "early", 2).items()} == {
        rank: [float(rank * 100 + step) for step in range(20)] for rank in (0, 1)
    }
    assert store.artifacts(run_id, "rank-0") == ["rank-0/note.txt"]
    assert store.read_artifact(run_id, "rank-1/note.txt", str(tmp_path / "back")) == "rank 1"


@distributed(num_accelerators=1, experiment="gone")
def need_the_run() -> str:
    import mlflow

    mlflow.log_metric("loss", 1.0)  # needs no run: kept on disk as any point
    return str(mlflow.active_run().info.run_id)


def test_when_no_run_can_be_made_a_call_that_needs_it_says_why(store: Store, capsys: Any) -> None:
    client = store.client
    client.delete_experiment(client.create_experiment("gone"))
    with pytest.raises(RuntimeError) as info:
        need_the_run.distributed()
    assert str(info.value).startswith("air_magic: this launch has no MLflow run: MlflowException: ")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "tracking is off for this launch" in line]
    assert len(lines) == 1 and lines[0].startswith(
        "[air_magic] tracking is off for this launch: MLflow could not make its run: MlflowException: "
    ), err
    assert store.runs() == []


# -- the tracking URI without MLflow -----------------------------------------------------------


def test_the_default_uri_is_mlflows_own(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking._tracking_service import utils

    from air_magic.tracking.observer import _default_uri
    from air_magic.tracking.store import absolute_uri

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(utils, "_tracking_uri", None)
    assert _default_uri() == absolute_uri(utils.get_tracking_uri())
    assert _default_uri().startswith("sqlite:///")
    # A folder with experiments in ./mlruns keeps MLflow's file store.
    (tmp_path / "mlruns" / "1").mkdir(parents=True)
    (tmp_path / "mlruns" / "1" / "meta.yaml").write_text("name: old\n")
    assert _default_uri() == absolute_uri(utils.get_tracking_uri())
    assert _default_uri().startswith("file:///")
