"""``air_magic.Pool`` from Python (a script, or a notebook without the magic): run, push,
pull, restart, close, the context manager, and the errors a user sees."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil
import pytest
from harness import wait_until

import air_magic
from air_magic import ConfigurationError, ResultError
from air_magic.pool import Pool, PoolBrokenError, PoolBusyError

pytestmark = pytest.mark.process


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def remember(value: int) -> None:
    global remembered
    remembered = value  # type: ignore[name-defined]


def recall() -> int:
    return remembered  # type: ignore[name-defined]  # noqa: F821


def test_a_pool_keeps_its_group_and_its_names_from_one_call_to_the_next() -> None:
    with Pool(2, "CPU", tracking=False) as pool:
        assert isinstance(pool, air_magic.Pool)
        assert pool.num_accelerators == 2 and pool.state == "idle"
        assert pool.run(rank_and_world) == [(0, 2), (1, 2)]
        pool.run(remember, 41)
        assert pool.run(recall) == [41, 41]
        pool.push(remembered=42)
        assert pool.pull("remembered") == [42, 42]
        pids = pool.run(os.getpid)
        assert len(set(pids)) == 2 and pool.run(os.getpid) == pids  # the same ranks
        assert pool.status()["cells"] >= 5
    assert pool.state == "closed"


def test_restart_gives_fresh_ranks_without_the_old_state() -> None:
    with Pool(2, "CPU", tracking=False) as pool:
        before = pool.run(os.getpid)
        pool.push(kept=1)
        pool.restart()
        after = pool.run(os.getpid)
        assert not set(before) & set(after)
        assert wait_until(lambda: not any(psutil.pid_exists(p) for p in before), timeout=10)
        with pytest.raises(NameError) as info:
            pool.pull("kept")
        assert str(info.value) == "name 'kept' is not defined on this rank"


def test_a_closed_pool_says_so() -> None:
    pool = Pool(1, "CPU", tracking=False)
    pool.close()
    with pytest.raises(PoolBrokenError) as info:
        pool.run(int)
    assert str(info.value) == ("this pool is closed; start a new one (air_magic.Pool(...), or %distributed_pool -n N).")


def test_a_value_that_cannot_come_back_is_a_result_error_and_the_pool_stays() -> None:
    with Pool(1, "CPU", tracking=False) as pool:
        with pytest.raises(ResultError) as info:
            pool.run(threading.Lock)
        assert str(info.value).startswith("rank 0 of 1 returned a _thread.lock, which cannot be sent back (TypeError: ")
        assert pool.run(int) == [0]


def test_an_unknown_backend_is_the_launch_s_own_error() -> None:
    with pytest.raises(ConfigurationError) as info:
        Pool(2, backend="slurm")
    assert str(info.value) == "backend must be one of 'local', 'ray', got 'slurm'."


def test_a_bad_size_is_the_launch_s_own_error() -> None:
    with pytest.raises(ConfigurationError) as info:
        Pool(0)
    assert str(info.value) == (
        "num_accelerators must be a positive integer (the number of ranks), got 0. Pass 1 or more, or omit it "
        "to use every GPU of this machine."
    )


def sleep_then(seconds: float, value: int) -> int:
    import time

    time.sleep(seconds)
    return value


def test_submit_runs_in_the_background_and_other_calls_are_refused_meanwhile() -> None:
    with Pool(2, "CPU", tracking=False) as pool:
        call = pool.submit(sleep_then, 1.5, 7)
        assert not call.done()
        with pytest.raises(PoolBusyError) as info:
            pool.run(int)
        assert str(info.value) == (
            "the pool is running another call (a pool.submit(...) not yet done); wait for its .result() or "
            ".cancel() it, then run this."
        )
        assert call.result(timeout=30) == [7, 7]
        assert call.done() and call.exception() is None
        assert pool.run(int) == [0, 0]


def test_cancel_interrupts_a_submitted_call_and_the_pool_stays() -> None:
    with Pool(2, "CPU", tracking=False) as pool:
        pool.push(kept="yes")
        call = pool.submit(sleep_then, 60, 1)
        assert wait_until(lambda: pool.state == "running", timeout=10)
        assert call.cancel() is True
        with pytest.raises(KeyboardInterrupt) as info:
            call.result(timeout=10)
        assert str(info.value) == "the pool's cell was interrupted on its ranks; the pool and its state are intact."
        assert call.cancel() is False
        assert pool.pull("kept") == ["yes", "yes"]


def test_cancel_reaches_a_rank_that_had_not_yet_read_the_call() -> None:
    """The interrupt of a call a rank has not begun (a loaded machine: it was not scheduled
    yet) waits for it to begin: rank 1 is stopped while the call is sent and cancelled."""
    import signal

    with Pool(2, "CPU", tracking=False) as pool:
        pool.push(kept="yes")
        late = pool._engine.pids[1]
        os.kill(late, signal.SIGSTOP)
        try:
            call = pool.submit(sleep_then, 60, 1)
            assert wait_until(lambda: pool.state == "running", timeout=10)
            assert call.cancel() is True
            time.sleep(0.5)  # the SIGINT is pending on the stopped rank, and rank 0 came back
        finally:
            os.kill(late, signal.SIGCONT)
        with pytest.raises(KeyboardInterrupt) as info:
            call.result(timeout=20)
        assert str(info.value) == "the pool's cell was interrupted on its ranks; the pool and its state are intact."
        assert pool.state == "idle"
        assert pool.pull("kept") == ["yes", "yes"]


def heeds_on_rank_0_only(folder: str, seconds: float) -> None:
    import os
    import time

    import torch.distributed as dist

    try:
        open(os.path.join(folder, str(dist.get_rank())), "w").close()  # in the try: a cancel raises here
        time.sleep(seconds)
    except KeyboardInterrupt:
        if dist.get_rank() == 0:
            raise
        time.sleep(seconds)  # rank 1 goes on


def test_a_cancel_a_rank_does_not_heed_breaks_the_pool_and_says_where_that_rank_was(tmp_path: Path) -> None:
    with Pool(2, "CPU", tracking=False) as pool:
        call = pool.submit(heeds_on_rank_0_only, str(tmp_path), 60)
        assert wait_until(lambda: len(os.listdir(tmp_path)) == 2, timeout=60)
        assert call.cancel() is True
        with pytest.raises(KeyboardInterrupt) as info:
            call.result(timeout=30)
        message = str(info.value)
        assert pool.state == "broken", message
        assert message.startswith(
            "the pool's call was cancelled; rank 1 did not stop within 3 s (its code caught the KeyboardInterrupt, "
            "or waits in a collective or in C), so the pool is broken: the next pool cell starts fresh ranks.\n"
            "[air_magic] where each rank was:\n"
        )
        assert f"rank 1: at {__file__}, line " in message and " in heeds_on_rank_0_only" in message
        assert "rank 0: had come back, interrupted" in message  # (it heeded the cancel: not "done")
        # The rows (the panel's, the sidebar's) say what the message says: both stopped by the
        # pool, neither "failed (exit -9)" (the kill's first exit had read as a rank's failure).
        from air_magic.panel._state import rank_state

        launch = pool._engine.launch
        assert launch is not None and wait_until(launch.done, timeout=15)
        assert [rank_state(launch, r) for r in range(2)] == ["stopped", "stopped"]
        assert pool.run(int) == [0, 0]  # fresh ranks


def test_connections_that_are_not_its_ranks_do_not_stop_a_pool_from_starting() -> None:
    """Someone else's connections to the pool's socket while its ranks start (one that closes
    at once, one that writes garbage, one with the wrong key) are dropped: the pool starts."""
    import socket
    from multiprocessing.connection import Connection, answer_challenge

    from air_magic.plugins import get_launcher

    session = get_launcher().session_dir
    done = threading.Event()
    strangers: list[str] = []

    def stranger() -> None:
        while not done.is_set():
            sockets = [n for n in os.listdir(session) if n.startswith("pool-") and n.endswith(".sock")]
            if sockets:
                break
            time.sleep(0.001)
        else:
            return
        address = os.path.join(session, sockets[0])
        with socket.socket(socket.AF_UNIX) as closes_at_once:
            closes_at_once.connect(address)
        strangers.append("closed")
        with socket.socket(socket.AF_UNIX) as garbage:
            garbage.connect(address)
            garbage.sendall(b"\xff" * 64)
        strangers.append("garbage")
        wrong = socket.socket(socket.AF_UNIX)
        wrong.connect(address)
        try:
            answer_challenge(Connection(wrong.detach()), b"not the pool's key")
        except Exception:  # the pool refuses it
            strangers.append("wrong key refused")

    thread = threading.Thread(target=stranger)
    thread.start()
    try:
        with Pool(2, "CPU", tracking=False) as pool:
            assert pool.run(rank_and_world) == [(0, 2), (1, 2)]
    finally:
        done.set()
        thread.join(30)
    assert strangers == ["closed", "garbage", "wrong key refused"]
