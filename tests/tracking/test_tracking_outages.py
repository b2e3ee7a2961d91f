"""A tracking server that is down, or dies mid-launch, costs the launch seconds, not minutes;
its points wait on disk and reach the run once the server is back.

Each test starts its own ``mlflow server`` on 127.0.0.1 (the session's shared one must
stay up), stops it (killed, as a crash does), and starts it again on the same port and
store: the same server come back.  Each has its own state folder, so that what
``upload_pending()`` finds is this test's.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterator

import cloudpickle
import pytest
from tracking_support import free_port, one_run_id, rank_key, run_ids_in, spooled_points, start_mlflow_server

from air_magic import distributed

pytestmark = pytest.mark.process

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Seconds a launch may take with its server gone, rank work included (MLflow's own
#: retries took 247 s before every launch, and 16 min after a server died mid-launch).
BOUND = 30.0


@pytest.fixture
def server_root(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    import mlflow
    from mlflow.tracking import fluent

    root = tmp_path / "server"
    root.mkdir()
    state = tmp_path / "state"
    monkeypatch.setenv("AIR_MAGIC_STATE_DIR", str(state))
    monkeypatch.chdir(tmp_path)
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    while mlflow.active_run() is not None:
        mlflow.end_run()
    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    yield str(root)


def unreachable_line(uri: str, reason: str) -> str:
    return (
        f"[air_magic] MLflow server {uri} is unreachable ({reason}): this launch's points stay on disk and "
        "are sent when it is back, at the next launch or %load_ext, or with air_magic.tracking.upload_pending()."
    )


def runs_of_launch(uri: str, launch_id: str) -> list[Any]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return list(client.search_runs(experiments, filter_string=f"tags.`air_magic.launch_id` = '{launch_id}'"))


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def by_rank(uri: str, run_id: str, key: str) -> dict[int, list[tuple[int, float]]]:
    """Each of the 2 ranks' points of ``key`` (rank 0's under it, rank 1's under rank1/<key>)."""
    return {rank: history(uri, run_id, rank_key(rank, key)) for rank in (0, 1)}


@distributed(num_accelerators=2, experiment="outages")
def log_points(points: int) -> int:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(points):
        mlflow.log_metric("loss", rank + step / 1000, step=step)
    mlflow.log_param("points", points)
    return rank


def test_a_server_that_is_down_costs_seconds_and_gets_the_points_when_back(
    server_root: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    port = free_port()
    server = start_mlflow_server(server_root, port)
    server.stop()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)

    started = time.monotonic()
    assert log_points.distributed(100) == [0, 1]
    took = time.monotonic() - started
    assert took < BOUND, f"the launch took {took:.1f} s with its server down"
    captured = capsys.readouterr()
    assert run_ids_in(captured) == []
    assert unreachable_line(server.uri, "connection refused") in captured.err.splitlines()
    launch = log_points.last_launch
    assert launch.run_id is None
    assert spooled_points(os.environ["AIR_MAGIC_STATE_DIR"], "loss") == 200

    server = start_mlflow_server(server_root, port)
    try:
        from air_magic.tracking import upload_pending

        [result] = upload_pending()
        [run] = runs_of_launch(server.uri, launch.id)
        run_id = run.info.run_id
        assert capsys.readouterr().err == (
            f"[air_magic] recovered what earlier launches left on disk: MLflow run {run_id} "
            f"(of log_points, run from {os.getcwd()}, 200 points sent, marked FINISHED) in MLflow server {server.uri}.\n"
        )
        assert (result.outcome, result.run_id) == ("sent", run_id)
        assert run.info.status == "FINISHED"
        assert run.data.params["points"] == "100"
        assert run.data.params["air_magic.num_accelerators"] == "2"
        assert by_rank(server.uri, run_id, "loss") == {
            rank: [(step, rank + step / 1000) for step in range(100)] for rank in (0, 1)
        }
        from mlflow import MlflowClient

        logs = sorted(a.path for a in MlflowClient(server.uri).list_artifacts(run_id, "logs"))
        assert logs == ["logs/rank-0.log", "logs/rank-1.log"]
        assert spooled_points(os.environ["AIR_MAGIC_STATE_DIR"], "loss") == 0
    finally:
        server.stop()


@distributed(num_accelerators=2, experiment="outages")
def log_around_a_crash(folder: str) -> int:
    import os
    import time

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(100):
        mlflow.log_metric("loss", rank + step / 1000, step=step)
    open(os.path.join(folder, f"first-half-{rank}"), "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(folder, "server-gone")) and time.monotonic() < deadline:
        time.sleep(0.05)
    for step in range(100, 200):
        mlflow.log_metric("loss", rank + step / 1000, step=step)
    return rank


def test_a_server_that_dies_mid_launch_costs_seconds_and_gets_the_points_when_back(
    server_root: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    port = free_port()
    server = start_mlflow_server(server_root, port)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    try:
        launch = log_around_a_crash.submit(str(tmp_path))
        deadline = time.monotonic() + 120
        # The run is made beside the ranks: the handle has its id once it exists.
        while launch.run_id is None or sum(map(len, by_rank(server.uri, launch.run_id, "loss").values())) < 200:
            assert time.monotonic() < deadline, "the first half never reached the server"
            time.sleep(0.2)
    finally:
        server.stop()
    open(tmp_path / "server-gone", "w").close()
    started = time.monotonic()
    assert launch.result(timeout=120) == [0, 1]
    took = time.monotonic() - started
    assert took < BOUND, f"the launch took {took:.1f} s to end after its server died"
    captured = capsys.readouterr()
    run_id = one_run_id(captured)
    assert launch.run_id == run_id
    unreachable = [line for line in captured.err.splitlines() if "is unreachable" in line]
    assert unreachable in (
        [unreachable_line(server.uri, "connection refused")],
        [unreachable_line(server.uri, "connection lost")],
    ), captured.err

    server = start_mlflow_server(server_root, port)
    try:
        assert by_rank(server.uri, run_id, "loss") == {
            rank: [(step, rank + step / 1000) for step in range(100)] for rank in (0, 1)
        }
        from air_magic.tracking import upload_pending

        [result] = upload_pending()
        assert capsys.readouterr().err == (
            f"[air_magic] recovered what earlier launches left on disk: MLflow run {run_id} "
            f"(of log_around_a_crash, run from {os.getcwd()}, 200 points sent, marked FINISHED) "
            f"in MLflow server {server.uri}.\n"
        )
        assert (result.outcome, result.run_id, result.points) == ("sent", run_id, 200)
        from mlflow import MlflowClient

        client = MlflowClient(server.uri)
        assert client.get_run(run_id).info.status == "FINISHED"
        assert by_rank(server.uri, run_id, "loss") == {
            rank: [(step, rank + step / 1000) for step in range(200)] for rank in (0, 1)
        }
        logs = sorted(a.path for a in client.list_artifacts(run_id, "logs"))
        assert logs == ["logs/rank-0.log", "logs/rank-1.log"]
    finally:
        server.stop()


def test_a_server_still_down_is_said_once_and_its_points_stay(
    server_root: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from air_magic.tracking import upload_pending

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert log_points.distributed(30) == [0, 1]
    capsys.readouterr()
    started = time.monotonic()
    [result] = upload_pending()
    assert time.monotonic() - started < 10
    assert (result.outcome, result.points) == ("waiting", 60)
    assert capsys.readouterr().err == (
        f"[air_magic] MLflow server {uri} is still unreachable (connection refused): 60 points of "
        "1 earlier launch stay on disk; air_magic.tracking.upload_pending() sends them once it is back.\n"
    )
    assert spooled_points(os.environ["AIR_MAGIC_STATE_DIR"], "loss") == 60


@distributed(num_accelerators=1, experiment="outages")
def needs_the_run_id() -> str:
    import mlflow

    try:
        return str(mlflow.active_run().info.run_id)
    except RuntimeError as exc:
        return f"raised: {exc}"


def test_a_rank_that_waits_for_the_run_says_so_after_a_second(
    server_root: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    # No server on this port: the run cannot be made, and a call that needs its id waits.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AIR_MAGIC_RUN_WAIT", "3")
    [value] = needs_the_run_id.distributed()
    assert value.startswith("raised: air_magic: the launch's MLflow run was not made within 3 s"), value
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if line.startswith("[air_magic] rank 0: waiting")]
    assert said == ["[air_magic] rank 0: waiting for MLflow to make the launch's run (this call needs its id)…"], (
        out.out + out.err
    )
