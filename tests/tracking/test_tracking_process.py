"""``@distributed`` with MLflow tracking, launched from this process into a private sqlite store.

Each test reads the store back with ``MlflowClient`` right after the launch
returns: what is there then is what the user sees.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from typing import Any

import cloudpickle
import pytest
from tracking_support import Store, one_run_id, run_ids_in

from air_magic import LaunchCancelledError, LaunchTimeoutError, distributed

pytestmark = pytest.mark.process

# The functions below travel by value, as a notebook's do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def metric_points(store: Store, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in store.history(run_id, key))


# -- one launch, one run -----------------------------------------------------------------------


@distributed(num_accelerators=2, timeout=600)
def log_a_little() -> int:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(5):
        mlflow.log_metric("loss", 10 * rank + step, step=step)
    return rank


def test_a_launch_is_one_finished_run_with_its_configuration(store: Store, capsys: Any) -> None:
    assert log_a_little.distributed() == [0, 1]
    captured = capsys.readouterr()
    run_id = one_run_id(captured)
    assert log_a_little.last_launch.run_id == run_id
    launch = log_a_little.last_launch
    assert launch.run_name == store.run(run_id).info.run_name and launch.run_name
    assert launch.run_url is None
    assert launch.run_command == f"{shlex.quote(sys.executable)} -m mlflow ui --backend-store-uri '{store.uri}'"
    # Said once, by the panel's summary, with air_magic's other lines on stderr.
    assert run_id not in captured.out
    said = [line for line in captured.err.splitlines() if run_id in line]
    assert said == [f"[air_magic]  MLflow run {launch.run_name} ({run_id}); open it with: {launch.run_command}"], said

    runs = store.runs()
    assert [r.info.run_id for r in runs] == [run_id]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["air_magic.num_accelerators"] == "2"
    assert run.data.params["air_magic.accelerator_type"] == "CPU"
    assert run.data.params["air_magic.timeout"] == "600.0"
    assert run.data.params["air_magic.code"] == "function log_a_little"
    assert run.data.tags["air_magic.launch_id"] == log_a_little.last_launch.id
    assert "mlflow.parentRunId" not in run.data.tags
    assert store.by_rank(run_id, "loss", 2) == {
        rank: [(step, float(10 * rank + step)) for step in range(5)] for rank in (0, 1)
    }
    assert store.artifacts(run_id, "logs") == ["logs/rank-0.log", "logs/rank-1.log"]
    # With no experiment chosen anywhere, the run goes to the one named after the
    # notebook; outside a notebook that is "air_magic".
    assert store.experiment_name(run_id) == "air_magic"


@distributed(num_accelerators=2)
def steps_of_every_number_type() -> None:
    import os

    import mlflow
    import torch

    rank = int(os.environ["RANK"])
    mlflow.log_metric("loss", 1 + rank / 10, step=1.0)  # a float step, as MLflow itself accepts
    mlflow.log_metric("loss", 2 + rank / 10, step=torch.tensor(2))  # a counter kept as a tensor
    mlflow.log_metrics({"loss": 3 + rank / 10}, step=3.0, timestamp=1.7e12)
    mlflow.log_metric("loss", 4 + rank / 10, step=4)


def test_steps_and_timestamps_of_any_number_type_are_stored(store: Store, capsys: Any) -> None:
    steps_of_every_number_type.distributed()
    run_id = one_run_id(capsys.readouterr())
    assert store.by_rank(run_id, "loss", 2) == {rank: [(s, s + rank / 10) for s in (1, 2, 3, 4)] for rank in (0, 1)}


@distributed(num_accelerators=2)
def run_ids_seen_by_the_rank() -> tuple[str, str, str, str]:
    import mlflow

    run = mlflow.start_run()
    with mlflow.start_run() as in_with:
        inner = in_with.info.run_id
    active = mlflow.active_run().info.run_id
    mlflow.end_run()  # the kernel ends the run, not the rank
    return run.info.run_id, inner, active, str(mlflow.active_run().info.run_id)


def test_start_run_inside_a_rank_is_the_launchs_run(store: Store, capsys: Any) -> None:
    values = run_ids_seen_by_the_rank.distributed()
    run_id = one_run_id(capsys.readouterr())
    assert values == [(run_id,) * 4, (run_id,) * 4]
    assert [r.info.run_id for r in store.runs()] == [run_id]
    assert store.run(run_id).info.status == "FINISHED"


@distributed(num_accelerators=2)
def run_info_seen_by_the_rank() -> tuple[Any, ...]:
    import mlflow

    mlflow.log_param("p", 1)
    run = mlflow.active_run()
    info, data = run.info, run.data  # data as MLflow's own active_run() has it: fetched at the start
    return (
        info.run_id,
        info.experiment_id,
        info.artifact_uri,
        info.status,
        info.run_name,
        info.lifecycle_stage,
        (data.params, data.metrics, data.tags),
    )


def test_a_rank_s_active_run_info_has_what_mlflow_s_run_info_has(store: Store, capsys: Any) -> None:
    values = run_info_seen_by_the_rank.distributed()
    run_id = one_run_id(capsys.readouterr())
    run = store.run(run_id)
    seen = (run_id, run.info.experiment_id, run.info.artifact_uri, "RUNNING", run.info.run_name, "active", ({}, {}, {}))
    assert values == [seen, seen]
    assert run.data.params["p"] == "1"


# -- nesting and the experiment ------------------------------------------------------------------


def test_launch_nests_under_the_active_run_which_stays_active(store: Store, capsys: Any) -> None:
    import mlflow

    parent = mlflow.start_run(run_name="outer")
    try:
        assert log_a_little.distributed() == [0, 1]
        run_id = one_run_id(capsys.readouterr())
        active = mlflow.active_run()
        assert active is not None and active.info.run_id == parent.info.run_id
        child = store.run(run_id)
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.experiment_id == parent.info.experiment_id
        assert child.info.status == "FINISHED"
        assert store.run(parent.info.run_id).info.status == "RUNNING"
    finally:
        mlflow.end_run()
    assert store.run(parent.info.run_id).info.status == "FINISHED"


@distributed(num_accelerators=2, experiment="from-keyword", run_name="named-by-keyword")
def log_into_chosen_experiment() -> None:
    import os

    import mlflow

    mlflow.log_metric("x", float(os.environ["RANK"]))


def test_experiment_from_environment_and_keyword_wins(
    store: Store, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-environment")
    log_a_little.distributed()
    from_env = one_run_id(capsys.readouterr())
    assert store.experiment_name(from_env) == "from-environment"

    log_into_chosen_experiment.distributed()
    chosen = one_run_id(capsys.readouterr())
    run = store.run(chosen)
    assert store.experiment_name(chosen) == "from-keyword"
    assert run.info.run_name == "named-by-keyword"
    assert run.data.tags["mlflow.runName"] == "named-by-keyword"
    assert store.by_rank(chosen, "x", 2) == {0: [(0, 0.0)], 1: [(0, 1.0)]}


def test_the_run_line_names_the_run_and_the_command_that_opens_its_store(store: Store, capsys: Any) -> None:
    # Without a panel (whose summary says the run), tracking announces it on lines of its own.
    unpaneled = log_into_chosen_experiment.with_overrides(panel=False)
    unpaneled.distributed()
    out = capsys.readouterr().out
    run_id = one_run_id(out)
    launch = unpaneled.last_launch
    assert (launch.run_id, launch.run_name, launch.run_url) == (run_id, "named-by-keyword", None)
    experiment_id = store.run(run_id).info.experiment_id
    path = store.uri[len("sqlite:///") :]
    command = f"{shlex.quote(sys.executable)} -m mlflow ui --backend-store-uri '{store.uri}'"
    assert launch.run_command == command
    # The name and id, then the command alone on its line: nothing a front end would make
    # a link of in the prose, the store's URI quoted for the shell, the kernel's own Python.
    assert (
        f"[air_magic] MLflow run 'named-by-keyword' (id {run_id}, experiment {experiment_id}, in {path}). "
        "To see it, run in a terminal (with the mlflow of the kernel's environment):\n"
        f"    {command}\n"
    ) in out
    assert shlex.split(command) == [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store.uri]
    assert "://" not in out.split("\n    ")[0]


@distributed(num_accelerators=2, timeout=600)
def log_the_same_keys_on_every_rank(marker: str) -> int:
    import os
    import time

    import mlflow

    rank = int(os.environ["RANK"])
    if rank == 0:
        mlflow.log_params({"batch_size": 32, "seed": 1000})
        open(marker, "w").close()
    else:  # after rank 0's, so that the first value sent is rank 0's
        while not os.path.exists(marker):
            time.sleep(0.01)
        time.sleep(1.0)
        mlflow.log_params({"batch_size": 32, "seed": 1000 + rank})
    for step in range(20):
        mlflow.log_metric("loss", 10 * rank + step / 10, step=step)
    return rank


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_chart_of_a_key_is_rank_0s_curve_and_each_other_rank_has_its_own(
    store: Store, capsys: Any, ranks: int, tmp_path: Any
) -> None:
    launch = log_the_same_keys_on_every_rank.with_overrides(num_accelerators=ranks)
    assert launch.distributed(str(tmp_path / "rank-0-logged")) == list(range(ranks))
    run_id = one_run_id(capsys.readouterr())
    # One point a step under "loss": rank 0's, not one per rank zigzagging between them.
    assert metric_points(store, run_id, "loss") == [(step, step / 10) for step in range(20)]
    for rank in range(1, ranks):
        assert metric_points(store, run_id, f"rank{rank}/loss") == [(step, 10 * rank + step / 10) for step in range(20)]
    # Beside MLflow's own system metrics (system/..., the kernel's machine), which a launch
    # that runs past 2 s gets (this one does on a loaded machine).
    logged = {key for key in store.run(run_id).data.metrics if not key.startswith("system/")}
    assert logged == {"loss"} | {f"rank{r}/loss" for r in range(1, ranks)}
    params = store.run(run_id).data.params
    assert {k: v for k, v in params.items() if not k.startswith("air_magic.")} == {
        "batch_size": "32",
        "seed": "1000",
        **{f"rank{r}/seed": str(1000 + r) for r in range(1, ranks)},
    }


def test_experiment_set_in_this_process_is_used_and_keyword_wins(store: Store, capsys: Any) -> None:
    import mlflow

    mlflow.set_experiment("set-here")
    log_a_little.distributed()
    assert store.experiment_name(one_run_id(capsys.readouterr())) == "set-here"
    # experiment= on the decorator wins over it
    log_into_chosen_experiment.distributed()
    assert store.experiment_name(one_run_id(capsys.readouterr())) == "from-keyword"


# -- statuses ------------------------------------------------------------------------------------


@distributed(num_accelerators=2)
def log_then_fail(points: int) -> None:
    import os
    import time

    import mlflow

    if os.environ["RANK"] == "0":
        for step in range(points):
            mlflow.log_metric("loss", 1.0 / (step + 1), step=step)
        raise ValueError(f"diverged after {points} steps")
    time.sleep(60)  # stopped when rank 0 fails


def test_points_logged_before_a_rank_fails_are_stored_and_run_failed(store: Store, capsys: Any) -> None:
    with pytest.raises(ValueError, match="diverged after 100 steps"):
        log_then_fail.distributed(100)
    run_id = one_run_id(capsys.readouterr())
    assert store.run(run_id).info.status == "FAILED"
    assert metric_points(store, run_id, "loss") == [(step, 1.0 / (step + 1)) for step in range(100)]
    assert store.artifacts(run_id, "logs") == ["logs/rank-0.log", "logs/rank-1.log"]
    rank0_log = store.read_artifact(run_id, "logs/rank-0.log", os.getcwd())
    assert "ValueError: diverged after 100 steps" in rank0_log


@distributed(num_accelerators=2)
def log_then_wait(marker: str) -> None:
    import os
    import time

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(10):
        mlflow.log_metric("before_stop", step + rank / 10, step=step)
    with open(f"{marker}-{os.environ['RANK']}", "w"):
        pass
    time.sleep(120)


def wait_for_files(*paths: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"ranks did not reach {paths}"
        time.sleep(0.05)


def test_cancel_of_a_submitted_launch_marks_the_run_killed(store: Store, capsys: Any) -> None:
    launch = log_then_wait.submit("ready")
    wait_for_files("ready-0", "ready-1")
    assert launch.cancel() is True
    with pytest.raises(LaunchCancelledError):
        launch.result(timeout=60)
    run_id = one_run_id(capsys.readouterr())
    assert launch.run_id == run_id
    assert store.run(run_id).info.status == "KILLED"
    assert store.by_rank(run_id, "before_stop", 2) == {
        rank: [(step, step + rank / 10) for step in range(10)] for rank in range(2)
    }


def test_timeout_marks_the_run_killed(store: Store, capsys: Any) -> None:
    with pytest.raises(LaunchTimeoutError):
        log_then_wait.with_overrides(timeout=10).distributed("never-read")
    run_id = one_run_id(capsys.readouterr())
    assert store.run(run_id).info.status == "KILLED"
    assert len(store.all_ranks(run_id, "before_stop", 2)) == 20


# -- many ranks, many points ---------------------------------------------------------------------


@distributed(num_accelerators=8, timeout=600)
def log_everything(points: int) -> int:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(points):
        mlflow.log_metric("loss", rank + step / 1000, step=step)
        if step % 50 == 0:
            mlflow.log_metrics({"acc": rank + step / 1000, f"rank{rank}.lr": 0.1 * rank}, step=step)
    mlflow.log_param("batch_size", 32)
    mlflow.log_param(f"seed_of_rank_{rank}", 1000 + rank)
    mlflow.set_tag(f"host_of_rank_{rank}", f"node-{rank}")
    name = f"summary-{rank}.txt"
    with open(name, "w") as handle:
        handle.write(f"rank {rank} logged {points} points\n")
    mlflow.log_artifact(name, "summaries")
    print(f"rank {rank} done")
    return rank


def test_eight_ranks_every_point_param_tag_and_artifact_is_stored(store: Store, capsys: Any) -> None:
    points = 500
    assert log_everything.distributed(points) == list(range(8))
    run_id = one_run_id(capsys.readouterr())
    # Read back at once: everything was written before .distributed() returned.
    loss = store.by_rank(run_id, "loss", 8)
    assert sum(len(curve) for curve in loss.values()) == 8 * points
    assert loss == {rank: [(step, rank + step / 1000) for step in range(points)] for rank in range(8)}
    acc = store.by_rank(run_id, "acc", 8)
    assert acc == {rank: [(step, rank + step / 1000) for step in range(0, points, 50)] for rank in range(8)}
    run = store.run(run_id)
    assert run.info.status == "FINISHED"
    for rank in range(8):
        assert len(store.by_rank(run_id, f"rank{rank}.lr", 8)[rank]) == points // 50
        assert run.data.params[f"seed_of_rank_{rank}"] == str(1000 + rank)
        assert run.data.tags[f"host_of_rank_{rank}"] == f"node-{rank}"
    assert run.data.params["batch_size"] == "32"
    assert run.data.params["air_magic.num_accelerators"] == "8"

    assert store.artifacts(run_id, "logs") == [f"logs/rank-{r}.log" for r in range(8)]
    assert store.artifacts(run_id, "summaries") == [f"summaries/summary-{r}.txt" for r in range(8)]
    assert store.read_artifact(run_id, "summaries/summary-5.txt", os.getcwd()) == "rank 5 logged 500 points\n"
    for rank in range(8):
        text = store.read_artifact(run_id, f"logs/rank-{rank}.log", os.getcwd())
        assert f"rank {rank} done" in text
        assert "database is locked" not in text
    for path in log_everything.last_launch.log_paths:
        with open(path, encoding="utf-8", errors="replace") as handle:
            assert "database is locked" not in handle.read()


# -- rank-side cost ----------------------------------------------------------------------------


@distributed(num_accelerators=2)
def median_log_metric_seconds(calls: int) -> float:
    import os
    import statistics
    import time

    import mlflow

    rank = int(os.environ["RANK"])
    costs = []
    for step in range(calls):
        started = time.perf_counter()
        mlflow.log_metric("loss", rank + 0.5 * step, step=step)
        costs.append(time.perf_counter() - started)
    return statistics.median(costs)


def test_log_metric_in_a_rank_costs_microseconds(store: Store, capsys: Any) -> None:
    medians = median_log_metric_seconds.distributed(2000)
    run_id = one_run_id(capsys.readouterr())
    # A direct write to a sqlite store costs milliseconds; a line in a file, microseconds.
    assert all(m < 200e-6 for m in medians), [f"{m * 1e6:.1f} us" for m in medians]
    assert len(store.all_ranks(run_id, "loss", 2)) == 2 * 2000


# -- mistakes inside a rank ----------------------------------------------------------------------


@distributed(num_accelerators=2)
def set_experiment_inside() -> None:
    import mlflow

    mlflow.set_experiment("chosen-on-a-rank")


def test_set_experiment_inside_a_rank_says_to_call_it_in_the_notebook(store: Store, capsys: Any) -> None:
    with pytest.raises(RuntimeError, match=r"call mlflow\.set_experiment\(\.\.\.\) in the notebook"):
        set_experiment_inside.distributed()
    run_id = one_run_id(capsys.readouterr())
    assert store.run(run_id).info.status == "FAILED"
    assert "chosen-on-a-rank" not in [e.name for e in store.client.search_experiments()]


@distributed(num_accelerators=2)
def log_to_another_run() -> None:
    import mlflow

    mlflow.log_metric("loss", 1.0, run_id="other")


def test_log_metric_to_another_run_inside_a_rank_names_the_launchs_run(store: Store, capsys: Any) -> None:
    with pytest.raises(RuntimeError) as info:
        log_to_another_run.distributed()
    run_id = one_run_id(capsys.readouterr())
    message = str(info.value)
    assert f"this rank logs to the launch's MLflow run {run_id}" in message
    assert "run_id='other'" in message
    assert store.run(run_id).info.status == "FAILED"


@distributed(num_accelerators=2)
def log_then_use_a_bad_name() -> None:
    import os
    import time

    import mlflow

    if os.environ["RANK"] == "0":
        for step in range(100):
            mlflow.log_metric("loss", step / 100, step=step)
        mlflow.log_metric("loss@rank0", 1.0)  # '@' is not allowed in MLflow names
    time.sleep(60)


def test_a_name_mlflow_refuses_raises_at_the_call_and_earlier_points_are_kept(store: Store, capsys: Any) -> None:
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match=r'Invalid value "loss@rank0".*Names may only contain') as info:
        log_then_use_a_bad_name.distributed()
    assert 'mlflow.log_metric("loss@rank0", 1.0)' in str(info.value.__cause__)
    run_id = one_run_id(capsys.readouterr())
    run = store.run(run_id)
    assert run.info.status == "FAILED"
    assert metric_points(store, run_id, "loss") == [(step, step / 100) for step in range(100)]
    assert store.artifacts(run_id, "logs") == ["logs/rank-0.log", "logs/rank-1.log"]


@distributed(num_accelerators=2)
def log_and_change_a_launch_param() -> int:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(100):
        mlflow.log_metric("loss", rank + step / 1000, step=step)
    if rank == 0:
        mlflow.log_param("air_magic.timeout", "1")  # already logged by the launch, with another value
    return rank


def test_what_the_store_refuses_is_reported_and_the_run_still_ends(store: Store, capsys: Any) -> None:
    assert log_and_change_a_launch_param.distributed() == [0, 1]
    captured = capsys.readouterr()
    run_id = one_run_id(captured)
    run = store.run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["air_magic.timeout"] == "10800.0"
    assert len(store.all_ranks(run_id, "loss", 2)) == 200
    assert store.artifacts(run_id, "logs") == ["logs/rank-0.log", "logs/rank-1.log"]
    assert f"[air_magic] not everything the ranks logged reached MLflow run {run_id}: " in captured.err
    assert "Changing param values is not allowed" in captured.err


# -- tracking off ------------------------------------------------------------------------------


@distributed(num_accelerators=2, tracking=False)
def untracked() -> tuple[Any, ...]:
    import mlflow

    mlflow.log_metric("loss", 1.0, step=1)
    mlflow.log_metrics({"a": 1.0, "b": 2.0})
    mlflow.set_tag("t", "v")
    with open("note.txt", "w") as handle:
        handle.write("x")
    mlflow.log_artifact("note.txt")
    with mlflow.start_run() as run:
        mlflow.log_metric("loss", 2.0)
    return mlflow.log_param("p", 3), run.info.run_id, mlflow.active_run()


def test_tracking_off_creates_nothing_and_rank_calls_do_nothing(store: Store, capsys: Any, tmp_path: Any) -> None:
    db = store.uri[len("sqlite:///") :]
    assert not os.path.exists(db)
    assert untracked.distributed() == [(3, None, None), (3, None, None)]
    captured = capsys.readouterr()
    assert "[air_magic] tracking is off" in captured.err  # a status line, where there is no notebook
    assert run_ids_in(captured) == []
    assert untracked.last_launch.run_id is None
    assert not os.path.exists(db), "the sqlite store was created with tracking off"
    assert sorted(os.listdir(tmp_path)) == ["note.txt"]  # no mlruns/, no mlflow.db
