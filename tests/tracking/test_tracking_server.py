"""MLflow tracking against a real ``mlflow server``: the cell shows a link, and the link opens the run.

"Opens the run" is checked the way the UI loads it: the server's REST API
(``GET /api/2.0/mlflow/runs/get``) answers with that run.
"""

from __future__ import annotations

import ast
import re
import sys
from typing import Any, Iterator

import cloudpickle
import pytest
from tracking_support import Server, one_run_id, rank_key, shown, stored_run

from air_magic import distributed

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def link_pattern(server: Server) -> re.Pattern[str]:
    """The summary's line for a run on a server: its name and id, then the link to it."""
    return re.compile(
        rf"^\[air_magic\] +MLflow run ([^\n]*) \(([0-9a-f]{{32}})\): "
        rf"(http://127\.0\.0\.1:{server.port}/#/experiments/(\d+)/runs/([0-9a-f]{{32}}))$",
        re.MULTILINE,
    )


def check_link_opens_the_run(server: Server, output: Any) -> dict[str, Any]:
    """The link in ``output`` (see ``shown``), said once, names a run the server knows;
    return that run (REST JSON)."""
    text = shown(output)
    matches = link_pattern(server).findall(text)
    assert len(matches) == 1, f"not one link to {server.uri} in:\n{text}"
    name, run_id, _, linked_experiment, linked_run = matches[0]
    assert linked_run == run_id
    run = server.get("/api/2.0/mlflow/runs/get", run_id=run_id)["run"]
    assert run["info"]["run_id"] == run_id
    assert run["info"]["run_name"] == name
    assert run["info"]["experiment_id"] == linked_experiment
    return run  # type: ignore[no-any-return]


def params_of(run: dict[str, Any]) -> dict[str, str]:
    return {p["key"]: p["value"] for p in run["data"].get("params", [])}


@pytest.fixture
def server_env(mlflow_server: Server, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    import mlflow
    from mlflow.tracking import fluent

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    while mlflow.active_run() is not None:
        mlflow.end_run()
    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    yield mlflow_server


@distributed(num_accelerators=2, experiment="served", run_name="served-run")
def log_to_server(points: int) -> int:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(points):
        mlflow.log_metric("loss", rank + step / 100, step=step)
    mlflow.set_tag("rank_seen", "yes")
    return rank


@pytest.mark.process
def test_decorator_output_links_to_the_run_on_the_server(server_env: Server, capsys: Any) -> None:
    assert log_to_server.distributed(50) == [0, 1]
    out = capsys.readouterr()
    run = check_link_opens_the_run(server_env, out)
    run_id = one_run_id(out)
    assert log_to_server.last_launch.run_url.endswith(f"/runs/{run_id}")
    assert run["info"]["status"] == "FINISHED"
    assert run["info"]["run_name"] == "served-run"
    params = params_of(run)
    assert params["air_magic.num_accelerators"] == "2"
    assert params["air_magic.accelerator_type"] == "CPU"
    assert params["air_magic.code"] == "function log_to_server"
    experiment = server_env.get("/api/2.0/mlflow/experiments/get", experiment_id=run["info"]["experiment_id"])
    assert experiment["experiment"]["name"] == "served"
    assert log_to_server.last_launch.run_command is None  # the server has a UI of its own
    assert log_to_server.last_launch.run_name == "served-run"
    # Rank 0's curve under "loss", rank 1's under "rank1/loss".
    for rank in (0, 1):
        history = server_env.get(
            "/api/2.0/mlflow/metrics/get-history",
            run_id=run_id,
            metric_key=rank_key(rank, "loss"),
            max_results="1000",
        )["metrics"]
        assert sorted((m["step"], m["value"]) for m in history) == [(step, rank + step / 100) for step in range(50)]
    from mlflow import MlflowClient

    logs = sorted(a.path for a in MlflowClient(server_env.uri).list_artifacts(run_id, "logs"))
    assert logs == ["logs/rank-0.log", "logs/rank-1.log"]


@pytest.mark.kernel
def test_cell_output_links_to_the_run_on_the_server(mlflow_server: Server, kernel_factory: Any) -> None:
    kernel = kernel_factory(extra_env={"MLFLOW_TRACKING_URI": mlflow_server.uri}, tracking=True)
    try:
        res = stored_run(
            kernel,
            "%%distributed -n 2 --experiment served-cells\n"
            "import os, mlflow\n"
            "mlflow.log_metric('loss', float(os.environ['RANK']))\n"
            "int(os.environ['RANK'])",
            timeout=180,
        )
        assert res.error is None, res.error_text
        assert ast.literal_eval(res.result) == [0, 1]
        run = check_link_opens_the_run(mlflow_server, res)
        assert run["info"]["status"] == "FINISHED"
        for rank in (0, 1):
            history = mlflow_server.get(
                "/api/2.0/mlflow/metrics/get-history", run_id=run["info"]["run_id"], metric_key=rank_key(rank, "loss")
            )["metrics"]
            assert [m["value"] for m in history] == [float(rank)]
        assert params_of(run)["air_magic.num_accelerators"] == "2"
        assert "mlflow ui" not in res.stdout  # a server has a UI of its own: the link is enough
    finally:
        kernel.shutdown()
