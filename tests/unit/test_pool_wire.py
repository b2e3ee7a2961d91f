"""The pool's wire, without processes: typed messages over a pipe (what a rank sends is read
back as the call's reply, or breaks the pool as out of step; a stranger's hello is refused)."""

from __future__ import annotations

import pickle
import socket
import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

import pytest

from air_magic.kernel.pool.start import greet
from air_magic.kernel.pool.wire import OutOfStep, replies
from air_magic.protocol import ValueRecord
from air_magic.protocol.pool import CallBegan, CallDone, PoolKind, PoolRequest, RankHello


def _blob(value: object) -> bytes:
    return pickle.dumps(ValueRecord(value))


def test_a_rank_s_began_then_done_are_its_reply_to_the_call() -> None:
    kernel, rank = Pipe()
    began: list[tuple[int, int]] = []
    rank.send(CallBegan(7))
    rank.send(CallDone(7, _blob(42), ["model"], []))
    pending: dict[int, Connection] = {0: kernel}
    found = []
    for _ in range(10):
        found += replies(pending, 7, 0.05, lambda r, i: began.append((r, i)), {})
        if not pending:
            break
    assert began == [(0, 7)]
    assert [(r.rank, r.record, r.names) for r in found] == [(0, ValueRecord(42), ["model"])]
    assert pending == {}


def test_a_reply_to_another_call_breaks_the_pool_as_out_of_step() -> None:
    kernel, rank = Pipe()
    rank.send(CallDone(6, _blob(1), [], []))
    with pytest.raises(OutOfStep, match=r"rank 0 answered call #6 while call #7 ran"):
        replies({0: kernel}, 7, 1.0, lambda r, i: None, {})


@pytest.mark.parametrize("sent", [("done", 7, b"", [], []), "garbage", RankHello(0, 1)])
def test_anything_but_a_reply_breaks_the_pool_as_out_of_step(sent: object) -> None:
    kernel, rank = Pipe()
    rank.send(sent)
    with pytest.raises(OutOfStep, match=r"rank 0 sent the kernel something that is not a reply"):
        replies({0: kernel}, 7, 1.0, lambda r, i: None, {})


def test_a_request_names_its_kind_and_the_kinds_are_the_ones_the_ranks_serve() -> None:
    request = pickle.loads(pickle.dumps(PoolRequest(PoolKind("cell"), 3, {"label": "Cell In[2]"})))
    assert request.kind is PoolKind.CELL and request.id == 3 and str(request.kind) == "cell"
    with pytest.raises(ValueError):
        PoolKind("exec")


def _handshake(hello: object) -> tuple[int, Connection, int] | None:
    """greet() on one end of a socket pair, a rank that knows the key on the other."""
    ours, theirs = socket.socketpair()
    key = b"k" * 32

    def rank() -> None:
        conn = Connection(theirs.detach())
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
        conn.send(hello)

    thread = threading.Thread(target=rank)
    thread.start()
    try:
        return greet(ours, key, world_size=2)
    finally:
        thread.join(5)


def test_a_rank_s_hello_is_taken_and_anything_else_is_refused() -> None:
    taken = _handshake(RankHello(1, 4321))
    assert taken is not None and (taken[0], taken[2]) == (1, 4321)
    taken[1].close()
    assert _handshake(("hello", 1, 4321)) is None  # the old tuple: not a hello
    assert _handshake(RankHello(2, 4321)) is None  # no rank 2 in a pool of 2
