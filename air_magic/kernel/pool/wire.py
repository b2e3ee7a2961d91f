"""The pool's wire, kernel side: one call sent to every rank, and the replies read back
(the rank side is :mod:`air_magic.rank.pool.serve`; the engine, :mod:`air_magic.kernel.pool.engine`)::

    kernel                                         rank r
    ------                                         ------
    send(conns, call)   PoolRequest(CELL, id, data) ---->   runs it (SIGINT raises only now)
    replies(pending, id)              <----  CallBegan(id): a SIGINT raises in its code now
                                      <----  CallDone(id, record blob, the rank's own names,
                                              the processes its code forked with os.fork())
                                              (a large tensor: its bytes in a file of the
                                              launch's /dev/shm folder, the blob names it)

Every reply names the call it answers.  One that names another call (a process the rank's
code forked and that went on speaking on the rank's connection, an earlier reply left
unread) or that cannot be read at all (bytes the rank's code wrote on the connection) is
:class:`OutOfStep`: the engine breaks the pool with that reason.  A pool never returns a
value that is not this call's.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from air_magic import capture
from air_magic.protocol import ValueRecord
from air_magic.protocol.pool import CallBegan, CallDone, PoolKind, PoolRequest
from air_magic.rank import results as _results

__all__ = ["OutOfStep", "Reply", "replies", "load"]


class OutOfStep(Exception):
    """A rank's connection carried something that is not this call's reply."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank} {reason}")
        self.rank = rank
        self.reason = reason


@dataclass(frozen=True)
class Reply:
    """A rank's answer to the call: its record (or the error that loading it raised) and
    the names its own code assigned in its namespace."""

    rank: int
    record: Any
    names: list[str]
    forked: list[int]  # processes the call's code forked with os.fork() (each ends at the call's end)


def replies(
    pending: dict[int, Connection],
    call_id: int,
    timeout: float,
    began: Callable[[int, int], None],
    closed: dict[int, float],
    folders: tuple[str | None, ...] = (),
    assembled: dict[int, Any] | None = None,
) -> list[Reply]:
    """The replies to call ``call_id`` that came within ``timeout`` s; a rank that answered
    leaves ``pending``.  A rank whose connection closed stays there and is added to
    ``closed`` (with when it was seen), and is not waited on again: the caller sees the
    rank's end.  A rank's ``CallBegan(id)`` goes to ``began(rank, id)``.  A record's large
    tensors are files the rank wrote into ``folders`` (mapped here, then unlinked); a DTensor's
    full tensor is put together in ``assembled``, shared by the call's replies.  Raises
    :class:`OutOfStep`."""
    open_ = {rank: conn for rank, conn in pending.items() if rank not in closed}
    by_conn = {id(conn): rank for rank, conn in open_.items()}
    found: list[Reply] = []
    if not open_:
        time.sleep(timeout)
        return found
    for conn in wait(list(open_.values()), timeout=timeout):
        rank = by_conn[id(conn)]
        try:
            message = pending[rank].recv()
        except (EOFError, OSError):
            closed[rank] = time.monotonic()
            continue
        except (pickle.UnpicklingError, ValueError, TypeError, AttributeError, ImportError, IndexError) as exc:
            raise OutOfStep(
                rank,
                f"sent the kernel something that is not a reply ({type(exc).__name__}: {exc}): "
                "its code wrote on air_magic's connection",
            ) from None
        if not isinstance(message, (CallBegan, CallDone)):
            raise OutOfStep(rank, f"sent the kernel something that is not a reply ({_short(message)})")
        answered = message.id
        if answered != call_id:
            raise OutOfStep(
                rank,
                f"answered call #{answered} while call #{call_id} ran (a process its code forked went on "
                "speaking on the rank's connection, or an earlier reply was left unread)",
            )
        if isinstance(message, CallBegan):
            began(rank, answered)
            continue
        found.append(Reply(rank, load(message.blob, folders, assembled), list(message.names), list(message.forked)))
        del pending[rank]
    return found


def _short(message: Any) -> str:
    text = repr(message)
    return text if len(text) <= 80 else text[:77] + "..."


def load(blob: bytes, folders: tuple[str | None, ...] = (), assembled: dict[int, Any] | None = None) -> Any:
    """A record sent by a rank (its large tensors' files looked for in ``folders``); an error
    loading it raises is returned in its place (a value of a class the kernel does not have)."""
    try:
        return _results.loads_record(blob, folders, assembled)
    except Exception as exc:
        return exc


def ask_every_rank(
    conns: list[Connection], kind: str, call_id: int, data: dict[str, Any], timeout: float, doing: str
) -> dict[int, Any] | str:
    """Send one message (``kind``, e.g. ``settle`` or ``regroup``) to every rank and wait up
    to ``timeout`` s for each one's value: ``{rank: value}``, or why not (a string naming the
    rank; ``doing``: what the ranks were asked, ``check its state``)."""
    message = capture.dumps(PoolRequest(PoolKind(kind), call_id, data))
    pending = dict(enumerate(conns))
    for rank, conn in list(pending.items()):
        try:
            conn.send_bytes(message)
        except OSError:
            return f"rank {rank}'s connection closed"
    found: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    closed: dict[int, float] = {}
    while pending and time.monotonic() < deadline:
        try:
            answers = replies(pending, call_id, 0.05, lambda rank, _id: None, closed)
        except OutOfStep as exc:
            return str(exc)
        for reply in answers:
            if not isinstance(reply.record, ValueRecord):
                text = getattr(reply.record, "message", "") or str(reply.record)
                return f"rank {reply.rank} could not {doing} ({text[:200]})"
            found[reply.rank] = reply.record.value
        if closed:
            return f"rank {min(closed)}'s connection closed"
    if pending:
        which = ", ".join(map(str, sorted(pending)))
        return f"rank{'s' * (len(pending) != 1)} {which} did not {doing} in {timeout:g} s"
    return found
