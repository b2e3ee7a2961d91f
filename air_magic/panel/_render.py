"""What the panel shows, rendered from a :class:`LaunchState`: HTML for widgets, text lines, the summary.

Pure functions of the state (they read it, never change it); the observer decides when
to call them and where the result goes::

    LaunchState --> _top_html    header (label, status, clock, MLflow run, lint), the run's command,
                                 the overall line (slowest rank, ETA, throughput, straggler),
                                 rank table (fixed layout: never wider than the output), outcome
                --> _chart_html  the metrics tab (a legend, one SVG per metric with its caption)
                --> _log_html    one rank's log tab (its last lines)
                --> _lint_html   the linter's findings tab (each with its hint; --fix only if it fixes some)
                --> text_status  one compact line, for front ends without widgets
                --> LaunchSummary  what stays in the notebook at the end (HTML + text/plain, and
                                   the same as data under its own MIME type: _mime.summary_data)
"""

from __future__ import annotations

import os
from typing import Any

from air_magic.panel._format import (
    _CELL,
    _FONT,
    _MONO,
    _MUTED,
    _STATUS_STYLE,
    _clip,
    _esc,
    _fmt_clock,
    _fmt_value,
    _metrics_text,
    _progress_text,
    _status_text,
    _where,
)
from air_magic.panel._lint import _Finding
from air_magic.panel._mime import SUMMARY_MIME, summary_data
from air_magic.panel._state import LaunchState, paused_where
from air_magic.panel._svg import chart_caption, chart_svg, line_sample
from air_magic.protocol import FINAL_STACK_SIGNAL

_SUMMARY_LOG_LINES = 30


def _title_html(state: LaunchState) -> str:
    launch = state.launch
    icon, color = _STATUS_STYLE.get(launch.status, ("●", "#6b7280"))
    where = _where(launch)
    parts = [
        f"<b>{_esc(launch.label)}</b> on {where}",
        f'<span style="color:{color};font-weight:bold">{icon} {_esc(_status_text(launch))}</span>',
    ]
    if not launch.ended_at:  # once it has ended, its outcome line says how long it took
        parts.append(f'<span title="elapsed">{_fmt_clock(state.elapsed())}</span>')
    parts.append(f'<span style="{_MUTED}">{_noun(launch)} {_esc(launch.id)}</span>')
    run = _run_html(launch)
    if run:
        parts.append(run)
    storing = getattr(launch, "storing", None)
    if storing:
        parts.append(f'<span data-air-magic-storing="1" style="{_MUTED}">{_esc(storing)}</span>')
    if state.lint is not None and state.lint.findings:
        n = len(state.lint.findings)
        parts.append(f'<span style="color:#d97706">lint: {n} finding{"s" if n != 1 else ""}</span>')
    return " · ".join(parts)


def _noun(launch: Any) -> str:
    """What the panel calls it: ``launch``, or ``pool call`` (kernel/pool/view.py)."""
    return str(getattr(launch, "noun", "launch"))


def _context(launch: Any) -> str:
    """The line above a pool call's title: the pool itself ('' for a launch)."""
    return str(getattr(launch, "context", "") or "")


def _run(launch: Any) -> tuple[str, str, str, str]:
    """The launch's MLflow run: (id, name, url, command); the fake launches of tests may lack some."""

    def text(name: str) -> str:
        return str(getattr(launch, name, None) or "")

    return text("run_id"), text("run_name"), text("run_url"), text("run_command")


def _run_html(launch: Any) -> str:
    """``MLflow run <name> (<id>)``, a link where the run has a URL (the id in full on hover)."""
    run_id, name, url, _ = _run(launch)
    if not run_id and not name:
        return ""
    shown = _esc(name or run_id[:12])
    if name and run_id:
        shown += f' <span style="{_MUTED}">({_esc(run_id[:12])})</span>'
    if url:
        shown = f'<a href="{_esc(url)}" target="_blank" rel="noopener">{shown}</a>'
    return f'<span data-air-magic-run="1" title="{_esc(run_id)}">MLflow run {shown}</span>'


def _run_command_html(launch: Any) -> str:
    """Where the run has no URL: the command that opens it, as text to copy (one click selects it)."""
    run_id, name, url, command = _run(launch)
    if url or not command or not (run_id or name):
        return ""
    return (
        # Wrapped anywhere (a path has no spaces to break at): a line of ``white-space:pre`` set
        # the panel's least width to its own, and at 1024 px with a sidebar open the whole panel
        # (headline, table) grew past the output area's edge.
        f'<div data-air-magic-run-command="1" style="{_MUTED};max-width:100%">open the run with: '
        f'<code style="display:block;user-select:all;-webkit-user-select:all;white-space:pre-wrap;'
        f'overflow-wrap:anywhere;max-width:100%;{_MONO}">{_esc(command)}</code></div>'
    )


def _overall_html(state: LaunchState) -> str:
    """One line for the whole launch while it runs: the slowest rank's bar, ETA, throughput, a straggler."""
    overall = state.overall()
    if overall is None:
        return ""
    pct = overall.fraction * 100
    # What it measures: the slowest rank's current bar (an epoch's, say), not the whole run.
    label = f"slowest bar {_esc(overall.desc)!s}" if overall.desc else "slowest bar"
    bits = [f"{pct:.0f}% {_esc(overall.n)}/{_esc(overall.total)}"]
    if overall.ranks > 1:
        bits[0] += f" (rank {overall.slowest})"
    if overall.eta:
        bits.append(f"this bar's eta {_esc(overall.eta)}")
    if overall.throughput:
        bits.append(f'<span title="the running ranks\' rates added up">{_esc(overall.throughput)} in all</span>')
    behind = (
        f' <span data-air-magic-behind="1" style="color:#d97706;font-weight:bold">⚠ {_esc(overall.behind)}</span>'
        if overall.behind
        else ""
    )
    return (
        f'<div data-air-magic-overall="1" style="overflow-wrap:anywhere"><progress max="100" value="{pct:.0f}" '
        f'style="width:120px;height:10px;vertical-align:middle"></progress> '
        f'<span title="the slowest rank\'s current progress bar, not the whole run">{label}:</span> '
        f"{' · '.join(bits)}{behind}</div>"
    )


def _overall_text(state: LaunchState) -> str:
    """``slowest Epoch 2: 45% eta 00:02 600 it/s`` and the straggler, for the text line (the
    slowest rank's current bar, by its description: not the whole run)."""
    overall = state.overall()
    if overall is None:
        return ""
    text = f"slowest {overall.desc + ': ' if overall.desc else 'bar '}{overall.fraction * 100:.0f}%"
    if overall.eta:
        text += f" eta {overall.eta}"
    if overall.throughput:
        text += f" {overall.throughput}"
    if overall.behind:
        text += f" ({overall.behind})"
    return text


# The rank table's columns: fixed widths but the last line's, which takes the rest and
# cuts its text with an ellipsis (table-layout: fixed), so the table never outgrows the cell.
# The progress keeps to one line (its bar, then its text cut at the column's end, whole on
# hover): at 1280 px a wrapped one doubled every row while the metrics column had room.
# Fixed and relative widths leave the last line room down to a ~590 px output area (1024 px
# with a sidebar open), where wider ones had squeezed it to nothing.
_COLUMNS = (("rank", "3.5em"), ("state", "8em"), ("progress", "30%"), ("metrics", "11%"), ("usage", "10em"))
_WRAP = "white-space:normal;overflow-wrap:anywhere"
_ELLIPSIS = "white-space:pre;overflow:hidden;text-overflow:ellipsis"


def _table_html(state: LaunchState) -> str:
    launch = state.launch
    gpu = launch.placement.device == "cuda"
    head = "".join(
        f'<th style="{_CELL};{_ELLIPSIS};border-bottom:1px solid var(--jp-border-color2,#ccc)">{h}</th>'
        for h in ("rank", "state", "progress", "metrics", "GPU · memory" if gpu else "CPU · RSS", "last line")
    )
    cols = "".join(f'<col style="width:{width}">' for _, width in _COLUMNS) + "<col>"
    rows = []
    for rank, log in enumerate(state.logs):
        rank_state = state.rank_state(rank)
        icon, color = _STATUS_STYLE.get(
            {"stopped": "cancelled", "stopping": "stopping"}.get(rank_state, rank_state), ("●", "#6b7280")
        )
        metrics = state.metrics[rank]
        progress = log.progress
        bar = ""
        if progress is not None and progress["pct"] is not None:
            bar = (
                f'<progress max="100" value="{progress["pct"]:.0f}" '
                'style="width:80px;height:10px;vertical-align:middle"></progress> '
            )
        returncode = launch.ranks[rank].returncode
        # A rank stopped (by you, or because another failed) did not crash: its exit code,
        # the stop's own doing, is on hover only; the KeyboardInterrupt it printed is muted.
        exit_note = _exit_note(returncode) if rank_state != "stopped" else ""
        stopped_title = f' title="exit {returncode}"' if rank_state == "stopped" and returncode else ""
        running = rank_state == "running"
        said = _progress_text(progress, metrics.max_step, running)
        where = paused_where(launch, rank) if rank_state == "paused" else None
        line = _clip(f"in pdb at {where}" if where else log.last_line)
        line_style = f";{_MUTED}" if rank_state == "stopped" and line.startswith("KeyboardInterrupt") else ""
        rows.append(
            f'<tr data-rank="{rank}" data-state="{_esc(rank_state)}">'
            f'<td style="{_CELL};{_WRAP}">{rank}{_node_html(launch.ranks[rank].node)}</td>'
            f'<td style="{_CELL};{_WRAP};color:{color}"{stopped_title}>{icon} {_esc(rank_state)}{exit_note}</td>'
            f'<td style="{_CELL};{_ELLIPSIS}" title="{_esc(said)}">{bar}{_esc(said)}</td>'
            f'<td style="{_CELL}">{_metrics_cell(metrics.latest)}</td>'
            f'<td style="{_CELL};{_WRAP}">{_esc(state.usage_text(rank))}</td>'
            f'<td style="{_CELL};{_ELLIPSIS};{_MONO}{line_style}" title="{_esc(line)}">{_esc(line)}</td>'
            "</tr>"
        )
    return (
        '<table style="border-collapse:collapse;margin:4px 0;table-layout:fixed;width:100%;max-width:100%">'
        f"<colgroup>{cols}</colgroup><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _metrics_cell(latest: dict[str, tuple[int, float]], limit: int = 3) -> str:
    """The rank's latest metrics, one a line (``loss=0.5``); where the column is too narrow for
    both, the value goes under its name, which is cut at the column's edge (whole on hover): the
    value is always whole (a long name broken every few letters had hidden it)."""
    lines = []
    for key, (_, value) in list(latest.items())[-limit:]:
        shown = _fmt_value(value)
        lines.append(
            f'<div data-air-magic-metric="{_esc(key)}" title="{_esc(key)}={_esc(shown)}" '
            'style="display:flex;flex-wrap:wrap;min-width:0">'
            f'<span style="{_ELLIPSIS};min-width:0;max-width:100%">{_esc(key)}</span>'
            f'<span style="flex:none">={_esc(shown)}</span></div>'
        )
    return "".join(lines)


def _node_html(node: str | None) -> str:
    """Under the rank's number, the machine it runs on (ranks placed on a cluster's nodes)."""
    if not node:
        return ""
    return (
        f'<div data-air-magic-node style="font-size:smaller;color:var(--jp-ui-font-color2,#6b7280)">{_esc(node)}</div>'
    )


def _top_html(state: LaunchState) -> str:
    launch = state.launch
    outcome = state.outcome()
    icon, color = _STATUS_STYLE.get(launch.status, ("●", "#6b7280"))
    outcome_html = (
        f'<div data-air-magic-outcome="1" style="color:{color};font-weight:bold;white-space:pre-wrap">'
        f"{icon} {_esc(outcome)}</div>"
        if outcome
        else ""
    )
    return (
        f'<div class="air-magic-panel" data-air-magic-status="{_esc(launch.status)}" '
        f'data-air-magic-launch="{_esc(launch.id)}" style="{_FONT};max-width:100%;box-sizing:border-box">'
        f"{_context_html(launch)}"
        f'<div style="overflow-wrap:anywhere">{_title_html(state)}</div>{_run_command_html(launch)}'
        f"{_overall_html(state)}{_table_html(state)}{outcome_html}</div>"
    )


def _context_html(launch: Any) -> str:
    context = _context(launch)
    if not context:
        return ""
    return f'<div data-air-magic-context="1" style="{_MUTED};overflow-wrap:break-word">{_esc(context)}</div>'


def _chart_html(state: LaunchState) -> str:
    series = state.chart_series()
    charts = []
    for key, lines in series.items():
        svg = chart_svg(key, lines)
        if svg:
            charts.append(
                f'<figure style="margin:2px 8px 6px 0;width:300px;max-width:100%">{svg}'
                f'<figcaption style="{_MUTED};overflow-wrap:anywhere">{_esc(chart_caption(key, lines))}</figcaption>'
                "</figure>"
            )
    if not charts:
        if not state.tracking:
            return f'<div style="{_FONT};{_MUTED}">tracking is off: no metrics to chart.</div>'
        return f'<div style="{_FONT};{_MUTED}">no metrics logged yet (mlflow.log_metric in the ranks).</div>'
    legend = " ".join(
        f'<span data-air-magic-legend="{r}" style="white-space:nowrap;margin-right:8px">{line_sample(r)} rank {r}</span>'
        for r in range(state.launch.world_size)
    )
    return (
        f'<div style="{_FONT}" data-air-magic-chart="1"><div style="display:flex;flex-wrap:wrap">{legend}</div>'
        f'<div style="display:flex;flex-wrap:wrap">{"".join(charts)}</div></div>'
    )


def _log_where(state: LaunchState, rank: int) -> str:
    path = state.logs[rank].path
    where = f"full log: <code>{_esc(path)}</code>"
    if getattr(state.launch, "run_id", None):
        where += f" · MLflow artifact <code>logs/{_esc(os.path.basename(path))}</code>"
    return where


def _log_html(state: LaunchState, rank: int) -> str:
    log = state.logs[rank]
    body = _esc("\n".join(log.lines)) if log.lines else "(nothing printed yet)"
    # column-reverse keeps a scrolled box at its bottom, where the newest lines are
    return (
        f'<div style="{_FONT}"><div style="{_MUTED}">{_last_lines(len(log.lines))} · {_log_where(state, rank)}</div>'
        '<div style="display:flex;flex-direction:column-reverse;max-height:320px;overflow:auto">'
        f'<pre style="margin:0;{_MONO};white-space:pre-wrap">{body}</pre></div></div>'
    )


def _lint_html(state: LaunchState) -> str:
    """Each finding with its own hint; the ``--fix`` command only when it fixes some of them."""
    lint = state.lint
    if lint is None or not lint.findings:
        return ""
    items = lint.items or [_Finding(text) for text in lint.findings]
    rows = []
    for finding in items[:50]:
        hint = f'<div style="{_MUTED}">→ {_esc(finding.hint)}</div>' if finding.hint else ""
        mark = {"safe": " [fixable: --fix]", "unsafe": " [fixable: --fix --unsafe-fixes]"}.get(finding.fix, "")
        rows.append(f"<li>{_esc(finding.text)}{_esc(mark)}{hint}</li>")
    return (
        f'<div style="{_FONT};overflow-wrap:anywhere" data-air-magic-lint="1">migration linter: '
        f'<ul style="margin:2px 0">{"".join(rows)}</ul>{_fix_advice(items)}</div>'
    )


def _fix_advice(items: list[_Finding]) -> str:
    """``air-magic lint --fix`` fixes 2 of them ... (nothing when no finding is fixable by it)."""
    safe = sum(1 for f in items if f.fix == "safe")
    unsafe = sum(1 for f in items if f.fix == "unsafe")
    n = len(items)
    advice = []
    if safe:
        which = "it" if n == 1 else ("them" if safe == n else f"{safe} of them")
        advice.append(f"<code>air-magic lint --fix</code> fixes {which}")
    if unsafe:
        which = "it" if n == 1 else ("them" if unsafe == n else f"{unsafe} {'more' if safe else 'of them'}")
        advice.append(
            f"<code>air-magic lint --fix --unsafe-fixes</code> fixes {which} (check the result: "
            "the code may behave differently)"
        )
    if not advice:
        return f'<div style="{_MUTED}">these are fixed by hand, as each hint says.</div>'
    rest = n - safe - unsafe
    if rest:
        advice.append(
            f"the other{'s' if rest > 1 else ''} by hand, as {'their hints say' if rest > 1 else 'its hint says'}"
        )
    return "<div>" + "; ".join(advice) + ".</div>"


def _exit_note(returncode: int | None) -> str:
    """`` (exit -9)`` after a rank's state; `` (timeout)`` for the end a timeout gives it
    (its stacks written, by the timeout's own signal); nothing for a clean exit."""
    if returncode in (None, 0):
        return ""
    if returncode == -FINAL_STACK_SIGNAL:
        return " (timeout)"
    return f" (exit {returncode})"


def text_status(state: LaunchState) -> str:
    """One compact line: ``[air_magic] train 0:12 running · r0 45% 450/1000 loss=0.32 · r1 ... · all 40% eta 0:05 ...``."""
    launch = state.launch
    head = f"[air_magic] {launch.label} {_fmt_clock(state.elapsed())} {_status_text(launch)}"
    parts = []
    n = launch.world_size
    shown = range(n) if n <= 4 else (0, n - 1)
    for rank in shown:
        log, metrics = state.logs[rank], state.metrics[rank]
        bits = [state.rank_state(rank)] if state.rank_state(rank) != launch.status else []
        progress = log.progress
        if progress is not None and progress["desc"]:
            bits.append(_clip(progress["desc"], 20))
        if progress is not None and progress["pct"] is not None:
            bits.append(f"{progress['pct']:.0f}% {progress['n']}/{progress['total']}")
        elif progress is not None:
            bits.append(progress["n"])
        elif metrics.max_step is not None:
            bits.append(f"step {metrics.max_step}")
        text = _metrics_text(metrics.latest, 2)
        if text:
            bits.append(text)
        if bits:
            parts.append(f"r{rank} " + " ".join(bits))
    if n > 4:
        parts.insert(1, "…")
    line = " · ".join([head, *parts])
    # The overall part goes last, after the ranks (the line keeps its "status · r0 ..." start),
    # and is never the part cut off: the ranks' parts give way to it.
    overall = _overall_text(state)
    if overall:
        return _clip(line, 220 - len(overall) - 3) + " · " + overall
    return _clip(line, 220)


# -- the static summary ------------------------------------------------------------------


class LaunchSummary:
    """What stays in the notebook after a launch: HTML for Jupyter, text for everything else,
    and the data the lab extension draws it from (``application/vnd.air-magic.summary+json``)."""

    def __init__(self, state: LaunchState) -> None:
        #: What was still being stored of the launch's run when this was made (None: all).
        self.storing: str | None = getattr(state.launch, "storing", None)
        #: The run's line (``MLflow run NAME (ID); open it with: ...``), None before it is made.
        self.run = self.run_text(state.launch)
        self.text = self._text(state)
        self.html = self._html(state)
        self.data = summary_data(state)

    def bundle(self) -> dict[str, Any]:
        """Every form of the summary, as a display's MIME bundle."""
        return {"text/plain": self.text, "text/html": self.html, SUMMARY_MIME: self.data}

    @staticmethod
    def run_text(launch: Any) -> str | None:
        """``MLflow run NAME (ID)``, then the link to it or the command that opens its store."""
        run_id, name, url, command = _run(launch)
        if not run_id and not name:
            return None
        run = f"{name} ({run_id})" if name and run_id else (name or run_id)
        return f"MLflow run {run}" + (f": {url}" if url else f"; open it with: {command}" if command else "")

    @staticmethod
    def _text(state: LaunchState) -> str:
        launch = state.launch
        where = _where(launch)
        lines = [
            f"[air_magic] {launch.label} on {where} ({_noun(launch)} {launch.id}): {state.outcome() or launch.status}"
        ]
        if _context(launch):
            lines.append(f"  {_context(launch)}")
        for rank, log in enumerate(state.logs):
            bits = [state.rank_state(rank)]
            returncode = launch.ranks[rank].returncode
            if bits[0] != "stopped":  # a stopped rank's exit code is the stop's doing
                bits[0] += _exit_note(returncode)
            progress = _progress_text(log.progress, state.metrics[rank].max_step, bits[0] == "running")
            if progress:
                bits.append(progress)
            metrics = _metrics_text(state.metrics[rank].latest)
            if metrics:
                bits.append(metrics)
            if log.last_line:
                bits.append(repr(_clip(log.last_line, 80)))
            node = launch.ranks[rank].node
            lines.append(f"  rank {rank}{f' on {node}' if node else ''}: " + " · ".join(bits))
        run = LaunchSummary.run_text(launch)
        if run is not None:
            lines.append(f"  {run}")
        storing = getattr(launch, "storing", None)
        if storing:
            lines.append(f"  {storing}")
        if state.lint is not None and state.lint.findings:
            first = state.lint.items[0] if state.lint.items else _Finding(state.lint.findings[0])
            hint = f" ({first.hint})" if first.hint else ""
            lines.append(f"  migration linter: {len(state.lint.findings)} finding(s), e.g. {first.text}{hint}")
        lines.append(f"  logs: {os.path.dirname(state.logs[0].path)}")
        # Every line is marked, as all of air_magic's own output is (tools filter on it).
        return "\n".join(line if line.startswith("[air_magic]") else "[air_magic]" + line for line in lines)

    @staticmethod
    def _html(state: LaunchState) -> str:
        details = []
        for rank, log in enumerate(state.logs):
            tail = log.lines[-_SUMMARY_LOG_LINES:]
            if not tail:  # no disclosure to open onto nothing: one quiet line says so
                details.append(f'<div style="{_MUTED}">rank {rank} printed nothing · {_log_where(state, rank)}</div>')
                continue
            body = _esc("\n".join(tail))
            details.append(
                f"<details><summary>rank {rank} log ({_last_lines(len(tail))})</summary>"
                f'<div style="{_MUTED}">{_log_where(state, rank)}</div>'
                f'<pre style="margin:0;{_MONO};white-space:pre-wrap;max-height:300px;overflow:auto">{body}</pre>'
                "</details>"
            )
        chart = ""
        if any(m.series for m in state.metrics):
            chart = f"<details open><summary>metrics</summary>{_chart_html(state)}</details>"
        return _top_html(state) + f'<div style="{_FONT}">{chart}{"".join(details)}{_lint_html(state)}</div>'

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return self.bundle()

    def _repr_html_(self) -> str:
        return self.html

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text)

    def __repr__(self) -> str:
        return self.text


def _last_lines(n: int) -> str:
    return "its last line" if n == 1 else f"last {n} lines"
