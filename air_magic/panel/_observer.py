"""The launch observer: shows a launch's panel, refreshes it on a thread of its own, leaves a summary.

The launcher calls :func:`panel_observer` per launch and the observer's hooks around it::

    before_start  the panel is displayed in the launching cell (widgets or a text line);
                  the refresh thread and the linter start
    the thread    every 0.5 s: LaunchState.refresh(), then the widgets (WidgetPanel) or,
                  now and then, a text line; it ends with the launch
    before_end    the ranks' last metric lines are read (before tracking deletes its spool)
    after_end     LaunchSummary replaces the widget panel at once; as text lines, the
                  waiting cell shows it after rank 0's last output, before its value; a
                  background launch's display is replaced too (its widgets stay open,
                  up to _KEEP_FINISHED)

``launch_mimebundle`` is how a ``Launch`` renders: its panel, or its summary once done;
nothing more in the cell that shows its panel.  While a blocking cell shows a widget panel,
``keep_busy`` keeps the kernel's status busy (see ``_ipykernel``).
"""

from __future__ import annotations

import collections
import contextvars
import functools
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable

from air_magic.panel._format import _status_text, _where
from air_magic.panel._frontend import _shell, panel_mode
from air_magic.panel._ipykernel import keep_busy, release_iopub
from air_magic.panel._render import LaunchSummary, text_status
from air_magic.panel._state import LaunchState
from air_magic.panel._widgets import WidgetPanel

if TYPE_CHECKING:
    from air_magic.kernel.launcher import Launch

_TICK = 0.5  # seconds between refreshes
_FIRST_TICK = 0.2
_LINT_WAIT = 0.3  # seconds the end of a launch waits for the linter at most
_TERMINAL_STORE_WAIT = 30.0  # terminal IPython: how long its summary waits for the run's points


class PanelObserver(WidgetPanel):
    """The panel of one launch (see the package docstring)."""

    timing_name = "panel"  # in Launch.timings

    def __init__(self, launch: "Launch", mode: str) -> None:
        self.launch = launch
        self.mode = mode
        self.state = LaunchState(launch)
        self.shell = _shell()
        self.display_id = f"air-magic-{launch.id}"
        self.cell: int | None = None
        self.background = False
        self.stop_clicked = False
        self.displayed = False
        self.widgets: dict[str, Any] = {}
        self._ctx: contextvars.Context | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sent: dict[str, Any] = {}
        self._chart_sent = -1
        self._log_sent: list[int] = [-1] * launch.world_size
        self._log_next = 0
        self._next_text = 3.0
        self._error: str | None = None
        self._registered = False
        self._keep_busy: Callable[[], None] = _nothing
        self.summary: LaunchSummary | None = None
        self._end_lock = threading.Lock()
        self._end_display: str | None = None  # how the summary was shown: "panel", "end", "text"
        self._stored = threading.Event()  # nothing (more) to store for the launch's run

    # -- observer --------------------------------------------------------------------------

    def before_start(self, launch: "Launch", env: dict[str, str]) -> None:
        self._ctx = contextvars.copy_context()
        shell = self.shell
        if shell is not None:
            self.cell = getattr(shell, "execution_count", None)
            events = getattr(shell, "events", None)
            if events is not None:
                events.register("post_run_cell", self._cell_ended)
                self._registered = True
        if self.mode == "widget":
            self._keep_busy = keep_busy(shell)  # the status bar says Busy while the cell runs
        try:
            if self.mode == "widget":
                self._build_widgets()
                self._show(self._widget_bundle(), update=False)
                PanelObserver._close_retired()
            else:
                self._show({"text/plain": self._start_line()}, update=False)
        except BaseException:  # the launcher goes on without this panel: leave nothing behind
            launch.run_shown = False  # nor does it say the run: tracking does
            self._keep_busy()
            self._unregister()
            self._close_widgets()
            raise
        self._thread = threading.Thread(
            target=self._ctx.copy().run, args=(self._loop,), name=f"air_magic-panel-{launch.id}", daemon=True
        )
        self._thread.start()
        self.state.start_lint()

    def before_end(self, launch: "Launch") -> None:
        # The ranks' last metric lines, read before any observer's after_end: tracking sends
        # them and deletes its spool there.
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        self.state.refresh(tick=0, final=True)

    def after_end(self, launch: "Launch") -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        self._keep_busy()
        self._unregister()
        # A first lint (the linter's import) can take a second: a short launch does not
        # wait for it, it only misses the findings in its summary.
        self.state.join_lint(_LINT_WAIT)
        self.state.refresh(tick=0, final=True)
        self.state.close()
        summary = LaunchSummary(self.state)
        self.summary = summary
        try:
            self._show_end(summary)
        finally:
            # The run's last points are stored behind the values: the summary says so
            # (``launch.storing``) and is shown again, in place, once they are.
            if not launch.when_stored(self._on_stored):
                self._stored.set()
                if summary.storing:  # stored between the summary and the hook: show it now
                    self._on_stored([])

    def _show_end(self, summary: LaunchSummary) -> None:
        if self._error is not None:
            self._run(lambda: print(f"[air_magic] the panel stopped updating: {self._error}", file=sys.stderr))
        if self.mode == "widget":
            # A blocking launch's panel gives way to the summary at once: its last state is
            # enough there; a background panel stays, with everything up to date.
            self._run(lambda: self._update_widgets(final=True, full=self.background))
        terminal = self.shell is not None and getattr(self.shell, "kernel", None) is None
        if not self.background:
            if self.mode == "widget":
                self._show(summary, update=True)  # in place of the panel
                self._end_display = "panel"
                self._retire()
            elif self.launch.waited_on:
                # Text lines: the summary comes last, after the status lines and the last
                # of rank 0's output (the cell's thread shows it), before the cell's value.
                self.launch.notify_call(self._show_last)
            elif terminal:
                self._after_cell()
            else:
                self._show(summary, update=True)
                self._end_display = "panel"
            return
        # A background launch: the launching cell is over; its display gives way to the
        # summary, so that a saved notebook keeps the outcome, not a live panel's first state.
        if not terminal and self.shell is not None:
            self._show(summary, update=True, current=True)
            self._end_display = "background"
        if self.mode == "widget":
            self._keep_open()
        elif terminal or self.shell is None or getattr(self.shell, "execution_count", None) != self.cell:
            # The launching cell is over and the user has moved on: say it where they are
            # now.  (While no cell ran since, the line would land under the launching cell,
            # right below its display, which already says it.)
            line = summary.text.splitlines()[0]
            print(line, file=sys.stdout if self.shell is not None else sys.stderr, flush=True)

    # -- the thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        tick = 0
        gone = 0
        while not self._stop.wait(_FIRST_TICK if tick == 0 else _TICK):
            tick += 1
            try:
                if not self.launch.waited_on:  # a background launch: its lines
                    self.launch.print_notices()  # (the MLflow run) reach its cell from here
                self.state.refresh(tick)
                if self.mode == "widget":
                    self._update_widgets(tick=tick)
                elif not self.background:
                    self._maybe_print()
            except Exception as exc:  # the panel must never disturb a launch: any failure is kept and reported once
                if self._error is None:
                    self._error = f"{type(exc).__name__}: {exc}"
            # A launch that never reached the helper has no end to wait for.
            launcher = self.launch.launcher
            gone = gone + 1 if not launcher.is_active(self.launch) and not self.launch.done() else 0
            if gone > 6:
                break
        release_iopub(self.shell)  # this thread's iopub socket, now that it ends

    def _cell_ended(self, *_: Any) -> None:
        self._keep_busy()
        if not self.launch.done() and self.launch.ended_at is None:
            self.background = True
        self._unregister()

    def _unregister(self) -> None:
        if not self._registered:
            return
        self._registered = False
        try:
            self.shell.events.unregister("post_run_cell", self._cell_ended)
        except (ValueError, AttributeError):
            pass

    # -- text ------------------------------------------------------------------------------------

    def _start_line(self) -> str:
        launch = self.launch
        where = _where(launch)
        noun = getattr(launch, "noun", "launch")
        return f"[air_magic] {launch.label} on {where} ({noun} {launch.id}): {_status_text(launch)}"

    def _maybe_print(self) -> None:
        elapsed = self.state.elapsed()
        if elapsed < self._next_text or self.launch.done():
            return
        # Lines thin out as the launch gets older (a saved notebook keeps each): the next when
        # its age has doubled, 5 minutes apart at most: 6 lines in 2 minutes, about 40 in 3 h.
        self._next_text = elapsed + max(3.0, min(300.0, elapsed))
        stream = "stdout" if self.shell is not None else "stderr"
        if self.launch.waited_on:  # the cell's thread prints it, in turn with rank 0's output
            self.launch.notify(text_status(self.state), stream)
        else:
            print(text_status(self.state), file=getattr(sys, stream), flush=True)

    # -- displaying ----------------------------------------------------------------------------

    def _run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the context of the cell that started the launch (its outputs go there)."""
        if self._ctx is None:
            return fn()
        return self._ctx.copy().run(fn)

    def _show_last(self) -> None:
        """The summary as the cell's last display: the lines written before it (the status
        lines, rank 0's output, buffered by the kernel's streams) are sent first."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        terminal = self.shell is not None and getattr(self.shell, "kernel", None) is None
        if terminal:
            # A terminal cannot show it again in place: it waits (bounded, said after a
            # second) for the run's last points, and is printed once, whole.
            self.wait_stored(_TERMINAL_STORE_WAIT)
        with self._end_lock:
            summary = self._fresh_summary()
            self._show(summary, update=False, new=True)
            self._end_display = "text" if terminal or self.shell is None else "end"

    def _fresh_summary(self) -> LaunchSummary:
        """The summary, made again where what is stored of the run changed since."""
        summary = self.summary
        if summary is None or summary.storing != getattr(self.launch, "storing", None):
            summary = self.summary = LaunchSummary(self.state)
        return summary

    def _on_stored(self, notes: list[tuple[str, str]]) -> None:
        """The run's last points are stored (from the writer's thread): the summary, in
        place, with the run; the lines tracking tells then, in the launch's cell."""
        with self._end_lock:
            shown = self._end_display
            told_run = self.summary is not None and self.summary.run is not None
            summary = None if shown is None else self._fresh_summary()  # else made when shown
        as_text = shown == "text" or self.shell is None  # printed: no display to update in place
        if as_text and not told_run and summary is not None and summary.run is not None:
            # A summary printed as text before the run was made: the run, once, on a line of its own.
            # (indented as the summary's own line of it is: it is that line, come late)
            notes = [(f"[air_magic]  {summary.run}", "stdout" if self.shell is not None else "stderr"), *notes]
        for line, stream in notes:
            self._run(functools.partial(print, line, file=getattr(sys, stream), flush=True))
        # Only now: a terminal's summary waits for this, and its lines must not run into these.
        self._stored.set()
        if summary is None or as_text:  # no display to update
            return
        self._show(
            summary, update=True, current=shown == "background", display_id=self._end_id() if shown == "end" else None
        )

    def _end_id(self) -> str:
        return f"{self.display_id}-end"

    def wait_stored(self, timeout: float) -> bool:
        """Wait for the run's last points (bounded), saying so after a second."""
        if self._stored.wait(1.0):
            return True
        print(
            f"[air_magic] waiting for {getattr(self.launch, 'storing', None) or 'MLflow'}", file=sys.stderr, flush=True
        )
        return self._stored.wait(max(0.0, timeout - 1.0))

    def _show(
        self, obj: Any, *, update: bool, new: bool = False, current: bool = False, display_id: str | None = None
    ) -> None:
        """Display ``obj`` as the launch's display (``update``: in its place); ``new``: a
        display of its own; ``current``: also with the parent of the cell that runs now.

        A front end that is executing another cell (nbclient: nbconvert, papermill) reads
        only that cell's messages: an update of a background launch's display is sent
        with that cell's parent too (ipykernel's publisher falls back to the parent of
        the latest request where the context sets none).
        """
        if self.shell is None:  # plain Python: progress goes where tqdm's goes
            text = obj.text if isinstance(obj, LaunchSummary) else obj.get("text/plain", "")
            print(text, file=sys.stderr, flush=True)
            if isinstance(obj, LaunchSummary):
                self._end_display = "text"
            return
        from IPython.display import display, update_display

        raw = isinstance(obj, dict)
        shown_as = display_id or self.display_id

        def show() -> None:
            if update:
                update_display(obj, display_id=shown_as, raw=raw)
            elif new:  # the summary of a cell that printed text lines: a display of its own
                display(obj, raw=raw, display_id=self._end_id())
            else:
                display(obj, display_id=shown_as, raw=raw)

        self._run(show)
        if current:
            fresh = contextvars.Context()
            if fresh.run(self._parent) != self._run(self._parent):
                fresh.run(show)
        self.displayed = True

    def _parent(self) -> Any:
        """The parent header IPython's display publisher uses here (None: unknown)."""
        return getattr(getattr(self.shell, "display_pub", None), "parent_header", None)

    #: Summaries waiting for their cell to end in a terminal shell (bounded: a shell that
    #: runs no more cells, as in a test process, does not collect them forever).
    _pending: collections.deque[Callable[..., None]] = collections.deque(maxlen=8)

    def _after_cell(self) -> None:
        """Terminal IPython: show the summary once the cell has printed all of rank 0's output.

        A terminal has no display to update in place, and the launch ends before the cell
        has copied the last of rank 0's output; printed now, the summary would come first.
        The cell's values came back already; the summary waits (bounded, said after a
        second) for the run's last points, so that it is printed once, whole.
        """
        shell = self.shell

        def show(*_: Any) -> None:
            try:
                shell.events.unregister("post_run_cell", show)
            except ValueError:
                pass
            from IPython.display import display

            self.wait_stored(_TERMINAL_STORE_WAIT)
            with self._end_lock:
                summary = self._fresh_summary()
                display(summary)
                self._end_display = "text"

        if len(PanelObserver._pending) == PanelObserver._pending.maxlen:
            try:
                shell.events.unregister("post_run_cell", PanelObserver._pending[0])
            except ValueError:
                pass
        PanelObserver._pending.append(show)
        shell.events.register("post_run_cell", show)

    def mimebundle(self) -> dict[str, Any]:
        """How ``Launch`` renders: the live panel, the summary once done, text in its own
        cell; ``{}`` in the cell that displayed its panel (the panel is its display there)."""
        same_cell = (
            self.shell is not None
            and self.cell is not None
            and getattr(self.shell, "execution_count", None) == self.cell
            and self.displayed
        )
        if same_cell:  # the panel is right above: the handle shows as nothing more
            return {}
        summary = self.summary
        if summary is not None:
            return summary.bundle()
        if self.mode == "widget" and self.widgets:
            return self._widget_bundle()
        return {"text/plain": text_status(self.state)}


def _nothing() -> None:
    pass


def shows_panel(launch: "Launch") -> bool:
    """Whether ``launch`` gets a panel here (which then says its MLflow run: live, and in
    its summary, updated in place, or, as text, on a line of its own when the run comes
    after it)."""
    return panel_mode(wanted=launch.spec.panel) is not None


def panel_observer(launch: "Launch") -> PanelObserver | None:
    """The launcher's factory: a panel for every launch unless it is turned off."""
    mode = panel_mode(wanted=launch.spec.panel)
    if mode is None:
        return None
    return PanelObserver(launch, mode)


def launch_mimebundle(launch: "Launch") -> dict[str, Any]:
    """``Launch._repr_mimebundle_``: the panel of the launch, or its text where it has none."""
    for observer in getattr(launch, "observers", ()):
        if isinstance(observer, PanelObserver):
            return observer.mimebundle()
    return {"text/plain": repr(launch)}
