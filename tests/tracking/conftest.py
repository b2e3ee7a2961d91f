"""Fixtures of the MLflow tracking tests: private sqlite stores and a real ``mlflow server``.

Every store lives in a temporary folder.  The process tests point this pytest
process at it (``MLFLOW_TRACKING_URI`` and the working directory, which the
ranks inherit); the kernel tests start kernels whose environment names it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest

from tracking_support import Server, Store, free_port, kill_tree, sqlite_uri

#: Environment that would steer MLflow away from the store under test.
_MLFLOW_VARIABLES = ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")


@pytest.fixture(autouse=True)
def outside_the_repository(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run each test from its temp folder: a sqlite store that this process creates puts
    its default experiment's artifacts (``mlruns/``) in the working directory."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def store(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """A fresh sqlite store for launches from this process; ranks start in ``tmp_path``."""
    import mlflow
    from mlflow.tracking import fluent

    monkeypatch.chdir(tmp_path)  # the ranks' working directory, and where mlruns/ goes
    uri = sqlite_uri(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for name in _MLFLOW_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    while mlflow.active_run() is not None:
        mlflow.end_run()
    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    yield Store(uri)
    while mlflow.active_run() is not None:
        mlflow.end_run()


# -- a real tracking server ------------------------------------------------------------------


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``mlflow server`` on 127.0.0.1 at a free port, its store and artifacts in a temp folder."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log_path = str(root / "server.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "mlflow", "server",
                "--backend-store-uri", sqlite_uri(root),
                "--artifacts-destination", str(root / "artifacts"),
                "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            ],
            cwd=str(root), env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}", port, proc, log_path)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(f"{server.uri}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not answer on port {port} in 180 s:\n{server.log_tail()}")
            time.sleep(0.5)
        yield server
    finally:
        kill_tree(proc)
