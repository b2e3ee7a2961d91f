"""The panel of a pool's call: a launch's panel, drawn on the call seen as a launch.

The pool's call (:func:`air_magic.kernel.pool.wait.run_call`) makes a
:class:`~air_magic.kernel.pool.view.PoolCallView` as a call begins and calls the factory
registered in ``CALL_WATCHERS`` with it; ``end()`` once the view says how the call ended::

    call begins   --> PoolCallPanel; the cell's own wait loop calls tick(), which does nothing
                      for SHOW_AFTER s (a quick cell shows nothing: the notebook's loop stays
                      as fast as the pool; no thread is woken)
    still running --> the launch's own PanelObserver on the view: the same widgets (a bar,
                      rate and ETA per rank, CPU · RSS, Stop, Where?, the log tabs, the chart
                      of the call's points, the pool's MLflow run) or the same text lines, with
                      the pool's line on top; its thread refreshes it as a launch's
    tick()        --> the lines it queued for the cell (text mode) are printed by the cell's thread
    end()         --> the observer's before_end / after_end: the launch's summary (HTML, text,
                      and the lab extension's data) replaces the panel

Only in a kernel (JupyterLab, Notebook, VS Code, nbclient), and only where a launch would get
a panel (``panel_mode``): terminal IPython and plain Python show rank 0's output alone.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from air_magic.panel._frontend import _shell, panel_mode
from air_magic.panel._observer import PanelObserver

if TYPE_CHECKING:
    from air_magic.kernel.pool.view import PoolCallView

__all__ = ["PoolCallPanel", "pool_call_panel", "SHOW_AFTER"]

#: A call shorter than this shows no panel.
SHOW_AFTER = 1.0


class PoolCallPanel:
    """One call's panel (see the module's docstring)."""

    def __init__(self, view: "PoolCallView", mode: str) -> None:
        self.view = view
        self.mode = mode
        self.observer: PanelObserver | None = None
        self._show_at = time.monotonic() + SHOW_AFTER

    @property
    def shown(self) -> bool:
        return self.observer is not None

    def holds_output(self) -> bool:
        """Rank 0's output waits for the panel (or the call's end): the panel stays above it,
        in the first cell as in the next, even when the cell prints in its first second."""
        return self.observer is None

    def tick(self) -> None:
        """From the cell's own wait loop (every few tens of ms): nothing but a clock read for
        SHOW_AFTER s; then the panel, once; then the lines it queued for the cell."""
        if self.observer is None:
            if time.monotonic() < self._show_at:
                return
            observer = PanelObserver(self.view, self.mode)  # type: ignore[arg-type]
            self.view.observers.append(observer)
            observer.before_start(self.view, {})  # type: ignore[arg-type]
            self.observer = observer
        self._print_notices()

    def end(self) -> None:
        """The call is over (the view says how): the summary replaces the panel."""
        observer = self.observer
        if observer is None:
            return
        observer.before_end(self.view)  # type: ignore[arg-type]
        observer.after_end(self.view)  # type: ignore[arg-type]
        self._print_notices()

    def _print_notices(self) -> None:
        for item, stream in self.view.take_notices():
            if callable(item):
                item()
                continue
            out = sys.stdout if stream == "stdout" else sys.stderr
            out.write(item + "\n")
            out.flush()


def pool_call_panel(view: "PoolCallView") -> PoolCallPanel | None:
    """The panel of a pool's call, where a launch would get one and in a kernel; else None."""
    shell = _shell()
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    mode = panel_mode(shell)
    if mode is None:
        return None
    return PoolCallPanel(view, mode)
