"""The lab extension's kernel side in a real kernel: the ``air_magic`` comm.

A front end is played with jupyter_client: the comm the kernel opens at ``%load_ext``,
one the front end opens itself (as a page reloaded on a running kernel does), the list
of launches pushed at each change, Stop for a background launch and, sent on a kernel
subshell, for a blocking one while its cell runs, a rank's log, and the summary's own
MIME type in a saved output.
"""

from __future__ import annotations

import queue
import time
import uuid
from typing import Any, Callable, Iterator

import pytest
from harness import Kernel, rank_processes, wait_until

pytestmark = pytest.mark.kernel

SUMMARY_MIME = "application/vnd.air-magic.summary+json"


class Front:
    """Every iopub message of one kernel; comm messages sent the way JupyterLab sends them."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.messages: list[dict[str, Any]] = []

    def drain(self, seconds: float = 0.0) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                self.messages.append(self.kernel.kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return

    def wait(self, what: str, found: Callable[[], Any], timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = found()
            if value:
                return value
            if time.monotonic() > deadline:
                kinds = [(m["msg_type"], m["content"].get("data", {}).get("type")) for m in self.messages[-30:]]
                raise AssertionError(f"timed out waiting for {what}; last messages: {kinds}")
            self.drain(0.1)

    def comm_data(self, comm_id: str, kind: str) -> list[dict[str, Any]]:
        return [
            m["content"]["data"]
            for m in self.messages
            if m["msg_type"] in ("comm_msg", "comm_open")
            and m["content"]["comm_id"] == comm_id
            and m["content"].get("data", {}).get("type") == kind
        ]

    def latest(self, comm_id: str) -> list[dict[str, Any]]:
        lists = self.comm_data(comm_id, "launches")
        return lists[-1]["launches"] if lists else []

    def send(self, msg_type: str, content: dict[str, Any], subshell: str | None = None) -> None:
        kc = self.kernel.kc
        msg = kc.session.msg(msg_type, content)
        if subshell is not None:
            msg["header"]["subshell_id"] = subshell
        kc.shell_channel.send(msg)

    def request(self, comm_id: str, data: dict[str, Any], subshell: str | None = None) -> dict[str, Any]:
        request = uuid.uuid4().hex
        self.send("comm_msg", {"comm_id": comm_id, "data": {**data, "request": request}}, subshell)
        replies = lambda: [r for r in self.comm_data(comm_id, "reply") if r["request"] == request]  # noqa: E731
        return self.wait(f"the reply to {data}", replies)[0]  # type: ignore[no-any-return]

    def subshell(self) -> str:
        kc = self.kernel.kc
        msg = kc.session.msg("create_subshell_request", {})
        kc.control_channel.send(msg)
        reply = kc.get_control_msg(timeout=10)
        assert reply["content"]["status"] == "ok", reply
        return str(reply["content"]["subshell_id"])


@pytest.fixture(scope="module")
def front(kernel_factory: Any) -> Iterator[Front]:
    kernel = kernel_factory(load=False)
    yield Front(kernel)
    kernel.shutdown()


def test_the_kernel_opens_the_channel_at_load_ext_and_lists_its_launches(front: Front) -> None:
    kernel = front.kernel
    msg_id = kernel.execute("%load_ext air_magic\n%config DistributedMagics.tracking = False")
    front.wait(
        "the cell's end",
        lambda: any(
            m["msg_type"] == "status"
            and m["content"]["execution_state"] == "idle"
            and m["parent_header"].get("msg_id") == msg_id
            for m in front.messages
        ),
    )
    opened = [m for m in front.messages if m["msg_type"] == "comm_open" and m["content"]["target_name"] == "air_magic"]
    assert len(opened) == 1, opened
    data = opened[0]["content"]["data"]
    assert data["type"] == "launches" and data["launches"] == [] and data["now"] > 0

    # A front end that opens its own comm (a page reloaded on this kernel) gets the list too.
    comm_id = uuid.uuid4().hex
    front.send("comm_open", {"comm_id": comm_id, "target_name": "air_magic", "data": {}})
    assert front.wait("the list on the new comm", lambda: front.comm_data(comm_id, "launches"))[0]["launches"] == []

    # A background launch: listed at its start, its ranks running, then Stop from the comm.
    kernel.ok("%%distributed -n 2 --async\nimport time\ntime.sleep(60)")

    def running() -> list[dict[str, Any]]:
        found = front.latest(comm_id)
        return found if found and all(r["state"] == "running" for r in found[0]["ranks"]) else []

    launch = front.wait("the launch's ranks running", running)[0]
    assert launch["status"] == "running" and launch["world_size"] == 2 and launch["blocking"] is False
    assert launch["where"] == "2 CPU ranks" and launch["label"].startswith("Cell In[")
    assert launch["cell"]["execution_count"] == 2
    assert [r["rank"] for r in launch["ranks"]] == [0, 1] and all(r["pid"] for r in launch["ranks"])
    assert len(rank_processes()) == 2

    log = front.request(comm_id, {"type": "log", "launch": launch["id"], "rank": 1})
    assert log["ok"] and log["rank"] == 1 and log["path"].endswith("rank-1.log"), log

    reply = front.request(comm_id, {"type": "stop", "launch": launch["id"]})
    assert reply == {"type": "reply", "request": reply["request"], "ok": True, "launch": launch["id"]}
    ended = front.wait("the launch cancelled", lambda: [d for d in front.latest(comm_id) if d["status"] == "cancelled"])
    assert ended[0]["id"] == launch["id"] and ended[0]["outcome"].startswith("cancelled after")
    assert [r["state"] for r in ended[0]["ranks"]] == ["stopped", "stopped"]
    assert wait_until(lambda: not rank_processes(), timeout=10)
    # The kernel's own comm said the same.
    assert front.latest(opened[0]["content"]["comm_id"])[0]["status"] == "cancelled"

    # Asking about a launch that ended: an answer, not an error in the kernel.
    again = front.request(comm_id, {"type": "stop", "launch": launch["id"]})
    assert again["ok"] is False and again["error"] == f"launch {launch['id']} is not running"
    assert front.request(comm_id, {"type": "log", "launch": launch["id"], "rank": 5})["error"] == (
        f"launch {launch['id']} has no rank 5"
    )


def test_stop_sent_on_a_subshell_stops_a_blocking_launch_while_its_cell_runs(front: Front) -> None:
    kernel = front.kernel
    comm_id = uuid.uuid4().hex
    front.send("comm_open", {"comm_id": comm_id, "target_name": "air_magic", "data": {}})
    front.wait("the list", lambda: front.comm_data(comm_id, "launches"))
    subshell = front.subshell()
    cell = kernel.execute("%%distributed -n 2\nimport time\ntime.sleep(60)")

    def blocking() -> list[dict[str, Any]]:
        found = [d for d in front.latest(comm_id) if d["status"] == "running" and d["blocking"]]
        return found if found and all(r["state"] == "running" for r in found[0]["ranks"]) else []

    launch = front.wait("the blocking launch running", blocking)[0]
    started = time.monotonic()
    reply = front.request(comm_id, {"type": "stop", "launch": launch["id"]}, subshell=subshell)
    assert reply["ok"] is True, reply
    errors = lambda: [  # noqa: E731
        m for m in front.messages if m["msg_type"] == "error" and m["parent_header"].get("msg_id") == cell
    ]
    error = front.wait("the cell's error", errors)[0]["content"]
    assert error["ename"] == "LaunchCancelledError"
    assert time.monotonic() - started < 15
    assert wait_until(lambda: not rank_processes(), timeout=10)


def test_a_summary_carries_its_own_mime_type(front: Front) -> None:
    kernel = front.kernel
    cell = kernel.execute(
        "%%distributed -n 2\nimport os\nprint('hello from', os.environ['RANK'])\nint(os.environ['RANK'])"
    )
    front.wait(
        "the cell's end",
        lambda: any(
            m["msg_type"] == "status"
            and m["content"]["execution_state"] == "idle"
            and m["parent_header"].get("msg_id") == cell
            for m in front.messages
        ),
        timeout=60,
    )
    summaries = [
        m["content"]["data"]
        for m in front.messages
        if m["msg_type"] in ("display_data", "update_display_data")
        and SUMMARY_MIME in m["content"]["data"]
        and m["parent_header"].get("msg_id") == cell
    ]
    assert len(summaries) == 1 and summaries[0]["text/plain"].startswith("[air_magic]") and summaries[0]["text/html"]
    data = summaries[0][SUMMARY_MIME]
    assert data["version"] == 1 and data["status"] == "finished" and data["world_size"] == 2
    assert [(r["rank"], r["state"], r["returncode"]) for r in data["ranks"]] == [(0, "finished", 0), (1, "finished", 0)]
    assert data["ranks"][1]["log_tail"] == ["hello from 1"]
    assert data["outcome"].startswith("finished in") and data["run"] is None and data["tracking"] is False
