"""The JupyterLab extension's kernel side: the comm target ``air_magic`` and what it says.

The extension (``labextension/``) lists this kernel's launches with Stop, a rank's log
and the cell that started each one.  Everything goes over Jupyter comms that the front end
opens (the kernel only registers the target: a front end without the extension would have
nothing to receive a comm the kernel opened), and the kernel speaks only when something
changed: no front end polls it::

    front end (labextension/src/channel.ts)          kernel (air_magic.plugins, this module)
    ---------------------------------------          ----------------------------------------
                                                     import air_magic: target "air_magic"
                                                     registered (nothing sent)
    a cell whose code names air_magic ended:
    comm_open "air_magic" / {"type": "list"} --->   opened(): {"type": "launches", ...}
                                 <--- comm_close    no target (air_magic not imported): the
                                                     page waits for the next such cell
    a page loaded on a kernel that has one:
    comm_info_request "air_magic"           --->    the open comms; the page adopts one and
    {"type": "list"}                        --->    gets the list on it
                                  <--- "launches"   at a launch's start, each change of its
                                                     state (a watcher thread, only while a
                                                     launch runs) and its end, on every comm
    {"type": "stop", "launch", "request"}   --->    Launch.cancel(); reply {"ok": ...} (a pool's
                                                     launch: its running cell is interrupted as
                                                     Ctrl-C does it, the ranks stay)
    {"type": "close", "launch", "request"}  --->    a pool's launch: the pool is closed (the page
                                                     asked the user first); reply {"ok": ...}
    {"type": "log", "launch", "rank", ...}  --->    the end of that rank's log; reply {"text"}

Every message from the front end that asks something carries ``request``; its answer is
``{"type": "reply", "request": ..., "ok": true|false, ...}``.  A launch is described by
:func:`describe` (``launches``: the running ones and the last ``_RECENT`` ended ones, newest
first); an ended launch is kept as that description only, so the list never holds a
launch's values.  A pool is one item for its whole life (``item``: the pool's key, shared by
the launch of each start of its ranks) with the pool's own state (``pool``).

Stopping a blocking launch.  JupyterLab >= 4.4 sends comm messages on a kernel subshell
when the kernel has them (ipykernel >= 7): the message is handled on the subshell's
thread while the cell blocks the main one (``_ipykernel.messages_where_sent`` keeps it
there).  Where the kernel has no subshell, the front end interrupts the kernel instead
(``blocking`` says which launch that stops).

Migration (``air-magic lint --fix`` on the open notebook) needs no kernel: the server
extension :mod:`air_magic.lint.server` does it.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from air_magic.panel._format import _where
from air_magic.panel._ipykernel import messages_where_sent, release_iopub
from air_magic.panel._state import outcome_text, rank_state

if TYPE_CHECKING:
    from air_magic.kernel.launcher import Launch

__all__ = ["LabChannel", "channel", "opened", "lab_observer", "describe"]

_RECENT = 10  # ended launches listed
_WATCH = 0.5  # seconds between looks at running launches
_LOG_BYTES = 64 * 1024  # of a rank's log, sent at most


def describe(launch: "Launch", cell: dict[str, Any] | None = None) -> dict[str, Any]:
    """One launch as the extension lists it (JSON-able)."""
    ended = launch.ended_at
    elapsed = (ended or time.time()) - launch.started_at
    progress = _progress(launch) if not ended else {}
    run = None
    if launch.run_id or launch.run_name:
        run = {"id": launch.run_id or "", "name": launch.run_name or "", "url": launch.run_url or ""}
    described: dict[str, Any] = {
        "id": launch.id,
        "item": launch.group,
        "label": launch.label,
        "kind": launch.kind,
        "status": launch.status,
        "where": _where(launch),
        "world_size": launch.world_size,
        "ranks": [
            {
                "rank": s.rank,
                "state": rank_state(launch, s.rank),
                "pid": s.pid,
                "returncode": s.returncode,
                "progress": progress.get(s.rank, ""),
            }
            for s in launch.ranks
        ],
        "started_at": launch.started_at,
        "ended_at": ended,
        "elapsed": elapsed,
        "outcome": outcome_text(launch, elapsed) if ended else "",
        "blocking": launch.waited_on and not ended,
        "cell": cell or {},
        "run": run,
        "logs": len(launch.ranks),
    }
    if launch.kind == "pool":
        described["pool"] = facts = _pool_facts(launch)
        if facts["state"] == "closed":
            return _closed(described)
    return described


def _closed(described: dict[str, Any]) -> dict[str, Any]:
    """A pool's item once the pool is closed: the pool and each of its ranks say so."""
    return {
        **described,
        "pool": {**described["pool"], "state": "closed"},
        "ranks": [{**rank, "state": "closed", "progress": ""} for rank in described["ranks"]],
    }


def _pool_facts(launch: "Launch") -> dict[str, Any]:
    """A pool's launch: the pool's own state (what ``pool.state`` and ``%distributed_pool``
    say), its restarts and its cells; ``closed`` once no open pool runs on it."""
    from air_magic.kernel.pool.engine import pool_of

    engine = pool_of(launch.id)
    if engine is None:
        return {"state": "closed", "restarts": None, "calls": None}
    return {"state": str(engine.state), "restarts": engine.restarts, "calls": engine.cells}


def _progress(launch: "Launch") -> dict[int, str]:
    """Each running rank's tqdm bar as ``45%``, from the launch's panel where it has one."""
    for observer in getattr(launch, "observers", ()):
        logs = getattr(getattr(observer, "state", None), "logs", None)
        if logs:
            shown = {}
            for rank, log in enumerate(logs):
                bar = getattr(log, "progress", None)
                if bar and bar.get("pct") is not None:
                    shown[rank] = f"{bar['pct']:.0f}%"
            return shown
    return {}


class LabChannel:
    """This kernel's side of the extension: its comms, the launches it lists, the watcher."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.comms: list[Any] = []
        self.running: dict[str, tuple["Launch", dict[str, Any]]] = {}  # id -> (launch, its cell)
        self.ended: collections.deque[dict[str, Any]] = collections.deque(maxlen=_RECENT)
        self.log_paths: dict[str, list[str]] = {}  # the ended launches' logs, by id
        #: a pool's launch id -> the call running on it (its view, its cell, when it began)
        self.calls: dict[str, tuple[Any, dict[str, Any], float]] = {}
        self._wake = threading.Event()
        self._watcher: threading.Thread | None = None
        self._sent: Any = None
        self.shell: Any = None

    # -- what is listed ------------------------------------------------------------------------

    def launches(self) -> list[dict[str, Any]]:
        """The running launches (newest first), then the ended ones: one item each, a pool's
        starts one item (the newest start's), and a pool no longer open said ``closed``."""
        from air_magic.kernel.pool.engine import open_pools

        with self._lock:
            running = [self._describe(launch, cell) for launch, cell in self.running.values()]
            ended = list(self.ended)
        open_keys = {engine.key for engine in open_pools()}
        listed = sorted(running, key=lambda d: -d["started_at"])
        seen = {d["item"] for d in listed}
        for described in ended:
            if described["item"] in seen:
                continue
            seen.add(described["item"])
            if "pool" in described and described["item"] not in open_keys:
                described = _closed(described)
            listed.append(described)
        return listed

    def message(self) -> dict[str, Any]:
        return {"type": "launches", "launches": self.launches(), "now": time.time()}

    def _describe(self, launch: "Launch", cell: dict[str, Any]) -> dict[str, Any]:
        """A launch as listed; a pool's while one of its cells runs: that cell (its clock,
        where Go to cell goes) and each rank's progress in it."""
        described = describe(launch, cell)
        call = self.calls.get(launch.id)
        if call is not None:
            view, call_cell, began = call
            described["cell"] = call_cell
            described["started_at"] = began
            described["elapsed"] = time.time() - began
            progress = _progress(view)
            for rank in described["ranks"]:
                rank["progress"] = progress.get(rank["rank"], "")
        return described

    def call_began(self, view: Any, cell: dict[str, Any]) -> None:
        with self._lock:
            self.calls[view.pool.id] = (view, cell, time.time())
            listening = bool(self.comms)
        if listening:  # (a pool cell with no front end listening costs a dict entry, no more)
            self.push()

    def call_ended(self, view: Any) -> None:
        with self._lock:
            listed = self.calls.get(view.pool.id)
            if listed is not None and listed[0] is view:
                del self.calls[view.pool.id]
            listening = bool(self.comms)
        if listening:
            self.push()

    def started(self, launch: "Launch", cell: dict[str, Any]) -> None:
        with self._lock:
            self.running[launch.id] = (launch, cell)
            if self.comms:  # no front end listening: nothing to watch for
                self._ensure_watcher()
        self.push()

    def ended_launch(self, launch: "Launch") -> None:
        with self._lock:
            entry = self.running.pop(launch.id, None)
            cell = entry[1] if entry else {}
            self.ended.appendleft(describe(launch, cell))
            self.log_paths[launch.id] = list(launch.log_paths)
            known = {d["id"] for d in self.ended}
            for stale in [i for i in self.log_paths if i not in known]:
                del self.log_paths[stale]
            watcher = self._watcher if not self.running else None
        self.push()
        if watcher is not None and watcher is not threading.current_thread():
            # Nothing runs any more: the watcher ends now, not at its next look, and is
            # gone when the launch's cell returns (no thread outlives the launches).
            self._wake.set()
            deadline = time.monotonic() + _WATCH * 4
            while watcher.is_alive() and not self.running and time.monotonic() < deadline:
                watcher.join(0.05)

    # -- sending -------------------------------------------------------------------------------

    def push(self, force: bool = False) -> None:
        """Send the list to every front end, if it changed (the clocks aside)."""
        message = self.message()
        shape = [{k: v for k, v in d.items() if k != "elapsed"} for d in message["launches"]]
        with self._lock:
            if shape == self._sent and not force:
                return
            self._sent = shape
            comms = list(self.comms)
        for comm in comms:
            self._send(comm, message)

    def _send(self, comm: Any, message: dict[str, Any]) -> None:
        try:
            comm.send(message)
        except Exception:  # a closed comm, a kernel shutting down: that front end is gone
            self._drop(comm)

    def _ensure_watcher(self) -> None:
        if self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(target=self._watch, name="air_magic-lab", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        """While a launch runs: push its changes of state (starting -> running -> stopping)."""
        try:
            while True:
                self._wake.wait(_WATCH)
                self._wake.clear()
                with self._lock:
                    if not self.running:
                        self._watcher = None
                        return
                if self.comms:
                    self.push()
        finally:
            release_iopub(self.shell)  # this thread's iopub socket, now that it ends

    # -- comms ---------------------------------------------------------------------------------

    def adopt(self, comm: Any) -> None:
        """A comm to a front end: its messages handled, the list sent on it."""
        messages_where_sent(comm)
        comm.on_msg(lambda msg: self._on_msg(comm, msg))
        comm.on_close(lambda msg: self._drop(comm))
        with self._lock:
            self.comms.append(comm)
            if self.running:
                self._ensure_watcher()

    def _drop(self, comm: Any) -> None:
        with self._lock:
            if comm in self.comms:
                self.comms.remove(comm)

    def _on_msg(self, comm: Any, msg: dict[str, Any]) -> None:
        data = msg.get("content", {}).get("data", {}) or {}
        kind = data.get("type")
        request = data.get("request")
        try:
            if kind == "list":
                self._send(comm, self.message())
                return
            if kind == "stop":
                reply = self.stop(str(data.get("launch")))
            elif kind == "close":
                reply = self.close_pool(str(data.get("launch")))
            elif kind == "log":
                reply = self.log(str(data.get("launch")), int(data.get("rank", 0)), int(data.get("bytes", _LOG_BYTES)))
            else:
                reply = {"ok": False, "error": f"unknown request {kind!r}"}
        except Exception as exc:  # an answer, never a traceback in the kernel's log
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        self._send(comm, {"type": "reply", "request": request, **reply})

    # -- requests ------------------------------------------------------------------------------

    def stop(self, launch_id: str) -> dict[str, Any]:
        with self._lock:
            entry = self.running.get(launch_id)
        # Listed as running until its observers are told of its end, but over (cancel() says
        # so) once its outcome is known: what the list may already show.
        if entry is None or not entry[0].cancel():  # a pool's launch: cancel() interrupts its call
            from air_magic.kernel.pool.engine import pool_of

            if entry is not None and pool_of(launch_id) is not None:
                return {
                    "ok": False,
                    "error": "the pool runs no cell now, so there is nothing to stop; %distributed_pool --stop "
                    "ends the pool",
                }
            return {"ok": False, "error": f"launch {launch_id} is not running"}
        self._wake.set()
        return {"ok": True, "launch": launch_id}

    def close_pool(self, launch_id: str) -> dict[str, Any]:
        """The sidebar's Close on a pool: its ranks end and their names are lost (the front end
        asked the user first); a cell running on it ends saying the sidebar closed the pool."""
        from air_magic.kernel.pool.engine import pool_of

        engine = pool_of(launch_id)
        if engine is None:
            return {"ok": False, "error": f"no open pool runs as launch {launch_id}"}
        engine.close("closed from the JupyterLab sidebar")
        self._wake.set()
        self.push()
        return {"ok": True, "launch": launch_id}

    def log(self, launch_id: str, rank: int, limit: int) -> dict[str, Any]:
        with self._lock:
            entry = self.running.get(launch_id)
            paths = list(entry[0].log_paths) if entry else self.log_paths.get(launch_id)
        if paths is None:
            return {"ok": False, "error": f"no launch {launch_id} in this kernel's list"}
        if not 0 <= rank < len(paths):
            return {"ok": False, "error": f"launch {launch_id} has no rank {rank}"}
        path = paths[rank]
        limit = max(1024, min(limit, 1024 * 1024))
        try:
            with open(path, "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - limit))
                raw = fh.read()
        except FileNotFoundError:
            return {"ok": False, "error": f"the log of rank {rank} is gone ({path})"}
        text = raw.decode("utf-8", "replace")
        if size > limit:  # from the first whole line
            text = text.partition("\n")[2]
        return {"ok": True, "launch": launch_id, "rank": rank, "path": path, "text": text, "size": size}


_channel: LabChannel | None = None
_channel_lock = threading.Lock()


def channel() -> LabChannel:
    """The kernel's channel (one per kernel)."""
    global _channel
    with _channel_lock:
        if _channel is None:
            _channel = LabChannel()
        return _channel


def _kernel(shell: Any) -> Any:
    return getattr(shell, "kernel", None) if shell is not None else None


def opened(comm: Any, msg: dict[str, Any] | None = None) -> None:
    """A front end opened its comm (target ``air_magic``, registered by
    :func:`air_magic.plugins.lab_target`): adopted, and the list sent on it."""
    lab = channel()
    lab.adopt(comm)
    lab._send(comm, lab.message())


def _cell() -> dict[str, Any]:
    """The notebook cell that runs now: its id (JupyterLab sends it with each execute
    request) and its execution count."""
    from IPython import get_ipython

    shell = get_ipython()
    kernel = _kernel(shell)
    # The In[N] of the running cell, as %%distributed names it ("Cell In[N]"): IPython has
    # counted the cell already, and execution_count is the next one's number.
    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None)
    count = max(numbers.values()) if numbers else getattr(shell, "execution_count", None)
    found: dict[str, Any] = {"execution_count": count}
    try:
        parent = kernel.get_parent("shell") if kernel is not None else {}
        cell_id = (parent.get("metadata") or {}).get("cellId")
        if cell_id:
            found["id"] = str(cell_id)
    except Exception:  # an older kernel: the count alone
        pass
    return found


class _LabObserver:
    """A launch's start and end, told to the channel."""

    timing_name = "lab"

    def __init__(self, lab: LabChannel) -> None:
        self.lab = lab

    def before_start(self, launch: "Launch", env: dict[str, str]) -> None:
        self.lab.started(launch, _cell())

    def after_end(self, launch: "Launch") -> None:
        self.lab.ended_launch(launch)


def lab_observer(launch: "Launch") -> _LabObserver | None:
    """The launcher's factory: the launch is listed where a kernel can have the extension."""
    from IPython import get_ipython

    shell = get_ipython()
    if _kernel(shell) is None:
        return None
    lab = channel()
    with lab._lock:
        lab.shell = shell  # the watcher releases its iopub socket through it
    return _LabObserver(lab)


class _LabCallWatcher:
    """A pool's call, told to the channel (kernel/pool/engine.py's CALL_WATCHERS): the sidebar's pool
    item shows the running cell, its clock and its ranks' progress."""

    def __init__(self, lab: LabChannel, view: Any) -> None:
        self.lab = lab
        self.view = view
        lab.call_began(view, _cell())

    def holds_output(self) -> bool:
        return False

    def tick(self) -> None:
        pass

    def end(self) -> None:
        self.lab.call_ended(self.view)


def lab_call_watcher(view: Any) -> _LabCallWatcher | None:
    """The pool's factory: a call is listed where a kernel can have the extension."""
    from IPython import get_ipython

    if _kernel(get_ipython()) is None:
        return None
    return _LabCallWatcher(channel(), view)
