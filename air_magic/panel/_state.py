"""The state of one launch as the panel sees it: the readers of every rank, and the linter's findings.

One :class:`LaunchState` per launch, refreshed by the observer's thread each tick and
read by the renderers between ticks::

    Launch (ranks, work_dir, spec, placement)
        --> LaunchState: LogTail + MetricsReader per rank, one UsageSampler
              refresh(tick): logs always, metrics when tracking is on, usage every 2nd tick
              start_lint(): the migration linter on the launched cells, on its own thread
        --> rank_state(), usage_text(), outcome(), chart_series(), elapsed()  (for rendering)
        --> overall(): the slowest rank's bar, its ETA, the summed rate, a straggler (while running)
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from air_magic.panel._format import _clip, _fmt_bytes, _fmt_elapsed, _fmt_rate, _number, _rate_per_second
from air_magic.panel._lint import _Lint, _lint_texts
from air_magic.panel._sources import LogTail, MetricsReader, UsageSampler
from air_magic.protocol import spool_file
from air_magic.protocol.debugging import paused_at

if TYPE_CHECKING:
    from air_magic.kernel.launcher import Launch

_USAGE_EVERY = 2  # ticks
_CHART_KEYS = 6  # metrics charted


_ENDED = ("finished", "failed", "timed out", "cancelled")
#: A rank is called out as behind when its progress trails the median of the other ranks'
#: by at least this share of the total *and* by at least STRAGGLER_ITEMS items: tqdm
#: redraws a bar at most ten times a second and the logs are read twice a second, so ranks
#: in step differ by a few items; a short loop (say 20 items) needs 2 whole items too.
STRAGGLER_FRACTION = 0.10
STRAGGLER_ITEMS = 2


@dataclass(frozen=True)
class Overall:
    """One line across ranks: the slowest rank's current bar, the summed rate, a straggler.

    It measures that bar (one epoch's, say), not the whole run: it is labelled with the
    bar's own description, and its ETA is the bar's."""

    slowest: int  # the rank furthest behind
    fraction: float  # its progress, 0..1
    n: str  # its count and total as tqdm shows them
    total: str
    eta: str  # its ETA ("" when tqdm gives none)
    throughput: str  # "600 it/s": the running ranks' rates summed ("" when they cannot be added)
    ranks: int  # ranks with a bar
    behind: str  # "rank 3 is behind: 40% while the others are at 75%" (or "")
    desc: str = ""  # the bar's description as tqdm shows it ("Epoch 2", "train"; "" when it has none)


class LaunchState:
    """Everything the panel shows, gathered by one thread (then read by the renderers)."""

    def __init__(self, launch: "Launch") -> None:
        self.launch = launch
        # A pool call's ranks say where the call began in their log and metrics files.
        self.logs = [LogTail(state.log_path, getattr(state, "log_start", 0)) for state in launch.ranks]
        self.metrics = [
            MetricsReader(spool_file(launch.work_dir, state.rank), getattr(state, "metrics_start", 0))
            for state in launch.ranks
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
            except Exception:  # whatever the linter raises: the panel shows no findings
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
        # Ranks on other machines (a Ray launch) cannot be sampled from here.
        if not final and tick % _USAGE_EVERY == 1 and getattr(self.launch, "local_processes", True):
            try:
                self.usage.sample(self.launch.ranks)
            except Exception:  # usage numbers are a bonus: logs and metrics refresh all the same
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
        """``starting``, ``running``, ``stopping``, ``finished``, ``stopped`` or ``failed``."""
        return rank_state(self.launch, rank)

    def overall(self) -> "Overall | None":
        """The launch's progress across ranks while it runs (None when no running rank shows a bar).

        Progress and ETA are the slowest rank's (the launch ends with it); throughput is
        the sum of the running ranks' tqdm rates (items/s of the whole launch), given only
        when their bars count the same unit.  See :class:`Overall` for the straggler rule.
        """
        if self.launch.status != "running" or len(self.logs) < 2:  # one rank: its row says it all
            return None
        bars: list[tuple[int, float, dict[str, Any]]] = []
        for rank, log in enumerate(self.logs):
            progress = log.progress
            if progress is None or progress["pct"] is None or self.rank_state(rank) != "running":
                continue
            n, total = _number(progress["n"]), _number(progress["total"])
            fraction = n / total if n is not None and total else progress["pct"] / 100
            bars.append((rank, min(1.0, max(0.0, fraction)), progress))
        if not bars:
            return None
        slowest, fraction, progress = min(bars, key=lambda bar: (bar[1], bar[0]))
        rates = [rate for rate in (_rate_per_second(bar[2]["rate"]) for bar in bars) if rate is not None]
        throughput = ""
        if len(rates) == len(bars) and len({unit for _, unit in rates}) == 1:
            throughput = _fmt_rate(sum(value for value, _ in rates), rates[0][1])
        behind = ""
        if len(bars) >= 2:
            others = sorted(bar[1] for bar in bars if bar[0] != slowest)
            median = statistics.median(others)
            total = _number(progress["total"]) or 0.0
            gap = median - fraction
            if gap >= STRAGGLER_FRACTION - 1e-9 and gap * total >= STRAGGLER_ITEMS - 1e-9:
                behind = (
                    f"rank {slowest} is behind: {fraction * 100:.0f}% while the "
                    f"other{'s are' if len(others) > 1 else ' is'} at {median * 100:.0f}%"
                )
        return Overall(
            slowest=slowest,
            fraction=fraction,
            n=progress["n"],
            total=progress["total"],
            eta=progress["eta"] or "",
            throughput=throughput,
            ranks=len(bars),
            behind=behind,
            desc=str(progress.get("desc") or ""),
        )

    def outcome(self) -> str:
        """The launch's end in one line ('' while it runs)."""
        return outcome_text(self.launch, self.elapsed())

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


def rank_state(launch: "Launch", rank: int) -> str:
    """How rank ``rank`` of ``launch`` is: ``starting``, ``running``, ``paused`` (in its
    debugger), ``stopping``, ``finished``, ``stopped`` or ``failed`` (the panel's rows, the lab
    extension's list); a pool's rank, as the pool says it (``idle`` between its calls)."""
    found = _rank_state(launch, rank)
    if found == "running" and paused_at(launch.work_dir, rank) is not None:
        return "paused"
    return found


def paused_where(launch: "Launch", rank: int) -> str | None:
    """Where a rank paused in its debugger is (its row's last line says so), or None."""
    return paused_at(launch.work_dir, rank)


def _rank_state(launch: "Launch", rank: int) -> str:
    state = launch.ranks[rank]
    status = launch.status
    if launch.kind == "pool call":  # what the rank did of the call (kernel/pool/view.py)
        return str(state.state)
    if launch.kind == "pool" and status == "running":  # the pool's ranks: idle, or what they do of its call
        from air_magic.kernel.pool.engine import pool_of

        engine = pool_of(launch.id)
        if engine is not None:
            return engine.rank_state(rank)
    if state.returncode is not None and state.returncode != 0 and status in ("cancelled", "timed out", "stopping"):
        return "stopped"
    if state.returncode is None and status == "stopping":
        return "stopping"
    if state.returncode is None and status in _ENDED:  # the launch ended without this rank's exit code
        return "stopped"
    return state.state


def outcome_text(launch: "Launch", elapsed: float) -> str:
    """A launch's end in one line ('' while it runs)."""
    if not launch.done() and launch.ended_at is None:
        return ""
    try:
        error, ended = launch.exception(timeout=0), True
    except TimeoutError:  # its outcome is not read yet
        error, ended = None, False
    took = _fmt_elapsed(elapsed)
    if launch.status == "finished" or (ended and error is None):
        return f"finished in {took}"
    if error is not None:
        first = (str(error).strip().splitlines() or [""])[0]
        return f"{launch.status} after {took}: {type(error).__name__}: {_clip(first, 300)}"
    return f"{launch.status} after {took}"
