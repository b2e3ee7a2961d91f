"""How a launch ends in its cell, as a notebook front end receives it: an interrupt is one
line in the summary's words, the summary comes before the cell's value, a handle does not
repeat its panel as a stale line, stopped ranks' logs say "stopped", and the kernel reads
busy for as long as a blocking cell runs."""

from __future__ import annotations

import os
import queue
import re
import time
from typing import Any, Callable, Iterator

import pytest
from harness import Kernel, strip_ansi

pytestmark = pytest.mark.kernel

SLEEPER = '%%distributed -n 2\nimport time\nprint("started", flush=True)\ntime.sleep(60)\n'
NAP = (
    "from air_magic import distributed\n"
    "@distributed(num_accelerators=2, tracking=False)\n"
    "def nap(seconds):\n"
    "    import os, time\n"
    "    print('started', flush=True)\n"
    "    time.sleep(seconds)\n"
    "    return int(os.environ['RANK'])\n"
)

Messages = list[dict[str, Any]]


@pytest.fixture(scope="module")
def k(kernel: Kernel) -> Iterator[Kernel]:
    kernel.ok(NAP)
    kernel.ok("%%distributed -n 2\n0")  # the helper is ready
    yield kernel


def messages(
    k: Kernel, msg_id: str, timeout: float = 60.0, until: Callable[[Messages], bool] | None = None
) -> Messages:
    """Every iopub message of one cell, in order, up to its idle status (or ``until``)."""
    found: Messages = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"the cell did not end in {timeout} s: {stream_text(found)[-2000:]!r}"
        try:
            msg = k.kc.get_iopub_msg(timeout=min(remaining, 1.0))
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        found.append(msg)
        if until is not None and until(found):
            return found
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            k.kc.get_shell_msg(timeout=10)  # its execute_reply
            return found


def stream_text(msgs: Messages) -> str:
    return "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")


def shown_text(msgs: Messages) -> list[str]:
    """The text/plain of every display and display update, in order."""
    kinds = ("display_data", "update_display_data")
    return [m["content"]["data"].get("text/plain", "") for m in msgs if m["msg_type"] in kinds]


def interrupt(k: Kernel, code: str) -> Messages:
    msg_id = k.execute(code)
    msgs = messages(k, msg_id, until=lambda ms: "started" in stream_text(ms))
    time.sleep(0.5)
    k.km.interrupt_kernel()
    return msgs + messages(k, msg_id, timeout=30)


@pytest.mark.parametrize("code", [SLEEPER, "nap.distributed(60)"], ids=["magic", "decorator"])
def test_an_interrupt_is_one_line_in_the_summary_s_words(k: Kernel, code: str) -> None:
    msgs = interrupt(k, code)
    errors = [m["content"] for m in msgs if m["msg_type"] == "error"]
    assert len(errors) == 1, errors
    error = errors[0]
    assert error["ename"] == "KeyboardInterrupt"  # `except KeyboardInterrupt` still catches it
    lines = [strip_ansi(line) for line in error["traceback"]]
    text = "\n".join(lines)
    assert len(lines) == 1 and "\n" not in lines[0], text
    for frame in ("magics.py", "launcher.py", "Traceback"):
        assert frame not in text
    label = r"Cell In\[\d+\]" if code.startswith("%%") else "nap"
    assert re.fullmatch(
        rf"KeyboardInterrupt: {label} was cancelled: you interrupted it after \d+\.\d s; its 2 ranks were stopped\.",
        lines[0],
    ), lines[0]
    # The summary says it in the same words: cancelled, by whom, after how long.
    summary = [text for text in shown_text(msgs) if "[air_magic]" in text and "cancelled after" in text]
    assert len(summary) == 1, shown_text(msgs)
    assert error["evalue"] in summary[0], summary[0]
    # The ranks' own tracebacks stay in their logs: none reaches the cell.
    assert "KeyboardInterrupt" not in stream_text(msgs) and "Traceback" not in stream_text(msgs)
    # ... where they say the rank was stopped, not that it failed.
    folder = re.search(r"logs: (\S+)", summary[0])
    assert folder, summary[0]
    for rank in (0, 1):
        with open(os.path.join(folder.group(1), f"rank-{rank}.log"), encoding="utf-8") as handle:
            log = handle.read()
        assert "[air_magic] this rank was stopped by air_magic" in log, log
        assert "this rank failed" not in log, log


def test_the_summary_comes_before_the_value(k: Kernel) -> None:
    msgs = messages(k, k.execute("%%distributed -n 2\nimport os\nprint('hello', flush=True)\nint(os.environ['RANK'])"))
    kinds = [m["msg_type"] for m in msgs if m["msg_type"] != "status"]
    assert kinds[-1] == "execute_result", kinds
    assert msgs[-2]["msg_type"] == "execute_result"  # then only the idle status
    # Status line, rank 0's output, then the summary: all before the value.
    shown = shown_text(msgs)
    assert shown[0].endswith(": starting (forking 2 ranks)"), shown
    assert re.match(r"\[air_magic\] Cell In\[\d+\] on 2 CPU ranks \(launch \S+\): finished in", shown[-1]), shown
    before_summary = msgs[: max(i for i, m in enumerate(msgs) if m["msg_type"] == "display_data")]
    assert "hello" in stream_text(before_summary)


def test_a_handle_shown_in_its_own_cell_is_its_panel_alone(k: Kernel) -> None:
    code = "%%distributed -n 2 --async\nimport os, time\ntime.sleep(1)\nint(os.environ['RANK'])"
    msg_id = k.execute(code)
    msgs = messages(k, msg_id)
    # No `Out[n]: <Launch ... starting after 0.2 s ...>` under the panel: the panel is its display.
    assert not [m for m in msgs if m["msg_type"] == "execute_result"], msgs
    assert [m for m in msgs if m["msg_type"] == "display_data"]
    n = msgs[0]["content"]["execution_count"] if msgs[0]["msg_type"] == "execute_input" else None
    n = n or k.value("len(In) - 2")
    # The value is kept (Out[n], _) and, shown again later, follows its state.
    assert k.value(f"Out[{n}].result(timeout=30)") == [0, 1]
    again = k.ok(f"Out[{n}]")
    assert again.result is not None and "finished in" in again.result, again.result


WIDGET_ENV = {"JPY_SESSION_NAME": "cell-end.ipynb"}  # a Jupyter server's kernel: widgets


def test_the_kernel_reads_busy_while_a_blocking_launch_with_a_panel_runs(kernel_factory: Any) -> None:
    """JupyterLab shows the kernel's state from every status message.  When a panel
    appears it opens a subshell for the widgets' comms (a control request), and clicks go
    on it: each of those requests ends with an "idle" while the cell still runs."""
    kernel = kernel_factory(extra_env=WIDGET_ENV)
    kc = kernel.kc
    try:
        kernel.ok(NAP)
        kernel.ok("nap.distributed(0)")
        msg_id = kernel.execute("nap.distributed(6)")
        every: Messages = []  # every iopub message, any parent
        deadline = time.monotonic() + 90
        subshell = None
        ended = False
        while not ended:
            assert time.monotonic() < deadline, [m["msg_type"] for m in every]
            try:
                msg = kc.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                continue
            every.append(msg)
            buttons = [
                m["content"]["comm_id"]
                for m in every
                if m["msg_type"] == "comm_open" and m["content"]["data"]["state"].get("_model_name") == "ButtonModel"
            ]
            if subshell is None and len(buttons) == 2:  # the panel is shown: as JupyterLab does
                kc.control_channel.send(kc.session.msg("create_subshell_request", {}))
                subshell = kc.control_channel.get_msg(timeout=10)["content"]["subshell_id"]
                for comm_id in buttons:  # a message to each button, on the subshell (no click)
                    note = kc.session.msg(
                        "comm_msg", {"comm_id": comm_id, "data": {"method": "custom", "content": {"event": "none"}}}
                    )
                    note["header"]["subshell_id"] = subshell
                    kc.shell_channel.send(note)
            ended = (
                msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
                and msg["parent_header"].get("msg_id") == msg_id
            )
        reply = kernel._shell_reply(msg_id, 10)
        assert reply["status"] == "ok", reply
        mine = [m for m in every if m["parent_header"].get("msg_id") == msg_id]
        assert any(m["msg_type"] == "comm_open" for m in mine), "no panel was shown"
        statuses = [
            (m["content"]["execution_state"], m["parent_header"].get("msg_id"), m["parent_header"].get("msg_type"))
            for m in every
            if m["msg_type"] == "status"
        ]
        first = statuses.index(("busy", msg_id, "execute_request"))
        during = statuses[first:-1]
        others = {(parent_type) for _, parent, parent_type in during if parent != msg_id}
        assert {"create_subshell_request", "comm_msg"} <= others, [s[0::2] for s in statuses]
        # The cell's own idle comes at its end only, and every idle of another request is
        # followed at once by the cell's busy: a front end reading them shows Busy all along.
        assert statuses[-1] == ("idle", msg_id, "execute_request")
        assert ("idle", msg_id, "execute_request") not in during
        for at, (state, _, _) in enumerate(during):
            if state == "idle":
                assert during[at + 1][:2] == ("busy", msg_id), statuses
        kinds = [m["msg_type"] for m in mine if m["msg_type"] != "status"]
        assert kinds[-1] == "execute_result", kinds
        assert "update_display_data" in kinds  # the summary, in the panel's place, before the value
    finally:
        if subshell is not None:
            kc.control_channel.send(kc.session.msg("delete_subshell_request", {"subshell_id": subshell}))
            kc.control_channel.get_msg(timeout=10)
        kernel.shutdown()


def test_no_busy_of_a_launch_cell_follows_its_idle(kernel_factory: Any) -> None:
    """The "busy" the panel sends for its cell after another request's "idle" never comes
    after the cell's own "idle", even with requests on a subshell ending all along, across
    the cell's end (a front end would read Busy for a cell that is over)."""
    kernel = kernel_factory(extra_env=WIDGET_ENV)
    kc = kernel.kc
    subshell = None
    try:
        kernel.ok(NAP)
        kernel.ok("nap.distributed(0)")
        msg_id = kernel.execute("nap.distributed(3)")
        every: Messages = []
        buttons: list[str] = []
        sent = 0
        next_note = 0.0
        ended_at = None
        deadline = time.monotonic() + 90
        # Read on for a second after the cell's idle: a late busy would have arrived by then.
        while ended_at is None or time.monotonic() < ended_at + 1.0:
            assert time.monotonic() < deadline, [m["msg_type"] for m in every]
            if subshell is not None and time.monotonic() >= next_note:  # a request ends every 20 ms
                note = kc.session.msg(
                    "comm_msg",
                    {"comm_id": buttons[sent % 2], "data": {"method": "custom", "content": {"event": "none"}}},
                )
                note["header"]["subshell_id"] = subshell
                kc.shell_channel.send(note)
                sent += 1
                next_note = time.monotonic() + 0.02
            try:
                msg = kc.get_iopub_msg(timeout=0.02)
            except queue.Empty:
                continue
            every.append(msg)
            if subshell is None:
                buttons = [
                    m["content"]["comm_id"]
                    for m in every
                    if m["msg_type"] == "comm_open"
                    and m["content"]["data"]["state"].get("_model_name") == "ButtonModel"
                ]
                if len(buttons) == 2:  # the panel is shown: a subshell, as JupyterLab opens one
                    kc.control_channel.send(kc.session.msg("create_subshell_request", {}))
                    subshell = kc.control_channel.get_msg(timeout=10)["content"]["subshell_id"]
            if (
                msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
                and msg["parent_header"].get("msg_id") == msg_id
            ):
                ended_at = time.monotonic()
        reply = kernel._shell_reply(msg_id, 10)
        assert reply["status"] == "ok", reply
        statuses = [
            (m["content"]["execution_state"], m["parent_header"].get("msg_id"), m["parent_header"].get("msg_type"))
            for m in every
            if m["msg_type"] == "status"
        ]
        first = statuses.index(("busy", msg_id, "execute_request"))
        end = statuses.index(("idle", msg_id, "execute_request"))
        after = statuses[end + 1 :]
        assert not [s for s in after if s[1] == msg_id], after[:40]
        assert not [s for s in after if s[2] == "execute_request"], after[:40]  # nor of an earlier cell
        # The test did what it says: the panel said busy again after subshell idles while
        # the cell ran, and subshell requests still ended after the cell had.
        assert statuses[first + 1 : end].count(("busy", msg_id, "execute_request")) >= 5, statuses[first:end]
        assert ("idle", "comm_msg") in {(state, kind) for state, _, kind in after}, after[:40]
    finally:
        if subshell is not None:
            kc.control_channel.send(kc.session.msg("delete_subshell_request", {"subshell_id": subshell}))
            kc.control_channel.get_msg(timeout=10)
        kernel.shutdown()
