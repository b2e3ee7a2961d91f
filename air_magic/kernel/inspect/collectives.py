"""The ranks' collectives, kernel side: ask each rank what torch's Flight Recorder saw (the
rank side is :mod:`air_magic.rank.inspect.collectives`), and judge what an interrupt left::

    ask(work_dir, ranks) --"c<token>" on each rank's stack pipe--> collectives-<rank>.json
        -> {rank: {"groups": {pg: {name, enqueued, completed, ranks}}, "pending": [entry...]}}

    stuck(seen, back): the ranks still in the call that wait in a collective a rank back
        from it never started (it cannot complete: the kernel cuts the group's connections,
        and the collective raises on them); none while a collective every rank started is
        still in flight
    uneven(seen): groups whose members started different collectives (a rank back with an
        async one started, FSDP's all-gathers, that a peer never started): the group is
        rebuilt before the next call, or its next collective would pair with the wrong one

A collective is never completed for a rank with data no rank sent.
"""

from __future__ import annotations

import json
import time
from typing import Any

from air_magic.protocol import ask_for_collectives, collectives_path

__all__ = ["ask", "stuck", "uneven", "describe_op", "user_where", "group_label", "dtype_name"]


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


def _numbers(seen: dict[int, dict[str, Any] | None]) -> dict[str, dict[int, tuple[int, int]]]:
    """Group name -> {rank: (its last enqueued, its last completed collective)}."""
    found: dict[str, dict[int, tuple[int, int]]] = {}
    for rank, data in seen.items():
        for pg, info in ((data or {}).get("groups") or {}).items():
            name = str(info.get("name", pg))
            found.setdefault(name, {})[rank] = (int(info.get("enqueued", -1)), int(info.get("completed", -1)))
    return found


def stuck(seen: dict[int, dict[str, Any] | None], back: set[int]) -> list[int]:
    """The ranks not in ``back`` (still in the call) that wait in a collective a rank of
    ``back`` (idle: back from the call) never started: it cannot complete, so only cutting the
    group's connections frees them.  Empty when a rank did not answer, or when a collective
    every rank started is still in flight somewhere (cutting then could complete it on some
    ranks and fail it on others)."""
    if not back or any(seen.get(rank) is None for rank in seen):
        return []
    groups = _numbers(seen)
    found: set[int] = set()
    for at in groups.values():
        if len(at) < len(seen):
            continue  # a group not every rank is in (a subgroup): not judged here
        everyone = min(e for e, _ in at.values())
        if any(c < everyone for _, c in at.values()):
            return []  # a collective every rank started has not completed everywhere yet
        idle = min((at[r][0] for r in back if r in at), default=None)
        if idle is None:
            continue
        for rank, (enqueued, completed) in at.items():
            if rank not in back and enqueued > completed and completed + 1 > idle:
                found.add(rank)
    return sorted(found)


def uneven(seen: dict[int, dict[str, Any] | None]) -> list[str]:
    """The groups whose members have not started the same collectives (a rank that came back
    with one started that a peer never started: the next collective would pair with the
    wrong one), each as ``the default group: rank 0 at #12, rank 1 at #11``."""
    found = []
    for name, at in sorted(_numbers(seen).items()):
        if len({e for e, _ in at.values()}) > 1:
            where = ", ".join(f"rank {r} at #{e}" for r, (e, _) in sorted(at.items()))
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
