"""What travels between the kernel and a pool's ranks, over one connection per rank (the kernel's
side is :mod:`air_magic.kernel.pool.wire` and :mod:`air_magic.kernel.pool.start`; the rank's,
:mod:`air_magic.rank.pool.serve`)::

    kernel                                            rank r
    ------                                            ------
           <---- RankHello(rank, pid)                 once, after the auth key's challenge
    PoolRequest(kind, id, data) ---->                 one call (kind: a PoolKind)
           <---- CallBegan(id)                        a SIGINT raises in its code from now on
           <---- CallDone(id, blob, names, forked)    its record; the names its own code set;
                                                      the processes its code forked
    PoolClose() ---->                                 leaves its loop (the pool closed)

Every reply names the call it answers (a reply to another call breaks the pool).  The
messages are pickled: a class both sides import from here, so a field is named, not read
by its position in a tuple.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PoolKind", "PoolRequest", "PoolClose", "RankHello", "CallBegan", "CallDone"]


class PoolKind(str, enum.Enum):
    """What a :class:`PoolRequest` asks of every rank."""

    CELL = "cell"  # a cell's code, in the rank's namespace
    CALL = "call"  # a function with its arguments (pool.run, pool.submit)
    PUSH = "push"  # names set in the namespace
    PULL = "pull"  # a name's value sent back
    DEBUG = "debug"  # %distributed_debug: the post-mortem of the last call's exception
    MODEL = "model"  # the model back: pool.state_dict / model / save
    SETTLE = "settle"  # after an interrupt: what it left half-way put back; fingerprints
    SYNC = "sync"  # pool.sync: names copied from one rank to the others
    REGROUP = "regroup"  # the group's connections were cut: fresh ones

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PoolRequest:
    """One call to every rank: its kind, its id (every reply names it), and what it carries
    (the cell's code and names, a function's pickled arguments..., plus the kernel's state
    where it changed: ``cwd``, ``sys_path``, ``env``, ``postmortem``; and ``label``)."""

    kind: PoolKind
    id: int
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PoolClose:
    """The pool closed: the rank leaves its loop."""


@dataclass(frozen=True)
class RankHello:
    """A rank that connected and proved it knows the pool's key: which rank, which process."""

    rank: int
    pid: int


@dataclass(frozen=True)
class CallBegan:
    """The rank began call ``id``: a SIGINT raises in its code from now on."""

    id: int


@dataclass(frozen=True)
class CallDone:
    """The rank's answer to call ``id``: its record (pickled; large tensors in files named by
    it), the names its own code assigned, the processes its code forked with ``os.fork()``."""

    id: int
    blob: bytes
    names: list[str]
    forked: list[int]
