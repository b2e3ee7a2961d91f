"""The panel's charts: one inline SVG per metric, a polyline per rank (no scripts, no CDN).

Data flow: ``LaunchState.chart_series()`` gives ``{metric: {rank: [(step, value), ...]}}``;
:func:`chart_svg` drops non-finite points, thins each line to at most ``_CHART_POINTS``
points, scales both axes to the data and returns the ``<svg>`` text the HTML renderers
place in the metrics tab and in the summary.
"""

from __future__ import annotations

import math

from ._format import _RANK_COLORS, _esc, _fmt_value

_CHART_POINTS = 150  # points drawn per line


def chart_svg(key: str, series: dict[int, list[tuple[float, float]]], width: int = 300, height: int = 130) -> str:
    """One inline SVG: a polyline per rank of one metric against its step (no scripts, no CDN)."""
    clean = {
        rank: [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)] for rank, points in series.items()
    }
    clean = {rank: points for rank, points in clean.items() if points}
    if not clean:
        return ""
    xs = [x for points in clean.values() for x, _ in points]
    if max(xs) == min(xs):  # no steps given: use the order of the calls
        clean = {rank: [(float(i), y) for i, (_, y) in enumerate(points)] for rank, points in clean.items()}
        xs = [x for points in clean.values() for x, _ in points]
    ys = [y for points in clean.values() for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    left, right, top, bottom = 46, 8, 18, 16
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * plot_h

    lines = []
    lasts = []
    for rank in sorted(clean):
        points = clean[rank]
        if len(points) > _CHART_POINTS:
            step = len(points) / (_CHART_POINTS - 1)
            points = [points[int(i * step)] for i in range(_CHART_POINTS - 1)] + [points[-1]]
        color = _RANK_COLORS[rank % len(_RANK_COLORS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
        lines.append(
            f'<polyline data-rank="{rank}" fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>'
        )
        lasts.append(points[-1][1])
    last = _fmt_value(lasts[0]) if len(lasts) == 1 else f"{_fmt_value(min(lasts))}…{_fmt_value(max(lasts))}"
    label = 'font-size="10" fill="currentColor"'
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" data-metric="{_esc(key)}" style="margin:2px 8px 2px 0">'
        f'<text x="{left}" y="12" font-size="11" font-weight="bold" fill="currentColor">{_esc(key)}'
        f'<tspan font-weight="normal" opacity="0.7"> last {_esc(last)}</tspan></text>'
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" '
        f'stroke="currentColor" stroke-opacity="0.25"/>'
        f'<text x="{left - 3}" y="{top + 8}" text-anchor="end" {label}>{_esc(_fmt_value(y1))}</text>'
        f'<text x="{left - 3}" y="{top + plot_h}" text-anchor="end" {label}>{_esc(_fmt_value(y0))}</text>'
        f'<text x="{left}" y="{height - 3}" {label}>{_esc(_fmt_value(x0))}</text>'
        f'<text x="{left + plot_w}" y="{height - 3}" text-anchor="end" {label}>step {_esc(_fmt_value(x1))}</text>'
        + "".join(lines)
        + "</svg>"
    )
