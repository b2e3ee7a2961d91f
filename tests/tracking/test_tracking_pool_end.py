"""A notebook that ends with its pool open (most do): the pool's MLflow run ends FINISHED with
every point stored, as pool.close() ends it; and ``air_magic.tracking.flush()`` during a pool's
life returns True only once what its cells logged is in the store."""

from __future__ import annotations

import os
from typing import Any

import pytest
from harness import Kernel, rank_processes, wait_until
from tracking_support import Store, sqlite_uri

pytestmark = pytest.mark.kernel

LOGS = """\
%%distributed --pool
import mlflow
for step in range({n}):
    mlflow.log_metric("pooled", step, step=step)
"""

PARENT = "mlflow.parentRunId"


@pytest.fixture
def places(tmp_path: Any) -> tuple[str, dict[str, str]]:
    folder = tmp_path / "notebook"
    folder.mkdir()
    return str(folder), {"AIR_MAGIC_STATE_DIR": str(tmp_path / "state")}


@pytest.mark.parametrize("how", ["shutdown", "restart"])
def test_a_kernel_that_ends_with_its_pool_open_leaves_a_finished_run_with_every_point(
    places: tuple[str, dict[str, str]], how: str
) -> None:
    folder, env = places
    store = Store(sqlite_uri(folder))
    kernel = Kernel(folder, env)
    try:
        kernel.ok("%load_ext air_magic")
        kernel.ok("%distributed_pool -n 2", timeout=180)
        kernel.ok(LOGS.format(n=3000), timeout=120)
        engine = "__import__('air_magic').Pool.current()._engine"
        assert wait_until(lambda: kernel.value(f"str({engine}.launch.run_id)") != "None", timeout=60)
        run_id = kernel.value(f"{engine}.launch.run_id")
        if how == "shutdown":
            kernel.km.shutdown_kernel(now=False)
            kernel.forget()
        else:
            kernel.km.restart_kernel(now=False)
            kernel.refresh_pid()
        assert wait_until(lambda: not rank_processes(), timeout=60)
        parent = store.run(run_id)
        assert parent.info.status == "FINISHED", parent.info.status
        [child] = [r for r in store.runs() if r.data.tags.get(PARENT) == run_id]
        assert child.info.status == "FINISHED"
        assert len(store.all_ranks(child.info.run_id, "pooled", 2)) == 6000
        assert not os.listdir(os.path.join(env["AIR_MAGIC_STATE_DIR"], "tracking"))  # nothing left to recover
    finally:
        kernel.shutdown()


def test_flush_during_a_pool_s_life_returns_once_its_cells_points_are_stored(
    places: tuple[str, dict[str, str]],
) -> None:
    folder, env = places
    store = Store(sqlite_uri(folder))
    kernel = Kernel(folder, env)
    try:
        kernel.ok("%load_ext air_magic")
        kernel.ok("%distributed_pool -n 2", timeout=180)
        for n in (4000, 8000):
            kernel.ok(LOGS.format(n=n), timeout=120)
            assert kernel.value("__import__('air_magic').tracking.flush(120)", timeout=180) is True
            children = [r for r in store.runs() if PARENT in r.data.tags]
            stored = sum(len(store.all_ranks(c.info.run_id, "pooled", 2)) for c in children)
            assert stored == (8000 if n == 4000 else 24000), stored  # every point, at once
    finally:
        kernel.shutdown()
