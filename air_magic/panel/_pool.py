"""The panel of a pool's call: the pool's ranks while a cell (or ``pool.run``) runs on them.

The pool's engine (:mod:`air_magic.kernel.pool`) calls the factory registered in
``CALL_WATCHERS`` as a call begins, and ``end(outcome)`` once it is over::

    call begins  --> PoolCallPanel; the cell's own wait loop calls tick(), which does nothing
                     for SHOW_AFTER s (a quick cell shows nothing: the notebook's loop stays
                     as fast as the pool; no thread is woken)
    still running --> one display in the cell (HTML and text): a row per rank with its state
                     (running / idle: done with this call / broken), its progress (the last
                     tqdm bar of its log since the call began), memory, its last line;
                     updated in place every TICK s
    end(outcome) --> the display's last state: every rank's, and how the call ended

Only in a kernel (JupyterLab, Notebook, VS Code, nbclient), and only where a launch would get
a panel (``panel_mode``): terminal IPython and plain Python show rank 0's output alone.
"""

from __future__ import annotations

import html
import os
import time
from typing import TYPE_CHECKING

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

    def __init__(self, engine: "PoolEngine", label: str) -> None:
        self.engine = engine
        self.label = label
        self.began = time.monotonic()
        self.display_id = f"air-magic-pool-{id(self):x}-{engine.cells}"
        self.shown = False
        self.outcome = ""
        self._next = self.began + SHOW_AFTER
        # What this call writes: its bars and lines, not an earlier call's.
        ranks = engine.launch.ranks if engine.launch is not None else []
        self.logs = [LogTail(state.log_path, _size(state.log_path)) for state in ranks]

    def tick(self) -> None:
        """From the cell's own wait loop (every few tens of ms): show the panel once the call
        has run SHOW_AFTER s, then update it every TICK s; nothing before (a clock read)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + TICK
        from IPython.display import display, update_display

        if self.shown:
            update_display(self.bundle(), raw=True, display_id=self.display_id)
        else:
            display(self.bundle(), raw=True, display_id=self.display_id)
            self.shown = True

    def end(self, outcome: str) -> None:
        """The call is over (``outcome``: ``done``, ``failed (...)``, ``interrupted``, ``the pool is broken ...``)."""
        self.outcome = outcome
        if self.shown:
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
    return PoolCallPanel(engine, label)
