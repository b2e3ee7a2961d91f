"""The panel of a pool's call: the pool's ranks while a cell (or ``pool.run``) runs on them.

The pool's engine (:mod:`air_magic.kernel.pool`) calls the factory registered in
``CALL_WATCHERS`` as a call begins, and ``end(outcome)`` once it is over::

    call begins  --> PoolCallPanel, handed to the kernel's one watcher thread, which waits
                     SHOW_AFTER s (a quick cell shows nothing: the notebook's loop stays as
                     fast as the pool)
    still running --> one display in the cell (HTML and text): a row per rank with its state
                     (running / idle: done with this call / broken), its progress (the last
                     tqdm bar of its log since the call began), memory, its last line;
                     updated in place every TICK s
    end(outcome) --> the display's last state: every rank's, and how the call ended

Only in a kernel (JupyterLab, Notebook, VS Code, nbclient), and only where a launch would get
a panel (``panel_mode``): terminal IPython and plain Python show rank 0's output alone.
"""

from __future__ import annotations

import contextvars
import html
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from air_magic.panel._format import _fmt_elapsed
from air_magic.panel._frontend import _shell, panel_mode
from air_magic.panel._sources import LogTail

if TYPE_CHECKING:
    from air_magic.kernel.pool import PoolEngine

__all__ = ["PoolCallPanel", "pool_call_panel", "SHOW_AFTER"]

#: A call shorter than this shows no panel.
SHOW_AFTER = 1.0
TICK = 0.5

_CELL = "padding:1px 14px 1px 0;text-align:left;white-space:nowrap"
_STATE_COLOURS = {"running": "#1a73e8", "idle": "#188038", "broken": "#d93025"}


class PoolCallPanel:
    """One call's view of the pool (see the module's docstring)."""

    def __init__(self, engine: "PoolEngine", label: str, shell: Any) -> None:
        self.engine = engine
        self.label = label
        self.shell = shell
        self.began = time.monotonic()
        self.display_id = f"air-magic-pool-{id(self):x}-{engine.cells}"
        self.shown = False
        self.outcome = ""
        self.ended = threading.Event()
        self.lock = threading.Lock()
        self.ctx = contextvars.copy_context()  # the cell's: its outputs go there
        # What this call writes: its bars and lines, not an earlier call's.
        ranks = engine.launch.ranks if engine.launch is not None else []
        self.logs = [LogTail(state.log_path, _size(state.log_path)) for state in ranks]

    def end(self, outcome: str) -> None:
        """The call is over (``outcome``: ``done``, ``failed (...)``, ``interrupted``, ``the pool is broken ...``)."""
        with self.lock:
            self.outcome = outcome
            self.ended.set()
            if self.shown:
                self.ctx.run(self._update)

    def show(self) -> None:
        """From the watcher's thread, once the call has run SHOW_AFTER s: the display, then updates."""
        with self.lock:
            if self.ended.is_set():
                return
            from IPython.display import display

            self.ctx.run(display, self.bundle(), raw=True, display_id=self.display_id)
            self.shown = True
        while not self.ended.wait(TICK):
            with self.lock:
                if not self.ended.is_set():
                    self.ctx.run(self._update)

    def _update(self) -> None:
        from IPython.display import update_display

        update_display(self.bundle(), raw=True, display_id=self.display_id)

    # -- what it shows ---------------------------------------------------------------------

    def rows(self) -> list[dict[str, str]]:
        info = self.engine.status()
        rows = []
        for rank in range(info["ranks"]):
            tail = self.logs[rank] if rank < len(self.logs) else None
            progress, last = "", ""
            if tail is not None:
                tail.refresh()
                bar = tail.progress
                if bar is not None:
                    total = f"/{bar['total']}" if bar.get("total") else ""
                    percent = f"{bar['pct']:.0f}% " if bar.get("pct") is not None else ""
                    desc = f"{bar['desc']} " if bar.get("desc") else ""
                    progress = f"{desc}{percent}{bar['n']}{total}"
                last = tail.last_line
            memory = info["memory"][rank]
            state = info["rank_states"][rank]
            if self.outcome and state == "running":
                state = "idle"
            rows.append(
                {
                    "rank": str(rank),
                    "state": state,
                    "progress": progress,
                    "memory": "" if memory is None else f"{memory / 2**20:.0f} MiB",
                    "last": last[-80:],
                }
            )
        return rows

    def headline(self) -> str:
        engine = self.engine
        n = engine.world_size
        where = f" on {engine.spec.backend}" if engine.spec.backend != "local" else ""
        device = engine.launch.placement.device.upper() if engine.launch else "CPU"
        elapsed = _fmt_elapsed(time.monotonic() - self.began)
        if not self.outcome:
            state = f"running {self.label} for {elapsed}"
        else:
            state = f"{self.label}: {self.outcome} after {elapsed}"
        return f"[air_magic] pool of {n} {device} rank{'s' * (n != 1)}{where}: {state}"

    def bundle(self) -> dict[str, str]:
        rows = self.rows()
        text = "\n".join(
            [self.headline()]
            + [
                f"  rank {r['rank']}: {r['state']}"
                + "".join(f", {r[key]}" for key in ("progress", "memory") if r[key])
                + (f" · {r['last']}" if r["last"] else "")
                for r in rows
            ]
        )
        head = "".join(
            f"<th style='{_CELL}'>{name}</th>" for name in ("rank", "state", "progress", "memory", "last line")
        )
        body = "".join(
            "<tr>"
            + f"<td style='{_CELL}'>{r['rank']}</td>"
            + f"<td style='{_CELL};color:{_STATE_COLOURS.get(r['state'], 'inherit')}'>{html.escape(r['state'])}</td>"
            + "".join(f"<td style='{_CELL}'>{html.escape(r[key])}</td>" for key in ("progress", "memory"))
            + f"<td style='{_CELL};font-family:monospace'>{html.escape(r['last'])}</td>"
            + "</tr>"
            for r in rows
        )
        markup = (
            f"<div class='air-magic-pool-call'><div style='font-weight:600'>{html.escape(self.headline())}</div>"
            f"<table style='border-collapse:collapse;margin-top:2px'><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table></div>"
        )
        return {"text/plain": text, "text/html": markup}


class _Watcher:
    """The one thread that shows the panels of a kernel's pool calls (a thread per call
    would cost every quick cell its start)."""

    def __init__(self) -> None:
        self._calls: "queue.SimpleQueue[PoolCallPanel]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="air_magic-pool-panel", daemon=True)
        self._thread.start()

    def watch(self, panel: PoolCallPanel) -> None:
        self._calls.put(panel)

    def _run(self) -> None:
        while True:
            panel = self._calls.get()
            try:
                if not panel.ended.wait(max(0.0, SHOW_AFTER - (time.monotonic() - panel.began))):
                    panel.show()
            except Exception:  # the panel must never disturb a call: that one just stops updating
                pass


_watcher: _Watcher | None = None
_watcher_lock = threading.Lock()


def _watch(panel: PoolCallPanel) -> None:
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            _watcher = _Watcher()
    _watcher.watch(panel)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def pool_call_panel(engine: "PoolEngine", label: str) -> PoolCallPanel | None:
    """The panel of a pool's call, where a launch would get one and in a kernel; else None."""
    shell = _shell()
    if shell is None or getattr(shell, "kernel", None) is None or panel_mode(shell) is None:
        return None
    if engine.launch is None:
        return None
    panel = PoolCallPanel(engine, label, shell)
    _watch(panel)
    return panel
