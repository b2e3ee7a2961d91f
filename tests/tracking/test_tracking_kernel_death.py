"""A kernel that dies mid-launch (SIGKILL, as the out-of-memory killer sends; a restart) leaves
its ranks' points on disk; the next kernel sends every one of them and marks the run KILLED.

Each test has its own notebook folder (its sqlite store) and its own state folder, both
shared by the kernel that dies and the one after it, as a user's are.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterator

import pytest
from harness import Kernel, rank_processes, wait_until
from tracking_support import Store, spool_files, spooled_points, sqlite_uri

pytestmark = pytest.mark.kernel

#: Logs a point every 5 ms until the kernel dies; says when the first 100 are written.
SLOW_CELL = """\
%%distributed -n 2 --async
import os, time, mlflow
rank = int(os.environ["RANK"])
for step in range(100000):
    mlflow.log_metric("slow", rank + step / 100000, step=step)
    if step == 100:
        open(f"logged-100-{rank}", "w").close()
    time.sleep(0.005)
"""


@pytest.fixture
def places(tmp_path: Any) -> Iterator[tuple[str, dict[str, str]]]:
    folder = tmp_path / "notebook"
    folder.mkdir()
    state = tmp_path / "state"
    yield str(folder), {"AIR_MAGIC_STATE_DIR": str(state)}


def start_slow_launch(kernel: Kernel) -> str:
    kernel.ok("%load_ext air_magic")
    res = kernel.run(SLOW_CELL, timeout=180)
    assert res.error is None, res.error_text
    # The run is made beside the ranks: a background launch's handle gets its id when it exists.
    kernel.ok("launch = _")
    assert wait_until(lambda: kernel.value("str(launch.run_id)") != "None", timeout=60)
    run_id = kernel.value("launch.run_id")
    markers = [os.path.join(kernel.workdir, f"logged-100-{rank}") for rank in (0, 1)]
    assert wait_until(lambda: all(os.path.exists(m) for m in markers), timeout=120), "the ranks never got going"
    time.sleep(1.0)  # more points, some sent by the writer, the last ones not yet
    return run_id


def killed_mid_launch(folder: str, env: dict[str, str]) -> tuple[Kernel, str]:
    """A kernel SIGKILLed (what the out-of-memory killer sends) while its ranks log; its run."""
    first = Kernel(folder, env)
    try:
        run_id = start_slow_launch(first)
    except BaseException:
        first.shutdown()
        raise
    os.kill(first.pid, signal.SIGKILL)
    first.forget()
    return first, run_id


def died_with_points_unsent(store: Store, run_id: str, state: str) -> int:
    """After the kernel died: its ranks went with it, and some points are on disk only."""
    assert wait_until(lambda: not rank_processes(), timeout=30), "ranks outlived their kernel"
    spooled = spooled_points(state, "slow")
    assert len(spool_files(state)) == 2
    run = store.run(run_id)
    assert run.info.status == "RUNNING"
    assert 200 < spooled
    assert len(store.all_ranks(run_id, "slow", 2)) < spooled, "everything was sent before the kill"
    return spooled


def test_a_kernel_killed_mid_launch_leaves_every_point_to_the_next_kernel(places: tuple[str, dict[str, str]]) -> None:
    folder, env = places
    store = Store(sqlite_uri(folder))
    first, run_id = killed_mid_launch(folder, env)
    try:
        spooled = died_with_points_unsent(store, run_id, env["AIR_MAGIC_STATE_DIR"])
    finally:
        first.shutdown()

    second = Kernel(folder, env)
    try:
        second.ok("%load_ext air_magic")
        # Its first launch looks for what dead kernels left, in the background.
        res = second.run("%%distributed -n 1\n7", timeout=180)
        assert res.error is None, res.error_text
        assert wait_until(lambda: store.run(run_id).info.status == "KILLED", timeout=60)
        assert len(store.all_ranks(run_id, "slow", 2)) == spooled
        assert store.run(run_id).info.status == "KILLED"
        # The recovery deletes the spool once the run's status is stored: a moment after.
        tracking = os.path.join(env["AIR_MAGIC_STATE_DIR"], "tracking")
        wait_until(lambda: not spool_files(env["AIR_MAGIC_STATE_DIR"]) and not os.listdir(tracking), timeout=30)
        assert spool_files(env["AIR_MAGIC_STATE_DIR"]) == []
        assert os.listdir(tracking) == []
    finally:
        second.shutdown()


def test_a_kernel_restarted_mid_launch_leaves_every_point_to_upload_pending(places: tuple[str, dict[str, str]]) -> None:
    folder, env = places
    store = Store(sqlite_uri(folder))
    kernel = Kernel(folder, env)
    try:
        run_id = start_slow_launch(kernel)
        kernel.km.restart_kernel(now=True)
        kernel.refresh_pid()
        spooled = died_with_points_unsent(store, run_id, env["AIR_MAGIC_STATE_DIR"])
        sent_before = len(store.all_ranks(run_id, "slow", 2))
        kernel.kc.wait_for_ready(timeout=60)
        res = kernel.ok("import air_magic.tracking\nresults = air_magic.tracking.upload_pending()", timeout=120)
        recovered = [line for line in res.stderr.splitlines() if line.startswith("[air_magic]")]
        # The line names what launched it and the store (issue 33: "without naming the store or the notebook")
        assert recovered == [
            f"[air_magic] recovered what earlier launches left on disk: MLflow run {run_id} "
            f"(of Cell In[2] in a notebook in {kernel.workdir}, {spooled - sent_before} points sent, marked KILLED) "
            f"in MLflow store {store.uri}."
        ]
        assert kernel.value("[(r.outcome, r.run_id) for r in results]") == [("sent", run_id)]
        assert store.run(run_id).info.status == "KILLED"
        assert len(store.all_ranks(run_id, "slow", 2)) == spooled
        assert spool_files(env["AIR_MAGIC_STATE_DIR"]) == []
    finally:
        kernel.shutdown()


def test_a_kernel_started_at_once_after_a_kill_sends_every_point_by_itself(places: tuple[str, dict[str, str]]) -> None:
    folder, env = places
    store = Store(sqlite_uri(folder))
    first, run_id = killed_mid_launch(folder, env)
    try:
        # At once, with no launch of its own: its %load_ext finds the orphan while the dead
        # kernel's ranks may still be on their way out.
        second = Kernel(folder, env)
    finally:
        first.shutdown()
    try:
        second.ok("%load_ext air_magic")
        began = time.monotonic()
        assert wait_until(lambda: store.run(run_id).info.status == "KILLED", timeout=60)
        took = time.monotonic() - began
        by_rank = store.by_rank(run_id, "slow", 2)
        for points in by_rank.values():  # every point each rank logged before it died, in order
            steps = [step for step, _ in points]
            assert steps == list(range(len(steps))) and len(steps) > 100, steps[-5:]
        assert spool_files(env["AIR_MAGIC_STATE_DIR"]) == []
        assert took < 30, took
    finally:
        second.shutdown()


#: 20,000 points in a moment, then the values come back (before the store exists: see below).
QUICK_CELL = """\
%%distributed -n 2
import os, mlflow
for step in range(10000):
    mlflow.log_metric("quick", step, step=step)
os.environ["RANK"]
"""


def test_a_kernel_killed_before_its_store_was_made_leaves_the_points_to_a_store_made_for_them(
    places: tuple[str, dict[str, str]],
) -> None:
    folder, env = places
    store = Store(sqlite_uri(folder))
    path = os.path.join(folder, "mlflow.db")
    # The kernel's import of MLflow (what its writer makes the store with) takes a minute: the
    # ranks log and end, and the kernel dies, before mlflow.db exists.
    first = Kernel(folder, {**env, "AIR_MAGIC_TEST_SLOW_MLFLOW": "60"})
    try:
        first.ok("%load_ext air_magic")
        res = first.run(QUICK_CELL, timeout=180)
        assert res.error is None, res.error_text
        assert res.result == "['0', '1']"
        assert not os.path.exists(path)
        os.kill(first.pid, signal.SIGKILL)
        first.forget()
        assert wait_until(lambda: not rank_processes(), timeout=30)
        assert spooled_points(env["AIR_MAGIC_STATE_DIR"], "quick") == 20000
    finally:
        first.shutdown()
    second = Kernel(folder, env)
    try:
        second.ok("%load_ext air_magic")  # looks for orphans in the background
        res = second.ok("import air_magic.tracking\nresults = air_magic.tracking.upload_pending()", timeout=120)
        assert os.path.exists(path)  # made for them, not taken for a store the user deleted
        [run] = store.runs()
        assert run.info.status == "FINISHED"  # the launch had ended: its kernel died while storing it
        assert len(store.all_ranks(run.info.run_id, "quick", 2)) == 20000
        assert "dropped" not in res.stderr
        assert spool_files(env["AIR_MAGIC_STATE_DIR"]) == []
    finally:
        second.shutdown()
