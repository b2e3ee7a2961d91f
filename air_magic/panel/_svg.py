"""The panel's charts: one inline SVG per metric, a polyline per rank (no scripts, no CDN).

Data flow: ``LaunchState.chart_series()`` gives ``{metric: {rank: [(step, value), ...]}}``;
:func:`chart_svg` drops non-finite points, thins each line to at most ``_CHART_POINTS``
points, scales both axes to the data and returns the ``<svg>`` text the HTML renderers
place in the metrics tab and in the summary; :func:`chart_caption` is the line under it
(``loss — rank 0: 0.0824, rank 1: 0.0824 (step 120)``) and :func:`line_sample` the
legend's sample of a rank's line.

Every rank's line has its colour, its dash pattern and its marker on its last point
(hollow after rank 0), and lines drawn later are thinner: ranks whose values are the same
stay visible one under the other.  The left margin fits the longest y-axis label (estimated from its length),
so no label is cut at the SVG's edge.
"""

from __future__ import annotations

import math
from typing import Any

from air_magic.panel._format import _RANK_COLORS, _esc, _fmt_value

_CHART_POINTS = 150  # points drawn per line
_LABEL_SIZE = 10  # px, the axis labels
_CHAR_WIDTH = 0.62  # of the font size: an upper estimate of a digit's width in the UI font
_DASHES = ("", "6 3", "2 2", "8 3 2 3", "1 3", "10 4", "4 2 1 2", "12 3 3 3", "3 5", "6 2 2 2 2 2")
_MARKERS = ("circle", "square", "triangle", "diamond", "cross")


def _rank_color(rank: int) -> str:
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


def _rank_dash(rank: int) -> str:
    return _DASHES[rank % len(_DASHES)]


def _text_width(text: str, size: float = _LABEL_SIZE) -> float:
    """An upper estimate of ``text``'s width in px (no font metrics here)."""
    return len(text) * size * _CHAR_WIDTH


def _marker(rank: int, x: float, y: float, size: float) -> str:
    """A small shape, one kind per rank, at ``(x, y)``: what tells ranks apart where lines coincide."""
    color = _rank_color(rank)
    fill = color if rank == 0 else "none"  # hollow after rank 0: a marker under it shows through
    common = f'data-rank="{rank}" fill="{fill}" stroke="{color}" stroke-width="1.2"'
    shape = _MARKERS[rank % len(_MARKERS)]
    if shape == "circle":
        return f'<circle class="marker" {common} cx="{x:.1f}" cy="{y:.1f}" r="{size:.1f}"/>'
    if shape == "square":
        return (
            f'<rect class="marker" {common} x="{x - size:.1f}" y="{y - size:.1f}" '
            f'width="{2 * size:.1f}" height="{2 * size:.1f}"/>'
        )
    if shape == "triangle":
        points = f"{x:.1f},{y - size * 1.2:.1f} {x + size * 1.1:.1f},{y + size:.1f} {x - size * 1.1:.1f},{y + size:.1f}"
    elif shape == "diamond":
        points = f"{x:.1f},{y - size * 1.3:.1f} {x + size * 1.3:.1f},{y:.1f} {x:.1f},{y + size * 1.3:.1f} {x - size * 1.3:.1f},{y:.1f}"
    else:  # cross
        return (
            f'<path class="marker" {common} '
            f'd="M{x - size:.1f},{y - size:.1f}L{x + size:.1f},{y + size:.1f}M{x - size:.1f},{y + size:.1f}L{x + size:.1f},{y - size:.1f}"/>'
        )
    return f'<polygon class="marker" {common} points="{points}"/>'


def line_sample(rank: int, width: int = 22, height: int = 10) -> str:
    """The legend's sample of rank ``rank``'s line: its colour, dashes and marker."""
    dash = _rank_dash(rank)
    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'style="vertical-align:middle" data-rank="{rank}">'
        f'<line x1="0" y1="{height / 2}" x2="{width}" y2="{height / 2}" stroke="{_rank_color(rank)}" '
        f'stroke-width="1.5"{dash_attr}/>{_marker(rank, width / 2, height / 2, 2.6)}</svg>'
    )


def _finite(series: dict[int, list[tuple[float, float]]]) -> dict[int, list[tuple[float, float]]]:
    clean = {
        rank: [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)] for rank, points in series.items()
    }
    return {rank: points for rank, points in clean.items() if points}


def _clean(series: dict[int, list[tuple[float, float]]]) -> dict[int, list[tuple[float, float]]]:
    clean = _finite(series)
    xs = [x for points in clean.values() for x, _ in points]
    if xs and max(xs) == min(xs):  # no steps given: use the order of the calls
        clean = {rank: [(float(i), y) for i, (_, y) in enumerate(points)] for rank, points in clean.items()}
    return clean


def chart_caption(key: str, series: dict[int, list[tuple[float, float]]], limit: int = 4) -> str:
    """``loss — rank 0: 0.0824, rank 1: 0.0824 (step 120)``: each rank's latest value.

    More than ``limit`` ranks: the lowest and the highest, ``loss — 0.0801 (rank 3) to
    0.0824 (rank 0), 8 ranks (step 120)``.  The step is the latest any rank logged.
    """
    clean = _finite(series)
    if not clean:
        return ""
    lasts = {rank: points[-1] for rank, points in sorted(clean.items())}
    step = max(x for x, _ in lasts.values())
    where = f" (step {_fmt_value(step)})"
    if len(lasts) <= limit:
        values = ", ".join(f"rank {rank}: {_fmt_value(y)}" for rank, (_, y) in lasts.items())
        return f"{key} — {values}{where}"
    low = min(lasts, key=lambda r: lasts[r][1])
    high = max(lasts, key=lambda r: lasts[r][1])
    return (
        f"{key} — {_fmt_value(lasts[low][1])} (rank {low}) to {_fmt_value(lasts[high][1])} (rank {high}), "
        f"{len(lasts)} ranks{where}"
    )


def chart_model(
    key: str, series: dict[int, list[tuple[float, float]]], width: int = 300, height: int = 130
) -> dict[str, Any] | None:
    """What a chart of one metric draws, in the chart's own pixels: the one model the live
    panel's and the summary's SVG (:func:`chart_svg`) and the lab extension's renderer
    (``labextension/src/mime.ts``, from the summary's data) draw the same way.

    ``left`` fits the longest y label; a metric logged without ``step=`` (every point at
    step 0) is drawn by the order of its calls (``by_index``); ``lines`` holds each rank's
    thinned points, already scaled; ``last`` each rank's last point (its marker)."""
    clean = _clean(series)
    if not clean:
        return None
    by_index = _all_at_one_step(series)
    xs = [x for points in clean.values() for x, _ in points]
    ys = [y for points in clean.values() for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    y_labels = (_fmt_value(y1), _fmt_value(y0))
    # The y labels end 4 px left of the plot: the margin holds the longest one and 2 px more.
    left = max(24, math.ceil(max(_text_width(label) for label in y_labels)) + 6)
    right, top, bottom = 8, 18, 16
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return round(left + (x - x0) / (x1 - x0) * plot_w, 1)

    def sy(y: float) -> float:
        return round(top + (1 - (y - y0) / (y1 - y0)) * plot_h, 1)

    lines: dict[str, list[tuple[float, float]]] = {}
    for rank in sorted(clean):
        points = clean[rank]
        if len(points) > _CHART_POINTS:
            step = len(points) / (_CHART_POINTS - 1)
            points = [points[int(i * step)] for i in range(_CHART_POINTS - 1)] + [points[-1]]
        lines[str(rank)] = [(sx(x), sy(y)) for x, y in points]
    return {
        "key": key,
        "title": _clip_label(key, plot_w, 11),
        "caption": chart_caption(key, series),
        "width": width,
        "height": height,
        "plot": {"left": left, "top": top, "width": plot_w, "height": plot_h},
        "labels": {
            "y_top": y_labels[0],
            "y_bottom": y_labels[1],
            "x_left": _fmt_value(x0),
            "x_right": f"{'call' if by_index else 'step'} {_fmt_value(x1)}",
        },
        "by_index": by_index,
        "lines": lines,
    }


def _all_at_one_step(series: dict[int, list[tuple[float, float]]]) -> bool:
    """Several points of a rank, all at one step: logged without ``step=`` (drawn by call)."""
    finite = _finite(series)
    xs = {x for points in finite.values() for x, _ in points}
    return len(xs) == 1 and any(len(points) > 1 for points in finite.values())


def chart_svg(key: str, series: dict[int, list[tuple[float, float]]], width: int = 300, height: int = 130) -> str:
    """One inline SVG of :func:`chart_model`: a polyline per rank of one metric (no scripts, no CDN)."""
    model = chart_model(key, series, width, height)
    if model is None:
        return ""
    plot, labels = model["plot"], model["labels"]
    left, top, plot_w, plot_h = plot["left"], plot["top"], plot["width"], plot["height"]
    lines = []
    markers = []
    for index, (rank_text, points) in enumerate(model["lines"].items()):
        rank = int(rank_text)
        color = _rank_color(rank)
        dash = _rank_dash(rank)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        stroke = max(1.0, 2.6 - 0.5 * index)  # later lines thinner: the one below shows at their sides
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        lines.append(
            f'<polyline data-rank="{rank}" fill="none" stroke="{color}" stroke-width="{stroke:.1f}"{dash_attr} '
            f'stroke-linejoin="round" points="{coords}"/>'
        )
        x, y = points[-1]
        markers.append(_marker(rank, x, y, max(1.8, 4.0 - 0.6 * index)))
    label = f'font-size="{_LABEL_SIZE}" fill="currentColor"'
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" data-metric="{_esc(key)}" style="margin:2px 8px 2px 0;max-width:100%">'
        f"<title>{_esc(model['caption'])}</title>"
        f'<text x="{left}" y="12" font-size="11" font-weight="bold" fill="currentColor">{_esc(model["title"])}</text>'
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" '
        f'stroke="currentColor" stroke-opacity="0.25"/>'
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end" {label}>{_esc(labels["y_top"])}</text>'
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end" {label}>{_esc(labels["y_bottom"])}</text>'
        f'<text x="{left}" y="{height - 3}" {label}>{_esc(labels["x_left"])}</text>'
        f'<text x="{left + plot_w}" y="{height - 3}" text-anchor="end" {label}>{_esc(labels["x_right"])}</text>'
        + "".join(lines)
        + "".join(markers)
        + "</svg>"
    )


def _clip_label(text: str, room: float, size: float) -> str:
    """``text`` cut (with …) to what fits in ``room`` px at font ``size``."""
    chars = max(1, int(room / (size * _CHAR_WIDTH)))
    return text if len(text) <= chars else text[: chars - 1] + "…"
