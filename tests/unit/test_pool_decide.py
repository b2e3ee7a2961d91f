"""The pool's decision of which rank's end broke a call, without processes."""

from __future__ import annotations

from air_magic.kernel.outcome import RankState
from air_magic.kernel.pool.decide import CLOSED_GRACE, first_gone


def _states(*ends: tuple[int | None, float | None, bool]) -> list[RankState]:
    """(returncode, ended_at, stopped) per rank."""
    return [
        RankState(rank=r, log_path=f"/logs/rank-{r}.log", pid=100 + r, returncode=code, ended_at=at, stopped=stopped)
        for r, (code, at, stopped) in enumerate(ends)
    ]


def test_the_rank_that_ended_by_itself_comes_before_those_air_magic_stopped_because_of_it() -> None:
    states = _states((-15, 1.0, True), (1, 2.0, False), (None, None, False))
    assert first_gone(states, [0, 1, 2], {}, launch_done=False, now=5.0) == 1


def test_among_ranks_that_ended_by_themselves_the_earliest() -> None:
    states = _states((1, 3.0, False), (-9, 2.0, False), (None, None, False))
    assert first_gone(states, [0, 1, 2], {}, launch_done=False, now=5.0) == 1


def test_only_stopped_ranks_gone_the_earliest_of_them() -> None:
    states = _states((-15, 2.5, True), (-15, 2.0, True))
    assert first_gone(states, [0, 1], {}, launch_done=False, now=5.0) == 1


def test_a_closed_connection_counts_only_after_its_grace() -> None:
    states = _states((None, None, False), (None, None, False))
    assert first_gone(states, [0, 1], {1: 10.0}, launch_done=False, now=10.0 + CLOSED_GRACE / 2) is None
    assert first_gone(states, [0, 1], {1: 10.0}, launch_done=False, now=10.0 + CLOSED_GRACE + 0.1) == 1
    assert first_gone(states, [0], {1: 10.0}, launch_done=False, now=20.0) is None  # (1 answered meanwhile)


def test_a_launch_that_is_over_with_ranks_still_in_the_call_names_the_lowest() -> None:
    states = _states((None, None, False), (None, None, False))
    assert first_gone(states, [1, 0], {}, launch_done=True, now=5.0) == 0
    assert first_gone(states, [], {}, launch_done=True, now=5.0) is None
