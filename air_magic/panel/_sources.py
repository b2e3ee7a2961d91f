"""What the ranks wrote and what they use, read by the kernel: logs, metric files, processes.

Each reader keeps a bounded state and a ``version`` that is bumped when what it shows
changed, so the renderers redraw only what moved::

    rank-<r>.log          LogTail: the last 64 KiB, re-read only when the file grew
                            --> progress (parse_tqdm of the last bar), last line, last 100 lines
    tracking-<r>.tsv      MetricsReader: new lines only, at most 1 MiB a tick
                            --> latest value per metric, max step, Series (at most 500 points)
    each rank's pid       UsageSampler: psutil on the rank and its children
                            --> "CPU 97% · 1 GB", or GPU numbers from accelerators.NvmlDevices

Nothing here renders HTML: the renderers read these objects' attributes.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable

from air_magic.accelerators import NvmlDevices
from air_magic.panel._format import _fmt_bytes
from air_magic.protocol import METRIC, TailReader, parse_line

_TAIL_BYTES = 64 * 1024  # read from the end of a rank's log per refresh
_LOG_LINES = 100  # lines of a rank's log in its tab
_LOG_CHARS = 8 * 1024  # and at most this many characters
_TSV_CHUNK = 1 << 20  # bytes of a metrics file read per tick
_MAX_POINTS = 500  # points kept per (rank, metric)
_MAX_KEYS = 50  # metrics remembered per rank

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

    def __init__(self, path: str, start: int = 0) -> None:
        self.path = path
        self.start = start  # what comes before this offset is not shown (a pool's earlier calls)
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
        start = max(self.start, size - _TAIL_BYTES)
        try:
            with open(self.path, "rb") as handle:
                handle.seek(start)
                data = handle.read(_TAIL_BYTES)
        except OSError:
            return False
        text = _ANSI.sub("", data.decode("utf-8", "replace"))
        raw = text.split("\n")
        if start > self.start and len(raw) > 1:
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
    """New metric lines of one rank's spool file (the line format is ``_protocol``'s)."""

    def __init__(self, path: str, start: int = 0) -> None:
        self.path = path
        self._tail = TailReader(path, start)  # a pool call's: from where the call began
        self.latest: dict[str, tuple[int, float]] = {}
        self.series: dict[str, Series] = {}
        self.max_step: int | None = None
        self.version = 0

    def refresh(self) -> bool:
        changed = False
        # Far behind: keep up, skip the middle.
        for line in self._tail.read_recent(_TSV_CHUNK).splitlines():
            record = parse_line(line)
            if record is None or record[0] != METRIC:
                continue
            _, key, value, step, _ = record
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
            except Exception:  # NVMLError, a missing pynvml or driver: GPU numbers are a bonus; CPU numbers stay
                self.nvml_failed = True
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
