"""The ranks' collectives, kernel side: ask each rank what torch's Flight Recorder saw (the
rank side is :mod:`air_magic.rank.collectives`), and find what the ranks that came back from
an interrupt must make so that a rank left inside a collective they abandoned can stop::

    ask(work_dir, ranks) --"c<token>" on each rank's stack pipe--> collectives-<rank>.json
        -> {rank: {"groups": {pg: {name, enqueued, completed, ranks}}, "pending": [entry...]}}

    plan_even(seen, able): for each group, the most advanced member's last enqueued
        collective #t; each member of ``able`` (ranks back from the interrupt) whose last
        enqueued is #s < #t makes #s+1..#t as a member that waits in them recorded them
        -> {rank: [entry + the group's name, ...]}   (one round; the caller asks again)

    A rank left waiting inside #t (a collective its peers abandoned), and a rank that came
    back with #t started but not waited for (an async op: FSDP's all-gathers) are the same
    case: the group is uneven, and the next collective would pair with the wrong one.
"""

from __future__ import annotations

import json
import time
from typing import Any

from air_magic.protocol import ask_for_collectives, collectives_path

__all__ = ["ask", "plan_even", "uneven", "describe_op", "user_where", "group_label", "dtype_name"]


def ask(
    work_dir: str, ranks: list[int], timeout: float = 1.0, unanswered: set[int] | None = None, how: str = "c"
) -> dict[int, dict[str, Any] | None]:
    """Each rank's collectives (None for a rank that did not answer within ``timeout`` s, or
    whose torch records none); the ranks that did not answer are added to ``unanswered``, and
    so are the ranks that could not be asked (their thread busy with an earlier request is not
    listening: not the same as "nothing recorded").
    ``how``: what each rank reads (:func:`air_magic.protocol.ask_for_collectives`)."""
    tokens = {rank: ask_for_collectives(work_dir, rank, how) for rank in ranks}
    found: dict[int, dict[str, Any] | None] = {rank: None for rank in ranks}
    waiting = {rank for rank, token in tokens.items() if token}
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        for rank in list(waiting):
            data = _read(collectives_path(work_dir, rank))
            if data is not None and data.get("token") == tokens[rank]:
                waiting.discard(rank)
                found[rank] = data if data.get("recorded") else None
        if waiting:
            time.sleep(0.01)
    if unanswered is not None:
        unanswered.update(waiting)
        unanswered.update(rank for rank, token in tokens.items() if not token)
    return found


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def plan_even(seen: dict[int, dict[str, Any] | None], able: set[int]) -> dict[int, list[dict[str, Any]]]:
    """What each rank of ``able`` makes so that every group's members are at the same
    collective again: a member whose last enqueued collective is behind the group's most
    advanced one makes the ones it lacks, in order, as a member that waits in them recorded
    them (see the module's docstring); ``{}`` when every group is even, or when what is
    lacking is not known."""
    members: dict[str, dict[int, int]] = {}  # group name -> {rank: its last enqueued sequence number}
    entries: dict[str, dict[int, dict[str, Any]]] = {}  # group name -> {seq: a pending entry}
    for rank, data in seen.items():
        if not data:
            continue
        groups = data.get("groups") or {}
        for pg, info in groups.items():
            name = str(info.get("name", pg))
            members.setdefault(name, {})[rank] = int(info.get("enqueued", -1))
        for entry in data.get("pending") or []:
            name = str((groups.get(entry["pg"]) or {}).get("name", entry["pg"]))
            entries.setdefault(name, {}).setdefault(int(entry["seq"]), {**entry, "name": name, "of": rank})
    plan: dict[int, list[dict[str, Any]]] = {}
    for name in sorted(members):
        top = max(members[name].values())
        known = entries.get(name, {})
        for rank, enqueued in members[name].items():
            if rank not in able or enqueued >= top:
                continue
            lacking = [known.get(seq) for seq in range(enqueued + 1, top + 1)]
            if all(lacking):
                plan.setdefault(rank, []).extend(op for op in lacking if op)
    return plan


def uneven(seen: dict[int, dict[str, Any] | None]) -> list[str]:
    """The groups whose members are not at the same collective, each as
    ``the default group: rank 0 at #12, rank 1 at #11``."""
    found = []
    by_group: dict[str, dict[int, int]] = {}
    for rank, data in seen.items():
        for pg, info in ((data or {}).get("groups") or {}).items():
            by_group.setdefault(str(info.get("name", pg)), {})[rank] = int(info.get("enqueued", -1))
    for name in sorted(by_group):
        at = by_group[name]
        if len(set(at.values())) > 1:
            where = ", ".join(f"rank {r} at #{s}" for r, s in sorted(at.items()))
            found.append(f"{_group_name(name)}: {where}")
    return found


def _group_name(name: str) -> str:
    return "the default group" if name in ("0", "default_pg") else f"group {name}"


def group_label(name: str) -> str:
    """``default`` for the default group, else the group's name."""
    return "default" if name in ("0", "default_pg") else name


#: torch's names of dtypes in the Flight Recorder, and the ones users write.
_DTYPES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "bfloat16": "bfloat16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "char": "int8",
    "byte": "uint8",
    "bool": "bool",
}


def dtype_name(name: str) -> str:
    """``float32`` for the recorder's ``Float``."""
    return _DTYPES.get(name.lower(), name.lower())


def describe_op(entry: dict[str, Any]) -> str:
    """``all_reduce #42 of the default group ([1024] float32) at Cell In[3]:11``."""
    op = str(entry.get("op", "")).split(":", 1)[-1]
    group = _group_name(str(entry.get("name", entry.get("pg"))))
    sizes = ", ".join(str(list(s)) for s in entry.get("input_sizes") or [])
    dtypes = ", ".join(dtype_name(str(d)) for d in entry.get("input_dtypes") or [])
    shape = f" ({sizes} {dtypes})" if sizes else ""
    where = f" at {entry['where']}" if entry.get("where") else ""
    return f"{op} #{entry.get('seq')} of {group}{shape}{where}"


def user_where(text: str, sources: dict[str, tuple[str, str]]) -> str:
    """``text`` with each notebook cell's file name replaced by the cell's name."""
    for filename, (display, _) in sources.items():
        text = text.replace(filename, display)
    return text
