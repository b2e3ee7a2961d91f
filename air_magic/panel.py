"""The live panel of a launch: widgets in Jupyter, compact text elsewhere, a static summary at the end.

Plugs into the launcher as a :class:`~air_magic.launcher.LaunchObserver`.  Everything
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
    Launch (status, ranks, run_url, outcome)
        +--> header, rank states, Stop, elapsed time, final outcome
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

Stopping.  A click reaches the kernel only when the kernel reads its shell channel: not
while a cell blocks it (ipywidgets issue 3468).  JupyterLab >= 4.4 sends comm messages on
a kernel *subshell* when the kernel has them (ipykernel >= 7), and a subshell runs in its
own thread: there a click during a blocking launch is handled at once (the Stop button's
comm keeps clicks on the subshell they came on, see ``_clicks_where_sent``).  So Stop is
live for background launches (``.submit()``, ``--async``) always, and for blocking ones
while the kernel has a subshell; otherwise the panel says to interrupt the kernel.
"""

from __future__ import annotations

import collections
import contextvars
import html
import math
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from .launcher import Launch

__all__ = ["PanelObserver", "LaunchSummary", "panel_observer", "launch_mimebundle", "parse_tqdm", "chart_svg"]

_TICK = 0.5  # seconds between refreshes
_FIRST_TICK = 0.2
_CHART_EVERY = 4  # ticks
_USAGE_EVERY = 2  # ticks
_TAIL_BYTES = 64 * 1024  # read from the end of a rank's log per refresh
_LOG_LINES = 100  # lines of a rank's log in its tab
_LOG_CHARS = 8 * 1024  # and at most this many characters
_LINE_CHARS = 160  # the "last line" column
_TSV_CHUNK = 1 << 20  # bytes of a metrics file read per tick
_MAX_POINTS = 500  # points kept per (rank, metric)
_CHART_POINTS = 150  # points drawn per line
_CHART_KEYS = 6  # metrics charted
_MAX_KEYS = 50  # metrics remembered per rank
_SUMMARY_LOG_LINES = 30
_KEEP_FINISHED = 20  # finished background panels whose widgets stay open
_LINT_WAIT = 0.3  # seconds the end of a launch waits for the linter at most
_WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_NUM = r"\d[\d.]*[kMGTPEZY]?"
# tqdm's default bar formats (``{l_bar}{bar}{r_bar}``, and the one without a total); what
# follows the closing bracket is text printed after the bar on the same line.
_TQDM_TOTAL = re.compile(
    rf"(?P<desc>.*?)(?P<pct>\d{{1,3}})%\|[^|]*\|\s*(?P<n>{_NUM})/(?P<total>{_NUM})\s*"
    r"\[(?P<elapsed>[\d:]+)<(?P<eta>[\d:?]+)(?:,\s*(?P<rate>[^,\]]*))?(?:,\s*(?P<postfix>[^\]]*))?\]"
)
_TQDM_OPEN = re.compile(
    rf"(?P<desc>.*?)(?P<n>{_NUM})(?P<unit>[^\s\[\d]*)\s\[(?P<elapsed>[\d:]+),\s*"
    r"(?P<rate>[^,\]]*/[^,\]]*)(?:,\s*(?P<postfix>[^\]]*))?\]"
)

_STATUS_STYLE = {
    "starting": ("○", "#6b7280"),
    "running": ("●", "#2563eb"),
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

STOP_NOTE_BLOCKING = (
    "interrupt the kernel to stop (■ in the toolbar): a click cannot reach a kernel busy with this cell"
)
STOP_NOTE_SUBSHELL = "Stop works during this cell: the front end sends clicks on a kernel subshell"


# -- what the ranks wrote ------------------------------------------------------------------


def parse_tqdm(segment: str) -> dict[str, Any] | None:
    """A tqdm status line (default formats, any unit, with or without a total) as a dict.

    >>> parse_tqdm("train:  45%|####5     | 450/1000 [00:01<00:02, 299.91it/s, loss=0.32]")["pct"]
    45.0
    """
    text = segment.strip()
    # Every bar ends in "[elapsed...]": most lines of a log are rejected here, before a regex.
    if not text or len(text) > 1000 or "]" not in text or "[" not in text:
        return None
    match = _TQDM_TOTAL.match(text)
    if match is not None:
        return {
            "after": text[match.end() :].strip(),
            "desc": match["desc"].strip().rstrip(":").strip(),
            "pct": float(match["pct"]),
            "n": match["n"],
            "total": match["total"],
            "elapsed": match["elapsed"],
            "eta": None if "?" in match["eta"] else match["eta"],
            "rate": _rate(match["rate"]),
            "postfix": (match["postfix"] or "").strip(),
        }
    match = _TQDM_OPEN.match(text)
    if match is not None:
        return {
            "after": text[match.end() :].strip(),
            "desc": match["desc"].strip().rstrip(":").strip(),
            "pct": None,
            "n": match["n"] + match["unit"],
            "total": None,
            "elapsed": match["elapsed"],
            "eta": None,
            "rate": _rate(match["rate"]),
            "postfix": (match["postfix"] or "").strip(),
        }
    return None


def _rate(text: str | None) -> str | None:
    text = (text or "").strip()
    return None if not text or "?" in text else text


def _shown(line: str) -> str:
    """What a terminal shows of a line with carriage returns: its last non-empty part."""
    for part in reversed(line.split("\r")):
        if part.strip():
            return part.rstrip()
    return ""


class LogTail:
    """The end of one rank's log: progress, last line and the lines of its tab (bounded reads)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = -1
        self.lines: list[str] = []
        self.progress: dict[str, Any] | None = None
        self.last_line = ""
        self.version = 0  # bumped when the lines changed

    def refresh(self) -> bool:
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return False
        if size == self.size:
            return False
        self.size = size
        start = max(0, size - _TAIL_BYTES)
        try:
            with open(self.path, "rb") as handle:
                handle.seek(start)
                data = handle.read(_TAIL_BYTES)
        except OSError:
            return False
        text = _ANSI.sub("", data.decode("utf-8", "replace"))
        raw = text.split("\n")
        if start > 0 and len(raw) > 1:
            raw = raw[1:]  # the first line is cut
        progress = None
        shown: list[str] = []
        for line in raw:
            shown.append(_shown(line))
        for line in reversed(raw):
            for part in reversed(line.split("\r")):
                progress = parse_tqdm(part)
                if progress is not None:
                    break
            if progress is not None:
                break
        if progress is not None:
            self.progress = progress  # a flood without bars keeps the last one seen
        last = ""
        for line in reversed(shown):
            bar = parse_tqdm(line)
            text = line.strip() if bar is None else bar["after"]  # a print right after a bar
            if text:
                last = text
                break
        if last or not self.last_line:
            self.last_line = last
        while shown and not shown[-1].strip():
            shown.pop()
        lines = shown[-_LOG_LINES:]
        while sum(len(line) + 1 for line in lines) > _LOG_CHARS and len(lines) > 1:
            lines = lines[len(lines) // 4 or 1 :]
        if len(lines) == 1 and len(lines[0]) > _LOG_CHARS:
            lines = ["…" + lines[0][-_LOG_CHARS:]]
        if lines != self.lines:
            self.lines = lines
            self.version += 1
        return True


class Series:
    """At most ``limit`` points of one metric of one rank: every ``stride``-th point, the
    stride doubling whenever the list fills up, plus always the latest point."""

    __slots__ = ("points", "stride", "seen", "last", "limit")

    def __init__(self, limit: int = _MAX_POINTS) -> None:
        self.points: list[tuple[float, float]] = []
        self.stride = 1
        self.seen = 0
        self.last: tuple[float, float] | None = None
        self.limit = limit

    def add(self, step: float, value: float) -> None:
        if self.seen % self.stride == 0:
            self.points.append((step, value))
            if len(self.points) > self.limit:
                self.points = self.points[::2]
                self.stride *= 2
        self.seen += 1
        self.last = (step, value)

    def all(self) -> list[tuple[float, float]]:
        if self.last is not None and (not self.points or self.points[-1] != self.last):
            return [*self.points, self.last]
        return list(self.points)


class MetricsReader:
    """New lines of one rank's ``tracking-<rank>.tsv`` (``m\\tkey\\tvalue\\tstep\\tts``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.latest: dict[str, tuple[int, float]] = {}
        self.series: dict[str, Series] = {}
        self.max_step: int | None = None
        self.version = 0

    def refresh(self) -> bool:
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return False
        if size <= self.offset:
            return False
        start = self.offset
        if size - start > _TSV_CHUNK:
            start = size - _TSV_CHUNK  # far behind: keep up, skip the middle
        try:
            with open(self.path, "rb") as handle:
                handle.seek(start)
                data = handle.read(size - start)
        except OSError:
            return False
        if start != self.offset:
            cut = data.find(b"\n") + 1
            data = data[cut:]
            start += cut
        end = data.rfind(b"\n") + 1
        self.offset = start + end
        changed = False
        for line in data[:end].decode("utf-8", "replace").splitlines():
            fields = line.split("\t")
            if len(fields) != 5 or fields[0] != "m":
                continue
            key = fields[1]
            try:
                value, step = float(fields[2]), int(float(fields[3]))
            except ValueError:
                continue
            if key not in self.latest and len(self.latest) >= _MAX_KEYS:
                continue
            self.latest[key] = (step, value)
            self.series.setdefault(key, Series()).add(step, value)
            if self.max_step is None or step > self.max_step:
                self.max_step = step
            changed = True
        if changed:
            self.version += 1
        return changed


class UsageSampler:
    """CPU % and RSS of each rank with its children (psutil), and GPU use through NVML."""

    _FAMILY_EVERY = 5  # samples between two looks for new child processes (a scan of /proc)

    def __init__(self, device: str) -> None:
        self.device = device
        self.procs: dict[int, Any] = {}
        self.family: dict[int, list[int]] = {}
        self.samples = 0
        self.nvml: Any = None
        self.nvml_failed = False
        self.text: dict[int, str] = {}
        self.peak_rss: dict[int, int] = {}

    def _proc(self, pid: int) -> Any:
        proc = self.procs.get(pid)
        if proc is None:
            import psutil

            proc = psutil.Process(pid)
            proc.cpu_percent(None)  # the first call only starts the measurement
            self.procs[pid] = proc
        return proc

    def sample(self, ranks: Iterable[Any]) -> None:
        import psutil

        rescan = self.samples % self._FAMILY_EVERY == 0
        self.samples += 1
        live: dict[int, list[int]] = {}
        numbers: dict[int, tuple[float, int]] = {}
        for state in ranks:
            if state.pid is None or state.returncode is not None:
                continue
            pids = self.family.get(state.rank)
            if pids is None or pids[0] != state.pid or rescan:
                try:
                    pids = [state.pid, *(child.pid for child in self._proc(state.pid).children(recursive=True))]
                except psutil.Error:
                    continue
                self.family[state.rank] = pids
            cpu, rss, alive = 0.0, 0, []
            for pid in pids:
                try:
                    proc = self._proc(pid)
                    cpu += proc.cpu_percent(None)
                    rss += proc.memory_info().rss
                    alive.append(pid)
                except psutil.Error:
                    self.procs.pop(pid, None)
            if not alive:
                continue
            live[state.rank] = alive
            numbers[state.rank] = (cpu, rss)
            self.peak_rss[state.rank] = max(self.peak_rss.get(state.rank, 0), rss)
        gpus: dict[int, tuple[int | None, int | None, int | None, int | None]] = {}
        if self.device == "cuda" and live and not self.nvml_failed:
            try:
                if self.nvml is None:
                    self.nvml = NvmlDevices()
                gpus = self.nvml.sample(live)
            except Exception:
                self.nvml_failed = True  # GPU numbers are a bonus; CPU numbers stay
        for rank, (cpu, rss) in numbers.items():
            index, util, used, total = gpus.get(rank, (None, None, None, None))
            if index is not None:
                gpu = f"GPU {index}" + (f" {util}%" if util is not None else "")
                if used is not None:
                    gpu += f" · {_fmt_bytes(used)}" + (f"/{_fmt_bytes(total)}" if total else "")
                self.text[rank] = f"{gpu} · RSS {_fmt_bytes(rss)}"
            else:
                self.text[rank] = f"CPU {cpu:.0f}% · {_fmt_bytes(rss)}"
        keep = {pid for pids in live.values() for pid in pids}
        for pid in [p for p in self.procs if p not in keep]:
            self.procs.pop(pid, None)

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None
        self.procs.clear()


class NvmlDevices:
    """GPU utilisation and memory per rank through NVML (nvidia-ml-py), without touching CUDA."""

    def __init__(self) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        self.visible = [int(e) for e in entries] if entries and all(e.isdigit() for e in entries) else None

    def sample(self, live: dict[int, list[int]]) -> dict[int, tuple[int | None, int | None, int | None, int | None]]:
        nv = self.nv
        devices = []
        for handle in self.handles:
            try:
                util: int | None = int(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
            except nv.NVMLError:
                util = None
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            try:
                procs = {p.pid: p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)}
            except nv.NVMLError:
                procs = {}
            devices.append((util, int(memory.used), int(memory.total), procs))
        result = {}
        for rank, pids in live.items():
            index = None
            used = None
            for i, (_, _, _, procs) in enumerate(devices):
                mine = [procs[p] for p in pids if p in procs]
                if mine:
                    index, used = i, sum(int(m or 0) for m in mine)
                    break
            if index is None:  # pids from another PID namespace: the rank's usual device
                order = self.visible if self.visible is not None else list(range(len(devices)))
                if order and rank < len(order) and order[rank] < len(devices):
                    index = order[rank]
                    used = devices[index][1]
            if index is None:
                result[rank] = (None, None, None, None)
            else:
                result[rank] = (index, devices[index][0], used, devices[index][2])
        return result

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:
            pass


# -- formatting ------------------------------------------------------------------------------


def _fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit != "GB" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


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


def _progress_text(progress: dict[str, Any] | None, max_step: int | None) -> str:
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
    if progress["eta"] and progress["pct"] != 100:
        parts.append(f"eta {progress['eta']}")
    return " · ".join(parts)


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


# -- the state of one launch, read from its files ---------------------------------------------


@dataclass
class _Lint:
    findings: list[str] = field(default_factory=list)
    available: bool = False


_LINT_CACHE: "collections.OrderedDict[str, list[str]]" = collections.OrderedDict()
_LINT_CACHE_SIZE = 128
_LINT_LOCK = threading.Lock()


def _lint_texts(launch: "Launch") -> _Lint:
    """The migration linter's findings for the launched code (none when it is not installed).

    The code's notebook cells are linted (a ``%%distributed`` cell, or the cells that
    define the launched function), each once per kernel: a relaunch costs a lookup.
    """
    try:
        from . import lint  # type: ignore[attr-defined]
    except Exception:
        return _Lint()
    check_cell = getattr(lint, "lint_cell", None)  # IPython syntax included
    check_source = getattr(lint, "lint_source", None)
    if check_cell is None and check_source is None:
        return _Lint()
    sources = getattr(launch, "sources", {}) or {}
    result = _Lint(available=True)
    for display, source in sources.values():
        with _LINT_LOCK:
            cached = _LINT_CACHE.get(source)
        if cached is None:
            cached = []
            try:
                diagnostics = check_cell(source) if check_cell is not None else check_source(_python_of_cell(source))
            except Exception as exc:
                diagnostics = []
                cached.append(f"the linter failed ({type(exc).__name__}: {exc})")
            for diagnostic in diagnostics or ():
                code = str(_attr(diagnostic, "code") or "")
                if code.startswith("AM0"):  # about the linter itself (syntax it cannot parse)
                    continue
                cached.append(_diagnostic_text(diagnostic))
            with _LINT_LOCK:
                _LINT_CACHE[source] = cached
                while len(_LINT_CACHE) > _LINT_CACHE_SIZE:
                    _LINT_CACHE.popitem(last=False)
        result.findings.extend(f"{display}: {text}" for text in cached)
    return result


def _python_of_cell(source: str) -> str:
    """A notebook cell as plain Python, line for line: no ``%%`` header, magics as calls."""
    lines = source.splitlines()
    if lines and lines[0].lstrip().startswith("%%"):
        lines[0] = "#"  # the cell magic's line: keep the numbering of the cell
    text = "\n".join(lines)
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        return str(TransformerManager().transform_cell(text))
    except Exception:
        return text


def _attr(item: Any, name: str) -> Any:
    return item.get(name) if isinstance(item, dict) else getattr(item, name, None)


def _diagnostic_text(diagnostic: Any) -> str:
    def get(*names: str) -> Any:
        for name in names:
            value = _attr(diagnostic, name)
            if value not in (None, ""):
                return value
        return None

    code, message = get("code", "rule"), get("message", "msg")
    line = get("line", "lineno", "row")
    if message is None:
        return str(diagnostic)
    return " ".join(str(p) for p in (code, f"line {line}:" if line is not None else None, message) if p)


class LaunchState:
    """Everything the panel shows, gathered by one thread (then read by the renderers)."""

    def __init__(self, launch: "Launch") -> None:
        self.launch = launch
        self.logs = [LogTail(state.log_path) for state in launch.ranks]
        self.metrics = [
            MetricsReader(os.path.join(launch.work_dir, f"tracking-{state.rank}.tsv")) for state in launch.ranks
        ]
        self.tracking = bool(getattr(launch.spec, "tracking", False))
        self.usage = UsageSampler(launch.placement.device)
        self.lint: _Lint | None = None
        self._lint_thread: threading.Thread | None = None
        self.chart_version = 0

    def start_lint(self) -> None:
        """Lint the launched code on a thread of its own: never on the launch's path."""

        def work() -> None:
            try:
                self.lint = _lint_texts(self.launch)
            except Exception:
                self.lint = _Lint()

        self._lint_thread = threading.Thread(target=work, name=f"air_magic-lint-{self.launch.id}", daemon=True)
        self._lint_thread.start()

    def join_lint(self, timeout: float) -> None:
        if self._lint_thread is not None:
            self._lint_thread.join(timeout)

    def refresh(self, tick: int, final: bool = False) -> None:
        for log in self.logs:
            log.refresh()
        if self.tracking and sum(m.refresh() for m in self.metrics):  # every reader, no short cut
            self.chart_version += 1
        if not final and tick % _USAGE_EVERY == 1:
            try:
                self.usage.sample(self.launch.ranks)
            except Exception:
                pass

    def usage_text(self, rank: int) -> str:
        """Live CPU/GPU numbers of a running rank; its peak memory once it has ended."""
        if self.launch.ranks[rank].returncode is not None:
            peak = self.usage.peak_rss.get(rank)
            return f"peak RSS {_fmt_bytes(peak)}" if peak else ""
        return self.usage.text.get(rank, "")

    def elapsed(self) -> float:
        end = self.launch.ended_at or time.time()
        return end - self.launch.started_at

    def rank_state(self, rank: int) -> str:
        state = self.launch.ranks[rank]
        status = self.launch.status
        if state.returncode is not None and state.returncode != 0 and status in ("cancelled", "timed out", "stopping"):
            return "stopped"
        if state.returncode is None and status == "stopping":
            return "stopping"
        return state.state

    def outcome(self) -> str:
        """The launch's end in one line ('' while it runs)."""
        launch = self.launch
        if not launch.done() and launch.ended_at is None:
            return ""
        try:
            error, ended = launch.exception(timeout=0), True
        except TimeoutError:  # its outcome is not read yet
            error, ended = None, False
        took = _fmt_elapsed(self.elapsed())
        if launch.status == "finished" or (ended and error is None):
            return f"finished in {took}"
        if error is not None:
            first = (str(error).strip().splitlines() or [""])[0]
            return f"{launch.status} after {took}: {type(error).__name__}: {_clip(first, 300)}"
        return f"{launch.status} after {took}"

    def chart_series(self) -> dict[str, dict[int, list[tuple[float, float]]]]:
        keys: list[str] = []
        for reader in self.metrics:
            for key in reader.series:
                if key not in keys:
                    keys.append(key)
        keys = keys[:_CHART_KEYS]
        return {
            key: {r: reader.series[key].all() for r, reader in enumerate(self.metrics) if key in reader.series}
            for key in keys
        }

    def close(self) -> None:
        self.usage.close()


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


def _status_text(launch: "Launch") -> str:
    """``running``, or ``starting (waiting for the helper process to import torch)``."""
    waiting = getattr(launch, "waiting_for", "")
    return f"{launch.status} ({waiting})" if waiting else launch.status


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


# -- where the panel is shown ------------------------------------------------------------------


def _shell() -> Any:
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        return ipython.get_ipython()
    except Exception:
        return None


def _magics_setting(shell: Any) -> bool:
    try:
        magics = shell.magics_manager.registry.get("DistributedMagics")
    except AttributeError:
        return True
    return bool(getattr(magics, "panel", True)) if magics is not None else True


def widget_front_end(shell: Any) -> bool:
    """True where a front end that renders ipywidgets is recognised (see the module docstring)."""
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    if os.environ.get("JPY_SESSION_NAME") or os.environ.get("VSCODE_PID"):
        return True
    namespace = getattr(shell, "user_ns", {}) or {}
    return "__vsc_ipynb_file__" in namespace or "google.colab" in sys.modules


def panel_mode(shell: Any = None) -> str | None:
    """``"widget"``, ``"text"``, or ``None`` (panel off) for a launch from here now."""
    shell = _shell() if shell is None else shell
    value = os.environ.get("AIR_MAGIC_PANEL", "auto").strip().lower()
    if value in ("0", "off", "false", "no", "none"):
        return None
    if shell is not None and not _magics_setting(shell):
        return None
    if value in ("text", "plain"):
        return "text"
    if value in ("widget", "widgets"):
        return "widget" if shell is not None and getattr(shell, "kernel", None) is not None else "text"
    return "widget" if widget_front_end(shell) else "text"


def _subshells_active(shell: Any) -> bool:
    """Has a front end opened a subshell in this kernel (so its comm messages run beside a cell)?"""
    kernel = getattr(shell, "kernel", None)
    channel = getattr(kernel, "shell_channel_thread", None)
    manager = getattr(channel, "manager", None)
    try:
        return bool(manager.list_subshell()) if manager is not None else False
    except Exception:
        return False


class PanelObserver:
    """The panel of one launch (see the module docstring)."""

    timing_name = "panel"  # in Launch.timings

    #: Finished background panels whose widgets stay open (the oldest are closed).
    _finished: collections.deque["PanelObserver"] = collections.deque()
    _finished_lock = threading.Lock()

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
        self.summary: LaunchSummary | None = None

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
        try:
            if self.mode == "widget":
                self._build_widgets()
                self._show(self._widget_bundle(), update=False)
                PanelObserver._close_retired()
            else:
                self._show({"text/plain": self._start_line()}, update=False)
        except BaseException:  # the launcher goes on without this panel: leave nothing behind
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
        self._unregister()
        # A first lint (the linter's import) can take a second: a short launch does not
        # wait for it, it only misses the findings in its summary.
        self.state.join_lint(_LINT_WAIT)
        self.state.refresh(tick=0, final=True)
        self.state.close()
        summary = LaunchSummary(self.state)
        self.summary = summary
        if self._error is not None:
            self._run(lambda: print(f"[air_magic] the panel stopped updating: {self._error}", file=sys.stderr))
        if self.mode == "widget":
            # A blocking launch's panel gives way to the summary at once: its last state is
            # enough there; a background panel stays, with everything up to date.
            self._run(lambda: self._update_widgets(final=True, full=self.background))
        if not self.background:
            if self.shell is not None and getattr(self.shell, "kernel", None) is None:
                self._after_cell(summary)
            else:
                self._show(summary, update=True)
            if self.mode == "widget":
                self._retire()
        elif self.mode == "widget":
            self._keep_open()
        else:
            # The launching cell is over: say it where the user is now.
            line = summary.text.splitlines()[0]
            print(line, file=sys.stdout if self.shell is not None else sys.stderr, flush=True)

    # -- the thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        tick = 0
        gone = 0
        while not self._stop.wait(_FIRST_TICK if tick == 0 else _TICK):
            tick += 1
            try:
                if not getattr(self.launch, "_waiter", True):  # a background launch: its lines
                    self.launch._print_notices()  # (the MLflow run) reach its cell from here
                self.state.refresh(tick)
                if self.mode == "widget":
                    self._update_widgets(tick=tick)
                elif not self.background:
                    self._maybe_print()
            except Exception as exc:  # the panel must never disturb a launch
                if self._error is None:
                    self._error = f"{type(exc).__name__}: {exc}"
            # A launch that never reached the helper has no end to wait for.
            launcher = self.launch.launcher
            gone = gone + 1 if not launcher.is_active(self.launch) and not self.launch.done() else 0
            if gone > 6:
                break
        self._release_iopub()

    def _release_iopub(self) -> None:
        """Close this thread's iopub socket as its thread ends.

        ipykernel (7.4) gives each thread that writes to iopub a socket of its own and
        closes those of ended threads every 10 s; a launch's thread ends now, so its
        socket is closed now, once the IOPub thread has sent what was queued.
        """
        pub = getattr(getattr(self.shell, "kernel", None), "iopub_thread", None)
        local = getattr(pub, "_local", None)
        pipe = getattr(local, "event_pipe", None)
        pipes = getattr(pub, "_event_pipes", None)
        lock = getattr(pub, "_event_pipe_gc_lock", None)
        if pipe is None or pipes is None or lock is None:
            return
        deadline = time.monotonic() + 1.0
        while getattr(pub, "_events", None) and time.monotonic() < deadline:
            time.sleep(0.005)
        try:
            with lock:
                pipes.pop(threading.current_thread(), None)
            del local.event_pipe
            pipe.close()
        except Exception:
            pass

    def _cell_ended(self, *_: Any) -> None:
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
        return f"[air_magic] {launch.label} on {where} (launch {launch.id}): {_status_text(launch)}"

    def _maybe_print(self) -> None:
        elapsed = self.state.elapsed()
        if elapsed < self._next_text or self.launch.done():
            return
        # Lines thin out as the launch gets older: a 3 h run prints a few dozen, not thousands.
        self._next_text = elapsed + max(3.0, min(300.0, elapsed / 5))
        print(text_status(self.state), file=sys.stdout if self.shell is not None else sys.stderr, flush=True)

    # -- displaying ----------------------------------------------------------------------------

    def _run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the context of the cell that started the launch (its outputs go there)."""
        if self._ctx is None:
            return fn()
        return self._ctx.copy().run(fn)

    def _show(self, obj: Any, *, update: bool) -> None:
        if self.shell is None:  # plain Python: progress goes where tqdm's goes
            text = obj.text if isinstance(obj, LaunchSummary) else obj.get("text/plain", "")
            print(text, file=sys.stderr, flush=True)
            return
        from IPython.display import display, update_display

        raw = isinstance(obj, dict)

        def show() -> None:
            if update:
                update_display(obj, display_id=self.display_id, raw=raw)
            else:
                display(obj, display_id=self.display_id, raw=raw)

        self._run(show)
        self.displayed = True

    #: Summaries waiting for their cell to end in a terminal shell (bounded: a shell that
    #: runs no more cells, as in a test process, does not collect them forever).
    _pending: collections.deque[Callable[..., None]] = collections.deque(maxlen=8)

    def _after_cell(self, summary: LaunchSummary) -> None:
        """Terminal IPython: show the summary once the cell has printed all of rank 0's output.

        A terminal has no display to update in place, and the launch ends before the cell
        has copied the last of rank 0's output; printed now, the summary would come first.
        """
        shell = self.shell

        def show(*_: Any) -> None:
            try:
                shell.events.unregister("post_run_cell", show)
            except ValueError:
                pass
            from IPython.display import display

            display(summary)

        if len(PanelObserver._pending) == PanelObserver._pending.maxlen:
            try:
                shell.events.unregister("post_run_cell", PanelObserver._pending[0])
            except ValueError:
                pass
        PanelObserver._pending.append(show)
        shell.events.register("post_run_cell", show)

    def mimebundle(self) -> dict[str, Any]:
        """How ``Launch`` renders: the live panel, the summary once done, text in its own cell."""
        text = repr(self.launch)
        same_cell = (
            self.shell is not None
            and self.cell is not None
            and getattr(self.shell, "execution_count", None) == self.cell
            and self.displayed
        )
        if same_cell:  # the panel is right above
            return {"text/plain": text}
        summary = self.summary
        if summary is not None:
            return {"text/plain": summary.text, "text/html": summary.html}
        if self.mode == "widget" and self.widgets:
            return self._widget_bundle()
        return {"text/plain": text_status(self.state)}

    # -- widgets ---------------------------------------------------------------------------------

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
            layout=w.Layout(width="80px"),
        )
        where = w.Button(
            description="Where?",
            icon="search",
            disabled=True,
            tooltip="Where is every rank now? (each rank's Python stack)",
            layout=w.Layout(width="90px"),
        )
        stacks = w.HTML(value="")
        note = w.HTML(value=f'<span style="{_FONT};{_MUTED}">{STOP_NOTE_BLOCKING}</span>')
        chart = w.HTML(value=_chart_html(self.state))
        logs = [w.HTML(value=_log_html(self.state, r)) for r in range(launch.world_size)]
        lint = w.HTML(value="")
        tabs = w.Tab(children=[chart, *logs], titles=["metrics", *[f"rank {r} log" for r in range(launch.world_size)]])
        stop.on_click(self._clicked)
        _clicks_where_sent(stop)
        where.on_click(self._where_clicked)
        _clicks_where_sent(where)
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
        elif _subshells_active(self.shell):
            enabled, note = True, STOP_NOTE_SUBSHELL
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
            except Exception:
                pass
        self.widgets = {}

    #: Blocking panels that gave way to their summary, whose widgets are not closed yet.
    _retired: collections.deque["PanelObserver"] = collections.deque()

    def _retire(self) -> None:
        """Close this panel's widgets once the next panel's are open.

        JupyterLab shares one subshell among the comms of a target and deletes it when the
        last one closes; comms opened at that very moment can be given the subshell being
        deleted, and their clicks are lost.  Closing a finished panel only after the next
        one is open keeps the count above zero between launches.
        """
        with PanelObserver._finished_lock:
            PanelObserver._retired.append(self)
            while len(PanelObserver._retired) > 2:
                old = PanelObserver._retired.popleft()
                old._run(old._close_widgets)

    @classmethod
    def _close_retired(cls) -> None:
        with cls._finished_lock:
            retired = list(cls._retired)
            cls._retired.clear()
        for old in retired:
            old._run(old._close_widgets)

    def _keep_open(self) -> None:
        with PanelObserver._finished_lock:
            PanelObserver._finished.append(self)
            while len(PanelObserver._finished) > _KEEP_FINISHED:
                old = PanelObserver._finished.popleft()
                old._run(old._close_widgets)


def _keep_subshell(data: Any, default: Any) -> Any:
    return default


def _clicks_where_sent(button: Any) -> None:
    """Handle this button's clicks on the subshell the front end sent them on.

    ipykernel (7.4) routes a comm message to the subshell the kernel last *published* on
    for that comm (so a reply reaches the code awaiting it); the panel publishes from the
    cell that started the launch, i.e. the main shell, which a blocking launch keeps busy.
    A click needs no such reply, so it may run where JupyterLab sent it.
    """
    comm = getattr(button, "comm", None)
    if comm is not None and hasattr(comm, "_reply_subshell_for"):
        comm._reply_subshell_for = _keep_subshell


def panel_observer(launch: "Launch") -> PanelObserver | None:
    """The launcher's factory: a panel for every launch unless it is turned off."""
    mode = panel_mode()
    if mode is None:
        return None
    return PanelObserver(launch, mode)


def launch_mimebundle(launch: "Launch") -> dict[str, Any]:
    """``Launch._repr_mimebundle_``: the panel of the launch, or its text where it has none."""
    for observer in getattr(launch, "observers", ()):
        if isinstance(observer, PanelObserver):
            return observer.mimebundle()
    return {"text/plain": repr(launch)}
