"""MLflow off the critical path: the values come back when the ranks are done, and the last
points, the logs and the run's status are stored behind them.

* in a kernel, the summary says ``MLflow: storing N points…`` and is shown again, in place,
  with the run once they are; ``air_magic.tracking.flush()`` waits for it, after which
  every point is in the store;
* a kernel killed while it stores leaves the rest on disk: the next kernel sends it all;
* in this process: ``flush()`` says what it waits for after a second, and gives up after
  its timeout with nothing lost;
* a rank's ``import mlflow`` is a stand-in that answers the logging calls without the
  real package, and becomes the real one the moment anything else is asked of it;
* a new sqlite store is a copy of an empty one MLflow made once (the template), with its
  Default experiment as MLflow makes it in that folder.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import time
from typing import Any

import pytest
from harness import CellResult, Kernel, rank_processes, wait_until
from tracking_support import Store, spool_files, sqlite_uri

from air_magic import distributed

#: Points each rank logs: enough that storing them takes seconds after the ranks are done.
POINTS = 20000

BURST_CELL = f"""\
%%distributed -n 2
import os, mlflow
rank = int(os.environ["RANK"])
for step in range({POINTS}):
    mlflow.log_metric("burst", rank + step / {POINTS}, step=step)
rank
"""


def _texts(res: CellResult) -> list[str]:
    return [data.get("text/plain", "") for _, data, _ in res.displays]


@pytest.mark.kernel
def test_the_values_come_back_first_and_the_summary_turns_into_the_run_in_place(tmp_path: Any) -> None:
    store = Store(sqlite_uri(tmp_path))
    kernel = Kernel(str(tmp_path), {"AIR_MAGIC_STATE_DIR": str(tmp_path / "state")})
    try:
        kernel.ok("%load_ext air_magic")
        kernel.ok("%%distributed -n 1\n0", timeout=180)  # the store is made, MLflow imported
        launch_cell = kernel.execute(BURST_CELL)
        res = kernel.collect(launch_cell, timeout=180)
        assert res.error is None, res.error_text
        assert res.result == "[0, 1]"
        # The cell's summary says what is still being stored...
        storing = [
            (kind, text, shown)
            for (kind, _, shown), text in zip(res.displays, _texts(res))
            if "MLflow: storing" in text
        ]
        assert storing, _texts(res)
        _, text, summary_id = storing[-1]
        assert summary_id is not None
        assert "[air_magic]  MLflow: storing " in text and " points…" in text, text
        # ...and is shown again in its place once flush() returns: with the run, without the line.
        earlier = {launch_cell: CellResult()}
        flushed = kernel.collect(
            kernel.execute("import air_magic.tracking\nair_magic.tracking.flush(120)"), timeout=180, earlier=earlier
        )
        assert flushed.error is None and flushed.result == "True", flushed.error_text
        assert wait_until(lambda: _updated(kernel, earlier, launch_cell, summary_id), timeout=30), earlier[
            launch_cell
        ].displays
        final = [d for d in earlier[launch_cell].displays if d[0] == "update_display_data" and d[2] == summary_id][-1]
        final_text = final[1]["text/plain"]
        assert "MLflow: storing" not in final_text
        assert "[air_magic]  MLflow run " in final_text
        assert final[1]["application/vnd.air-magic.summary+json"]["storing"] == ""
        run_id = re.search(r"MLflow run \S+ \(([0-9a-f]{32})\)", final_text).group(1)  # type: ignore[union-attr]
        assert kernel.value("air_magic.tracking.pending()") == []
        # Every point is in the store, and the run is ended.
        assert len(store.history(run_id, "burst")) == POINTS
        assert len(store.history(run_id, "rank1/burst")) == POINTS
        assert store.run(run_id).info.status == "FINISHED"
        assert store.artifacts(run_id, "logs") == ["logs/rank-0.log", "logs/rank-1.log"]
    finally:
        kernel.shutdown()


def _updated(kernel: Kernel, earlier: dict[str, CellResult], cell: str, display_id: str) -> bool:
    kernel.collect(kernel.execute("0"), timeout=30, earlier=earlier)  # reads what came meanwhile
    return any(
        kind == "update_display_data" and shown == display_id and "MLflow: storing" not in data.get("text/plain", "")
        for kind, data, shown in earlier[cell].displays
    )


@pytest.mark.kernel
def test_a_kernel_killed_while_it_stores_leaves_every_point_to_the_next(tmp_path: Any) -> None:
    folder = tmp_path / "notebook"
    folder.mkdir()
    env = {"AIR_MAGIC_STATE_DIR": str(tmp_path / "state")}
    store = Store(sqlite_uri(folder))
    first = Kernel(str(folder), env)
    try:
        first.ok("%load_ext air_magic")
        first.ok("%%distributed -n 1\n0", timeout=180)
        # Many points, and the kernel killed the moment the values are back.
        cell = BURST_CELL.replace(f"range({POINTS})", "range(60000)").replace("\nrank\n", "\n")
        first.ok(cell, timeout=180)
        res = first.ok("import air_magic.tracking\n[_l] = air_magic.tracking.pending()\nprint('storing:', _l.storing)")
        assert "storing: MLflow: storing " in res.stdout, res.stdout
        run_id = first.value("_l.run_id")
        os.kill(first.pid, signal.SIGKILL)
        first.forget()
        assert wait_until(lambda: not rank_processes(), timeout=30)
        assert spool_files(env["AIR_MAGIC_STATE_DIR"]), "everything was stored before the kill"
        assert len(store.history(run_id, "burst")) < 60000
    finally:
        first.shutdown()
    second = Kernel(str(folder), env)
    try:
        second.ok("%load_ext air_magic")  # looks for what dead kernels left, in the background
        assert wait_until(lambda: not spool_files(env["AIR_MAGIC_STATE_DIR"]), timeout=180)
        assert len(store.history(run_id, "burst")) == 60000
        assert len(store.history(run_id, "rank1/burst")) == 60000
        # The launch had ended: its run is marked as it ended, with its logs.
        assert store.run(run_id).info.status == "FINISHED"
        assert store.artifacts(run_id, "logs") == ["logs/rank-0.log", "logs/rank-1.log"]
    finally:
        second.shutdown()


# -- in this process ------------------------------------------------------------------------------


@distributed(num_accelerators=2)
def burst(points: int) -> int:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(points):
        mlflow.log_metric("burst", rank + step / points, step=step)
    return rank


def test_flush_says_what_it_waits_for_and_every_point_is_stored(store: Store, capsys: Any) -> None:
    from air_magic import tracking

    burst.distributed(1)  # the store is made, MLflow imported
    assert tracking.flush(120)
    capsys.readouterr()
    began = time.monotonic()
    assert burst.distributed(POINTS) == [0, 1]
    returned = time.monotonic() - began
    launch = burst.last_launch
    assert launch.storing is not None and launch.storing.startswith("MLflow: storing ")
    assert tracking.pending() == [launch]
    assert tracking.flush(120)
    waited = time.monotonic() - began - returned
    err = capsys.readouterr().err
    assert launch.storing is None and tracking.pending() == []
    if waited > 1.5:  # a wait over a second says what it waits for (and only then)
        assert "[air_magic] waiting for MLflow to store " in err and f" of launch {launch.id}…" in err, err
    assert launch.run_id is not None
    assert len(store.history(launch.run_id, "burst")) == POINTS


def test_flush_gives_up_after_its_timeout_and_nothing_is_lost(store: Store, capsys: Any) -> None:
    from air_magic import tracking

    burst.distributed(1)
    assert tracking.flush(120)
    assert burst.distributed(POINTS) == [0, 1]
    launch = burst.last_launch
    assert tracking.flush(0.0) is False  # still storing: it says so and returns
    assert tracking.pending() == [launch]
    assert tracking.flush(120)
    run_id = launch.run_id
    assert run_id is not None
    assert len(store.history(run_id, "rank1/burst")) == POINTS


def test_the_next_launch_waits_for_the_points_of_the_last(store: Store) -> None:
    from air_magic import tracking

    burst.distributed(1)
    assert tracking.flush(120)
    burst.distributed(POINTS)
    first = burst.last_launch
    burst.distributed(1)
    assert first.storing is None  # stored before the second launch started
    assert len(store.history(str(first.run_id), "burst")) == POINTS
    assert tracking.flush(120)


# -- a rank's import mlflow ----------------------------------------------------------------------


@distributed(num_accelerators=1)
def import_mlflow() -> dict[str, Any]:
    import importlib.util
    import sys
    import time

    began = time.perf_counter()
    import mlflow

    mlflow.log_metric("light", 1.0, step=1)
    mlflow.log_param("lr", 0.1)
    mlflow.set_tag("kind", "test")
    found = importlib.util.find_spec("mlflow")  # as transformers asks whether MLflow is there
    seen = {
        "took": time.perf_counter() - began,
        "real_before": "mlflow.tracking" in sys.modules,
        "spec_origin": found is not None and bool(found.origin),
    }
    import mlflow.entities  # a submodule: the real package takes the stand-in's place

    seen["metric_class"] = mlflow.entities.Metric.__name__
    seen["version"] = mlflow.__version__ == __import__("importlib.metadata").metadata.version("mlflow")
    seen["real_after"] = type(sys.modules["mlflow"]).__name__ == "module"
    mlflow.log_metric("after", 2.0, step=1)  # the real package's logging is routed as well
    with mlflow.start_run() as run:
        seen["run"] = run.info.run_id
    return seen


def test_a_ranks_import_mlflow_is_answered_without_the_package_until_more_is_needed(store: Store) -> None:
    from air_magic import tracking

    [seen] = import_mlflow.distributed()
    assert seen["real_before"] is False  # the logging calls did not import MLflow
    assert seen["spec_origin"] is True
    assert seen["metric_class"] == "Metric" and seen["version"] and seen["real_after"]
    assert tracking.flush(120)
    run = store.run(seen["run"])
    assert run.data.metrics == {"light": 1.0, "after": 2.0}
    assert run.data.params["lr"] == "0.1"
    assert run.data.tags["kind"] == "test"


# -- the template of a new store ------------------------------------------------------------------


def _default_experiment(path: str) -> tuple[Any, ...]:
    """The Default experiment's row, every table's columns, the migration MLflow noted."""
    db = sqlite3.connect(path)
    try:
        row = db.execute(
            "SELECT name, artifact_location, lifecycle_stage FROM experiments WHERE experiment_id = 0"
        ).fetchone()
        names = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        columns = {n: sorted(c[1:3] for c in db.execute(f'PRAGMA table_info("{n}")')) for n in names}
        version = db.execute("SELECT version_num FROM alembic_version").fetchall()
        return row, columns, version
    finally:
        db.close()


def test_a_new_store_is_the_template_with_the_default_experiment_mlflow_makes_there(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    from air_magic.tracking.store import TEMPLATE_ENV, make_client, template_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no template yet
    made_by_mlflow = tmp_path / "by-mlflow"
    made_by_mlflow.mkdir()
    monkeypatch.chdir(made_by_mlflow)
    monkeypatch.setenv(TEMPLATE_ENV, "0")
    make_client(f"sqlite:///{made_by_mlflow / 'mlflow.db'}")
    monkeypatch.delenv(TEMPLATE_ENV)
    assert not os.path.exists(tmp_path / "cache" / "air_magic" / "stores")

    template = template_path()  # made once, by MLflow
    assert template is not None and template.startswith(str(tmp_path / "cache" / "air_magic" / "stores"))
    assert oct(os.stat(os.path.dirname(template)).st_mode & 0o777) == "0o700"
    copied = tmp_path / "copied"
    copied.mkdir()
    monkeypatch.chdir(copied)
    began = time.monotonic()
    client = make_client(f"sqlite:///{copied / 'mlflow.db'}")
    took = time.monotonic() - began
    ours, theirs = (
        _default_experiment(str(copied / "mlflow.db")),
        _default_experiment(str(made_by_mlflow / "mlflow.db")),
    )
    assert ours[0] == ("Default", f"{copied}/mlruns/0", "active")
    assert theirs[0] == ("Default", f"{made_by_mlflow}/mlruns/0", "active")
    assert ours[1] == theirs[1] and ours[2] == theirs[2]  # the same tables, the same migration
    # MLflow takes it as its own: a run in the Default experiment, and in a new one.
    run = client.create_run("0")
    client.log_metric(run.info.run_id, "x", 1.0)
    other = MlflowClient(f"sqlite:///{copied / 'mlflow.db'}")
    assert other.get_run(run.info.run_id).data.metrics == {"x": 1.0}
    assert other.get_experiment("0").artifact_location == f"{copied}/mlruns/0"
    assert other.create_experiment("new")
    print(f"a store from the template in {took * 1000:.0f} ms")
