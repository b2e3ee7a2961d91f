"""MLflow tracking from a real kernel: ``%%distributed`` and ``@distributed`` cells, the kernel's
own MLflow state (active run, ``mlflow.set_experiment``), interrupts, ``--no-tracking``, and two
kernels sharing one fresh sqlite store.

Each kernel runs in its own temporary folder with ``MLFLOW_TRACKING_URI`` naming a sqlite
file there (see ``harness.Kernel``); the test reads that store back with ``MlflowClient``.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import time
from typing import Any, Iterator

import pytest
from harness import Kernel
from tracking_support import Store, one_run_id, run_ids_in, shown, sqlite_uri, stored, stored_run

pytestmark = pytest.mark.kernel

#: Shown as the notebook's name to the kernel (as Jupyter does with JPY_SESSION_NAME).
NOTEBOOK = "/home/user/work/train-notebook.ipynb"

LOGGING_CELL = """\
import os
import mlflow
rank = int(os.environ["RANK"])
for step in range(3):
    mlflow.log_metric("loss", rank + step / 10, step=step)
rank"""


@pytest.fixture(scope="module")
def tk(kernel_factory: Any) -> Iterator[Kernel]:
    """A kernel with tracking on (the default), as a notebook named train-notebook."""
    kernel = kernel_factory(extra_env={"JPY_SESSION_NAME": NOTEBOOK}, tracking=True)
    # The kernel creates its store (in its own folder), not the test reading it back.
    kernel.ok("from mlflow import MlflowClient\nMlflowClient().search_experiments()")
    yield kernel
    kernel.shutdown()


def store_of(kernel: Kernel) -> Store:
    return Store(sqlite_uri(kernel.workdir))


def out_value(res: Any) -> Any:
    assert res.error is None, res.error_text
    assert res.result is not None, f"no Out; stdout={res.stdout!r}"
    return ast.literal_eval(res.result)


def loss_points(store: Store, run_id: str) -> dict[int, list[tuple[int, float]]]:
    return store.by_rank(run_id, "loss", 2)


#: Each rank's curve: rank 0's under "loss", rank 1's under "rank1/loss".
EXPECTED_LOSS = {rank: [(step, rank + step / 10) for step in range(3)] for rank in (0, 1)}


def test_cell_launch_is_one_finished_run_in_the_notebooks_experiment(tk: Kernel) -> None:
    store = store_of(tk)
    before = {r.info.run_id for r in store.runs()}
    res = stored_run(tk, f"%%distributed -n 2 --timeout 600\n{LOGGING_CELL}", timeout=180)
    assert out_value(res) == [0, 1]
    run_id = one_run_id(res)
    # Said once, in the launch's summary (updated in place once the run is stored), with the
    # command that opens its store: not also in the cell's stream.
    assert run_id not in res.stdout + res.stderr
    [line] = [line for line in shown(res).splitlines() if run_id in line]
    assert re.match(rf"\[air_magic\]  MLflow run \S+ \({run_id}\); open it with: ", line), line
    command = shlex.split(line.split("; open it with: ", 1)[1])
    assert command[1:] == ["-m", "mlflow", "ui", "--backend-store-uri", store.uri], line
    assert os.path.isabs(command[0]) and os.access(command[0], os.X_OK), command

    assert {r.info.run_id for r in store.runs()} == before | {run_id}
    run = store.run(run_id)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["air_magic.num_accelerators"] == "2"
    assert params["air_magic.accelerator_type"] == "CPU"
    assert params["air_magic.timeout"] == "600.0"
    assert params["air_magic.code"] == f"cell Cell In[{res.execution_count}]"
    assert store.experiment_name(run_id) == "train-notebook"
    assert loss_points(store, run_id) == EXPECTED_LOSS
    assert store.artifacts(run_id, "logs") == ["logs/rank-0.log", "logs/rank-1.log"]


def test_decorated_function_in_the_kernel_logs_to_its_run(tk: Kernel) -> None:
    tk.ok(
        "from air_magic import distributed\n"
        "@distributed(num_accelerators=2, timeout=300)\n"
        "def train(lr):\n"
        "    import mlflow\n"
        "    mlflow.log_param('lr', lr)\n"
        "    return lr\n"
    )
    res = stored_run(tk, "train.distributed(0.25)", timeout=180)
    assert out_value(res) == [0.25, 0.25]
    run_id = one_run_id(res)
    assert tk.value("train.last_launch.run_id") == run_id
    run = store_of(tk).run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.25"
    assert run.data.params["air_magic.code"] == "function train"
    assert run.data.params["air_magic.timeout"] == "300.0"


def test_launch_nests_under_the_kernels_active_run(tk: Kernel) -> None:
    store = store_of(tk)
    tk.ok("import mlflow\nparent = mlflow.start_run(run_name='notebook-run')")
    try:
        parent_id = tk.value("parent.info.run_id")
        res = stored_run(tk, f"%%distributed -n 2\n{LOGGING_CELL}", timeout=180)
        assert out_value(res) == [0, 1]
        run_id = one_run_id(res)
        child = store.run(run_id)
        assert child.data.tags["mlflow.parentRunId"] == parent_id
        assert child.info.experiment_id == store.run(parent_id).info.experiment_id
        assert child.info.status == "FINISHED"
        assert loss_points(store, run_id) == EXPECTED_LOSS
        # The notebook's run is untouched and still the active one.
        assert tk.value("mlflow.active_run().info.run_id") == parent_id
        assert store.run(parent_id).info.status == "RUNNING"
    finally:
        tk.ok("mlflow.end_run()")
    assert store.run(parent_id).info.status == "FINISHED"


def test_interrupt_marks_the_run_killed_and_keeps_what_was_logged(tk: Kernel) -> None:
    markers = [os.path.join(tk.workdir, f"interrupt-ready-{r}") for r in (0, 1)]
    msg_id = tk.execute(
        "%%distributed -n 2\n"
        "import os, time, mlflow\n"
        "rank = int(os.environ['RANK'])\n"
        "for step in range(20):\n"
        "    mlflow.log_metric('before_interrupt', step + rank / 10, step=step)\n"
        "open(f'interrupt-ready-{rank}', 'w').close()\n"
        "time.sleep(120)\n"
    )
    deadline = time.monotonic() + 120
    while not all(os.path.exists(m) for m in markers):
        assert time.monotonic() < deadline, "the ranks never got going"
        time.sleep(0.1)
    tk.km.interrupt_kernel()
    res = stored(tk, msg_id, tk.collect(msg_id, timeout=60))
    assert res.error is not None and res.error["ename"] == "KeyboardInterrupt", res.error_text
    run_id = one_run_id(res)
    store = store_of(tk)
    assert store.run(run_id).info.status == "KILLED"
    points = store.by_rank(run_id, "before_interrupt", 2)
    assert points == {rank: [(step, step + rank / 10) for step in range(20)] for rank in (0, 1)}


def test_no_tracking_creates_no_run_and_rank_calls_do_nothing(tk: Kernel) -> None:
    store = store_of(tk)
    before = sorted(r.info.run_id for r in store.runs())
    res = tk.run(
        "%%distributed -n 2 --no-tracking\n"
        "import mlflow\n"
        "mlflow.log_metric('loss', 1.0, step=0)\n"
        "mlflow.log_metrics({'a': 1.0})\n"
        "mlflow.log_param('p', 1)\n"
        "mlflow.set_tag('t', 'v')\n"
        "(mlflow.active_run(), mlflow.start_run().info.run_id)",
        timeout=180,
    )
    assert out_value(res) == [(None, None), (None, None)]
    assert "[air_magic] tracking is off" in res.stdout
    assert run_ids_in(res) == []
    assert sorted(r.info.run_id for r in store.runs()) == before


def test_experiment_choice_kernel_then_environment_flag_wins(kernel_factory: Any) -> None:
    kernel = kernel_factory(
        extra_env={"JPY_SESSION_NAME": NOTEBOOK, "MLFLOW_EXPERIMENT_NAME": "from-environment"}, tracking=True
    )
    store = store_of(kernel)
    kernel.ok("from mlflow import MlflowClient\nMlflowClient().search_experiments()")
    try:

        def launch(flags: str = "") -> str:
            res = stored_run(kernel, f"%%distributed -n 2 {flags}\n{LOGGING_CELL}", timeout=180)
            assert out_value(res) == [0, 1]
            return one_run_id(res)

        # MLFLOW_EXPERIMENT_NAME beats the notebook's name ...
        assert store.experiment_name(launch()) == "from-environment"
        # ... and --experiment beats it; --run-name names the run.
        flagged = launch("--experiment from-flag --run-name flagged-run")
        assert store.experiment_name(flagged) == "from-flag"
        assert store.run(flagged).info.run_name == "flagged-run"
        # mlflow.set_experiment in the notebook beats the environment ...
        kernel.ok("import mlflow\nmlflow.set_experiment('exp-a')")
        in_a = launch()
        assert store.experiment_name(in_a) == "exp-a"
        assert loss_points(store, in_a) == EXPECTED_LOSS
        # ... and --experiment beats mlflow.set_experiment.
        assert store.experiment_name(launch("--experiment from-flag")) == "from-flag"
        assert store.experiment_name(launch()) == "exp-a"
    finally:
        kernel.shutdown()


def test_two_kernels_first_launches_at_once_into_a_fresh_store(tmp_path: Any) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    uri = sqlite_uri(folder)
    kernels = [Kernel(str(folder), {"MLFLOW_TRACKING_URI": uri}) for _ in range(2)]
    try:
        # %load_ext opens (here: creates) the store in the background: both kernels at once.
        assert not os.path.exists(folder / "mlflow.db")
        for res in [
            kernel.collect(msg_id)
            for kernel, msg_id in [(kernel, kernel.execute("%load_ext air_magic")) for kernel in kernels]
        ]:
            assert not res.error, res.error
        for kernel in kernels:
            kernel.ok(
                "import time\n"
                "import mlflow\n"
                "from air_magic import distributed\n"
                "@distributed(num_accelerators=2)\n"
                "def train():\n"
                "    import os, mlflow\n"
                "    mlflow.log_metric('loss', float(os.environ['RANK']))\n"
                "    return os.getpid()\n"
            )
            # Start the helper, so that the launches below start together.
            assert out_value(kernel.run("%%distributed -n 2 --no-tracking\n1", timeout=180)) == [1, 1]
        start_at = time.time() + 2.0
        cell = f"time.sleep(max(0.0, {start_at!r} - time.time()))\nlen(train.distributed())"
        msg_ids = [kernel.execute(cell) for kernel in kernels]
        results = [kernel.collect(msg_id, timeout=240) for kernel, msg_id in zip(kernels, msg_ids)]
        results = [stored(kernel, msg_id, res) for kernel, msg_id, res in zip(kernels, msg_ids, results)]
        run_ids = []
        for res in results:
            assert out_value(res) == 2
            assert "is off for this launch" not in res.stderr, res.stderr
            run_ids.append(one_run_id(res))
        assert run_ids[0] != run_ids[1]
        store = Store(uri)
        assert sorted(r.info.run_id for r in store.runs()) == sorted(run_ids)
        for run_id in run_ids:
            assert store.run(run_id).info.status == "FINISHED"
            assert store.by_rank(run_id, "loss", 2) == {0: [(0, 0.0)], 1: [(0, 1.0)]}
    finally:
        for kernel in kernels:
            kernel.shutdown()
