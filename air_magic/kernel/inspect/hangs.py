"""Why is it stuck: a report of the ranks' collectives, once they stop completing.

The ranks' side is :mod:`air_magic.rank.inspect.collectives` (torch's Flight Recorder, read by each
rank's stack thread without touching the thread that waits); this module decides and says::

    HangWatch.check()        each poll of the cell's wait; one look a second
      ask(how="q") ------------> every rank still in the call: each group's last enqueued and
                                 completed collective, and the ones still pending
      progress = what every rank completed; it changed, or nothing is pending,
      or a rank is paused in the debugger  -> not a hang (a report shown says it is over)
      pending, and no progress for `seconds` (AIR_MAGIC_HANG_SECONDS)
      ask(how="r") ------------> the same, with where the user's code made each one, and
                                 each group's last completed collective
      stacks (rank's thread, or the faulthandler signal) for ranks that are not in one,
      or did not answer
                   -> report(...) -> HangReport: a row per rank and one verdict
                      (:mod:`air_magic.kernel.inspect.hang_report`)
                   -> show(report): in place while the hang lasts (the cell's display,
                      stderr in a terminal); the launch keeps it (``hang_report()``)

A verdict names who is behind (a rank whose last collective is older than the one its
peers wait in), who disagrees (ranks at the same collective with different ops or
shapes), who has ended while its peers wait, or says that every rank waits in the same
collective (a peer's network or device, not the code).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any, Callable, Mapping

from air_magic.kernel.inspect import collectives as _collectives
from air_magic.kernel.inspect.hang_report import IN_COLLECTIVE, HangReport, report
from air_magic.protocol import ask_for_collectives
from air_magic.protocol.debugging import paused_at

__all__ = ["HangWatch", "ReportShown", "watch_launch", "cpu_seconds", "READ", "FIRST_READ"]

#: Seconds a report waits for the ranks' full reads (their first: torch loads its symbols).
READ = 3.0
FIRST_READ = 10.0


class HangWatch:
    """Watches the ranks of one call for a hang (see the module's docstring).

    ``ended()``: rank -> how it ended (the others wait for nobody there); ``stacks(ranks)``:
    rank -> (file:line, whether it waits in a collective), from each rank's Python stack;
    ``show(report)``: a report to show, again while it changes, and
    once more with ``over`` set when the ranks went on."""

    def __init__(
        self,
        work_dir: str,
        world_size: int,
        seconds: float,
        *,
        ended: Callable[[], Mapping[int, str]],
        show: Callable[[HangReport], None],
        stacks: Callable[[list[int]], Mapping[int, tuple[str, bool, str]]] = lambda ranks: {},
        sources: Mapping[str, tuple[str, str]] | None = None,
        every: float = 1.0,
        ask: Callable[..., dict[int, dict[str, Any] | None]] | None = None,
        cpu: Callable[[list[int]], Mapping[int, float]] | None = None,
    ) -> None:
        self.work_dir = work_dir
        self.world_size = world_size
        self.seconds = seconds
        self.ended = ended
        self.show = show
        self.stacks = stacks
        self.sources = dict(sources or {})
        self.every = every
        #: How the ranks are asked: ask(ranks, timeout=, unanswered=, how=) (the ranks' pipes in
        #: the launch's folder; a Ray launch asks its agents)
        self.ask = ask or (lambda ranks, **kw: _collectives.ask(work_dir, ranks, **kw))
        self.local = ask is None  # (what the debugger's files say is only known of local ranks)
        #: Each rank's CPU seconds so far (None: not known, a Ray or GPU rank), sampled each look:
        #: how busy a rank is tells one that computes from one that is blocked.
        self.cpu = cpu
        self._cpu_at: tuple[float, Mapping[int, float]] | None = None
        self.busy: dict[int, float] = {}
        self.next_look = time.monotonic() + every
        self.progress: Any = None
        self.since = time.monotonic()
        self.current: HangReport | None = None  # the report shown while the hang lasts
        self.last: HangReport | None = None  # the last report made (kept once over)
        self._shown_at = 0.0
        self.warmed = False
        self.unsure = False
        self._read: dict[int, tuple[str, bool, str, float]] = {}  # rank -> the last stack read of it
        self._seen: Mapping[int, dict[str, Any] | None] = {}  # what the last report's read said
        self._said: dict[int, tuple[dict[str, Any], float]] = {}  # rank -> its last report read, when
        self._quick: dict[int, dict[str, Any] | None] = {}  # rank -> what it answered its last quick look

    def check(self) -> None:
        now = time.monotonic()
        if self.seconds <= 0 or now < self.next_look:
            return
        self.next_look = now + self.every
        ended = dict(self.ended())
        live = [r for r in range(self.world_size) if r not in ended]
        if not live:
            return
        self._sample_cpu(live, now)
        missing: set[int] = set()
        seen = dict(self.ask(live, timeout=0.3, unanswered=missing, how="q"))
        if missing and missing.issuperset(live):
            return  # no rank answered in time (their threads busy: a full read, a loaded machine): nothing seen
        for rank in live:  # a rank that did not answer this time is as it said last (not "nothing pending")
            if rank in missing:
                seen[rank] = self._quick.get(rank)
            else:
                self._quick[rank] = seen.get(rank)
        paused = {r for r in live if paused_at(self.work_dir, r) is not None}
        done = dict(self.progress[1]) if self.progress else {}
        for rank, data in seen.items():
            if data:  # (a rank that did not answer this time keeps what it said last)
                groups = data.get("groups") or {}
                done[rank] = tuple(sorted((str(pg), i.get("completed")) for pg, i in groups.items()))
        progress = (tuple(sorted(ended)), tuple(sorted(done.items())))
        pending = any(d and d.get("pending") for d in seen.values())
        first = self.progress is None
        if first and pending and not paused:
            self.progress = progress  # the first look: stuck since the watch began
        if progress != self.progress or not pending or paused:
            lasted = now - self.since
            self.progress, self.since, self.warmed = progress, now, False
            self._over(lasted)
            return
        stuck = now - self.since
        if stuck < self.seconds:
            if not self.warmed and not first and stuck >= min(1.0, self.seconds / 2):
                # torch reads the stack traces' symbols once, in a second of CPU: now, not
                # when the report is due (the answer is not waited for).  Not on the call's
                # first look: that one cannot tell a stall from a collective that is merely
                # in flight (most looks at a busy rank find one), and the read copies every
                # entry the recorder keeps (60 ms of the rank's time for 2,000).
                self.warmed = True
                if self.local:
                    for rank in live:
                        ask_for_collectives(self.work_dir, rank, "r")
            return
        if self.current is not None and now - self._shown_at < 5.0:
            return  # shown: looked at again every 5 s while it lasts
        made = self.look(ended, stuck)
        if made is not None and self._went_on():
            # The report's own read shows collectives completed since the last look (the
            # quick looks were not answered in time, a busy rank): not a hang.
            self.since, made = time.monotonic(), None
            self.unsure = False
        if made is None:
            if not self.unsure:  # pending in the recorder only (async ops not waited for): later
                self.since = now
            return
        self.current = made
        if not made.slow:  # (a notice is no hang: a failure's note does not repeat it)
            self.last = made
        self._shown_at = now
        self.show(made)

    def _sample_cpu(self, live: list[int], now: float) -> None:
        """How busy each rank was since the last look (a share of one core)."""
        if self.cpu is None:
            return
        try:
            sample = dict(self.cpu(live))
        except Exception:  # (a rank that ended meanwhile)
            return
        if self._cpu_at is not None:
            then, before = self._cpu_at
            wall = max(now - then, 1e-3)
            self.busy = {r: max(0.0, sample[r] - before[r]) / wall for r in sample if r in before}
        self._cpu_at = (now, sample)

    def waiting(self) -> dict[int, str]:
        """The ranks the last report found waiting in a collective issued by a hook (DDP's,
        FSDP's: their stacks do not show it), as ``all_reduce (DDP's gradient all-reduce)``."""
        made = self.current or self.last
        found = {}
        for row in made.rows if made is not None else []:
            if row.state == IN_COLLECTIVE and row.where.endswith(")") and " (" in row.where:
                found[row.rank] = f"{row.op} ({row.where.rsplit(' (', 1)[1]}"
        return found

    def _measure_busy(self, ranks: list[int], seconds: float = 0.25) -> None:
        """How busy ranks the looks have not measured yet are (a report's read: now, twice)."""
        if self.cpu is None or not ranks:
            return
        try:
            before = dict(self.cpu(ranks))
            time.sleep(seconds)
            after = dict(self.cpu(ranks))
        except Exception:  # (a rank that ended meanwhile)
            return
        for rank in ranks:
            if rank in before and rank in after:
                self.busy[rank] = max(0.0, after[rank] - before[rank]) / seconds

    def look(self, ended: Mapping[int, str] | None = None, stuck_for: float | None = None) -> HangReport | None:
        """A report now (None when no rank waits in a collective)."""
        ended = dict(self.ended() if ended is None else ended)
        live = [r for r in range(self.world_size) if r not in ended]
        unanswered: set[int] = set()
        # A rank's first full read costs it a second of CPU (torch loads its symbols for the
        # stack traces): on a loaded machine more than 3 s, and a rank never read would show as
        # "not answering". Its first read is waited for longer.
        first = any(rank not in self._said for rank in live)
        seen = dict(self.ask(live, timeout=FIRST_READ if first else READ, unanswered=unanswered, how="r"))
        self.unsure = bool(unanswered)  # (a rank's thread still busy: ask again, it is not over)
        self._seen = dict(seen)
        now = time.monotonic()
        for rank in live:  # a rank that did not answer in time (a loaded machine) keeps its last answer
            data = seen.get(rank)
            if data:
                self._said[rank] = (data, now)
            elif rank in self._said:
                earlier, at = self._said[rank]
                seen[rank] = dict(earlier, _age=now - at)
        paused = {r: where for r in live if (where := paused_at(self.work_dir, r)) is not None}
        if not any(d and d.get("pending") for d in seen.values()):
            return None
        self._measure_busy([r for r in live if r not in self.busy])
        stacks = dict(self.stacks([r for r in live if r not in paused]))
        for rank in live:  # a rank read by nothing this time keeps what an earlier look read of it
            if rank in stacks and stacks[rank][0]:
                self._read[rank] = (*stacks[rank], now)
            elif rank in self._read and rank not in paused:
                where, waits, how, at = self._read[rank]
                stacks[rank] = (where, waits, f"{how}, {now - at:.0f} s ago")
        made = report(
            seen,
            self.world_size,
            ended=ended,
            paused=paused,
            stacks=stacks,
            stuck_for=time.monotonic() - self.since if stuck_for is None else stuck_for,
            busy={r: b for r, b in self.busy.items() if r in live},
        )
        if made is not None:
            made.verdict = _tidy(made.verdict, self.sources)
            for row in made.rows:
                row.where = _tidy(row.where, self.sources)
        return made

    def _went_on(self) -> bool:
        """Whether a rank's last read (a report's) completed more than the quick looks saw."""
        before = dict(self.progress[1]) if self.progress else {}
        for rank, data in self._seen.items():
            if not data or rank not in before:
                continue
            groups = data.get("groups") or {}
            now = tuple(sorted((str(pg), i.get("completed")) for pg, i in groups.items()))
            if now != before[rank]:
                return True
        return False

    def finish(self) -> None:
        """The call's ranks all came back: a notice or report still shown says the wait is over
        (``rank 1 reached all_reduce #4 after 58 s``), so that the last word is true."""
        if self.current is not None:
            self._over(time.monotonic() - self.since)

    def _over(self, lasted: float) -> None:
        if self.current is None:
            return
        if self.current.slow:
            self.current.over = f"{self.current.awaited} after {lasted:.0f} s"
        else:
            self.current.over = f"the collectives went on after {lasted:.0f} s"
        shown, self.current = self.current, None
        self.show(shown)


_FILE = re.compile(r'File "([^"]+)"')


def _tidy(text: str, sources: Mapping[str, tuple[str, str]]) -> str:
    """File names as the user knows them: a cell's name (``Cell In[3]:4``), a script's path
    relative to the working directory."""
    text = _collectives.user_where(text, dict(sources))

    def short(match: re.Match[str]) -> str:
        path = match.group(1)
        try:
            rel = os.path.relpath(path)
        except ValueError:
            return path
        return rel if not rel.startswith("..") else path

    return _FILE.sub(short, text)


class ReportShown:
    """Shows a cell's hang reports: one display in a notebook, updated in place while the
    hang lasts (the saved notebook keeps its last state); in a terminal (``air-magic run``,
    plain IPython) each new verdict on stderr.  Each report is also written to
    ``save_to`` (``hang-report.txt``/``.json`` in the launch's logs: its MLflow run has them)."""

    def __init__(
        self, save_to: str | None = None, before: Callable[[], Any] = lambda: None, quiet: bool = False
    ) -> None:
        self.save_to = save_to
        self.quiet = quiet  # a background call's: written to the logs only (no cell waits for it)
        self.before = before
        self.handle: Any = None
        self.said = ""

    def __call__(self, made: HangReport) -> None:
        if self.save_to:
            try:
                with open(self.save_to + ".txt", "w", encoding="utf-8") as handle:
                    handle.write(made.text() + "\n")
                with open(self.save_to + ".json", "w", encoding="utf-8") as handle:
                    json.dump(made.to_dict(), handle, indent=1)
            except OSError:
                pass
        if self.quiet:
            return
        shell = _kernel_shell()
        if shell is not None:
            from IPython.display import display

            if self.handle is None:
                self.before()
                self.handle = display(made, display_id=True)
            else:
                self.handle.update(made)
            return
        key = (re.sub(r"\d+ s\b", "", made.verdict) if made.slow else made.verdict) + made.over
        if key != self.said:
            self.said = key
            self.before()
            text = made.text() if not made.over or made.slow else f"[air_magic] the hang is over: {made.over}"
            sys.stderr.write(text + "\n")
            sys.stderr.flush()


def _kernel_shell() -> Any:
    """IPython's shell where it runs in a Jupyter kernel (a display can be updated there)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None


def watch_launch(
    launch: Any,  # a kernel.launch.Launch (not imported: it imports this module)
    show: Callable[[HangReport], None],
    ended: Callable[[], Mapping[int, str]] | None,
    sources: dict[str, tuple[str, str]],
) -> HangWatch:
    """The watch of ``launch``'s ranks: local ranks are asked on their pipes and their stacks
    read as :meth:`Launch.stacks` reads them (py-spy where nothing came back); a Ray launch's
    through its backend's agents."""
    from air_magic.kernel.inspect.stacks import py_spy_stacks, read_stacks, request_stacks, user_frame

    def running_ended() -> dict[int, str]:
        return {s.rank: f"exit {s.returncode}" for s in launch.ranks if s.returncode is not None}

    helper = launch.helper
    far = helper is not None and not helper.local_processes  # Ray: the agents ask their ranks

    def ask(ranks: list[int], timeout: float = 1.0, unanswered: set[int] | None = None, how: str = "c") -> Any:
        assert helper is not None
        found = helper.collectives(launch.id, ranks, how, timeout)
        if unanswered is not None:
            unanswered.update(r for r, data in found.items() if data is None)
        return found

    def far_stacks(ranks: list[int]) -> dict[int, tuple[str, bool, str]]:
        found = {r: s for r, s in launch.stacks(timeout=1.0).items() if r in ranks}
        for filename, (display, _) in sources.items():
            found = {r: s.replace(f'File "{filename}"', display) for r, s in found.items()}
        return {r: (*user_frame(text), "its stack") for r, text in found.items()}

    def stacks(ranks: list[int]) -> dict[int, tuple[str, bool, str]]:
        running = {r: launch.ranks[r].pid for r in ranks if launch.ranks[r].pid}
        request_stacks(launch.work_dir, running, 1.0)  # type: ignore[arg-type]
        found = read_stacks(launch.work_dir, running, sources)  # type: ignore[arg-type]
        read = {r: (*user_frame(text), "its stack") for r, text in found.items()}
        for rank, pid in running.items():
            if not read.get(rank, ("",))[0] and pid:  # nothing from the rank itself: from outside
                text = py_spy_stacks(pid)
                if text:
                    read[rank] = (*user_frame(text), "py-spy")
        return read

    def cpu(ranks: list[int]) -> dict[int, float]:
        return cpu_seconds({r: launch.ranks[r].pid for r in ranks if launch.ranks[r].pid})

    # A GPU rank that waits for NCCL can spin a core (CUDA's scheduling): its CPU time says
    # nothing there, nor of a Ray rank's on another machine.
    local_cpu = not far and launch.placement.device == "cpu"
    return HangWatch(
        launch.work_dir,
        launch.world_size,
        launch.limits.hang_seconds,
        ended=ended or running_ended,
        show=show,
        stacks=far_stacks if far else stacks,
        sources=sources,
        ask=ask if far else None,  # (None: the ranks' pipes in the launch's folder)
        cpu=cpu if local_cpu else None,
    )


def cpu_seconds(pids: Mapping[int, int]) -> dict[int, float]:
    """Each rank's CPU seconds so far (its process's threads; not its children's)."""
    import psutil

    found = {}
    for rank, pid in pids.items():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        found[rank] = times.user + times.system
    return found
