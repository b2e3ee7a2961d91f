"""Reading a panel off the wire: every iopub message of a kernel, widget models rebuilt from them.

The harness's ``Kernel.collect`` keeps only the messages of one cell; a panel also talks
after its cell (background launches), so here every iopub message is recorded, and the
state of each widget model is rebuilt the way a front end does it (``comm_open`` gives
the state, each ``comm_msg`` "update" changes some keys, ``comm_close`` ends it).
"""

from __future__ import annotations

import json
import queue
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from harness import CellResult, Kernel

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@dataclass
class Model:
    comm_id: str
    name: str
    state: dict[str, Any]
    updates: list[dict[str, Any]] = field(default_factory=list)  # each update's changed keys
    update_times: list[float] = field(default_factory=list)
    closed: bool = False

    def history(self, key: str) -> list[Any]:
        """Every value ``key`` had, in order (the opening value first)."""
        values = []
        if key in self.opened:
            values.append(self.opened[key])
        values.extend(update[key] for update in self.updates if key in update)
        return values

    @property
    def opened(self) -> dict[str, Any]:
        return self._opened

    def __post_init__(self) -> None:
        self._opened = dict(self.state)


class Wire:
    """Every iopub message of one kernel, in order, with the widget models they describe."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.messages: list[dict[str, Any]] = []
        self.models: dict[str, Model] = {}

    # -- reading -----------------------------------------------------------------------------

    def _take(self, msg: dict[str, Any]) -> None:
        msg["_received"] = time.monotonic()
        self.messages.append(msg)
        kind, content = msg["msg_type"], msg["content"]
        if kind == "comm_open" and content.get("target_name") == "jupyter.widget":
            state = content["data"]["state"]
            self.models[content["comm_id"]] = Model(content["comm_id"], state.get("_model_name", ""), dict(state))
        elif kind == "comm_msg":
            model = self.models.get(content["comm_id"])
            data = content.get("data", {})
            if model is not None and data.get("method") == "update":
                model.state.update(data["state"])
                model.updates.append(data["state"])
                model.update_times.append(msg["_received"])
        elif kind == "comm_close":
            model = self.models.get(content["comm_id"])
            if model is not None:
                model.closed = True

    def drain(self, seconds: float = 0.0) -> None:
        """Read what arrives for ``seconds`` (at least everything already queued)."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            try:
                msg = self.kernel.kc.get_iopub_msg(timeout=max(0.05, remaining))
            except queue.Empty:
                if remaining <= 0:
                    return
                continue
            self._take(msg)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            try:
                self._take(self.kernel.kc.get_iopub_msg(timeout=0.2))
            except queue.Empty:
                pass
        return True

    def run(self, code: str, timeout: float = 90.0) -> tuple[CellResult, list[dict[str, Any]]]:
        """Run a cell; its result and every message that arrived while it ran (any parent)."""
        return self.collect(self.kernel.execute(code), timeout)

    def collect(self, msg_id: str, timeout: float = 90.0) -> tuple[CellResult, list[dict[str, Any]]]:
        """Wait for a cell sent earlier; its result and its messages (those already read too)."""
        first = next(
            (i for i, m in enumerate(self.messages) if m["parent_header"].get("msg_id") == msg_id), len(self.messages)
        )
        res = CellResult()
        for msg in self.messages[first:]:
            if msg["parent_header"].get("msg_id") == msg_id:
                if res.record(msg):
                    break
        else:
            self._wait_idle(res, msg_id, timeout)
        res.reply = self.kernel._shell_reply(msg_id, 10)
        return res, [m for m in self.messages[first:] if m["parent_header"].get("msg_id") == msg_id]

    def _wait_idle(self, res: CellResult, msg_id: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell did not finish in {timeout} s: {res.stdout[-2000:]!r}")
            try:
                msg = self.kernel.kc.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                continue
            self._take(msg)
            if msg["parent_header"].get("msg_id") == msg_id and res.record(msg):
                return

    def ok(self, code: str, timeout: float = 90.0) -> tuple[CellResult, list[dict[str, Any]]]:
        res, msgs = self.run(code, timeout)
        assert res.error is None, res.error_text
        return res, msgs

    # -- panels ------------------------------------------------------------------------------

    def panels(self) -> list["Panel"]:
        """Every panel seen so far, in the order they were opened."""
        found = []
        for model in self.models.values():
            if model.name == "HTMLModel" and 'class="air-magic-panel"' in model.opened.get("value", ""):
                ref = f"IPY_MODEL_{model.comm_id}"
                if any(m.name == "VBoxModel" and ref in m.opened.get("children", []) for m in self.models.values()):
                    found.append(Panel(self, model))  # its VBox is opened after it
        return found

    def panel(self, launch_id: str) -> "Panel":
        for panel in self.panels():
            if panel.launch_id == launch_id:
                return panel
        raise AssertionError(f"no panel for launch {launch_id}; panels: {[p.launch_id for p in self.panels()]}")

    def model(self, model_id: str) -> Model:
        return self.models[model_id]


def status_of(html: str) -> str | None:
    match = re.search(r'data-air-magic-status="([^"]+)"', html)
    return match.group(1) if match else None


def rank_states(html: str) -> dict[int, str]:
    return {int(r): s for r, s in re.findall(r'<tr data-rank="(\d+)" data-state="([^"]+)"', html)}


class Panel:
    """One launch's panel: the header/table HTML model and its siblings in the same VBox."""

    def __init__(self, wire: Wire, top: Model) -> None:
        self.wire = wire
        self.top = top
        match = re.search(r'data-air-magic-launch="([^"]+)"', top.opened["value"])
        assert match is not None
        self.launch_id = match.group(1)
        self.root = self._root()

    def _root(self) -> Model:
        ref = f"IPY_MODEL_{self.top.comm_id}"
        for model in self.wire.models.values():
            if model.name == "VBoxModel" and ref in model.opened.get("children", []):
                return model
        raise AssertionError("the panel's VBox was not opened")

    def child(self, index: int) -> Model:
        return self.wire.model(self.root.opened["children"][index][len("IPY_MODEL_") :])

    @property
    def html(self) -> str:
        return str(self.top.state["value"])

    @property
    def status(self) -> str | None:
        return status_of(self.html)

    def statuses(self) -> list[str]:
        seen: list[str] = []
        for value in self.top.history("value"):
            status = status_of(value)
            if status and (not seen or seen[-1] != status):
                seen.append(status)
        return seen

    @property
    def stop(self) -> Model:
        row = self.child(1)
        return self.wire.model(row.opened["children"][0][len("IPY_MODEL_") :])

    @property
    def where(self) -> Model:
        row = self.child(1)
        return self.wire.model(row.opened["children"][1][len("IPY_MODEL_") :])

    @property
    def note(self) -> Model:
        row = self.child(1)
        return self.wire.model(row.opened["children"][2][len("IPY_MODEL_") :])

    @property
    def tabs(self) -> Model:
        return self.child(2)

    def tab(self, index: int) -> Model:
        return self.wire.model(self.tabs.state["children"][index][len("IPY_MODEL_") :])

    def comm_ids(self) -> set[str]:
        """The comm ids of every model reachable from the panel's VBox (layouts included)."""
        found: set[str] = set()
        stack = [self.root.comm_id]
        while stack:
            comm_id = stack.pop()
            if comm_id in found or comm_id not in self.wire.models:
                continue
            found.add(comm_id)
            state = self.wire.models[comm_id].state
            for value in state.values():
                refs = value if isinstance(value, list) else [value]
                for ref in refs:
                    if isinstance(ref, str) and ref.startswith("IPY_MODEL_"):
                        stack.append(ref[len("IPY_MODEL_") :])
        return found

    def updates_between(self, start: float, end: float) -> int:
        return sum(
            1 for comm_id in self.comm_ids() for t in self.wire.models[comm_id].update_times if start <= t <= end
        )


def displays(msgs: list[dict[str, Any]], kind: str = "display_data") -> list[dict[str, Any]]:
    return [m["content"] for m in msgs if m["msg_type"] == kind]


def wire_bytes(msgs: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(m["content"])) for m in msgs)
