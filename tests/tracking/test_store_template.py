"""A new sqlite store is a copy of the empty store MLflow made once (per MLflow version and
schema), kept in the user's private cache: MLflow opens it as its own, its ``Default``
experiment points at the new folder's ``mlruns``, and no migration runs again."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from air_magic.tracking import store as _store

pytestmark = pytest.mark.process


def _rows(path: Path, table: str) -> list[tuple]:
    db = sqlite3.connect(path)
    try:
        return db.execute(f"SELECT * FROM {table}").fetchall()
    finally:
        db.close()


def _schema(path: Path) -> list[tuple]:
    db = sqlite3.connect(path)
    try:
        return sorted(db.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'").fetchall())
    finally:
        db.close()


def test_a_new_store_is_a_copy_of_the_template_that_mlflow_takes_as_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()

    monkeypatch.chdir(first)
    _store.make_client(f"sqlite:///{first / 'mlflow.db'}")  # the first use: MLflow migrates, once
    [template] = (tmp_path / "cache" / "air_magic" / "stores").iterdir()
    assert template.name.startswith("mlflow-") and template.name.endswith(".db")
    assert oct(template.parent.stat().st_mode & 0o777) == "0o700"

    monkeypatch.chdir(second)
    migrations: list[str] = []
    monkeypatch.setattr(_store, "_migrate", lambda path: migrations.append(path))
    client = _store.make_client(f"sqlite:///{second / 'mlflow.db'}")
    assert migrations == []  # a copy: MLflow's migrations did not run again
    assert _schema(second / "mlflow.db") == _schema(first / "mlflow.db")
    assert _rows(second / "mlflow.db", "alembic_version") == _rows(first / "mlflow.db", "alembic_version")
    [(experiment_id, name, location, *_)] = _rows(second / "mlflow.db", "experiments")
    assert (experiment_id, name, location) == (0, "Default", str(second / "mlruns" / "0"))
    # MLflow uses it as it uses its own: a run in the Default experiment, logged and read back.
    run = client.create_run("0")
    client.log_metric(run.info.run_id, "loss", 0.5)
    assert client.get_run(run.info.run_id).data.metrics == {"loss": 0.5}
    assert client.get_experiment("0").artifact_location == str(second / "mlruns" / "0")
    assert os.stat(second / "mlflow.db").st_uid == os.getuid()


def test_where_no_template_can_be_made_a_store_is_migrated_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)

    def moved() -> str:
        raise ImportError("MLflow's alembic layout moved")

    monkeypatch.setattr(_store, "_schema_head", moved)
    assert _store.store_template() is None
    client = _store.make_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_experiment("0").artifact_location == str(tmp_path / "mlruns" / "0")
    assert not (tmp_path / "cache" / "air_magic" / "stores").exists() or not any(
        (tmp_path / "cache" / "air_magic" / "stores").iterdir()
    )
