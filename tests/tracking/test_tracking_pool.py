"""A tracked pool: one MLflow run for the pool (its parent run) and a child run of it for
each call that logs something, named by the call, ended with the call's outcome; a call
that logs nothing makes no run."""

from __future__ import annotations

from typing import Any

import pytest
from tracking_support import Store

from air_magic import Pool

pytestmark = pytest.mark.process

PARENT = "mlflow.parentRunId"


def log_step(step: int) -> int:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    mlflow.log_metric("loss", rank + 1 / (step + 1), step=step)
    mlflow.log_param("step", step)
    return step


def nothing() -> int:
    return 1


def logs_then_fails() -> None:
    import os

    import mlflow

    mlflow.log_metric("before", 1.0)
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails")


def test_each_call_that_logs_has_a_child_run_of_the_pool_s_run(store: Store, capsys: Any) -> None:
    pool = Pool(2, "CPU")
    try:
        for step in range(2):
            assert pool.run(log_step, step) == [step, step]
        assert pool.run(nothing) == [1, 1]  # logs nothing: no run
        pool.push(x=1)
        with pytest.raises(ValueError, match="rank 1 fails"):
            pool.run(logs_then_fails)
        launch = pool._engine.launch
        assert launch is not None
    finally:
        pool.close()
    assert launch.done()
    runs = store.runs()
    [parent] = [run for run in runs if PARENT not in run.data.tags]
    assert parent.info.run_id == launch.run_id and parent.info.status == "FINISHED"
    assert "loss" not in parent.data.metrics  # every point is a call's
    children = sorted(
        (run for run in runs if PARENT in run.data.tags), key=lambda run: int(run.data.tags["air_magic.call"])
    )
    assert [run.data.tags[PARENT] for run in children] == [parent.info.run_id] * 3
    assert [run.info.run_name for run in children] == ["log_step", "log_step", "logs_then_fails"]
    assert [run.info.status for run in children] == ["FINISHED", "FINISHED", "FAILED"]
    for step, child in enumerate(children[:2]):
        assert store.by_rank(child.info.run_id, "loss", 2) == {rank: [(step, rank + 1 / (step + 1))] for rank in (0, 1)}
        assert child.data.params["step"] == str(step)
    assert store.by_rank(children[2].info.run_id, "before", 2) == {0: [(0, 1.0)], 1: [(0, 1.0)]}
