"""The static summary as data, under a MIME type of its own, for the JupyterLab extension's renderer.

A launch's summary is displayed with three forms; a front end shows the richest it knows::

    application/vnd.air-magic.summary+json   the lab extension draws it (per-rank outcome, the
                                             metrics as charts, the MLflow run, the log tails),
                                             with or without a kernel, trusted or not
    text/html                                JupyterLab, Notebook 7, nbviewer, VS Code ...
    text/plain                               terminals, nbconvert to text, anything else

The JSON is built from the same :class:`LaunchState` as the HTML, so both say the same;
``version`` changes when a field changes meaning (the renderer then falls back to the HTML).
Chart series are thinned to at most ``_POINTS`` points each: a saved notebook stays small.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from air_magic.panel._format import _clip, _progress_text, _where
from air_magic.panel._svg import chart_model

if TYPE_CHECKING:
    from air_magic.panel._state import LaunchState

__all__ = ["SUMMARY_MIME", "SUMMARY_VERSION", "summary_data"]

SUMMARY_MIME = "application/vnd.air-magic.summary+json"
SUMMARY_VERSION = 1
_POINTS = 200  # per chart series
_LOG_LINES = 30  # per rank, as the HTML summary
_FINDINGS = 50


def _number(value: float) -> float | str:
    """A metric value JSON can hold: NaN and infinities as text (a notebook is strict JSON)."""
    return float(value) if math.isfinite(value) else str(value)


def _thin(points: list[tuple[float, float]], limit: int = _POINTS) -> list[list[float]]:
    """At most ``limit`` points, evenly picked, the first and the last kept; points that
    are not finite (a NaN loss) are left out of the chart."""
    points = [p for p in points if math.isfinite(p[0]) and math.isfinite(p[1])]
    if len(points) > limit:
        step = (len(points) - 1) / (limit - 1)
        points = [points[round(i * step)] for i in range(limit)]
    return [[float(x), float(y)] for x, y in points]


def summary_data(state: "LaunchState") -> dict[str, Any]:
    """The summary of an ended launch as JSON-able data (see the module docstring)."""
    launch = state.launch
    ranks = []
    for rank, log in enumerate(state.logs):
        metrics = state.metrics[rank]
        ranks.append(
            {
                "rank": rank,
                "state": state.rank_state(rank),
                "returncode": launch.ranks[rank].returncode,
                "progress": _progress_text(log.progress, metrics.max_step, running=False),
                "metrics": {key: _number(value) for key, (_, value) in metrics.latest.items()},
                "last_line": _clip(log.last_line),
                "log_tail": log.lines[-_LOG_LINES:],
                "log_path": log.path,
            }
        )
    series = state.chart_series()
    charts = {key: {str(rank): _thin(points) for rank, points in lines.items()} for key, lines in series.items()}
    run_id, run_name, run_url, run_command = (
        str(getattr(launch, name, None) or "") for name in ("run_id", "run_name", "run_url", "run_command")
    )
    findings = []
    if state.lint is not None:
        for item in state.lint.items[:_FINDINGS]:
            findings.append({"text": item.text, "hint": item.hint, "fix": item.fix})
    return {
        "version": SUMMARY_VERSION,
        "launch": launch.id,
        "label": launch.label,
        "noun": str(getattr(launch, "noun", "launch")),  # "pool call" for a pool's call
        "context": str(getattr(launch, "context", "") or ""),  # the pool's own line, above the title
        "status": launch.status,
        "outcome": state.outcome() or launch.status,
        "where": _where(launch),
        "world_size": launch.world_size,
        "started_at": launch.started_at,
        "ended_at": launch.ended_at,
        "elapsed": state.elapsed(),
        "ranks": ranks,
        "charts": charts,
        # The one chart model the panel's SVG is drawn from too (_svg.chart_model).
        "chart_models": {key: model for key in series if (model := chart_model(key, series[key])) is not None},
        "tracking": state.tracking,
        "run": {"id": run_id, "name": run_name, "url": run_url, "command": run_command} if run_id or run_name else None,
        "storing": getattr(launch, "storing", None) or "",
        "lint": findings,
        "logs": os.path.dirname(state.logs[0].path) if state.logs else "",
    }
