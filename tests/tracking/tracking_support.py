"""Helpers of the MLflow tracking tests: reading a store back, a tracking server's REST API."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import psutil

#: The line air_magic prints when a launch starts its run.
RUN_LINE = re.compile(r"\[air_magic\] MLflow run ([0-9a-f]{32})")


def run_ids_in(text: str) -> list[str]:
    return RUN_LINE.findall(text)


def one_run_id(text: str) -> str:
    """The id of the one run announced in ``text``."""
    ids = run_ids_in(text)
    assert len(ids) == 1, f"expected one '[air_magic] MLflow run' line, got {ids} in:\n{text}"
    return ids[0]


@dataclass
class Store:
    """A tracking store under test, read back with MLflow's own client."""

    uri: str

    @property
    def client(self) -> Any:
        # Made on first use: creating a client for a sqlite URI creates the database.
        from mlflow import MlflowClient

        return MlflowClient(self.uri)

    def runs(self) -> list[Any]:
        client = self.client
        ids = [e.experiment_id for e in client.search_experiments()]
        return list(client.search_runs(ids, max_results=1000)) if ids else []

    def run(self, run_id: str) -> Any:
        return self.client.get_run(run_id)

    def experiment_name(self, run_id: str) -> str:
        client = self.client
        return str(client.get_experiment(client.get_run(run_id).info.experiment_id).name)

    def history(self, run_id: str, key: str) -> list[Any]:
        return list(self.client.get_metric_history(run_id, key))

    def artifacts(self, run_id: str, path: str | None = None) -> list[str]:
        return sorted(a.path for a in self.client.list_artifacts(run_id, path))

    def read_artifact(self, run_id: str, path: str, dst: str) -> str:
        local = self.client.download_artifacts(run_id, path, dst)
        with open(local, encoding="utf-8", errors="replace") as handle:
            return handle.read()


def sqlite_uri(folder: Any) -> str:
    return f"sqlite:///{os.path.join(str(folder), 'mlflow.db')}"


# -- a real tracking server ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    uri: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: str

    def get(self, path: str, **query: str) -> dict[str, Any]:
        url = f"{self.uri}{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.status == 200, url
            return json.loads(response.read().decode())  # type: ignore[no-any-return]

    def log_tail(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as handle:
                return handle.read()[-4000:]
        except OSError:
            return ""


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    try:
        root = psutil.Process(proc.pid)
        family = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        family = []
    for member in reversed(family):  # deepest first
        try:
            member.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=10)
    for member in alive:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    proc.wait(10)
