"""Ctrl-C during a blocking wait: read as a flag (``air_magic.kernel.launch._interrupt_flag``).

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread is; raised
inside a finalizer it is printed as "Exception ignored" and lost, and a blocking launch
would wait on while its ranks run.  The wait loop's flag keeps it.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

from air_magic.kernel.launch import _interrupt_flag


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs in this (the main) thread, between bytecodes


def test_an_interrupt_inside_a_finalizer_reaches_the_wait_loop() -> None:
    class Finalized:
        def __del__(self) -> None:
            _sigint()

    with pytest.raises(KeyboardInterrupt):
        with _interrupt_flag() as interrupt:
            Finalized()  # dropped at once: the interrupt comes inside __del__
            gc.collect()
            interrupt.raise_if_set()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_flag_is_read_only_where_the_loop_looks_and_none_is_lost_at_its_end() -> None:
    with _interrupt_flag() as interrupt:
        _sigint()  # no KeyboardInterrupt here
        with pytest.raises(KeyboardInterrupt):
            interrupt.raise_if_set()
        interrupt.raise_if_set()  # read once
    with pytest.raises(KeyboardInterrupt):  # one after the loop's last look
        with _interrupt_flag():
            _sigint()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_users_own_sigint_handler_is_left_alone() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with _interrupt_flag() as interrupt:
            _sigint()
            interrupt.raise_if_set()  # not ours to see
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_while_a_pool_call_goes_out_is_held_until_every_rank_has_it() -> None:
    """(``air_magic.kernel.pool.wait._held_sigint``: a message cut half-way, or sent to some ranks
    only, would leave the pool's connections out of step.)"""
    from air_magic.kernel.pool.wait import _held_sigint

    sent = []
    with _held_sigint() as came:
        sent.append("rank 0")
        _sigint()  # no KeyboardInterrupt here: the second rank still gets the call
        sent.append("rank 1")
    assert sent == ["rank 0", "rank 1"] and came == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with _held_sigint() as came:
        pass
    assert came == []
