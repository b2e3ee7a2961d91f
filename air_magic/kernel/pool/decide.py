"""The pool's decisions about a call that went wrong, as pure functions of what the engine
saw (no process, no clock of their own): tested without processes
(``tests/unit/test_pool_decide.py``), used by :mod:`air_magic.kernel.pool.engine`::

    the ranks' states (exit codes, who air_magic stopped, when each ended)
    + the ranks still in the call + when each closed its connection + now
        --> first_gone(): the rank whose end broke the call, or None
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from air_magic.kernel.outcome import RankState

__all__ = ["CLOSED_GRACE", "first_gone"]

#: Seconds after a rank closed its connection (its process still there) before that counts as
#: its end: its process's exit usually follows at once and says more.
CLOSED_GRACE = 1.0


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
