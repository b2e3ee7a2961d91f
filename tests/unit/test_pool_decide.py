"""The pool's decisions about a call that went wrong (which rank's end broke it, whose error
it raises, whether a cancel was heeded), without processes."""

from __future__ import annotations

from air_magic.kernel.outcome import RankState
from air_magic.kernel.pool.decide import CLOSED_GRACE, TOGETHER, first_failure, first_gone, interrupted_all
from air_magic.protocol import ErrorRecord, ValueRecord


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


def _error(type_name: str, at: float, message: str = "it failed") -> ErrorRecord:
    return ErrorRecord(None, type_name, message, "Traceback ...", at)


def test_the_error_raised_is_the_first_rank_s_to_fail() -> None:
    errors = {0: _error("ValueError", 3.0), 2: _error("KeyError", 1.0)}
    assert first_failure(errors) == 2


def test_ranks_that_failed_together_give_the_lowest_rank_s_error() -> None:
    errors = {3: _error("ValueError", 1.0), 1: _error("ValueError", 1.0 + TOGETHER / 2), 0: _error("ValueError", 9.0)}
    assert first_failure(errors) == 1


def test_a_collective_broken_by_a_peer_is_never_chosen_over_the_user_s_error() -> None:
    echo = _error("RuntimeError", 1.0, "Connection closed by peer [127.0.0.1]:1234")
    errors = {0: echo, 1: _error("ZeroDivisionError", 2.0, "division by zero")}
    assert first_failure(errors) == 1


def test_when_every_error_is_an_echo_the_first_of_them_is_said() -> None:
    errors = {
        1: _error("RuntimeError", 2.0, "Connection closed by peer"),
        0: _error("RuntimeError", 5.0, "Connection closed by peer"),
    }
    assert first_failure(errors) == 1


def test_a_cancel_was_heeded_only_when_every_error_is_an_interrupt() -> None:
    interrupt = _error("KeyboardInterrupt", 1.0, "")
    assert interrupted_all({0: interrupt, 1: interrupt})
    assert interrupted_all({0: interrupt, 1: ValueRecord(5)})  # a rank that finished is no error
    assert not interrupted_all({0: interrupt, 1: _error("ValueError", 1.0)})
    assert not interrupted_all({0: ValueRecord(5)})  # no error at all: nothing was interrupted
