"""The live panel in a real kernel: what reaches the front end for decorator, magic and
background launches, Stop, throttling, and what stays in the cell at the end."""

from __future__ import annotations

import ast
import re
import time
from typing import Any, Iterator

import pytest
from panel_support import WIDGET_MIME, Wire, displays, rank_states, status_of

pytestmark = pytest.mark.kernel

TQDM_CELL = (
    "%%distributed -n 2\n"
    "import os, time\n"
    "from tqdm.auto import tqdm\n"
    "rank = int(os.environ['RANK'])\n"
    "for i in tqdm(range(40), desc='train'):\n"
    "    time.sleep(0.04)\n"
    "print(f'rank {rank} done', flush=True)\n"
    "rank"
)


@pytest.fixture(scope="module")
def wire(kernel_factory: Any) -> Iterator[Wire]:
    """A kernel that shows widgets (forced: jupyter_client is no widget front end)."""
    kernel = kernel_factory(extra_env={"AIR_MAGIC_PANEL": "widget"})
    kernel.ok(
        "from air_magic import distributed\n"
        "@distributed(num_accelerators=2, tracking=False)\n"
        "def nap(seconds):\n"
        "    import os, time\n"
        "    time.sleep(seconds)\n"
        "    return int(os.environ['RANK'])\n"
    )
    yield Wire(kernel)
    kernel.shutdown()


def _panel_display(msgs: list[dict[str, Any]]) -> dict[str, Any]:
    shown = [d for d in displays(msgs) if WIDGET_MIME in d["data"]]
    assert len(shown) == 1, [d["data"].get("text/plain") for d in displays(msgs)]
    return shown[0]


def _last_launch_id(msgs: list[dict[str, Any]]) -> str:
    data = _panel_display(msgs)
    return data["transient"]["display_id"].removeprefix("air-magic-")


def _check_summary(msgs: list[dict[str, Any]], display_id: str, status: str) -> dict[str, Any]:
    updates = [u for u in displays(msgs, "update_display_data") if u["transient"]["display_id"] == display_id]
    assert len(updates) == 1, updates
    data = updates[0]["data"]
    assert status_of(data["text/html"]) == status
    assert data["text/plain"].startswith("[air_magic] ")
    return data


def test_magic_shows_a_live_panel_that_ends_as_a_summary(wire: Wire) -> None:
    res, msgs = wire.ok(TQDM_CELL)
    assert res.result == "[0, 1]"
    shown = _panel_display(msgs)
    assert shown["data"]["text/plain"].startswith("[air_magic] Cell In[")  # readable without widgets
    panel = wire.panel(_last_launch_id(msgs))
    assert panel.root.name == "VBoxModel"
    # It was live: running with progress, then finished, every rank done.
    assert "running" in panel.statuses() and panel.statuses()[-1] == "finished"
    assert any("train" in v and "%" in v for v in panel.top.history("value") if status_of(v) == "running")
    assert rank_states(panel.html) == {0: "finished", 1: "finished"}
    assert "100% 40/40" in panel.html and "rank 1 done" in panel.html
    # A blocking launch cannot be stopped by a click here (no subshell): the panel says so.
    assert panel.stop.opened["description"] == "Stop" and panel.stop.opened["disabled"] is True
    assert "interrupt the kernel" in panel.note.opened["value"]
    assert panel.tabs.state["titles"] == ["metrics", "rank 0 log", "rank 1 log"]
    # At the end the summary takes the panel's place ...
    data = _check_summary(msgs, shown["transient"]["display_id"], "finished")
    assert "finished in" in data["text/plain"] and "rank 1: finished" in data["text/plain"]
    assert "<details><summary>rank 0 log" in data["text/html"]
    # Rank 0's output still streams into the cell.
    assert "rank 0 done" in res.stdout
    # ... and its widgets are closed once the next panel is open (never none at all:
    # JupyterLab would drop the subshell that carries clicks, see panel._retire).
    assert not any(wire.models[c].closed for c in panel.comm_ids())
    wire.ok("nap.distributed(0)")
    assert all(wire.models[c].closed for c in panel.comm_ids())


def test_decorator_launch_shows_the_same_panel(wire: Wire) -> None:
    res, msgs = wire.ok("nap.distributed(0.6)")
    assert res.result == "[0, 1]"
    shown = _panel_display(msgs)
    panel = wire.panel(_last_launch_id(msgs))
    assert "<b>nap</b> on 2 CPU ranks" in panel.html
    assert panel.statuses()[-1] == "finished"
    _check_summary(msgs, shown["transient"]["display_id"], "finished")


def test_async_returns_at_once_and_stop_is_live(wire: Wire) -> None:
    start = time.monotonic()
    res, msgs = wire.ok("%%distributed -n 2 --async\nimport os, time\ntime.sleep(2.5)\nint(os.environ['RANK'])")
    took = time.monotonic() - start
    assert took < 2.0, took
    # The handle is shown as its panel alone: no `Out[n]: <Launch ... starting ...>` under it.
    assert res.result is None and not [m for m in msgs if m["msg_type"] == "execute_result"]
    panel = wire.panel(_last_launch_id(msgs))
    # The cell is over: the kernel reads clicks again, so Stop is enabled.
    assert wire.wait_for(lambda: panel.stop.state["disabled"] is False, 5), panel.stop.state
    n = res.reply["execution_count"]
    out, _ = wire.ok(f"h = Out[{n}]\n(h.result(timeout=30), h.status, h.done())")
    assert ast.literal_eval(out.result) == ([0, 1], "finished", True)
    assert wire.wait_for(lambda panel=panel: panel.status == "finished", 5)
    # A background panel stays open with its final state; Stop is off now.
    assert not panel.root.closed and panel.stop.state["disabled"] is True
    # Shown again later, a finished launch is its static summary.
    again, again_msgs = wire.ok("h")
    assert again.result is not None and "finished in" in again.result
    html = [m["content"]["data"]["text/html"] for m in again_msgs if m["msg_type"] == "execute_result"]
    assert status_of(html[0]) == "finished"


def test_submit_then_cancel_and_stop_button(wire: Wire) -> None:
    res, msgs = wire.ok("h1 = nap.submit(60)\nh1.status")
    assert res.result in ("'starting'", "'running'")
    first = wire.panel(_last_launch_id(msgs))
    out, _ = wire.ok(
        "import time\ntime.sleep(0.5)\nh1.cancel()\n"
        "try:\n    h1.result(timeout=30)\nexcept Exception as e:\n    err = type(e).__name__\n"
        "(h1.status, err)"
    )
    assert ast.literal_eval(out.result) == ("cancelled", "LaunchCancelledError")
    assert wire.wait_for(lambda: first.status == "cancelled", 5), first.statuses()
    assert rank_states(first.html) == {0: "stopped", 1: "stopped"}
    # The Stop button of a background launch cancels it (a click is a comm message).
    res, msgs = wire.ok("h2 = nap.submit(60)")
    second = wire.panel(_last_launch_id(msgs))
    assert wire.wait_for(lambda: second.stop.state["disabled"] is False, 5)
    kc = wire.kernel.kc
    kc.shell_channel.send(
        kc.session.msg(
            "comm_msg", {"comm_id": second.stop.comm_id, "data": {"method": "custom", "content": {"event": "click"}}}
        )
    )
    assert wire.wait_for(lambda: second.status == "cancelled", 20), second.statuses()
    assert wire.wait_for(lambda: "stopped from the panel" in second.note.state["value"], 5)
    assert wire.kernel.value("h2.status") == "cancelled"


def test_the_where_button_shows_every_rank_s_stack_in_a_tab(wire: Wire) -> None:
    res, msgs = wire.ok("h3 = nap.submit(60)")
    panel = wire.panel(_last_launch_id(msgs))
    assert wire.wait_for(lambda: panel.where.state["disabled"] is False, 10)
    assert wire.wait_for(lambda: wire.kernel.value("h3.status") == "running", 10)
    time.sleep(0.5)  # into the sleep
    kc = wire.kernel.kc
    kc.shell_channel.send(
        kc.session.msg(
            "comm_msg", {"comm_id": panel.where.comm_id, "data": {"method": "custom", "content": {"event": "click"}}}
        )
    )
    try:
        assert wire.wait_for(lambda: panel.tabs.state["titles"][-1:] == ["where"], 10), panel.tabs.state
        assert wire.wait_for(lambda: "where each rank was" in panel.tab(3).state["value"], 5)
        text = panel.tab(3).state["value"]
    finally:
        wire.ok("h3.cancel()")
    assert "[air_magic] where each rank was:" in text
    assert "  rank 0: at " in text and "  rank 1: at " in text and "in nap" in text
    assert "rank 0:\nThread 0x" in text or "rank 0:\nCurrent thread 0x" in text  # every thread's stack
    assert wire.wait_for(lambda: panel.status == "cancelled", 20)
    assert wire.wait_for(lambda: panel.where.state["disabled"] is True, 5)


def test_several_launches_at_once(wire: Wire) -> None:
    res, msgs = wire.ok("a = nap.submit(1.5)\nb = nap.submit(1.5)\n(a.id, b.id)")
    ids = ast.literal_eval(res.result)
    out, _ = wire.ok("(a.result(timeout=60), b.result(timeout=60))")
    assert ast.literal_eval(out.result) == ([0, 1], [0, 1])
    for launch_id in ids:
        panel = wire.panel(launch_id)
        assert wire.wait_for(lambda panel=panel: panel.status == "finished", 5)
        assert "running" in panel.statuses()


def test_a_click_on_a_subshell_stops_a_blocking_launch(wire: Wire) -> None:
    """JupyterLab >= 4.4 sends widget messages on a kernel subshell (ipykernel 7): the click
    is handled on the subshell's thread while the cell still blocks the main one."""
    kc = wire.kernel.kc
    request = kc.session.msg("create_subshell_request", {})
    kc.control_channel.send(request)
    reply = kc.control_channel.get_msg(timeout=10)
    assert reply["content"]["status"] == "ok", reply["content"]
    subshell = reply["content"]["subshell_id"]
    try:
        msg_id = wire.kernel.execute("nap.distributed(60)")
        assert wire.wait_for(lambda: any(p.status == "running" and not p.root.closed for p in wire.panels()), 20)
        panel = [p for p in wire.panels() if not p.root.closed][-1]
        assert wire.wait_for(
            lambda: (
                panel.stop.state["disabled"] is False
                and "Stop ends this launch and its ranks" in panel.note.state["value"]
            ),
            5,
        ), panel.note.state
        click = kc.session.msg(
            "comm_msg", {"comm_id": panel.stop.comm_id, "data": {"method": "custom", "content": {"event": "click"}}}
        )
        click["header"]["subshell_id"] = subshell
        start = time.monotonic()
        kc.shell_channel.send(click)
        res, msgs = wire.collect(msg_id, timeout=30)
        assert time.monotonic() - start < 15
        assert res.error is not None and res.error["ename"] == "LaunchCancelledError", res.error
        assert panel.statuses()[-1] == "cancelled"
        assert "stopped from the panel" in panel.note.state["value"]
        summary = displays(msgs, "update_display_data")[-1]["data"]
        assert status_of(summary["text/html"]) == "cancelled"
    finally:
        kc.control_channel.send(kc.session.msg("delete_subshell_request", {"subshell_id": subshell}))
        kc.control_channel.get_msg(timeout=10)


def test_a_chatty_rank_sends_few_updates(wire: Wire) -> None:
    code = (
        "%%distributed -n 2\n"
        "import os, sys, time\n"
        "from tqdm import tqdm\n"
        "start = time.perf_counter()\n"
        "for i in tqdm(range(50_000), mininterval=0, miniters=1):\n"
        "    if i % 500 == 0:\n"
        "        print(f'line {i}', file=sys.stderr)\n"
        "    time.sleep(0.00003)\n"
        "round(time.perf_counter() - start, 2)"
    )
    start = time.monotonic()
    res, msgs = wire.ok(code, timeout=120)
    duration = time.monotonic() - start
    panel = wire.panel(_last_launch_id(msgs))
    updates = panel.updates_between(start, time.monotonic())
    assert updates < 5 * duration + 10, (updates, duration)
    assert "100% 50000/50000" in panel.html
    # The widgets' bytes stay small next to what the rank wrote (megabytes of bars).
    comm_bytes = sum(len(str(m["content"])) for m in msgs if m["msg_type"] == "comm_msg")
    assert comm_bytes < 20_000 * duration + 50_000, (comm_bytes, duration)


def test_the_linter_findings_for_the_launched_code(wire: Wire) -> None:
    pytest.importorskip("air_magic.lint")
    res, msgs = wire.ok(
        "%%distributed -n 2\nimport os, time\nos.environ['MASTER_PORT'] = '29500'\ntime.sleep(1.5)\n1",
        timeout=60,
    )
    panel = wire.panel(_last_launch_id(msgs))
    assert "lint: 1 finding" in panel.html
    assert panel.tabs.state["titles"][-1] == "lint (1)"
    assert "AM305 line 3:" in panel.tab(3).state["value"]
    summary = displays(msgs, "update_display_data")[-1]["data"]
    assert "migration linter: 1 finding(s), e.g. Cell In[" in summary["text/plain"]


def test_panels_do_not_pile_up_in_the_kernel(wire: Wire) -> None:
    probe = (
        "import threading, ipywidgets\n"
        "(sorted(t.name for t in threading.enumerate()), len(ipywidgets.widgets.widget._instances))"
    )
    wire.ok("nap.distributed(0)")
    threads_1, widgets_1 = wire.kernel.value(probe)
    for _ in range(8):
        wire.ok("nap.distributed(0)")
    threads_9, widgets_9 = wire.kernel.value(probe)
    assert len(threads_9) <= len(threads_1), (threads_1, threads_9)
    assert widgets_9 <= widgets_1, (widgets_1, widgets_9)


# -- with tracking: metrics, chart and the run ---------------------------------------------


def test_metrics_feed_the_table_and_the_chart(kernel_factory: Any) -> None:
    kernel = kernel_factory(extra_env={"AIR_MAGIC_PANEL": "widget"}, tracking=True)
    try:
        wire = Wire(kernel)
        res, msgs = wire.ok(
            "%%distributed -n 2\n"
            "import os, time, mlflow\n"
            "rank = int(os.environ['RANK'])\n"
            "for step in range(60):\n"
            "    mlflow.log_metric('loss', 1.0 / (step + 1) + rank, step=step)\n"
            "    mlflow.log_metric('acc', step / 60, step=step)\n"
            "    time.sleep(0.05)\n"
            "rank",
            timeout=120,
        )
        # The run's last points are stored behind the values: the summary is shown again,
        # in place, with the run once they are (flush() waits for that).
        wire.ok("import air_magic.tracking\nassert air_magic.tracking.flush(120)", timeout=180)
        launch_id = _last_launch_id(msgs)
        summaries = [
            m["content"]["data"]
            for m in wire.messages
            if m["msg_type"] == "update_display_data"
            and m["content"].get("transient", {}).get("display_id") == f"air-magic-{launch_id}"
        ]
        assert "MLflow: storing" not in summaries[-1]["text/plain"], summaries[-1]["text/plain"]
        panel = wire.panel(launch_id)
        assert re.search(r"loss=1\.01[0-9]*", panel.html), panel.html  # rank 1's last loss: 1 + 1/60
        assert "step 59" in panel.html  # progress from metric steps when there is no bar
        # The live chart is redrawn every 2 s while the ranks log (3 s here); what it holds at
        # each redraw depends on how far the ranks have got, so its lines are checked on the
        # chart that stays: the summary's, drawn from every point once the launch has ended.
        live_charts = [value for value in panel.tab(0).history("value") if "<polyline" in value]
        assert live_charts, panel.tab(0).history("value")
        assert 'data-metric="loss"' in live_charts[-1] and 'data-metric="acc"' in live_charts[-1]
        summary = summaries[-1]
        assert "MLflow run" in summary["text/plain"]
        final_chart = summary["text/html"][summary["text/html"].index("<svg") :]
        assert 'data-metric="loss"' in final_chart and 'data-metric="acc"' in final_chart
        assert final_chart.count("<polyline") == 4  # 2 metrics x 2 ranks
        for chart in (*live_charts, final_chart):  # nothing fetched: inline SVG only
            assert "http" not in chart.replace('xmlns="http://www.w3.org/2000/svg"', "")
    finally:
        kernel.shutdown()


# -- without widgets ---------------------------------------------------------------------------


def test_text_lines_where_no_widget_front_end(kernel_factory: Any) -> None:
    kernel = kernel_factory()  # jupyter_client: no Jupyter server, no VS Code
    try:
        wire = Wire(kernel)
        wire.ok("%%distributed -n 2\n0")  # the helper is ready: the next launch starts at once
        res, msgs = wire.ok(TQDM_CELL.replace("range(40)", "range(90)"))
        assert res.result == "[0, 1]"
        assert not [m for m in msgs if m["msg_type"] == "comm_open"]
        lines = [line for line in res.stdout.replace("\r", "\n").splitlines() if line.startswith("[air_magic] Cell")]
        assert lines and all(len(line) < 230 for line in lines), res.stdout[-2000:]
        assert any(re.search(r"0:0\d running · r0 train \d+% \d+/90", line) for line in lines), lines
        start = displays(msgs)[0]
        assert start["data"] == {"text/plain": start["data"]["text/plain"]}
        # The helper is ready (the launch before): the first line says the ranks are being forked.
        assert start["data"]["text/plain"].endswith(": starting (forking 2 ranks)")
        # The summary comes last, after the status lines and rank 0's output (in time
        # order, as a notebook saved by nbconvert keeps them), not in the first line's place.
        assert not displays(msgs, "update_display_data")
        summary = displays(msgs)[-1]
        # A display of its own (its id is the one the storing of the run's last points updates).
        assert summary.get("transient", {}).get("display_id") != start.get("transient", {}).get("display_id")
        data = summary["data"]
        assert status_of(data["text/html"]) == "finished"
        assert "100% 90/90" in data["text/plain"]
        order = [m["msg_type"] for m in msgs if m["msg_type"] in ("stream", "display_data", "execute_result")]
        assert order[-2:] == ["display_data", "execute_result"], order
        # Turned off: nothing but the launch itself.
        wire.ok("%config DistributedMagics.panel = False")
        res, msgs = wire.ok("%%distributed -n 2\n1")
        assert res.result == "[1, 1]"
        assert not displays(msgs) and not displays(msgs, "update_display_data")
    finally:
        kernel.shutdown()


def test_a_background_launch_says_its_end_once_and_the_lint_does_not_guess_at_small_data(
    kernel_factory: Any,
) -> None:
    """``.submit()`` in a notebook with no widgets: its end updates the launching cell's line,
    and no second "finished" line is printed under it; a cell run meanwhile gets the line.
    The summary has no AM303 "large data" guess about a 4x1 tensor (capture knows its size)."""
    kernel = kernel_factory()
    try:
        wire = Wire(kernel)
        wire.ok(
            "import torch\n"
            "from air_magic import distributed\n"
            "weights = torch.ones(4, 1)\n"
            "@distributed(num_accelerators=2, tracking=False)\n"
            "def total():\n"
            "    return float(weights.sum())\n"
        )
        res, msgs = wire.ok("f = total.submit()")
        launch_id = displays(msgs)[0]["transient"]["display_id"]
        ended = lambda: [  # noqa: E731
            m
            for m in wire.messages
            if m["msg_type"] == "update_display_data" and m["content"]["transient"]["display_id"] == launch_id
        ]
        assert wire.wait_for(lambda: bool(ended()), 60)
        wire.drain(1.0)
        said = [
            m["content"]["text"]
            for m in wire.messages
            if m["msg_type"] == "stream" and "finished in" in m["content"]["text"]
        ]
        assert said == []  # the updated line says it, once
        summary = ended()[-1]["content"]["data"]
        assert status_of(summary["text/html"]) == "finished"
        for text in (summary["text/plain"], summary["text/html"]):
            assert "AM303" not in text and "large data" not in text
        assert kernel.value("f.result()") == [4.0, 4.0]

        # A launch that ends while another cell runs: the line lands in that cell.
        wire.ok("g = total.submit()")
        res, msgs = wire.ok("import time\nwhile not g.done():\n    time.sleep(0.1)\ntime.sleep(3)", timeout=120)
        lines = [
            m["content"]["text"] for m in msgs if m["msg_type"] == "stream" and "finished in" in m["content"]["text"]
        ]
        assert len(lines) == 1 and lines[0].startswith("[air_magic] total on 2 CPU ranks"), lines
    finally:
        kernel.shutdown()
