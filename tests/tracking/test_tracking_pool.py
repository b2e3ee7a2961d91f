"""A tracked pool: one MLflow run for the pool's life, holding every call's points, ended
(FINISHED) when the pool closes."""

from __future__ import annotations

from typing import Any

import pytest
from tracking_support import Store

from air_magic import Pool

pytestmark = pytest.mark.process


def log_step(step: int) -> int:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    mlflow.log_metric("loss", rank + 1 / (step + 1), step=step)
    return step


def test_every_call_s_points_go_to_the_pool_s_one_run(store: Store, capsys: Any) -> None:
    pool = Pool(2, "CPU")
    try:
        for step in range(3):
            assert pool.run(log_step, step) == [step, step]
        launch = pool._engine.launch
        assert launch is not None
    finally:
        pool.close()
    assert launch.done()
    run_id = launch.run_id  # made beside the ranks: known once MLflow has made it, at the latest at the end
    assert run_id is not None
    [run] = store.runs()
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert store.by_rank(run_id, "loss", 2) == {
        rank: [(step, rank + 1 / (step + 1)) for step in range(3)] for rank in (0, 1)
    }
