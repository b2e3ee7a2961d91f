"""Helpers of the MLflow tracking tests: reading a store back, a tracking server's REST API."""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import psutil

#: The line that says a launch's run: the summary's ``[air_magic]  MLflow run NAME (ID); ...``,
#: or, for a launch without a panel, ``[air_magic] MLflow run 'NAME' (id ID, ...``.
RUN_LINE = re.compile(r"^\[air_magic\] +MLflow run [^\n(]*\((?:id )?([0-9a-f]{32})[,)]", re.M)


def shown(output: Any) -> str:
    """What a launch showed: a kernel cell's streams and the last state of each of its
    displays (a summary updated in place counts once), or a process's stdout and stderr
    (pytest's captured output); a string as it is."""
    if isinstance(output, str):
        return output
    if hasattr(output, "displays"):
        last: dict[Any, str] = {}
        for number, (_, data, display_id) in enumerate(output.displays):
            last[display_id if display_id is not None else number] = data.get("text/plain", "")
        return "\n".join([output.stdout, output.stderr, *last.values()])
    return f"{output.out}\n{output.err}"


def rank_key(rank: int, key: str) -> str:
    """Where rank ``rank``'s points of metric ``key`` are: rank 0's under ``key``, the others'
    under ``rank<r>/<key>`` (the documented naming)."""
    return key if rank == 0 else f"rank{rank}/{key}"


def run_ids_in(output: Any) -> list[str]:
    return RUN_LINE.findall(shown(output))


def one_run_id(output: Any) -> str:
    """The id of the one run said in ``output`` (see :func:`shown`)."""
    ids = run_ids_in(output)
    assert len(ids) == 1, f"expected one '[air_magic] MLflow run' line, got {ids} in:\n{shown(output)}"
    return ids[0]


@dataclass
class Store:
    """A tracking store under test, read back with MLflow's own client."""

    uri: str

    @property
    def client(self) -> Any:
        # Made on first use: creating a client for a sqlite URI creates the database.
        from mlflow import MlflowClient

        # A launch of this process stores its last points after its values came back: what
        # the store holds is read once that is over (what shows meanwhile is tested apart).
        writer = sys.modules.get("air_magic.tracking.writer")
        if writer is not None:
            assert writer.flush(120), "the launches' points were not stored in 120 s"

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

    def by_rank(self, run_id: str, key: str, ranks: int) -> dict[int, list[tuple[int, float]]]:
        """Each rank's points of metric ``key`` as (step, value), sorted."""
        return {
            rank: sorted((m.step, m.value) for m in self.history(run_id, rank_key(rank, key))) for rank in range(ranks)
        }

    def all_ranks(self, run_id: str, key: str, ranks: int) -> list[Any]:
        """The points of metric ``key`` of every rank (each under its own name)."""
        return [m for rank in range(ranks) for m in self.history(run_id, rank_key(rank, key))]

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

    def stop(self) -> None:
        """Kill the server (its workers first), as a crash or an operator would."""
        kill_tree(self.proc)


class ServerDidNotStart(Exception):
    pass


def start_mlflow_server(root: str, port: int, timeout: float = 180) -> Server:
    """``mlflow server`` on 127.0.0.1:``port``, its store and artifacts in ``root``; waits
    until it answers ``/health``.  Started again on the same folder and port, it is the
    same server come back."""
    log_path = os.path.join(root, "server.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    # Without its job runner: the tests use none of its jobs, and its store is a folder in
    # /dev/shm the server makes at each start and never removes.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                sqlite_uri(root),
                "--artifacts-destination",
                os.path.join(root, "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}", port, proc, log_path)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerDidNotStart(f"mlflow server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(f"{server.uri}/health", timeout=5) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise ServerDidNotStart(
                f"mlflow server did not answer on port {port} in {timeout:g} s:\n{server.log_tail()}"
            )
        time.sleep(0.5)


# -- the spool ------------------------------------------------------------------------------------


def spool_files(state_dir: str) -> list[str]:
    """Every rank file of every launch spooled under ``state_dir``."""
    return sorted(glob.glob(os.path.join(state_dir, "tracking", "*", "tracking-*.tsv")))


def spooled_points(state_dir: str, key: str) -> int:
    """How many points of metric ``key`` the ranks wrote to the spool."""
    count = 0
    for path in spool_files(state_dir):
        with open(path, "rb") as handle:
            count += sum(1 for line in handle if line.startswith(f"m\t{key}\t".encode()))
    return count


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


# -- a kernel's launches, once their MLflow storing is over ---------------------------------------


def stored(kernel: Any, msg_id: str, res: Any, timeout: float = 120.0) -> Any:
    """``res``, the result of the kernel's cell ``msg_id``, once the kernel has stored its
    launches' last points (``air_magic.tracking.flush()`` in a next cell): what the launch's
    cell was sent meanwhile (the run's lines, an updated summary) is added to ``res``.  A
    launch's values come back before its last points are stored (what shows meanwhile is
    tested in test_tracking_background.py); these tests read what things end with."""
    flush = "import air_magic.tracking\nassert air_magic.tracking.flush(%r)" % timeout
    after = kernel.collect(kernel.execute(flush), timeout=timeout + 60, earlier={msg_id: res})
    assert after.error is None, after.error_text
    return res


def stored_run(kernel: Any, code: str, timeout: float = 60.0) -> Any:
    """Run a cell, then wait for its launches' MLflow storing (see :func:`stored`)."""
    msg_id = kernel.execute(code)
    return stored(kernel, msg_id, kernel.collect(msg_id, timeout=timeout))
