"""The widget panel of a launch: building its ipywidgets, updating them from the state, closing them.

A mix-in of :class:`~air_magic.panel._observer.PanelObserver` (same object, same
attributes); the observer's thread calls ``_update_widgets`` each tick::

    LaunchState --> renderers (_top_html, _chart_html, _log_html, _lint_html)
                --> _set(): a widget trait is assigned only when its value changed
                    (the chart at most every _CHART_EVERY ticks, one log tab a second)
                --> the front end, through ipywidgets' comms
    Stop / Where? clicks --> Launch.cancel() / Launch.stacks() (on the main thread or a subshell)

Finished panels' widgets are closed later, in bounded queues (``_retire``, ``_keep_open``).
ipywidgets is imported only when widgets are built.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any, Callable

from air_magic.panel._format import _FONT, _MUTED, _esc
from air_magic.panel._ipykernel import clicks_where_sent, subshells_active
from air_magic.panel._render import _chart_html, _lint_html, _log_html, _top_html, text_status
from air_magic.panel._state import LaunchState

if TYPE_CHECKING:
    from air_magic.kernel.launcher import Launch

_CHART_EVERY = 4  # ticks
_KEEP_FINISHED = 20  # finished background panels whose widgets stay open
_WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

STOP_NOTE_BLOCKING = (
    "interrupt the kernel to stop (■ in the toolbar): a click cannot reach a kernel busy with this cell"
)
#: What Stop does, said where it works while the cell runs (the front end sends clicks on a
#: kernel subshell): for a launch, and for a pool's call (kernel/pool/view.py's noun).
STOP_NOTE_SUBSHELL = "Stop ends this launch and its ranks, as ■ does"
STOP_NOTE_POOL = "Stop interrupts this cell on every rank, as ■ does; the pool and its state stay"


class WidgetPanel:
    """The widget half of a panel observer (see the module docstring)."""

    # Set by PanelObserver.__init__.
    launch: "Launch"
    state: LaunchState
    shell: Any
    background: bool
    stop_clicked: bool
    widgets: dict[str, Any]
    _sent: dict[str, Any]
    _chart_sent: int
    _log_sent: list[int]
    _log_next: int

    #: Finished background panels whose widgets stay open (the oldest are closed).
    _finished: collections.deque["WidgetPanel"] = collections.deque()
    _finished_lock = threading.Lock()

    def _run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` where the panel's output goes (PanelObserver: the launching cell's context)."""
        return fn()

    def _build_widgets(self) -> None:
        import ipywidgets as w

        launch = self.launch
        top = w.HTML(value=_top_html(self.state))
        stop = w.Button(
            description="Stop",
            icon="stop",
            button_style="danger",
            disabled=True,
            tooltip="Cancel this launch",
            layout=w.Layout(width="80px", flex="0 0 auto"),  # never squeezed by the note beside it
        )
        where = w.Button(
            description="Where?",
            icon="search",
            disabled=True,
            tooltip="Where is every rank now? (each rank's Python stack)",
            layout=w.Layout(width="90px", flex="0 0 auto"),
        )
        stacks = w.HTML(value="")
        note = w.HTML(value=f'<span style="{_FONT};{_MUTED}">{STOP_NOTE_BLOCKING}</span>')
        chart = w.HTML(value=_chart_html(self.state))
        logs = [w.HTML(value=_log_html(self.state, r)) for r in range(launch.world_size)]
        lint = w.HTML(value="")
        tabs = w.Tab(children=[chart, *logs], titles=["metrics", *[f"rank {r} log" for r in range(launch.world_size)]])
        stop.on_click(self._clicked)
        clicks_where_sent(stop)
        where.on_click(self._where_clicked)
        clicks_where_sent(where)
        root = w.VBox([top, w.HBox([stop, where, note]), tabs], layout=w.Layout(width="100%"))
        self.widgets = {
            "root": root,
            "top": top,
            "stop": stop,
            "where": where,
            "stacks": stacks,
            "note": note,
            "chart": chart,
            "tabs": tabs,
            "lint": lint,
            **{f"log{r}": log for r, log in enumerate(logs)},
        }
        self._sent = {"top": top.value, "note": note.value, "chart": chart.value}

    def _widget_bundle(self) -> dict[str, Any]:
        root = self.widgets["root"]
        return {
            _WIDGET_MIME: {"version_major": 2, "version_minor": 0, "model_id": root.model_id},
            "text/plain": text_status(self.state),
        }

    def _clicked(self, _button: Any) -> None:
        # Runs on the kernel's main thread (background launch) or on a subshell's thread.
        self.stop_clicked = True
        self.launch.cancel()

    def _where_clicked(self, _button: Any) -> None:
        # Where every rank is now: the summary, then every thread's stack, in a tab of its own.
        stacks = self.launch.stacks(timeout=1.0)
        summary = self.launch.where(stacks) or "[air_magic] no rank is running."
        try:
            report = self.launch.hang_report()  # the ranks' collectives, if one waits in one
        except Exception:  # the stacks are shown anyway
            report = None
        if report is not None:
            summary += "\n\n" + report.text()
        full = "\n\n".join(f"rank {rank}:\n{text.rstrip()}" for rank, text in sorted(stacks.items()))
        self._set("stacks", f'<pre style="{_FONT};white-space:pre-wrap">{_esc(summary)}\n\n{_esc(full)}</pre>')
        tabs = self.widgets["tabs"]
        widget = self.widgets["stacks"]
        if widget not in tabs.children:
            tabs.children = (*tabs.children, widget)
            tabs.titles = (*tabs.titles[: len(tabs.children) - 1], "where")
        tabs.selected_index = list(tabs.children).index(widget)

    def _set(self, name: str, value: Any, trait: str = "value") -> None:
        key = name if trait == "value" else f"{name}.{trait}"
        if self._sent.get(key) == value:
            return
        self._sent[key] = value
        setattr(self.widgets[name], trait, value)

    def _update_widgets(self, tick: int = 0, final: bool = False, full: bool = True) -> None:
        if not self.widgets:
            return
        state = self.state
        self._set("top", _top_html(state))
        self._update_stop(final)
        if not full:
            return
        if state.chart_version != self._chart_sent and (final or tick % _CHART_EVERY == 0):
            self._chart_sent = state.chart_version
            self._set("chart", _chart_html(state))
        changed = [r for r, log in enumerate(state.logs) if log.version != self._log_sent[r]]
        if final:
            for rank in changed:
                self._send_log(rank)
        elif changed and tick % 2 == 0:
            # One log tab a second: the one on screen first, then the others in turn.
            selected = (self.widgets["tabs"].selected_index or 0) - 1
            n = len(state.logs)
            rank = selected if selected in changed else min(changed, key=lambda r: (r - self._log_next) % n)
            self._log_next = rank + 1
            self._send_log(rank)
        if state.lint is not None and state.lint.findings and "lint" not in self._sent:
            self._sent["lint"] = True
            lint_widget = self.widgets["lint"]
            lint_widget.value = _lint_html(state)
            tabs = self.widgets["tabs"]
            tabs.children = (*tabs.children, lint_widget)
            tabs.titles = (*tabs.titles[: len(tabs.children) - 1], f"lint ({len(state.lint.findings)})")

    def _send_log(self, rank: int) -> None:
        self._log_sent[rank] = self.state.logs[rank].version
        self._set(f"log{rank}", _log_html(self.state, rank))

    def _update_stop(self, final: bool) -> None:
        launch = self.launch
        if final or launch.done() or launch.status in ("stopping",) or self.stop_clicked:
            enabled = False
            note = "stopping…" if (self.stop_clicked or launch.status == "stopping") and not final else ""
            if final and self.stop_clicked:
                note = "stopped from the panel"
        elif self.background:
            enabled, note = True, "Stop cancels this background launch"
        elif subshells_active(self.shell):
            pool_call = getattr(launch, "noun", "launch") == "pool call"
            enabled, note = True, STOP_NOTE_POOL if pool_call else STOP_NOTE_SUBSHELL
        else:
            enabled, note = False, STOP_NOTE_BLOCKING
        self._set("stop", not enabled, trait="disabled")
        self._set("where", not enabled or launch.done(), trait="disabled")
        self._set("note", f'<span style="{_FONT};{_MUTED}">{_esc(note)}</span>' if note else "")

    def _all_widgets(self) -> list[Any]:
        found: list[Any] = []
        for widget in self.widgets.values():
            for item in (widget, getattr(widget, "layout", None), getattr(widget, "style", None)):
                if item is not None and item not in found:
                    found.append(item)
        root = self.widgets.get("root")
        if root is not None:
            stack = list(root.children)
            while stack:
                child = stack.pop()
                for item in (child, getattr(child, "layout", None), getattr(child, "style", None)):
                    if item is not None and item not in found:
                        found.append(item)
                stack.extend(getattr(child, "children", ()))
        return found

    def _close_widgets(self) -> None:
        for widget in self._all_widgets():
            try:
                widget.close()
            except Exception:  # its comm may be gone with the front end: closing is best effort
                pass
        self.widgets = {}

    #: Blocking panels that gave way to their summary, whose widgets are not closed yet.
    _retired: collections.deque["WidgetPanel"] = collections.deque()

    def _retire(self) -> None:
        """Close this panel's widgets once the next panel's are open.

        JupyterLab shares one subshell among the comms of a target and deletes it when the
        last one closes; comms opened at that very moment can be given the subshell being
        deleted, and their clicks are lost.  Closing a finished panel only after the next
        one is open keeps the count above zero between launches.
        """
        with WidgetPanel._finished_lock:
            WidgetPanel._retired.append(self)
            while len(WidgetPanel._retired) > 2:
                old = WidgetPanel._retired.popleft()
                old._run(old._close_widgets)

    @classmethod
    def _close_retired(cls) -> None:
        with cls._finished_lock:
            retired = list(cls._retired)
            cls._retired.clear()
        for old in retired:
            old._run(old._close_widgets)

    def _keep_open(self) -> None:
        with WidgetPanel._finished_lock:
            WidgetPanel._finished.append(self)
            while len(WidgetPanel._finished) > _KEEP_FINISHED:
                old = WidgetPanel._finished.popleft()
                old._run(old._close_widgets)
