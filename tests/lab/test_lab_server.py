"""The server extension's migrate endpoint never holds the Jupyter server: the fixer runs
in a process of its own while the server answers everything else; a request too large, or
a migration that takes too long, gets a clear 413 or 408 that names the terminal command."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "panel"))
from test_panel_browser import serve_jupyter  # noqa: E402

from air_magic.lint import server  # noqa: E402

pytestmark = pytest.mark.process


def _cell(lines: int) -> str:
    return "from serverless_gpu import distributed\n" + "".join(f"x{i} = {i} + 1\n" for i in range(lines - 1))


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with serve_jupyter(tmp_path_factory.mktemp("server"), {}) as running:
        yield running


def _call(jupyter: dict[str, Any], path: str, body: Any = None, timeout: float = 120) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{jupyter['base']}/{path}",
        data=data,
        method="POST" if data is not None else "GET",
        headers={"Authorization": f"token {jupyter['token']}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def test_the_server_answers_other_requests_while_a_notebook_is_migrated(jupyter: dict[str, Any]) -> None:
    answer: dict[str, Any] = {}

    def migrate() -> None:
        answer["reply"] = _call(jupyter, server.ROUTE, {"sources": [_cell(2000)], "path": "big.ipynb"})

    worker = threading.Thread(target=migrate)
    worker.start()
    probes = []
    while worker.is_alive() and len(probes) < 200:
        began = time.monotonic()
        status, _ = _call(jupyter, "api/status", timeout=10)
        probes.append((status, time.monotonic() - began))
        time.sleep(0.2)
    worker.join(120)
    status, body = answer["reply"]
    assert status == 200 and "serverless_gpu" not in body["sources"][0], status
    assert len(probes) >= 3, "the migration ended before the server could be probed"
    assert all(code == 200 for code, _ in probes)
    assert max(took for _, took in probes) < 2.0, probes


def test_a_notebook_past_the_limit_is_refused_at_once_with_the_command_to_use(jupyter: dict[str, Any]) -> None:
    began = time.monotonic()
    status, body = _call(jupyter, server.ROUTE, {"sources": [_cell(20_000)], "path": "huge.ipynb"})
    assert time.monotonic() - began < 5
    assert status == 413
    assert body["message"] == (
        "air_magic migrate: the notebook's code is 20,000 lines, more than the 10,000 this command migrates; "
        "run `air-magic lint --fix huge.ipynb` in a terminal instead (it has no limit)"
    )


def test_a_bad_request_is_a_400(jupyter: dict[str, Any]) -> None:
    status, body = _call(jupyter, server.ROUTE, {"cells": []})
    assert status == 400 and body["message"] == "air_magic migrate: a bad request (KeyError: 'sources')"


def test_a_migration_that_takes_too_long_is_stopped_with_a_408(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "MAX_SECONDS", 0.5)
    body = json.dumps({"sources": [_cell(5000)], "path": "slow.ipynb"}).encode()
    began = time.monotonic()
    status, reply = asyncio.run(server.migrate_reply(body))
    assert time.monotonic() - began < 10
    assert status == 408
    assert reply["message"] == (
        "air_magic migrate: migrating slow.ipynb took longer than 0.5 s and was stopped; "
        "run `air-magic lint --fix slow.ipynb` in a terminal instead (it has no limit)"
    )


def test_the_machine_list_is_what_air_magic_ps_json_prints(jupyter: dict[str, Any]) -> None:
    """GET air-magic/machine: the rows of `air-magic ps --json` (from the same function), the
    server's user, GPU memory no launch holds; POST .../stop refuses a bad request and an id that
    is not running, in one line each (a real stop: tests/lab/test_lab_browser.py)."""
    import os

    from air_magic.kernel.machine import ps as machine
    from air_magic.kernel.machine import server as _machine_server
    from air_magic.protocol import registry

    me = os.getpid()
    start = registry.process_start(me)
    holder = registry.publish(
        registry.Record(
            id="0042-sidebar", uid=os.getuid(), user=registry.user_name(os.getuid()), holder_pid=me,
            holder_start=start, kind="pool", ranks=1, pids=[me], pid_starts=[start], notebook="side.ipynb",
        )
    )  # fmt: skip
    try:
        status, body = _call(jupyter, _machine_server.ROUTE)
        assert status == 200, body
        assert body["user"] == registry.user_name(os.getuid()) and body["skipped"] == []
        (row,) = [r for r in body["rows"] if r["id"] == "0042-sidebar"]
        expected = next(r for r in machine.rows()[0] if r["id"] == "0042-sidebar")
        assert {k: v for k, v in row.items() if k not in ("age_s", "host_memory")} == {
            k: v for k, v in expected.items() if k not in ("age_s", "host_memory")
        }
        assert row["notebook"] == "side.ipynb" and row["pids"] == [me] and row["kind"] == "pool"
    finally:
        holder.close()
    status, body = _call(jupyter, f"{_machine_server.ROUTE}/stop", {"launch": "x"})
    assert status == 400 and body["message"] == "air_magic stop: a bad request (KeyError: 'id')"
    status, body = _call(jupyter, f"{_machine_server.ROUTE}/stop", {"id": "0042-nothere"})
    assert status == 409 and body["message"] == (
        "air_magic stop: no air_magic launch or pool '0042-nothere' is running on this machine (air-magic ps lists them)"
    )
