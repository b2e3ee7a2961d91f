"""What a hang report says: a row per rank (where it is, in which collective, since when) and
one verdict, from the ranks' collectives as their Flight Recorders hold them (the watch that
decides when to make one is :mod:`air_magic.kernel.inspect.hangs`)::

    report(waiting, ended, stacks, busy, ...) -> HangReport
      a rank in a collective its peers never started: behind (the others wait for it)
      ranks at the same collective with different ops or shapes: they disagree
      a rank that ended while its peers wait: ended
      every rank in the same collective: a peer's network or device, not the code
      a rank that computes (its CPU share) while its peers wait: slow, not stuck
    HangReport.text() / _repr_html_()   the same rows and verdict, as text and as a table
"""

from __future__ import annotations

import html
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from air_magic.kernel.inspect import collectives as _collectives

__all__ = [
    "Row",
    "HangReport",
    "report",
    "ranks_text",
    "IN_COLLECTIVE",
    "COMPUTING",
    "BLOCKED",
    "OUTSIDE",
    "PAUSED",
    "ENDED",
    "SILENT",
    "COMPUTING_SHARE",
]

#: What a row says of a rank.
IN_COLLECTIVE = "in collective"
COMPUTING = "computing"
BLOCKED = "blocked"
OUTSIDE = "not in a collective"  # (its activity unknown: a Ray rank, a GPU rank)
PAUSED = "paused in the debugger"
ENDED = "ended"
SILENT = "not answering"

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
