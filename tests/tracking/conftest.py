"""Fixtures of the MLflow tracking tests: private sqlite stores and a real ``mlflow server``.

Every store lives in a temporary folder.  The process tests point this pytest
process at it (``MLFLOW_TRACKING_URI`` and the working directory, which the
ranks inherit); the kernel tests start kernels whose environment names it.
The spools that outlive a kernel go to a temporary state folder too
(``AIR_MAGIC_STATE_DIR``), never to the user's own.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
from tracking_support import Server, ServerDidNotStart, Store, free_port, sqlite_uri, start_mlflow_server

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
    try:
        server = start_mlflow_server(str(root), free_port())
    except ServerDidNotStart as exc:
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def capsys(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    """pytest's ``capsys``, whose ``readouterr()`` first waits for the launches' MLflow
    storing to be over (``air_magic.tracking.flush()``): a launch's values come back before
    its last points are stored, and these tests read what the store and the lines end with.
    What is shown while storing goes on is tested in test_tracking_background.py."""
    read = capsys.readouterr

    def readouterr() -> Any:
        from air_magic import tracking

        assert tracking.flush(120), "the launches' points were not stored in 120 s"
        return read()

    capsys.readouterr = readouterr  # type: ignore[method-assign]
    yield capsys
