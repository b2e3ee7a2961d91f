"""What the panel shows, rendered from a :class:`LaunchState`: HTML for widgets, text lines, the summary.

Pure functions of the state (they read it, never change it); the observer decides when
to call them and where the result goes::

    LaunchState --> _top_html    header (label, status, clock, MLflow run, lint) + rank table + outcome
                --> _chart_html  the metrics tab (one SVG per metric, from _svg.chart_svg)
                --> _log_html    one rank's log tab (its last lines)
                --> _lint_html   the linter's findings tab
                --> text_status  one compact line, for front ends without widgets
                --> LaunchSummary  what stays in the notebook at the end (HTML + text/plain)
"""

from __future__ import annotations

import os
from typing import Any

from ._format import (
    _CELL,
    _FONT,
    _MONO,
    _MUTED,
    _RANK_COLORS,
    _STATUS_STYLE,
    _clip,
    _esc,
    _fmt_clock,
    _fmt_elapsed,
    _metrics_text,
    _progress_text,
    _status_text,
    _where,
)
from ._state import LaunchState
from ._svg import chart_svg

_SUMMARY_LOG_LINES = 30


def _title_html(state: LaunchState) -> str:
    launch = state.launch
    icon, color = _STATUS_STYLE.get(launch.status, ("●", "#6b7280"))
    where = _where(launch)
    elapsed = _fmt_elapsed(state.elapsed()) if launch.ended_at else _fmt_clock(state.elapsed())
    parts = [
        f"<b>{_esc(launch.label)}</b> on {where}",
        f'<span style="color:{color};font-weight:bold">{icon} {_esc(_status_text(launch))}</span>',
        f'<span title="elapsed">{elapsed}</span>',
        f'<span style="{_MUTED}">launch {_esc(launch.id)}</span>',
    ]
    if launch.run_id:
        if launch.run_url:
            link = f'<a href="{_esc(launch.run_url)}" target="_blank" rel="noopener">{_esc(launch.run_id[:12])}</a>'
            parts.append(f"MLflow run {link}")
        else:
            parts.append(f'<span title="{_esc(launch.run_id)}">MLflow run {_esc(launch.run_id[:12])}</span>')
    if state.lint is not None and state.lint.findings:
        n = len(state.lint.findings)
        parts.append(f'<span style="color:#d97706">lint: {n} finding{"s" if n != 1 else ""}</span>')
    return " · ".join(parts)


def _table_html(state: LaunchState) -> str:
    launch = state.launch
    gpu = launch.placement.device == "cuda"
    head = "".join(
        f'<th style="{_CELL};border-bottom:1px solid var(--jp-border-color2,#ccc)">{h}</th>'
        for h in ("rank", "state", "progress", "metrics", "GPU · memory" if gpu else "CPU · RSS", "last line")
    )
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
        exit_note = f" (exit {returncode})" if returncode not in (None, 0) else ""
        rows.append(
            f'<tr data-rank="{rank}" data-state="{_esc(rank_state)}">'
            f'<td style="{_CELL}">{rank}</td>'
            f'<td style="{_CELL};color:{color}">{icon} {_esc(rank_state)}{exit_note}</td>'
            f'<td style="{_CELL}">{bar}{_esc(_progress_text(progress, metrics.max_step))}</td>'
            f'<td style="{_CELL}">{_esc(_metrics_text(metrics.latest))}</td>'
            f'<td style="{_CELL}">{_esc(state.usage_text(rank))}</td>'
            f'<td style="{_CELL};white-space:pre;{_MONO};max-width:40em;overflow:hidden;text-overflow:ellipsis">'
            f"{_esc(_clip(log.last_line))}</td>"
            "</tr>"
        )
    return (
        f'<table style="border-collapse:collapse;margin:4px 0"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
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
        f'data-air-magic-launch="{_esc(launch.id)}" style="{_FONT}">'
        f"<div>{_title_html(state)}</div>{_table_html(state)}{outcome_html}</div>"
    )


def _chart_html(state: LaunchState) -> str:
    charts = [chart_svg(key, series) for key, series in state.chart_series().items()]
    charts = [c for c in charts if c]
    if not charts:
        if not state.tracking:
            return f'<div style="{_FONT};{_MUTED}">tracking is off: no metrics to chart.</div>'
        return f'<div style="{_FONT};{_MUTED}">no metrics logged yet (mlflow.log_metric in the ranks).</div>'
    legend = " ".join(
        f'<span style="color:{_RANK_COLORS[r % len(_RANK_COLORS)]}">■</span> rank {r}'
        for r in range(state.launch.world_size)
    )
    return (
        f'<div style="{_FONT}" data-air-magic-chart="1"><div>{legend}</div>'
        f'<div style="display:flex;flex-wrap:wrap">{"".join(charts)}</div></div>'
    )


def _log_where(state: LaunchState, rank: int) -> str:
    path = state.logs[rank].path
    where = f"full log: <code>{_esc(path)}</code>"
    if state.launch.run_id:
        where += f" · MLflow artifact <code>logs/{_esc(os.path.basename(path))}</code>"
    return where


def _log_html(state: LaunchState, rank: int) -> str:
    log = state.logs[rank]
    body = _esc("\n".join(log.lines)) if log.lines else "(nothing printed yet)"
    # column-reverse keeps a scrolled box at its bottom, where the newest lines are
    return (
        f'<div style="{_FONT}"><div style="{_MUTED}">last {len(log.lines)} lines · {_log_where(state, rank)}</div>'
        '<div style="display:flex;flex-direction:column-reverse;max-height:320px;overflow:auto">'
        f'<pre style="margin:0;{_MONO};white-space:pre-wrap">{body}</pre></div></div>'
    )


def _lint_html(state: LaunchState) -> str:
    lint = state.lint
    if lint is None or not lint.findings:
        return ""
    items = "".join(f"<li>{_esc(text)}</li>" for text in lint.findings[:50])
    return (
        f'<div style="{_FONT}" data-air-magic-lint="1">migration linter: '
        f'<ul style="margin:2px 0">{items}</ul>fix them with <code>air-magic lint --fix</code>.</div>'
    )


def text_status(state: LaunchState) -> str:
    """One compact line: ``[air_magic] train 0:12 running · r0 45% 450/1000 loss=0.32 · r1 ...``."""
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
    return _clip(line, 220)


# -- the static summary ------------------------------------------------------------------


class LaunchSummary:
    """What stays in the notebook after a launch: HTML for Jupyter, text for everything else."""

    def __init__(self, state: LaunchState) -> None:
        self.text = self._text(state)
        self.html = self._html(state)

    @staticmethod
    def _text(state: LaunchState) -> str:
        launch = state.launch
        where = _where(launch)
        lines = [f"[air_magic] {launch.label} on {where} (launch {launch.id}): {state.outcome() or launch.status}"]
        for rank, log in enumerate(state.logs):
            bits = [state.rank_state(rank)]
            returncode = launch.ranks[rank].returncode
            if returncode not in (None, 0):
                bits[0] += f" (exit {returncode})"
            progress = _progress_text(log.progress, state.metrics[rank].max_step)
            if progress:
                bits.append(progress)
            metrics = _metrics_text(state.metrics[rank].latest)
            if metrics:
                bits.append(metrics)
            if log.last_line:
                bits.append(repr(_clip(log.last_line, 80)))
            lines.append(f"  rank {rank}: " + " · ".join(bits))
        if launch.run_id:
            lines.append(f"  MLflow run {launch.run_id}" + (f": {launch.run_url}" if launch.run_url else ""))
        if state.lint is not None and state.lint.findings:
            lines.append(f"  migration linter: {len(state.lint.findings)} finding(s), e.g. {state.lint.findings[0]}")
        lines.append(f"  logs: {os.path.dirname(state.logs[0].path)}")
        # Every line is marked, as all of air_magic's own output is (tools filter on it).
        return "\n".join(line if line.startswith("[air_magic]") else "[air_magic]" + line for line in lines)

    @staticmethod
    def _html(state: LaunchState) -> str:
        details = []
        for rank, log in enumerate(state.logs):
            tail = log.lines[-_SUMMARY_LOG_LINES:]
            body = _esc("\n".join(tail)) if tail else "(nothing printed)"
            details.append(
                f"<details><summary>rank {rank} log (last {len(tail)} lines)</summary>"
                f'<div style="{_MUTED}">{_log_where(state, rank)}</div>'
                f'<pre style="margin:0;{_MONO};white-space:pre-wrap;max-height:300px;overflow:auto">{body}</pre>'
                "</details>"
            )
        chart = ""
        if any(m.series for m in state.metrics):
            chart = f"<details open><summary>metrics</summary>{_chart_html(state)}</details>"
        return _top_html(state) + f'<div style="{_FONT}">{chart}{"".join(details)}{_lint_html(state)}</div>'

    def _repr_html_(self) -> str:
        return self.html

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text)

    def __repr__(self) -> str:
        return self.text
