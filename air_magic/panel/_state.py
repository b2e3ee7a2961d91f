"""The state of one launch as the panel sees it: the readers of every rank, and the linter's findings.

One :class:`LaunchState` per launch, refreshed by the observer's thread each tick and
read by the renderers between ticks::

    Launch (ranks, work_dir, spec, placement)
        --> LaunchState: LogTail + MetricsReader per rank, one UsageSampler
              refresh(tick): logs always, metrics when tracking is on, usage every 2nd tick
              start_lint(): the migration linter on the launched cells, on its own thread
        --> rank_state(), usage_text(), outcome(), chart_series(), elapsed()  (for rendering)
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from .._protocol import spool_file
from ._format import _clip, _fmt_bytes, _fmt_elapsed
from ._lint import _Lint, _lint_texts
from ._sources import LogTail, MetricsReader, UsageSampler

if TYPE_CHECKING:
    from ..launcher import Launch

_USAGE_EVERY = 2  # ticks
_CHART_KEYS = 6  # metrics charted


class LaunchState:
    """Everything the panel shows, gathered by one thread (then read by the renderers)."""

    def __init__(self, launch: "Launch") -> None:
        self.launch = launch
        self.logs = [LogTail(state.log_path) for state in launch.ranks]
        self.metrics = [MetricsReader(spool_file(launch.work_dir, state.rank)) for state in launch.ranks]
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
        if not final and tick % _USAGE_EVERY == 1:
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
