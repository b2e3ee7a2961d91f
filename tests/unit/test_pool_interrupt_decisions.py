"""What a pool's interrupt decides, without processes: which ranks are left in collectives
that cannot complete (and only those are cut free), which groups the ranks left uneven, and
what the cell says of the ranks' state once they compared it (the shapes of
:func:`air_magic.rank.inspect.collectives.dump`'s and :func:`air_magic.rank.pool.interrupts.state.fingerprint`'s
answers)."""

from __future__ import annotations

from typing import Any

from air_magic.kernel.inspect.collectives import stuck, uneven
from air_magic.kernel.pool.interrupts import state as pool_state
from air_magic.kernel.pool.interrupts.interrupt import INTACT, _not_made_by, headline
from air_magic.protocol import ErrorRecord, ValueRecord


def quick(*groups: tuple[str, int, int]) -> dict[str, Any]:
    """A rank's quick look: each group's (name, last enqueued, last completed)."""
    return {
        "groups": {name: {"enqueued": e, "completed": c} for name, e, c in groups},
        "pending": [{"pg": name, "seq": c + 1} for name, e, c in groups if e > c],
    }


def test_a_rank_left_in_a_collective_its_stopped_peer_never_started_is_cut_free() -> None:
    # Rank 1 stopped before its backward (#12); rank 0 waits in #12's gradient all-reduce.
    seen = {0: quick(("0", 12, 11)), 1: quick(("0", 11, 11))}
    assert stuck(seen, back={1}) == [0]


def test_nothing_is_cut_while_a_collective_every_rank_started_is_still_in_flight() -> None:
    # Every rank started #12; rank 1 came back (async) and rank 0 has not completed it yet:
    # cutting now could complete it on one rank and fail it on the other.
    seen = {0: quick(("0", 12, 11)), 1: quick(("0", 12, 11))}
    assert stuck(seen, back={1}) == []


def test_nothing_is_cut_while_no_rank_is_back_or_one_did_not_answer() -> None:
    seen = {0: quick(("0", 12, 11)), 1: quick(("0", 11, 11))}
    assert stuck(seen, back=set()) == []  # they may still agree on a point
    assert stuck({0: quick(("0", 12, 11)), 1: None}, back={1}) == []


def test_a_subgroup_only_some_ranks_are_in_is_not_judged() -> None:
    seen = {0: quick(("0", 5, 5), ("7", 3, 2)), 1: quick(("0", 5, 5))}
    assert stuck(seen, back={1}) == []


def test_ranks_that_started_different_collectives_leave_the_group_uneven() -> None:
    seen = {0: quick(("0", 12, 12)), 1: quick(("0", 11, 11)), 2: quick(("0", 12, 12))}
    assert uneven(seen) == ["the default group: rank 0 at #12, rank 1 at #11, rank 2 at #12"]
    assert uneven({0: quick(("0", 12, 12)), 1: quick(("0", 12, 12))}) == []


def module(tensors: dict[str, float | None], dtensors: tuple[int, int] = (0, 4), wrapped: str = "DDP") -> dict:
    return {"kind": "module", "tensors": tensors, "dtensors": dtensors, "wrapped": wrapped}


def optimizer(steps: int, tensors: dict[str, float | None] | None = None) -> dict:
    return {"kind": "optimizer", "tensors": tensors or {}, "steps": steps}


SAME = {"a.weight": 1.5, "a.bias": -0.25, "b.weight": 3.0, "b.bias": 0.125}


def test_equal_fingerprints_are_intact_and_the_note_says_what_was_checked() -> None:
    answers = {
        r: {
            "repaired": ["model: DDP's reducer reset and the interrupted step's gradients cleared"],
            "names": {"model": module(SAME), "opt": optimizer(13), "loss_fn": module({})},
        }
        for r in (0, 1)
    }
    check = pool_state.compare(answers)
    assert check.intact
    assert headline("", check) == INTACT
    assert check.note() == (
        "[air_magic] put back: model: DDP's reducer reset and the interrupted step's gradients cleared (every rank). "
        "checked on every rank: model (4 tensors), opt (13 steps): equal."
    )


def test_what_differs_is_named_with_the_repair() -> None:
    other = {**SAME, "a.weight": 1.75, "b.weight": 2.5, "b.bias": 0.0}
    answers = {
        0: {"names": {"model": module(SAME), "opt": optimizer(13)}},
        1: {"names": {"model": module(other), "opt": optimizer(15)}},
    }
    check = pool_state.compare(answers)
    assert not check.intact
    assert headline("", check) == (
        "you interrupted the pool's cell; every rank stopped it, but their state differs: model: rank 0 and rank 1 "
        "differ in 3 of 4 tensors; opt: 13 steps on rank 0, 15 steps on rank 1. pool.sync('model', 'opt') copies "
        "rank 0's to the others (air_magic.Pool.current().sync(...)), or run the cells that build them again."
    )


def test_sharded_tensors_are_not_compared_but_which_parameters_are_dtensors_is() -> None:
    sharded = {"a.weight": None, "a.bias": None}
    answers = {
        0: {"names": {"model": module(sharded, dtensors=(120, 125), wrapped="")}},
        1: {"names": {"model": module(sharded, dtensors=(125, 125), wrapped="")}},
    }
    check = pool_state.compare(answers)
    assert check.differs == [
        "model: 120 of 125 parameters are DTensors on rank 0, 125 of 125 parameters are DTensors on rank 1"
    ]


def test_a_plain_module_that_differs_says_it_may_be_meant_to() -> None:
    answers = {
        0: {"names": {"net": module(SAME, wrapped="")}},
        1: {"names": {"net": module({**SAME, "a.bias": 9.0}, wrapped="")}},
    }
    check = pool_state.compare(answers)
    assert check.differs == [
        "net: rank 0 and rank 1 differ in 1 of 4 tensors (a module not wrapped in DDP, FSDP or DeepSpeed: if its "
        "ranks are meant to differ, nothing is wrong)"
    ]


def test_a_name_one_rank_lacks_differs_and_one_that_cannot_be_read_is_said_not_checked() -> None:
    answers = {
        0: {"names": {"model": module(SAME), "extra": optimizer(1), "odd": {"kind": "module", "error": "E: x"}}},
        1: {"names": {"model": module(SAME), "odd": module(SAME)}},
    }
    check = pool_state.compare(answers)
    assert check.differs == ["extra: defined on rank 0 only"]
    assert check.unread == ["odd (rank 0: E: x)"]
    assert check.checked == ["model (4 tensors)"]


def test_after_a_rebuilt_group_the_headline_says_why_and_still_judges_the_state() -> None:
    check = pool_state.compare({r: {"names": {"model": module(SAME)}} for r in (0, 1)})
    why = "rank 0 waited in a collective that rank 1 had stopped before, so it was stopped there"
    assert headline(why, check) == (
        "you interrupted the pool's cell; rank 0 waited in a collective that rank 1 had stopped before, so it was "
        "stopped there: the process group was rebuilt; your names are kept, and their state is intact."
    )


def test_the_cut_names_what_the_ranks_back_from_the_call_did_instead_of_the_collective() -> None:
    stopped = ErrorRecord(None, "KeyboardInterrupt", "", "", 0.0)
    failed = ErrorRecord(None, "RuntimeError", "x", "", 0.0)
    assert _not_made_by({1}, {1: stopped}) == "a collective that rank 1 had stopped before"
    assert _not_made_by({1}, {1: ValueRecord(None)}) == "a collective that rank 1 never made (it had finished the call)"
    assert _not_made_by({1, 2, 3}, {1: stopped, 2: failed, 3: stopped}) == (
        "a collective that ranks 1, 3 had stopped before and rank 2 had failed before"
    )
