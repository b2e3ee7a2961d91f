"""panel/: the live panel, as an observer of launches -- widgets, text, the HTML summary, the
JupyterLab side (sidebar, lint endpoint).
Imports kernel/ (types), protocol/, settings, accelerators and lint/; nothing imports it but plugins.py.

The live panel of a launch: widgets in Jupyter, compact text elsewhere, a static summary at the end.

Plugs into the launcher as a :class:`~air_magic.kernel.launcher.LaunchObserver`.  Everything
it shows is read by the kernel from what the ranks already produce, so the ranks pay
nothing for it and user code does not change::

    rank-<r>.log    stdout + stderr of rank r (tqdm's carriage-return updates included)
        | the last 64 KiB, re-read only when the file grew
        +--> progress (the last tqdm status), last output line, the log tab (last 100 lines)
    tracking-<r>.tsv    the rank's fluent mlflow calls (when tracking is on)
        | new lines only, at most 1 MiB a tick (a backlog is skipped, not queued)
        +--> latest metrics, metric steps, chart series (at most 500 points each)
    psutil / NVML on each rank's pid (and its children)
        +--> CPU % and RSS, or GPU utilisation and memory
    Launch (status, ranks, run_id/run_name/run_url/run_command, outcome)
        +--> header, rank states, Stop, elapsed time, final outcome; the MLflow run by name,
             a link to it, or the command that opens it (text to copy)
    every running rank's last bar
        +--> the overall line: the slowest rank's progress and ETA, the ranks' rates
             added up, and a rank called out when it is clearly behind the others
                    |
          one thread per launch, a tick every 0.5 s; a widget trait is assigned only
          when its value changed (the chart at most every 2 s, one log tab a second),
          so a chatty rank costs the front end a few small messages a second
                    |
          widgets (JupyterLab, Notebook 7, VS Code)  or  a text line now and then
                    |
          at the end: a static summary (HTML + text/plain) replaces the panel in the cell

Which front end, decided at each launch (``AIR_MAGIC_PANEL`` can force it)::

    AIR_MAGIC_PANEL      0 / off: no panel     text: text lines     widget: widgets
    (unset / auto)       widgets when the kernel is an ipykernel *and* a front end that
                         renders widgets is recognised: a Jupyter server session
                         (JupyterLab, Notebook 7, nbclassic, Voila: ``JPY_SESSION_NAME``),
                         VS Code (``__vsc_ipynb_file__``, ``VSCODE_PID``), Colab;
                         text otherwise: terminal IPython, plain Python, and kernels a
                         client started directly (nbclient, nbconvert, papermill,
                         jupyter console), where no one renders widgets.

``%config DistributedMagics.panel = False`` turns the panel off for every launch of
the kernel, decorator included.

Where the parts are (each module says how its data flows)::

    _sources      LogTail, MetricsReader, Series, parse_tqdm, UsageSampler (psutil)
                  (GPU numbers: air_magic.accelerators.NvmlDevices)
    _state        LaunchState: the readers of one launch, refreshed each tick; the linter;
                  rank states (stopped/failed ranks show no eta), Overall (the straggler rule)
    _lint         the linter's findings: each with its hint and what fixes it (--fix or by hand)
    _format       numbers, times, progress and rates as text; the styles
    _svg          chart_svg, chart_caption, line_sample (ranks told apart by colour, dash, marker)
    _render       HTML of the panel's parts (a fixed-layout rank table that never outgrows
                  the output area), text_status, LaunchSummary
    _frontend     panel_mode: widgets, text or none
    _ipykernel    the workarounds that use private ipykernel attributes
    _widgets      WidgetPanel: the ipywidgets of a panel
    _observer     PanelObserver (the thread), panel_observer, launch_mimebundle

Stopping.  A click reaches the kernel only when the kernel reads its shell channel: not
while a cell blocks it (ipywidgets issue 3468).  JupyterLab >= 4.4 sends comm messages on
a kernel *subshell* when the kernel has them (ipykernel >= 7), and a subshell runs in its
own thread: there a click during a blocking launch is handled at once (the Stop button's
comm keeps clicks on the subshell they came on, see ``_ipykernel.clicks_where_sent``).  So Stop is
live for background launches (``.submit()``, ``--async``) always, and for blocking ones
while the kernel has a subshell; otherwise the panel says to interrupt the kernel.
"""

from __future__ import annotations

from air_magic.accelerators import NvmlDevices
from air_magic.panel._format import _fmt_bytes, _fmt_clock, _fmt_elapsed, _fmt_value
from air_magic.panel._frontend import panel_mode, widget_front_end
from air_magic.panel._observer import PanelObserver, launch_mimebundle, panel_observer, shows_panel
from air_magic.panel._pool import PoolCallPanel, pool_call_panel
from air_magic.panel._render import LaunchSummary, _chart_html, _lint_html, _log_html, _top_html, text_status
from air_magic.panel._sources import LogTail, MetricsReader, Series, UsageSampler, parse_tqdm
from air_magic.panel._state import LaunchState
from air_magic.panel._svg import chart_svg
from air_magic.panel._widgets import STOP_NOTE_BLOCKING, STOP_NOTE_SUBSHELL, WidgetPanel

__all__ = [
    "PanelObserver",
    "LaunchSummary",
    "PoolCallPanel",
    "panel_observer",
    "shows_panel",
    "pool_call_panel",
    "launch_mimebundle",
    "parse_tqdm",
    "chart_svg",
]

# Also importable from here, as before the package was split (tests and tools use them).
_REEXPORTED = (
    NvmlDevices,
    LaunchState,
    LogTail,
    MetricsReader,
    Series,
    UsageSampler,
    WidgetPanel,
    panel_mode,
    widget_front_end,
    text_status,
    STOP_NOTE_BLOCKING,
    STOP_NOTE_SUBSHELL,
    _top_html,
    _chart_html,
    _log_html,
    _lint_html,
    _fmt_bytes,
    _fmt_clock,
    _fmt_elapsed,
    _fmt_value,
)
