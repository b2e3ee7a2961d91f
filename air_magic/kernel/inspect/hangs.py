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
                   -> show(report): in place while the hang lasts (the cell's display,
                      stderr in a terminal); the launch keeps it (``hang_report()``)

A verdict names who is behind (a rank whose last collective is older than the one its
peers wait in), who disagrees (ranks at the same collective with different ops or
shapes), who has ended while its peers wait, or says that every rank waits in the same
collective (a peer's network or device, not the code).
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

from air_magic.kernel.inspect import collectives as _collectives
from air_magic.protocol import ask_for_collectives
from air_magic.protocol.debugging import paused_at

__all__ = ["Row", "HangReport", "HangWatch", "ReportShown", "report", "ranks_text", "watch_launch", "cpu_seconds"]

#: What a row says of a rank.
IN_COLLECTIVE = "in collective"
COMPUTING = "computing"
BLOCKED = "blocked"
OUTSIDE = "not in a collective"  # (its activity unknown: a Ray rank, a GPU rank)
PAUSED = "paused in the debugger"
ENDED = "ended"
SILENT = "not answering"
#: Seconds a report waits for the ranks' full reads (their first: torch loads its symbols).
READ = 3.0
FIRST_READ = 10.0

#: The share of one core a rank's process used since the last look above which it computes (a
#: rank waiting in a gloo collective, asleep, or reading a pipe uses next to none).
COMPUTING_SHARE = 0.3


@dataclass
class Row:
    """One rank, as the report shows it."""

    rank: int
    state: str
    group: str = ""
    seq: int | None = None
    op: str = ""
    shapes: str = ""
    where: str = ""
    read: str = ""  # how the row was read: "Flight Recorder", "stack", "exit code", ...


@dataclass
class HangReport:
    """A hang report: ``verdict`` (one line), ``rows`` (a rank each), ``stuck_for``
    (seconds since a collective last completed on any rank when it was made), and
    ``over`` (set once the ranks went on: the report stays, saying so)."""

    verdict: str
    rows: list[Row]
    stuck_for: float
    over: str = ""
    made_at: float = field(default_factory=time.time)
    #: Not a hang: ranks compute while their peers wait (a notice, no table; ``over`` says when
    #: the collective completed).
    slow: bool = False
    #: What completes when a slow notice is over (``rank 1 reached all_reduce #4``).
    awaited: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        if self.slow:
            return f"[air_magic] {self.over}" if self.over else f"[air_magic] {self.verdict}"
        head = f"[air_magic] hang report: {self.verdict}"
        if self.over:
            head += f"\n[air_magic] (over: {self.over})"
        cols = ("rank", "state", "group", "seq", "op", "shapes", "where", "read by")
        table = [_columns(r) for r in self.rows]
        widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
        lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in table]
        return head + "\n" + "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def _repr_html_(self) -> str:
        esc = html.escape
        if self.slow:
            return (
                "<div class='air-magic-hang' style='font-family:var(--jp-code-font-family,monospace);font-size:12px'>"
                f"{esc(self.text().removeprefix('[air_magic] '))}</div>"
            )
        cells = "".join(
            "<tr>"
            + "".join(
                f"<td style='padding:1px 8px;text-align:left;white-space:{'normal' if i == 6 else 'nowrap'}'>"
                f"{esc(v)}</td>"
                for i, v in enumerate(_columns(r))
            )
            + "</tr>"
            for r in self.rows
        )
        heads = "".join(
            f"<th style='padding:1px 8px;text-align:left'>{h}</th>"
            for h in ("rank", "state", "group", "seq", "op", "shapes", "where", "read by")
        )
        over = f"<div style='opacity:0.75'>over: {esc(self.over)}</div>" if self.over else ""
        return (
            "<div class='air-magic-hang' style='font-family:var(--jp-code-font-family,monospace);font-size:12px'>"
            f"<div><b>hang report:</b> {esc(self.verdict)}</div>{over}"
            f"<div style='overflow-x:auto'><table style='border-collapse:collapse'><tr>{heads}</tr>{cells}</table>"
            "</div></div>"
        )

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return {"text/plain": self.text(), "text/html": self._repr_html_()}


def _columns(r: Row) -> tuple[str, ...]:
    seq = "" if r.seq is None or r.seq < 0 else f"#{r.seq}"
    return (str(r.rank), r.state, r.group, seq, r.op, r.shapes, r.where, r.read)


def ranks_text(ranks: list[int]) -> str:
    """``rank 1``, ``ranks 0, 2, 3``, ``ranks 0–3``."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}–{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _op(entry: Mapping[str, Any]) -> str:
    return str(entry.get("op", "")).split(":", 1)[-1]


def _shapes(entry: Mapping[str, Any]) -> str:
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    parts = []
    for i, size in enumerate(sizes):
        dtype = str(dtypes[i]) if i < len(dtypes) else ""
        parts.append(f"{list(size)} {_collectives.dtype_name(dtype)}".strip())
    return ", ".join(parts)


def _at(entry: Mapping[str, Any]) -> str:
    said = ", ".join(str(entry[k]) for k in ("where", "via") if entry.get(k))
    return f" ({said})" if said else ""


def report(
    seen: Mapping[int, dict[str, Any] | None],
    world_size: int,
    *,
    ended: Mapping[int, str] | None = None,
    paused: Mapping[int, str] | None = None,
    stacks: Mapping[int, tuple[str, bool, str]] | None = None,
    stuck_for: float = 0.0,
    busy: Mapping[int, float] | None = None,
) -> HangReport | None:
    """The report of ranks whose collectives are ``seen`` (a rank's :func:`ask` answer; None
    where it did not answer), ``ended`` (rank: how, e.g. ``exit 0``), ``paused`` in the
    debugger (rank: where), with ``stacks`` (rank: (file:line, whether its main thread waits
    in a collective, how it was read: its stack thread, the signal, py-spy)).  A rank whose recorder has a collective
    pending but whose stack is not in one (an async collective not waited for yet) is
    computing.  None when no rank waits in a collective.

    ``busy``: the share of a core each rank's process used since the last look, where it is
    known (local CPU ranks).  A rank with a collective pending waits in it when its thread is
    in torch.distributed's wait or it is idle (a DDP or FSDP hook's collective: the wait is
    inside autograd's backward); a rank that has none pending computes when busy (the others
    wait for it: a notice, not a hang) and is blocked when not (asleep, reading a pipe: a hang)."""
    ended = dict(ended or {})
    paused = dict(paused or {})
    stacks = dict(stacks or {})
    busy = dict(busy or {})
    # The group the hang is in: the one most ranks wait in (the default group on a tie).
    waits: dict[str, dict[int, dict[str, Any]]] = {}
    names: dict[int, dict[str, dict[str, Any]]] = {}  # rank -> group name -> its info
    for rank, data in seen.items():
        if not data:
            continue
        groups = data.get("groups") or {}
        for pg, info in groups.items():
            names.setdefault(rank, {})[str(info.get("name", pg))] = info
        in_wait = stacks[rank][1] if rank in stacks else True
        if not in_wait and busy.get(rank, 0.0) >= COMPUTING_SHARE:
            continue  # its code computes (an async collective it has not waited for yet)
        if not in_wait and rank not in busy and not _hooked(data):
            continue  # its code is not in a collective (and how busy it is is not known)
        for entry in data.get("pending") or []:
            # The newest pending one: gloo marks a collective completed on a worker thread that
            # the next one, stuck, can hold, so an older entry can stay "pending" for ever.
            name = str((groups.get(entry["pg"]) or {}).get("name", entry["pg"]))
            held = waits.setdefault(name, {})
            if rank not in held or entry["seq"] > held[rank]["seq"]:
                held[rank] = entry
    if not waits:
        return None
    group = max(sorted(waits), key=lambda g: (len(waits[g]), g in ("0", "default_pg")))
    waiting = waits[group]
    label = _collectives.group_label(group)
    rows: list[Row] = []
    for rank in range(world_size):
        info = names.get(rank, {}).get(group, {})
        enqueued = int(info.get("enqueued", -1)) if info else None
        if rank in ended:
            read = "exit code" if ended[rank].startswith("exit") else "its reply"
            rows.append(Row(rank, ENDED, label, enqueued, "", "", ended[rank], read))
        elif rank in paused:
            rows.append(Row(rank, PAUSED, label, enqueued, "", "", paused[rank], "debugger"))
        elif rank in waiting:
            entry = waiting[rank]
            rows.append(
                Row(
                    rank,
                    IN_COLLECTIVE,
                    label,
                    entry["seq"],
                    _op(entry),
                    _shapes(entry),
                    entry.get("where", ""),
                    _recorder(seen.get(rank)),
                )
            )
        else:
            where = stacks[rank][0] if rank in stacks else ""
            last = info.get("last") or {}
            if not seen.get(rank):
                state = SILENT
            elif rank not in busy:
                state = OUTSIDE
            else:
                state = COMPUTING if busy[rank] >= COMPUTING_SHARE else BLOCKED
            how = [_recorder(seen.get(rank))] if seen.get(rank) else []
            how += [stacks[rank][2]] if rank in stacks else []
            how += ["its CPU time"] if rank in busy else []
            rows.append(Row(rank, state, label, enqueued, _op(last), "", where, " + ".join(how) or "nothing"))
    for row in rows:  # a hook's collective waits where the user's line led to it
        if row.state == IN_COLLECTIVE:
            entry = waiting[row.rank]
            if not row.where and row.rank in stacks:
                row.where = stacks[row.rank][0]
            if entry.get("via"):
                row.where = f"{row.where} ({entry['via']})" if row.where else str(entry["via"])
    outside = [r for r in rows if r.state not in (IN_COLLECTIVE,)]
    if outside and all(r.state == COMPUTING for r in outside):
        first = min(waiting.values(), key=lambda e: e["seq"])
        awaited = f"{ranks_text([r.rank for r in outside])} reached {_op(first)} #{first['seq']}"
        return HangReport(_slow(rows, waiting, stuck_for), rows, stuck_for, slow=True, awaited=awaited)
    return HangReport(_verdict(rows, waiting, names, group, stuck_for), rows, stuck_for)


def _hooked(data: dict[str, Any] | None) -> bool:
    """Whether a rank's pending collective was issued by a hook (DDP's reducer, FSDP,
    DeepSpeed): its thread waits for it inside the framework, not in torch.distributed."""
    return any(entry.get("via") for entry in (data or {}).get("pending") or [])


def _slow(rows: list[Row], waiting: dict[int, dict[str, Any]], stuck_for: float) -> str:
    """``rank 1 is computing at Cell In[5]:7 for 12 s; rank 0 waits in all_reduce #4 (...)``."""
    computing = [r for r in rows if r.state == COMPUTING]
    first = min(waiting.values(), key=lambda e: e["seq"])
    parts = [f"{ranks_text([r.rank])} is computing" + (f" at {r.where}" if r.where else "") for r in computing]
    in_one = sorted(waiting)
    return (
        f"{'; '.join(parts)} for {stuck_for:.0f} s; {ranks_text(in_one)} wait{'s' * (len(in_one) == 1)} in "
        f"{_op(first)} #{first['seq']}{_at(first)}"
    )


def _recorder(data: dict[str, Any] | None) -> str:
    """How a row's collectives were read: now, or (a rank that did not answer this time) earlier."""
    age = (data or {}).get("_age")
    return "Flight Recorder" if age is None else f"Flight Recorder, {age:.0f} s ago"


def _verdict(
    rows: list[Row],
    waiting: dict[int, dict[str, Any]],
    names: dict[int, dict[str, dict[str, Any]]],
    group: str,
    stuck_for: float,
) -> str:
    in_one = sorted(waiting)
    first = min(waiting.values(), key=lambda e: e["seq"])
    gone = [r for r in rows if r.state == ENDED]
    if gone:
        how = "; ".join(f"{ranks_text([r.rank])} has ended ({r.where})" for r in gone)
        return f"{how} while {ranks_text(in_one)} wait{'s' * (len(in_one) == 1)} in {_op(first)} #{first['seq']}{_at(first)}"
    outside = [r for r in rows if r.state in (COMPUTING, BLOCKED, OUTSIDE, SILENT)]
    if outside:
        parts = []
        for row in outside:
            info = names.get(row.rank, {}).get(group, {})
            last = info.get("last") or {}
            if row.seq is not None and row.seq >= 0:
                made = f"its last collective is #{row.seq}" + (f" ({last['where']})" if last.get("where") else "")
            else:
                made = "it has made no collective in this group" if row.state != SILENT else "it does not answer"
            now = f"; it is at {row.where}" if row.where else ""
            how = {BLOCKED: ", blocked (neither in a collective nor computing)", COMPUTING: ", computing"}.get(
                row.state, ""
            )
            parts.append(f"{ranks_text([row.rank])} is behind{how}: {made}{now}")
        waited = sorted({e["seq"] for e in waiting.values()})
        op = _op(first)
        at = f"#{waited[0]}" if len(waited) == 1 else "#" + ", #".join(map(str, waited))
        return f"{'; '.join(parts)}; {ranks_text(in_one)} wait{'s' * (len(in_one) == 1)} in {op} {at}{_at(first)}"
    seqs = {e["seq"] for e in waiting.values()}
    if len(seqs) > 1:  # all in one, at different collectives: the lowest are behind
        low = min(seqs)
        behind = sorted(r for r, e in waiting.items() if e["seq"] == low)
        ahead = sorted(r for r, e in waiting.items() if e["seq"] != low)
        top = max(waiting.values(), key=lambda e: e["seq"])
        return (
            f"{ranks_text(behind)} {'is' if len(behind) == 1 else 'are'} behind: in {_op(first)} #{low}{_at(first)}; "
            f"{ranks_text(ahead)} wait{'s' * (len(ahead) == 1)} in {_op(top)} #{top['seq']}{_at(top)}"
        )
    kinds = {(_op(e), _shapes(e)) for e in waiting.values()}
    seq = next(iter(seqs))
    if len(kinds) > 1:
        said = ", ".join(f"rank {r} {_op(e)} {_shapes(e)}".rstrip() for r, e in sorted(waiting.items()))
        return f"ranks disagree at #{seq}: {said}"
    return (
        f"every rank is in {_op(first)} #{seq}{_at(first)} for {stuck_for:.0f} s: "
        "a peer's network or device, not the code"
    )


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
