"""The pool's decisions about a call that went wrong, as pure functions of what the engine
saw (no process, no clock of their own): tested without processes
(``tests/unit/test_pool_decide.py``), used by :mod:`air_magic.kernel.pool.engine`::

    the ranks' states (exit codes, who air_magic stopped, when each ended)
    + the ranks still in the call + when each closed its connection + now
        --> first_gone(): the rank whose end broke the call, or None
    the ranks' error records (type, message, when each failed)
        --> first_failure(): the rank whose error the call raises
        --> interrupted_all(): whether every error was an interrupt's (a cancel heeded)
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from air_magic.kernel.outcome import RankState, is_echo
from air_magic.protocol import ErrorRecord

__all__ = ["CLOSED_GRACE", "TOGETHER", "first_gone", "first_failure", "interrupted_all"]

#: Seconds after a rank closed its connection (its process still there) before that counts as
#: its end: its process's exit usually follows at once and says more.
CLOSED_GRACE = 1.0
#: Failures this close together (seconds) are one failure of every rank (the same line failed
#: on each): the lowest rank's is said, as a user reading rank 0's output expects.
TOGETHER = 0.5


def first_gone(
    states: Sequence[RankState],
    pending: Iterable[int],
    closed: Mapping[int, float],
    launch_done: bool,
    now: float,
) -> int | None:
    """The pending rank that ended first (one that ended by itself before one air_magic
    stopped because of it; then the earliest), or, when none has ended: the lowest pending
    rank of a launch that is over, else the lowest that closed its connection more than
    ``CLOSED_GRACE`` s ago.  None: nobody is gone."""
    pending = list(pending)
    gone = [r for r in pending if states[r].returncode is not None]
    if not gone:
        if launch_done and pending:
            return min(pending)
        late = [r for r, at in closed.items() if r in pending and now - at > CLOSED_GRACE]
        return min(late) if late else None
    first = [r for r in gone if not states[r].stopped] or gone
    return min(first, key=lambda r: (states[r].ended_at or 0.0, r))


def first_failure(errors: Mapping[int, ErrorRecord]) -> int:
    """The rank whose error the call raises: the first to fail; of ranks that failed
    together, the lowest; a failure that echoes another's (a collective broken by a peer)
    is never chosen over an error of the user's code."""
    own = {r: e for r, e in errors.items() if not is_echo(e.type_name, e.message)} or dict(errors)
    first = min(e.failed_at for e in own.values())
    return min(r for r, e in own.items() if e.failed_at <= first + TOGETHER)


def interrupted_all(records: Mapping[int, Any]) -> bool:
    """Whether every rank that came back with an error came back interrupted."""
    errors = [rec for rec in records.values() if isinstance(rec, ErrorRecord)]
    return bool(errors) and all(rec.type_name == "KeyboardInterrupt" for rec in errors)
