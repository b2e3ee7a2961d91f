"""A hang's way out that keeps the pool: the kernel side of :mod:`air_magic.rank.pool.interrupts.regroup`.

    a pool's Ctrl-C: ranks still in collectives no peer will make (a skipped one the others
    could not make for them, ops that disagree), or a collective that timed out (gloo
    then closes the group's connections: the next collective would fail)
      cut(work_dir, n)        "x" on every rank's stack pipe: each shuts down its group's
                              connections; a collective waiting in one raises at once
      (the call's ranks come back: the pool's wait takes their replies)
      rebuild(conns, id, n)   ("regroup", id, {"round": n}) to every rank; each answers
                              when its new gloo backend has made one all_reduce
      -> "the process group was rebuilt; your names are kept"

Every gloo group of a CPU pool is rebuilt (its default group, and those the user's code,
DeepSpeed or a DeviceMesh made); ``can_rebuild`` says why not otherwise (a GPU pool's NCCL
groups), and the pool restarts instead, saying so.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from air_magic.kernel.pool.wire import ask_every_rank
from air_magic.protocol import ErrorRecord, ask_to_cut

__all__ = ["cut", "rebuild", "can_rebuild", "broke_the_group", "REBUILT"]

#: What the cell says once the group was rebuilt.
REBUILT = "the process group was rebuilt; your names are kept"
#: Seconds the ranks have to make their new backend (they meet on the rendezvous store).
REBUILD_WAIT = 30.0

#: Words of gloo's errors after which the group's connections are closed.
_BROKEN = (
    "Connection closed by peer",
    "Timed out waiting",
    "pair closure",
    "Application timeout",
    "Connection reset by peer",
)


def can_rebuild(device: str, local: bool) -> str:
    """Why the group cannot be rebuilt (``''`` when it can: as many times as it is needed)."""
    if device != "cpu":
        return "a GPU pool's NCCL group is not rebuilt"
    if not local:
        return "the ranks are not processes of this machine"
    return ""


def broke_the_group(records: dict[int, Any]) -> bool:
    """Whether a rank's error says gloo closed the group's connections (a collective that
    timed out, or whose peer's connection was cut)."""
    return any(
        isinstance(record, ErrorRecord) and any(word in record.message for word in _BROKEN)
        for record in records.values()
    )


def cut(work_dir: str, world_size: int) -> int:
    """Ask every rank to shut down its group's connections; how many were asked."""
    return sum(ask_to_cut(work_dir, rank) for rank in range(world_size))


def rebuild(conns: list[Connection], call_id: int, round_: int) -> str:
    """Every rank makes its new backend; ``''`` when all did, else why not."""
    answers = ask_every_rank(conns, "regroup", call_id, {"round": round_}, REBUILD_WAIT, "rebuild it")
    return answers if isinstance(answers, str) else ""
