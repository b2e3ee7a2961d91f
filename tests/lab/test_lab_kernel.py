"""The lab extension's kernel side in a real kernel: the ``air_magic`` comm.

A front end is played with jupyter_client, opening its comms as the extension does: the
kernel opens none itself (neither ``import air_magic`` nor ``%load_ext``), refuses one
before air_magic is imported (a ``comm_close``: no target), and answers one opened after
a bare ``import air_magic`` with its list, without importing the panel before that.  Then
the list of launches pushed at each change on every open comm, Stop for a background
launch and, on a kernel subshell, a comm opened and a blocking launch stopped while its
cell runs, a rank's log, and the summary's own MIME type in a saved output.
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

    def ended(self, msg_id: str) -> bool:
        """Has the kernel said "idle" for this request?"""
        return any(
            m["msg_type"] == "status"
            and m["content"]["execution_state"] == "idle"
            and m["parent_header"].get("msg_id") == msg_id
            for m in self.messages
        )

    def run(self, code: str, timeout: float = 30.0) -> str:
        """A cell, to its end (its iopub messages kept); returns its msg_id."""
        msg_id = self.kernel.execute(code)
        self.wait(f"the end of {code!r}", lambda: self.ended(msg_id), timeout)
        return msg_id

    def open(self, subshell: str | None = None) -> str:
        """Open a comm to the target as the extension does; returns its id."""
        comm_id = uuid.uuid4().hex
        self.send("comm_open", {"comm_id": comm_id, "target_name": "air_magic", "data": {"type": "list"}}, subshell)
        return comm_id

    def opened_by_kernel(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["msg_type"] == "comm_open"]

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


def test_outside_a_kernel_no_target_is_registered() -> None:
    from air_magic import plugins as _plugins

    assert _plugins.lab_target() is False  # this process: no kernel
    assert _plugins.lab_target(object()) is False  # a shell without one (terminal IPython)


def test_the_kernel_opens_no_comm_and_answers_one_opened_after_import_air_magic(front: Front) -> None:
    # Before air_magic is imported the target is not there: the kernel closes the comm at once
    # (the extension then waits for the next cell that names air_magic).
    early = front.open()
    closed = lambda: [  # noqa: E731
        m for m in front.messages if m["msg_type"] == "comm_close" and m["content"]["comm_id"] == early
    ]
    front.wait("the kernel to close a comm to a target it does not have", closed)
    assert not front.comm_data(early, "launches")

    # A bare import registers the target, sends nothing, and imports no more than it did.
    cell = front.run(
        "import air_magic, sys\nprint(sorted(m for m in ('air_magic.panel', 'ipywidgets') if m in sys.modules))"
    )
    printed = [
        m["content"]["text"]
        for m in front.messages
        if m["msg_type"] == "stream" and m["parent_header"].get("msg_id") == cell
    ]
    assert printed == ["[]\n"], printed
    assert front.opened_by_kernel() == []
    comm_id = front.open()
    listed = front.wait("the list on the comm", lambda: front.comm_data(comm_id, "launches"))
    assert listed[0]["launches"] == [] and listed[0]["now"] > 0

    # %load_ext opens nothing either.
    front.run("%load_ext air_magic\n%config DistributedMagics.tracking = False")
    front.drain(0.5)
    assert front.opened_by_kernel() == []


def test_every_open_comm_gets_the_list_of_launches_stop_and_logs(front: Front) -> None:
    kernel = front.kernel
    front.run("%load_ext air_magic\n%config DistributedMagics.tracking = False")  # (again: a no-op)
    first = front.open()
    assert front.wait("the list on the first comm", lambda: front.comm_data(first, "launches"))[0]["launches"] == []
    # A second front end (another page on this kernel) opens its own and gets the list too.
    comm_id = front.open()
    assert front.wait("the list on the new comm", lambda: front.comm_data(comm_id, "launches"))[0]["launches"] == []

    # A background launch: listed at its start, its ranks running, then Stop from the comm.
    started = kernel.ok("%%distributed -n 2 --async\nimport time\ntime.sleep(60)")

    def running() -> list[dict[str, Any]]:
        found = front.latest(comm_id)
        return found if found and all(r["state"] == "running" for r in found[0]["ranks"]) else []

    launch = front.wait("the launch's ranks running", running)[0]
    assert launch["status"] == "running" and launch["world_size"] == 2 and launch["blocking"] is False
    assert launch["where"] == "2 CPU ranks" and launch["label"].startswith("Cell In[")
    assert launch["cell"]["execution_count"] == started.execution_count is not None
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
    # The other comm was told the same.
    assert front.latest(first)[0]["status"] == "cancelled"
    assert front.opened_by_kernel() == []

    # Asking about a launch that ended: an answer, not an error in the kernel.
    again = front.request(comm_id, {"type": "stop", "launch": launch["id"]})
    assert again["ok"] is False and again["error"] == f"launch {launch['id']} is not running"
    assert front.request(comm_id, {"type": "log", "launch": launch["id"], "rank": 5})["error"] == (
        f"launch {launch['id']} has no rank 5"
    )


def test_a_comm_opened_on_a_subshell_lists_a_blocking_launch_and_stops_it_while_its_cell_runs(
    front: Front,
) -> None:
    kernel = front.kernel
    # As in JupyterLab's "run all": %load_ext and a blocking launch queued together; the page
    # opens its comm when the first cell ends, on the comm's subshell, while the second runs.
    subshell = front.subshell()
    cell = kernel.execute("%%distributed -n 2\nimport time\ntime.sleep(60)")
    front.wait(
        "the blocking cell's start",
        lambda: any(
            m["msg_type"] == "execute_input" and m["parent_header"].get("msg_id") == cell for m in front.messages
        ),
    )
    comm_id = front.open(subshell=subshell)
    front.wait("the list", lambda: front.comm_data(comm_id, "launches"))

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


def test_the_list_keeps_a_thread_only_while_a_front_end_watches_a_running_launch(kernel_factory: Any) -> None:
    kernel = kernel_factory()
    try:
        front = Front(kernel)
        watchers = (
            "import threading\nsorted(t.name for t in threading.enumerate() if t.name.startswith('air_magic-lab'))"
        )

        # No front end: a launch starts no watcher at all.
        kernel.ok("%%distributed -n 1 --async\nimport time\ntime.sleep(30)")
        assert wait_until(lambda: len(rank_processes()) == 1, timeout=30)
        assert kernel.value(watchers) == []

        # A page opens its comm while that launch runs: the watcher starts for it ...
        comm_id = front.open()
        front.wait("the list", lambda: front.comm_data(comm_id, "launches"))
        assert kernel.value(watchers) == ["air_magic-lab"]
        # ... and is gone once nothing runs (stopped from the page here).
        launch = front.latest(comm_id)[0]
        assert front.request(comm_id, {"type": "stop", "launch": launch["id"]})["ok"] is True
        front.wait("the launch cancelled", lambda: [d for d in front.latest(comm_id) if d["status"] == "cancelled"])
        assert wait_until(lambda: not rank_processes(), timeout=10)
        assert kernel.value(watchers) == []

        # A blocking launch watched by the page: no watcher left when its cell returns.
        for _ in range(3):
            kernel.ok("%%distributed -n 1\n1")
            assert kernel.value(watchers) == []
    finally:
        kernel.shutdown()  # (the factory's kernels live to the session's end)


def test_stop_on_a_pool_cell_interrupts_it_as_ctrl_c_does_and_the_pool_stays(kernel_factory: Any) -> None:
    """Stop in the sidebar on a running pool cell (on the comm's subshell, as JupyterLab 4.4+
    sends it): the cell ends as after Ctrl-C, the ranks and their state stay, and the list,
    ``%distributed_pool`` and the next cell all say the same."""
    kernel = kernel_factory()
    try:
        front = Front(kernel)
        kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
        kernel.ok("%%distributed --pool\nimport os\nx = 41", timeout=60)
        pids = sorted(p.pid for p in rank_processes())
        assert len(pids) == 2
        subshell = front.subshell()
        comm_id = front.open(subshell=subshell)
        front.wait("the list", lambda: front.comm_data(comm_id, "launches"))
        count = kernel.value("get_ipython().execution_count")  # the next cell's In[N], after this one's
        began = time.time()
        cell = kernel.execute("%%distributed --pool\nimport time\nwhile True:\n    time.sleep(0.01)")
        pool_launch = front.wait(
            "the pool's launch, running the cell",
            lambda: [
                d for d in front.latest(comm_id) if d["kind"] == "pool" and d["cell"].get("execution_count") == count
            ],
            timeout=30,
        )[0]
        # The pool's item is the running cell's: Go to cell goes there, its clock is the cell's.
        assert pool_launch["started_at"] >= began - 1.0, (pool_launch, began)
        time.sleep(1.0)  # the cell runs on both ranks
        reply = front.request(comm_id, {"type": "stop", "launch": pool_launch["id"]}, subshell=subshell)
        assert reply["ok"] is True, reply
        front.wait("the cell's end", lambda: front.ended(cell), timeout=30)
        errors = [m for m in front.messages if m["msg_type"] == "error" and m["parent_header"].get("msg_id") == cell]
        assert [(e["content"]["ename"], e["content"]["evalue"]) for e in errors] == [
            (
                "KeyboardInterrupt",
                "you interrupted the pool's cell; every rank stopped it, and the pool and its state are intact.",
            )
        ]
        assert sorted(p.pid for p in rank_processes()) == pids  # the same ranks, not killed
        front.drain(1.0)
        listed = [d for d in front.latest(comm_id) if d["id"] == pool_launch["id"]]
        assert listed and listed[0]["status"] == "running", listed  # not "cancelled"
        assert [r["state"] for r in listed[0]["ranks"]] == ["idle", "idle"]  # as the cell's table says
        assert "idle" in kernel.ok("%distributed_pool").shown_text
        assert kernel.value("%%distributed --pool\nx + 1") == [42, 42]
        # With no cell running there is nothing to stop: the answer says so, and the pool stays.
        idle = front.request(comm_id, {"type": "stop", "launch": pool_launch["id"]}, subshell=subshell)
        assert idle["ok"] is False and idle["error"] == (
            "the pool runs no cell now, so there is nothing to stop; %distributed_pool --stop ends the pool"
        )
        # A pool.submit call: Stop cancels it, as its handle's cancel() does.
        kernel.ok(
            "import air_magic, time\n"
            "def spins():\n"
            "    while True:\n"
            "        time.sleep(0.01)\n"
            "h = air_magic.Pool.current().submit(spins)\n"
            "time.sleep(1.0)"
        )
        reply = front.request(comm_id, {"type": "stop", "launch": pool_launch["id"]}, subshell=subshell)
        assert reply["ok"] is True, reply
        assert kernel.value("type(h.exception(timeout=30)).__name__") == "KeyboardInterrupt"
        assert sorted(p.pid for p in rank_processes()) == pids
        assert kernel.value("%%distributed --pool\nx") == [41, 41]
    finally:
        kernel.shutdown()


def _said(front: Front, msg_id: str) -> str:
    """What a cell showed (its streams, displays and value as text), read from the front's messages."""
    parts = []
    for m in front.messages:
        if m["parent_header"].get("msg_id") != msg_id:
            continue
        content = m["content"]
        if m["msg_type"] == "stream":
            parts.append(content["text"])
        elif m["msg_type"] in ("display_data", "update_display_data", "execute_result"):
            parts.append(content["data"].get("text/plain", ""))
        elif m["msg_type"] == "error":
            parts.append(f"{content['ename']}: {content['evalue']}")
    return "\n".join(parts)


def _value(front: Front, expr: str) -> Any:
    import ast

    msg_id = front.run(expr, timeout=60)
    results = [
        m["content"]["data"]["text/plain"]
        for m in front.messages
        if m["msg_type"] == "execute_result" and m["parent_header"].get("msg_id") == msg_id
    ]
    assert results, _said(front, msg_id)
    return ast.literal_eval(results[0])


def test_a_pool_is_one_item_whose_state_every_surface_says_and_close_ends_it(kernel_factory: Any) -> None:
    """The sidebar's list has one item per pool for its whole life (a restart updates it), with
    the pool's own state, the same as ``pool.state`` and ``%distributed_pool`` say: idle, after a
    rank's error, after a restart; its Close ends the ranks (the page asked first), a cell
    running on it ends saying the sidebar closed it, and the item says closed."""
    kernel = kernel_factory()
    try:
        front = Front(kernel)
        subshell = front.subshell()
        comm_id = front.open(subshell=subshell)
        front.wait("the list", lambda: front.comm_data(comm_id, "launches"))
        front.run("%distributed_pool -n 2 --no-tracking", timeout=180)
        pids = sorted(p.pid for p in rank_processes())
        assert len(pids) == 2

        def pool_items() -> list[dict[str, Any]]:
            return [d for d in front.latest(comm_id) if d["kind"] == "pool"]

        def agree(state: str) -> dict[str, Any]:
            """The list, pool.state and %distributed_pool say ``state`` (and the list one item)."""
            front.wait(f"the pool's item {state}", lambda: [d for d in pool_items() if d["pool"]["state"] == state])
            front.drain(0.5)
            items = pool_items()
            assert len(items) == 1 and items[0]["pool"]["state"] == state, items
            assert _value(front, "import air_magic; air_magic.Pool.current().state") == state
            assert "[air_magic] pool" in _said(front, front.run("%distributed_pool")), state
            assert state in _said(front, front.run("%distributed_pool"))
            return items[0]

        item = agree("idle")
        key = item["item"]
        assert item["pool"]["restarts"] == 0 and key.startswith("pool-")
        front.run("%%distributed --pool\nx = 41", timeout=60)
        # A rank's error fails the cell; the pool and its names stay (idle again).
        failed = front.run(
            "%%distributed --pool\nimport torch.distributed as dist\nif dist.get_rank() == 1:\n    1 / 0"
        )
        assert "ZeroDivisionError" in _said(front, failed)
        assert agree("idle")["pool"]["calls"] == 2
        # A restart: the same item (its key), restarted once; new ranks.
        front.run("%distributed_pool --restart", timeout=180)
        item = agree("idle")
        assert item["item"] == key and item["pool"]["restarts"] == 1
        assert sorted(p.pid for p in rank_processes()) != pids
        # Close from the sidebar while a cell runs on the pool: the cell says who closed it.
        count = _value(front, "get_ipython().execution_count")  # the next cell's In[N], after this one's
        cell = kernel.execute("%%distributed --pool\nimport time\nwhile True:\n    time.sleep(0.01)")
        front.wait("the pool's cell running", lambda: [d for d in pool_items() if d["pool"]["state"] == "running"])
        time.sleep(0.5)
        reply = front.request(comm_id, {"type": "close", "launch": pool_items()[0]["id"]}, subshell=subshell)
        assert reply["ok"] is True, reply
        front.wait("the cell's end", lambda: front.ended(cell), timeout=30)
        assert _said(front, cell).endswith(
            f"PoolBrokenError: the pool was closed from the JupyterLab sidebar while Cell In[{count}] ran on it; its "
            "ranks were stopped, so this call has no values."
        ), _said(front, cell)
        assert wait_until(lambda: not rank_processes(), timeout=10)
        front.wait("the item closed", lambda: [d for d in pool_items() if d["pool"]["state"] == "closed"])
        front.drain(0.5)
        assert [(d["item"], d["pool"]["state"]) for d in pool_items()] == [(key, "closed")]
        assert [r["state"] for r in pool_items()[0]["ranks"]] == ["closed", "closed"]
        assert _value(front, "air_magic.Pool.current() is None") is True
        # Closing what is closed says so.
        again = front.request(comm_id, {"type": "close", "launch": item["id"]}, subshell=subshell)
        assert again == {
            "type": "reply",
            "request": again["request"],
            "ok": False,
            "error": f"no open pool runs as launch {item['id']}",
        }
    finally:
        kernel.shutdown()
