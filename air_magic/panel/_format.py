"""Formatting for the panel: numbers, times, progress and metrics as short text, and the styles.

Pure functions of plain values (no I/O, no state): the readers' numbers go in, the
strings the renderers and the text lines show come out::

    bytes, seconds, metric values, a tqdm dict  -->  "12 GB", "1:02:03", "0.3201", "45% 450/1000"
    Launch (label, placement, status)           -->  "2 CPU ranks", "running (waiting for ...)"

The styles (status icons and colours, rank colours, CSS snippets) live here too, so the
HTML, the SVG charts and the widgets look alike.
"""

from __future__ import annotations

import html
import math
import re
from typing import TYPE_CHECKING, Any

from air_magic.protocol.units import fmt_bytes

if TYPE_CHECKING:
    from air_magic.kernel.launcher import Launch

_LINE_CHARS = 160  # the "last line" column

_STATUS_STYLE = {
    "starting": ("○", "#6b7280"),
    "running": ("●", "#2563eb"),
    "paused": ("‖", "#7c3aed"),
    "stopping": ("◐", "#d97706"),
    "finished": ("✔", "#16a34a"),
    "failed": ("✖", "#dc2626"),
    "timed out": ("⏱", "#dc2626"),
    "cancelled": ("■", "#6b7280"),
}
_RANK_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
_FONT = "font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:12px;line-height:1.45"
_MONO = "font-family:var(--jp-code-font-family,monospace);font-size:11px"
_CELL = "padding:1px 10px 1px 0;text-align:left;vertical-align:top;white-space:nowrap"
_MUTED = "opacity:0.7"


_fmt_bytes = fmt_bytes  # (one formatter for every surface: protocol/units.py)


def _fmt_elapsed(seconds: float) -> str:
    return f"{max(0.0, seconds):.1f} s" if seconds < 60 else _fmt_clock(seconds)


def _fmt_clock(seconds: float) -> str:
    """Whole seconds, so a running panel's clock changes once a second, not every tick."""
    minutes, sec = divmod(int(max(0.0, seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{sec:02d}" if hours else f"{minutes}:{sec:02d}"


def _fmt_value(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.4g}"


def _progress_text(progress: dict[str, Any] | None, max_step: int | None, running: bool = True) -> str:
    """``train · 45% 450/1000 · 300it/s · eta 00:02``; the eta only while the rank runs
    (a stopped or failed rank's last bar says nothing about when it would have ended)."""
    if progress is None:
        return f"step {max_step}" if max_step is not None else ""
    parts = []
    if progress["desc"]:
        parts.append(progress["desc"])
    if progress["pct"] is not None:
        parts.append(f"{progress['pct']:.0f}% {progress['n']}/{progress['total']}")
    else:
        parts.append(progress["n"])
    if progress["rate"]:
        parts.append(progress["rate"])
    if running and progress["eta"] and progress["pct"] != 100:
        parts.append(f"eta {progress['eta']}")
    return " · ".join(parts)


_SUFFIX = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "Z": 1e21, "Y": 1e24}
_RATE = re.compile(r"^\s*(?P<num>\d[\d.]*)(?P<suffix>[kMGTPEZY]?)(?P<a>[^/\s]*)/(?P<b>\S+)\s*$")


def _number(text: str | None) -> float | None:
    """tqdm's count, ``450``, ``4.50k``, ``1.2M`` (a unit after it is dropped), as a number."""
    match = re.match(r"^\s*(\d[\d.]*)([kMGTPEZY]?)", text or "")
    if match is None:
        return None
    try:
        return float(match[1]) * _SUFFIX.get(match[2], 1.0)
    except ValueError:
        return None


def _rate_per_second(text: str | None) -> tuple[float, str] | None:
    """tqdm's rate as (items per second, unit): ``299.91it/s`` -> (299.91, "it"), ``1.23s/it`` -> (0.813, "it")."""
    match = _RATE.match(text or "")
    if match is None:
        return None
    try:
        value = float(match["num"]) * _SUFFIX.get(match["suffix"], 1.0)
    except ValueError:
        return None
    if match["b"] == "s":
        return value, match["a"] or "it"
    if match["a"] == "s" and value > 0:
        return 1.0 / value, match["b"]
    return None


def _fmt_rate(per_second: float, unit: str) -> str:
    """``600 it/s``, ``1.2k it/s``, ``0.81 it/s``."""
    if per_second >= 1000:
        return f"{per_second / 1000:.1f}k {unit}/s"
    return f"{per_second:.3g} {unit}/s" if per_second < 100 else f"{per_second:.0f} {unit}/s"


def _metrics_text(latest: dict[str, tuple[int, float]], limit: int = 3) -> str:
    items = list(latest.items())[-limit:]
    return " ".join(f"{key}={_fmt_value(value)}" for key, (_, value) in items)


def _where(launch: "Launch") -> str:
    """``2 CPU ranks``, ``8 GPU ranks``, ``1 GPU rank``."""
    kind = "GPU" if launch.placement.device == "cuda" else "CPU"
    return f"{launch.world_size} {kind} rank{'s' if launch.world_size != 1 else ''}"


def _clip(text: str, limit: int = _LINE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _status_text(launch: "Launch") -> str:
    """``running``, or ``starting (waiting for the helper process to import torch)``."""
    waiting = getattr(launch, "waiting_for", "")
    return f"{launch.status} ({waiting})" if waiting else launch.status
