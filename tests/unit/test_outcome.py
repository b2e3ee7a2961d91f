"""How a launch's end becomes its values or its one exception (air_magic.kernel.outcome, pure)."""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle
import pytest

from air_magic.errors import (
    LaunchCancelledError,
    LaunchError,
    LaunchTimeoutError,
    RankCrashedError,
    RankFailedError,
    RankTraceback,
    ResultError,
)
from air_magic.kernel import outcome as _outcome
from air_magic.kernel.outcome import MISSING, Ending, RankState, decide, describe_exit, failed_ranks, needs_records
from air_magic.protocol import TRACEBACK_MARK, ErrorRecord, UnpicklableRecord, ValueRecord


def _ranks(*codes: int | None, stopped: tuple[int, ...] = (), left: tuple[int, ...] = ()) -> tuple[RankState, ...]:
    return tuple(
        RankState(
            r,
            f"/logs/rank-{r}.log",
            pid=100 + r,
            returncode=code,
            ended_at=10.0 + r,
            stopped=r in stopped,
            left=r in left,
        )
        for r, code in enumerate(codes)
    )


def _ending(ranks: tuple[RankState, ...], **fields: Any) -> Ending:
    return Ending(label="train", world_size=len(ranks), ranks=ranks, **fields)


def _error(exc: BaseException, failed_at: float = 5.0, blob: bool = True) -> ErrorRecord:
    name = type(exc).__qualname__
    text = f"Traceback (most recent call last):\n  ...\n{name}: {exc}\n"
    return ErrorRecord(cloudpickle.dumps(exc) if blob else None, name, str(exc), text, failed_at)


def test_success_is_the_values_in_rank_order() -> None:
    ending = _ending(_ranks(0, 0))
    assert needs_records(ending)
    outcome = decide(ending, {0: ValueRecord("a"), 1: ValueRecord({"b": 2})})
    assert (outcome.status, outcome.ok, outcome.value) == ("finished", True, ["a", {"b": 2}])


def test_one_rank_raising_is_its_own_exception_with_the_ranks_notes() -> None:
    ending = _ending(_ranks(-15, 1, stopped=(0,)), stop_reason="failure", failures=(1,))
    records = {0: MISSING, 1: _error(ValueError("bad batch on rank 1"))}
    assert failed_ranks(ending, records) == [1]
    outcome = decide(ending, records, tails={1: "line\n"})
    exc = outcome.value
    assert (outcome.status, outcome.ok) == ("failed", False)
    assert type(exc) is ValueError and str(exc) == "bad batch on rank 1"
    assert exc.__notes__[0] == (
        "[air_magic] raised on rank 1 of 2; rank 0 was stopped by air_magic. Full log: /logs/rank-1.log"
    )
    assert isinstance(exc.__cause__, RankTraceback) and exc.__suppress_context__


def test_an_exception_that_cannot_travel_is_a_rank_failed_error() -> None:
    ending = _ending(_ranks(0, 1), stop_reason="failure", failures=(1,))
    records = {1: _error(RuntimeError("boom"), blob=False)}
    exc = decide(ending, records).value
    assert isinstance(exc, RankFailedError)
    assert str(exc) == "rank 1 of 2 raised RuntimeError: boom; rank 0 finished."
    assert (exc.rank, exc.world_size, exc.exc_type) == (1, 2, "RuntimeError")


def test_the_first_to_fail_is_named_and_an_echo_is_never_the_cause() -> None:
    ending = _ending(_ranks(1, 1, -15, stopped=(2,)), stop_reason="failure", failures=(0, 1))
    records = {
        0: _error(RuntimeError("Connection closed by peer"), failed_at=1.0, blob=False),
        1: _error(KeyError("x"), failed_at=2.0, blob=False),
        2: MISSING,
    }
    exc = decide(ending, records).value
    assert str(exc) == (
        "rank 1 of 3, the first to fail, raised KeyError: 'x'; rank 0 failed too "
        "(RuntimeError: Connection closed by peer); rank 2 was stopped by air_magic."
    )


def test_a_program_s_exit_on_a_rank_the_cell_did_not_show_tells_what_it_printed() -> None:
    usage = "usage: train [-h] [--lr LR]\ntrain: error: argument --lr: invalid float value: 'fast'"
    log = f"{usage}\n{TRACEBACK_MARK}Traceback (most recent call last):\n  ...\nSystemExit: 2\n"
    records = {0: MISSING, 1: _error(SystemExit(2))}
    failed = {"stop_reason": "failure", "failures": (1,)}
    # rank 0's output was shown in the cell as it ran; rank 1's only in its log
    exc = decide(_ending(_ranks(-15, 1, stopped=(0,)), shown_rank=0, **failed), records, tails={1: log}).value
    assert isinstance(exc, RankFailedError)
    assert str(exc) == "rank 1 of 2 raised SystemExit: 2; rank 0 was stopped by air_magic."
    assert exc.__notes__ == [f"[air_magic] rank 1 printed before it exited (/logs/rank-1.log):\n{usage}"]
    # the same on rank 0, which the cell showed: not twice
    records = {0: _error(SystemExit(2)), 1: MISSING}
    failed = {"stop_reason": "failure", "failures": (0,)}
    exc = decide(_ending(_ranks(1, -15, stopped=(1,)), shown_rank=0, **failed), records, tails={0: log}).value
    assert getattr(exc, "__notes__", []) == []
    # a launch nobody watched (submit(), --async): rank 0's words are kept too
    exc = decide(_ending(_ranks(1, -15, stopped=(1,)), **failed), records, tails={0: log}).value
    assert exc.__notes__ == [f"[air_magic] rank 0 printed before it exited (/logs/rank-0.log):\n{usage}"]


def test_a_crash_by_signal_says_how_with_the_logs_last_lines() -> None:
    ending = _ending(_ranks(-15, -9, stopped=(0,)), stop_reason="failure", failures=(1,))
    log = "\n".join(f"step {i}" for i in range(30)) + "\n"
    exc = decide(ending, {0: MISSING, 1: MISSING}, tails={1: log}).value
    assert isinstance(exc, RankCrashedError)
    last = "\n".join(f"step {i}" for i in range(10, 30))
    assert str(exc) == (
        f"rank 1 of 2 {describe_exit(-9)}; rank 0 was stopped by air_magic.\nIts last lines (/logs/rank-1.log):\n{last}"
    )
    assert "was killed by SIGKILL (exit -9): possibly out of memory" in str(exc)
    assert (exc.rank, exc.returncode, exc.log_path) == (1, -9, "/logs/rank-1.log")


def test_an_exit_code_without_an_exception_and_an_early_exit() -> None:
    ending = _ending(_ranks(0, 3), stop_reason="failure", failures=(1,))
    exc = decide(ending, {1: MISSING}).value
    assert str(exc).startswith("rank 1 of 2 exited with code 3 without reporting an exception")
    ending = _ending(_ranks(0, 0, left=(1,)), failures=(1,))
    assert "exited (code 0) without returning" in str(decide(ending, {1: MISSING}).value)


def test_a_timeout_names_the_limit_and_where_the_ranks_were() -> None:
    ending = _ending(_ranks(-15, -15, stopped=(0, 1)), stop_reason="timeout", timeout=2.0, failures=())
    assert not needs_records(ending)
    outcome = decide(ending, {}, where="[air_magic] where each rank was:\n  rank 0: at x")
    assert outcome.status == "timed out" and isinstance(outcome.value, LaunchTimeoutError)
    assert str(outcome.value) == (
        "train ran past its timeout of 2 s; all 2 ranks were stopped. Pass a larger timeout (seconds) "
        "or timeout=None for no limit (%%distributed --timeout SECONDS|none)."
    )
    assert outcome.value.__notes__ == ["[air_magic] where each rank was:\n  rank 0: at x"]


def test_a_cancel() -> None:
    for fields in ({"stop_reason": "cancel"}, {"cancel_requested": True}, {"stop_reason": "kill"}):
        ending = _ending(_ranks(-2, -2), **fields)
        assert not needs_records(ending)
        outcome = decide(ending, {})
        assert outcome.status == "cancelled" and isinstance(outcome.value, LaunchCancelledError)
        assert str(outcome.value) == "the launch of train was cancelled; its 2 ranks were stopped."
    one = decide(_ending(_ranks(-2), stop_reason="cancel"), {}).value
    assert str(one) == "the launch of train was cancelled; its rank was stopped."


def test_a_launch_that_could_not_run() -> None:
    outcome = decide(_ending(_ranks(None), error_text="no fork"), {})
    assert outcome.status == "failed" and type(outcome.value) is LaunchError
    assert str(outcome.value) == "could not run train: no fork"


def test_an_unpicklable_or_unloadable_result_names_the_rank() -> None:
    ending = _ending(_ranks(0, 0))
    records: dict[int, Any] = {
        0: ValueRecord(1),
        1: UnpicklableRecord("_thread.lock", "TypeError: cannot pickle '_thread.lock' object"),
    }
    outcome = decide(ending, records)
    assert outcome.status == "failed" and isinstance(outcome.value, ResultError)
    assert str(outcome.value) == (
        "rank 1 of 2 returned a _thread.lock, which cannot be sent back to the kernel (TypeError: cannot "
        "pickle '_thread.lock' object). Return plain data instead (numbers, lists, tensors, a state_dict()), "
        "or save it to a file on the rank."
    )
    assert (outcome.value.rank, outcome.value.world_size) == (1, 2)
    records[1] = ModuleNotFoundError("No module named 'rank_only'")
    message = str(decide(ending, records).value)
    assert message.startswith(
        "rank 1 of 2 returned a value that cannot be loaded in the kernel "
        "(ModuleNotFoundError: No module named 'rank_only')."
    )


def test_a_rank_that_left_no_result_without_a_failure_seen() -> None:
    outcome = decide(_ending(_ranks(0, 0)), {0: MISSING})
    assert isinstance(outcome.value, RankCrashedError)
    assert str(outcome.value) == (
        "rank 0 of 2 exited (code 0) without returning a result: something in the code ended the "
        "process early (os._exit). Its log: /logs/rank-0.log"
    )


def test_stopped_exits_and_describe_exit() -> None:
    assert _outcome.is_stopped_exit(-15, 5.0, 4.0) and not _outcome.is_stopped_exit(-15, 3.0, 4.0)
    assert not _outcome.is_stopped_exit(1, 5.0, 4.0) and not _outcome.is_stopped_exit(-9, 5.0, None)
    # 130: the rank's code raised the KeyboardInterrupt the stop's SIGINT made (a cancel, a failure elsewhere)
    assert _outcome.is_stopped_exit(130, 5.0, 4.0) and not _outcome.is_stopped_exit(130, 3.0, 4.0)
    # With the stops begun: a SIGKILL seen 0.5 s into a failure's stop (whose SIGKILL comes at 2 s)
    # was not air_magic's (a rank killed from outside, its exit seen late): the failure itself.
    failure = [("failure", 4.0)]
    assert not _outcome.is_stopped_exit(-9, 4.5, 4.0, failure)
    assert _outcome.is_stopped_exit(-9, 6.1, 4.0, failure) and _outcome.is_stopped_exit(-15, 4.2, 4.0, failure)
    assert _outcome.is_stopped_exit(-9, 4.5, 4.0, failure + [("kill", 4.4)])  # a kill after it: at once
    assert not _outcome.is_stopped_exit(-15, 4.5, 4.0, [("kill", 4.0)])  # a kill sends no SIGTERM
    assert _outcome.is_stopped_exit(130, 4.1, 4.0, [("cancel", 4.0)])  # (its KeyboardInterrupt: any time)
    assert describe_exit(-11).startswith("was killed by SIGSEGV (exit -11): a segmentation fault")
    assert describe_exit(-200) == "was killed by signal 200 (exit -200)"


@pytest.mark.parametrize("record", [ValueRecord([1, 2]), _error(ValueError("x")), UnpicklableRecord("t", "r")])
def test_records_round_trip_through_pickle(record: Any) -> None:
    assert pickle.loads(pickle.dumps(record)) == record
