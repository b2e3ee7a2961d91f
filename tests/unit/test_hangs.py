"""The hang report's verdicts, from what ranks' Flight Recorders say (the shapes of
:func:`air_magic.rank.inspect.collectives.dump`'s answers): who is behind, who disagrees, who has
ended, and every rank in one collective."""

from __future__ import annotations

import sys
from typing import Any

from air_magic.kernel.inspect.hang_report import BLOCKED, COMPUTING, ENDED, IN_COLLECTIVE, OUTSIDE, PAUSED, report


def seen(enqueued: int, completed: int, *pending: dict[str, Any], last_where: str = "") -> dict[str, Any]:
    last = {"pg": "0", "seq": completed, "op": "gloo:all_reduce", "where": last_where} if completed >= 0 else None
    group = {"name": "0", "enqueued": enqueued, "completed": completed}
    if last:
        group["last"] = last
    return {"groups": {"0": group}, "pending": list(pending)}


def entry(
    seq: int, op: str = "all_reduce", size: tuple[int, ...] = (1024,), where: str = "train.py:61 in step"
) -> dict[str, Any]:
    return {
        "pg": "0",
        "seq": seq,
        "op": f"gloo:{op}",
        "input_sizes": [list(size)],
        "input_dtypes": ["Float"],
        "where": where,
    }


def test_a_rank_that_skipped_a_collective_is_behind_and_named_with_its_last_one() -> None:
    made = report(
        {
            0: seen(42, 41, entry(42)),
            1: seen(41, 41, last_where="train.py:57 in step"),
            2: seen(42, 41, entry(42)),
            3: seen(42, 41, entry(42)),
        },
        4,
        stacks={
            0: ("train.py:61 in step", True, "its stack"),
            1: ("train.py:80 in step", False, "its stack"),
            2: ("", True, "its stack"),
            3: ("", True, "its stack"),
        },
        stuck_for=7,
    )
    assert made is not None
    assert made.verdict == (
        "rank 1 is behind: its last collective is #41 (train.py:57 in step); it is at train.py:80 in step; "
        "ranks 0, 2, 3 wait in all_reduce #42 (train.py:61 in step)"
    )
    # How busy rank 1 is was not measured (a Ray rank's, a GPU rank's): not in a collective, no more.
    assert [r.state for r in made.rows] == [IN_COLLECTIVE, OUTSIDE, IN_COLLECTIVE, IN_COLLECTIVE]
    row = made.rows[0]
    assert (row.group, row.seq, row.op, row.shapes, row.where, row.read) == (
        "default",
        42,
        "all_reduce",
        "[1024] float32",
        "train.py:61 in step",
        "Flight Recorder",
    )
    assert made.rows[1].read == "Flight Recorder + its stack"
    text = made.text()
    assert text.splitlines()[0] == "[air_magic] hang report: " + made.verdict
    assert "rank  state" in text and "read by" in text


def test_ranks_at_the_same_collective_with_different_ops_disagree() -> None:
    made = report({0: seen(42, 41, entry(42)), 1: seen(42, 41, entry(42, "broadcast"))}, 2)
    assert made is not None
    assert made.verdict == "ranks disagree at #42: rank 0 all_reduce [1024] float32, rank 1 broadcast [1024] float32"
    shapes = report({0: seen(42, 41, entry(42)), 1: seen(42, 41, entry(42, size=(512,)))}, 2)
    assert shapes is not None and shapes.verdict.startswith("ranks disagree at #42: rank 0 all_reduce [1024] float32")


def test_every_rank_in_one_collective_points_at_the_network_or_a_device() -> None:
    made = report({r: seen(42, 41, entry(42)) for r in range(4)}, 4, stuck_for=12)
    assert made is not None
    assert made.verdict == (
        "every rank is in all_reduce #42 (train.py:61 in step) for 12 s: a peer's network or device, not the code"
    )


def test_a_rank_that_ended_while_its_peers_wait_is_named_with_its_exit() -> None:
    made = report(
        {0: seen(7, 6, entry(7, "barrier", size=())), 1: seen(7, 6, entry(7, "barrier", size=()))},
        3,
        ended={2: "exit 0"},
    )
    assert made is not None
    assert made.verdict == "rank 2 has ended (exit 0) while ranks 0, 1 wait in barrier #7 (train.py:61 in step)"
    assert made.rows[2].state == ENDED and made.rows[2].read == "exit code"


def test_ranks_at_different_collectives_name_the_lowest_as_behind() -> None:
    made = report({0: seen(43, 42, entry(43)), 1: seen(42, 41, entry(42, where="train.py:50 in f"))}, 2)
    assert made is not None
    assert made.verdict == (
        "rank 1 is behind: in all_reduce #42 (train.py:50 in f); rank 0 waits in all_reduce #43 (train.py:61 in step)"
    )


def test_a_rank_paused_in_the_debugger_is_a_row_of_its_own() -> None:
    made = report({0: seen(5, 4, entry(5))}, 2, paused={1: "Cell In[3], line 4"})
    assert made is not None and made.rows[1].state == PAUSED


def test_no_rank_in_a_collective_is_no_report() -> None:
    assert report({0: seen(5, 5), 1: seen(5, 5)}, 2) is None
    # pending in the recorder, but the stack says the code is not waiting (an async op): none
    assert (
        report(
            {0: seen(6, 5, entry(6)), 1: seen(6, 5, entry(6))},
            2,
            stacks={0: ("", False, "its stack"), 1: ("", False, "its stack")},
        )
        is None
    )


def test_a_rank_read_from_outside_says_so() -> None:
    made = report({0: seen(5, 4, entry(5)), 1: None}, 2, stacks={1: ("gil.py:6 in <module>", False, "py-spy")})
    assert made is not None
    assert made.rows[1].state == "not answering" and made.rows[1].read == "py-spy"
    assert made.verdict.startswith("rank 1 is behind: it does not answer; it is at gil.py:6 in <module>;")


PY_SPY_OUTPUT = """Process 4242: python -m air_magic.rank.zygote
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (active+gil): "MainThread"
    match (/usr/lib/python3.11/re/__init__.py:166)
    <module> (/home/me/gil.py:6)
    _run (/x/site-packages/air_magic/rank/main.py:584)
Thread 4250 (idle)
    answer (/x/site-packages/air_magic/rank/main.py:271)
"""


def test_a_rank_that_holds_the_gil_is_read_by_py_spy_where_it_is_installed(tmp_path: Any, monkeypatch: Any) -> None:
    """py-spy is a program air_magic does not own: a stand-in prints its output."""
    from air_magic.kernel.inspect.stacks import py_spy_stacks, user_frame

    spy = tmp_path / "py-spy"
    spy.write_text(f"#!{sys.executable}\nprint({PY_SPY_OUTPUT!r})\n")
    spy.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    text = py_spy_stacks(4242)
    assert '  File "/home/me/gil.py", line 6 in <module>' in text
    assert user_frame(text) == ("/home/me/gil.py:6 in <module>", False)


def test_a_rank_that_answered_before_keeps_its_answer_when_a_look_goes_unanswered(tmp_path: Any) -> None:
    """On a loaded machine a rank's thread may miss one look's 3 s: its row keeps what it said
    last (with its age), so the verdict does not flip to "it does not answer" and back."""
    from air_magic.kernel.inspect.hangs import HangWatch

    answers = [
        {0: seen(3, 2, entry(3)), 1: seen(2, 2, last_where="train.py:5 in <module>")},
        {0: seen(3, 2, entry(3)), 1: None},
    ]

    def ask(ranks: list[int], **kwargs: Any) -> dict[int, Any]:
        return answers.pop(0) if kwargs.get("how") == "r" else {}

    watch = HangWatch(str(tmp_path), 2, 5.0, ended=dict, show=lambda made: None, ask=ask)
    first = watch.look(ended={})
    second = watch.look(ended={})
    assert first is not None and second is not None
    assert second.verdict == first.verdict
    assert first.verdict.startswith("rank 1 is behind: its last collective is #2 (train.py:5 in <module>)")
    assert second.rows[1].state == OUTSIDE
    assert second.rows[1].read.startswith("Flight Recorder, ") and second.rows[1].read.endswith(" s ago")
    assert second.rows[0].read == "Flight Recorder"


def test_the_first_report_waits_longer_for_a_rank_s_first_full_read(tmp_path: Any) -> None:
    """A rank's first full read loads torch's symbols (a second of CPU; more than 3 s on a loaded
    machine, where it showed as "not answering"): the report waits up to FIRST_READ for it, and
    READ once every rank has answered one."""
    from air_magic.kernel.inspect.hangs import FIRST_READ, READ, HangWatch

    waited: list[float] = []

    def ask(ranks: list[int], **kwargs: Any) -> dict[int, Any]:
        if kwargs.get("how") != "r":
            return {}
        waited.append(kwargs["timeout"])
        return {0: seen(3, 2, entry(3)), 1: seen(2, 2, last_where="train.py:5 in <module>")}

    watch = HangWatch(str(tmp_path), 2, 5.0, ended=dict, show=lambda made: None, ask=ask)
    assert watch.look(ended={}) is not None and watch.look(ended={}) is not None
    assert waited == [FIRST_READ, READ] and FIRST_READ > READ == 3.0


def _watch_looks(
    tmp_path: Any, monkeypatch: Any, completed: list[int | None], quiet: tuple[int, ...] = (0, 1)
) -> tuple[list[str], list[Any]]:
    """A local watch (the ranks' pipes), 5 s to a report, looked at once a second on a fake
    clock; each look finds both ranks in a collective, having completed ``completed[i]``
    (None: the ranks in ``quiet`` do not answer that look in time).
    Returns what the ranks were asked, in order, and the reports shown."""
    from air_magic.kernel.inspect import hangs

    clock = [1000.0]
    asked: list[str] = []
    looks = iter(completed)

    def ask(work_dir: str, ranks: list[int], **kwargs: Any) -> dict[int, Any]:
        asked.append(kwargs.get("how", "c"))
        last = max(c for c in completed if c is not None)
        if kwargs.get("how") == "q":
            done = next(looks)
            if done is None:
                kwargs["unanswered"].update(r for r in ranks if r in quiet)
                return {r: None if r in quiet else seen(last, last) for r in ranks}
            return {r: seen(done + 1, done, {"pg": "0", "seq": done + 1, "quick": True}) for r in ranks}
        return {r: seen(last + 1, last, entry(last + 1)) for r in ranks}

    def ask_for_collectives(work_dir: str, rank: int, how: str = "c") -> str:
        asked.append(f"{how} (not waited for)")
        return "token"

    monkeypatch.setattr(hangs.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(hangs._collectives, "ask", ask)
    monkeypatch.setattr(hangs, "ask_for_collectives", ask_for_collectives)
    shown: list[Any] = []
    watch = hangs.HangWatch(str(tmp_path), 2, 5.0, ended=dict, show=shown.append)
    for _ in completed:
        clock[0] += 1.0
        watch.check()
    return asked, shown


def test_collectives_that_complete_between_looks_cost_the_ranks_a_quick_look_only(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """A busy rank is nearly always inside a collective when looked at.  While the ranks
    complete collectives between looks, each look is the quick one (the groups' numbers):
    never the full read, which copies every entry the recorder keeps (60 ms of a rank's time
    for 2,000), and no report."""
    asked, shown = _watch_looks(tmp_path, monkeypatch, [100, 700, 1300, 1900, 2500, 3100, 3700, 4300])
    assert asked == ["q"] * 8
    assert shown == []


def test_collectives_that_stop_completing_are_read_in_full_ahead_of_the_report(tmp_path: Any, monkeypatch: Any) -> None:
    """No collective completed from the call's first look on: the second look (no progress
    for a second) has each rank read its recorder in full without waiting for it, and the
    report comes 5 s after the watch began."""
    asked, shown = _watch_looks(tmp_path, monkeypatch, [41] * 5)
    assert asked[:4] == ["q", "q", "r (not waited for)", "r (not waited for)"]
    assert asked[4:] == ["q", "q", "q", "r"]
    assert len(shown) == 1 and shown[0].verdict.startswith("every rank is in all_reduce #42")


def test_a_look_the_ranks_do_not_answer_in_time_does_not_restart_the_hang_s_clock(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """A rank's thread busy with its first full read (a second of CPU) misses the 0.3 s of the
    next quick look: that look says nothing, it does not mean "nothing pending" (which started
    the 5 s again: a report at 8-10 s instead of 5)."""
    asked, shown = _watch_looks(tmp_path, monkeypatch, [41, 41, None, 41, 41])
    assert len(shown) == 1 and shown[0].verdict.startswith("every rank is in all_reduce #42")


def test_a_rank_that_misses_a_look_is_as_it_said_last_while_its_peer_answers(tmp_path: Any, monkeypatch: Any) -> None:
    """Rank 0 misses the third look and rank 1 answers (it has completed the same, nothing
    pending): rank 0 is still in its collective, so the hang is still due at 5 s."""
    asked, shown = _watch_looks(tmp_path, monkeypatch, [41, 41, None, 41, 41], quiet=(0,))
    assert len(shown) == 1 and shown[0].verdict.startswith("every rank is in all_reduce #42")


# -- what the ranks' CPU time tells ------------------------------------------------------------


def hooked(seq: int, via: str = "DDP's gradient all-reduce") -> dict[str, Any]:
    return {**entry(seq, where="nb.py:9 in <module>"), "via": via}


def test_a_collective_ddp_issued_from_backward_is_waited_in_though_no_stack_frame_is_torch_distributed() -> None:
    made = report(
        {0: seen(12, 11, hooked(12)), 1: seen(11, 11)},
        2,
        ended={1: "finished the call"},
        stacks={0: ("nb.py:9 in <module>", False, "its stack")},  # in loss.backward(), not in c10d
        busy={0: 0.01},
    )
    assert made is not None and not made.slow
    assert made.verdict == (
        "rank 1 has ended (finished the call) while rank 0 waits in all_reduce #12 "
        "(nb.py:9 in <module>, DDP's gradient all-reduce)"
    )
    assert made.rows[0].where == "nb.py:9 in <module> (DDP's gradient all-reduce)"


def test_a_rank_that_computes_while_its_peer_waits_is_a_notice_not_a_hang() -> None:
    made = report(
        {0: seen(4, 3, entry(4, where="nb.py:9 in <module>")), 1: seen(3, 3)},
        2,
        stacks={0: ("nb.py:9 in <module>", True, "its stack"), 1: ("nb.py:7 in <module>", False, "its stack")},
        busy={0: 0.0, 1: 0.97},
        stuck_for=12,
    )
    assert made is not None and made.slow
    assert [r.state for r in made.rows] == [IN_COLLECTIVE, COMPUTING]
    assert made.text() == (
        "[air_magic] rank 1 is computing at nb.py:7 in <module> for 12 s; rank 0 waits in all_reduce #4 "
        "(nb.py:9 in <module>)"
    )
    made.over = f"{made.awaited} after 58 s"
    assert made.text() == "[air_magic] rank 1 reached all_reduce #4 after 58 s"


def test_a_rank_blocked_in_a_system_call_while_its_peer_waits_is_a_hang() -> None:
    made = report(
        {0: seen(4, 3, entry(4, where="nb.py:9 in <module>")), 1: seen(3, 3, last_where="nb.py:5 in <module>")},
        2,
        stacks={0: ("nb.py:9 in <module>", True, "its stack"), 1: ("nb.py:7 in <module>", False, "its stack")},
        busy={0: 0.0, 1: 0.02},
    )
    assert made is not None and not made.slow
    assert made.verdict == (
        "rank 1 is behind, blocked (neither in a collective nor computing): its last collective is #3 "
        "(nb.py:5 in <module>); it is at nb.py:7 in <module>; rank 0 waits in all_reduce #4 (nb.py:9 in <module>)"
    )
    assert made.rows[1].state == BLOCKED and made.rows[1].read == "Flight Recorder + its stack + its CPU time"


def test_an_async_collective_of_a_rank_that_computes_is_not_waited_in() -> None:
    # FSDP's all-gathers are started ahead and waited for later: a busy rank with one pending
    # computes; with both ranks so, nobody waits.
    made = report(
        {0: seen(8, 7, hooked(8, "FSDP's all-gather")), 1: seen(8, 7, hooked(8, "FSDP's all-gather"))},
        2,
        stacks={0: ("nb.py:4 in <module>", False, "its stack"), 1: ("nb.py:4 in <module>", False, "its stack")},
        busy={0: 0.9, 1: 0.8},
    )
    assert made is None


def test_a_frame_read_while_it_changed_is_no_frame_of_the_user_s() -> None:
    from air_magic.kernel.inspect.stacks import user_frame

    # faulthandler, from a signal handler, read a busy thread's frame half-changed.
    garbled = 'Thread 0x00007f (most recent call first):\n  File "OSError", line 2043993280 in ismethod\n'
    assert user_frame(garbled) == ("", False)
    whole = (
        "Thread 0x00007f (most recent call first):\n"
        '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        "  Cell In[4], line 6 in <module>\n"
    )
    assert user_frame(whole) == ("Cell In[4]:6 in <module>", True)
