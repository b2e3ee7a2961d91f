"""Where a rank is, the rank's half: it answers the kernel's requests for its stacks and its
collectives (the kernel's half is :mod:`air_magic.kernel.inspect.stacks`)::

    stack-<r>.ask (a FIFO) --a thread of its own, blocked in open()/read() while idle-->
        ?        every thread's stack but its own -> stack-<r>.txt
        c q r    the collectives (:mod:`air_magic.rank.inspect.collectives`) -> collectives-<r>.json
        x        a pool's hang: its group's connections cut (what the rank's pool gave)
    STACK_SIGNAL        (the thread did not answer: a C call holds the GIL) -> faulthandler
                        writes the main thread's stack -> stack-<r>.txt
    FINAL_STACK_SIGNAL  the launch's time is up: the stack, then the rank ends by the signal
"""

from __future__ import annotations

import os
from typing import Any, Callable

from air_magic.protocol import (
    FINAL_STACK_SIGNAL,
    STACK_SIGNAL,
    StackAsk,
    format_thread_stacks,
    stack_path,
    stack_request_path,
)

__all__ = ["answer_requests"]

_stack_file: Any = None  # kept open for faulthandler, which writes to its descriptor


def answer_requests(work_dir: str, rank: int, cut: Callable[[], None] | None = None) -> None:
    """Make the rank answer stack requests: its stack file (``stack_path``), a thread
    that answers on its stack pipe without interrupting the user's code, and two
    signals for what the thread cannot answer.

    ``STACK_SIGNAL`` writes the main thread's Python stack (by faulthandler, from the
    signal handler itself: it works while a C call holds the GIL; Linux gives a signal
    sent to the process to its main thread first).  Only that thread's: faulthandler
    reads other threads' frames without their lock, and one that imports meanwhile (as
    the answering thread does on its first read of torch's Flight Recorder with stacks,
    which imports torch._inductor) crashes the rank with SIGSEGV.  It can cut a system
    call such as ``nanosleep`` short, so the kernel side sends it only when the thread
    did not answer.  ``FINAL_STACK_SIGNAL`` (a timeout) writes it too, then ends the
    rank by the signal's default action: no line of the user's code runs once the
    launch's time is up.  Python's own handler table is untouched.  ``cut``: what a
    pool's ``x`` request does (its group's connections cut; a launch's rank has none)."""
    import faulthandler

    global _stack_file
    # O_APPEND: the kernel empties the file before each request; writes start at its end.
    path = stack_path(work_dir, rank)
    _stack_file = open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600), "w")
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=False, chain=False)
    faulthandler.register(FINAL_STACK_SIGNAL, file=_stack_file, all_threads=False, chain=True)
    _answer(stack_request_path(work_dir, rank), _stack_file.fileno(), work_dir, rank, cut)


def _answer(ask: str, out: int, work_dir: str, rank: int, cut: Callable[[], None] | None) -> None:
    """A thread that waits on the rank's stack pipe and answers what is asked: its stacks
    (``?``), or its collectives (``c``, ``q`` or ``r`` and a token:
    :func:`air_magic.rank.inspect.collectives.answer`), or cuts a pool's group's connections (``x``:
    ``cut``, :func:`air_magic.rank.pool.interrupts.regroup.cut`).
    A request the thread answers leaves the user's code alone (no signal interrupts its
    system calls).  It costs nothing while idle (blocked in ``open``/``read``) and is not
    one of ``threading``'s threads.  Without the pipe, stack requests come by signal."""
    import _thread

    try:
        os.mkfifo(ask, 0o600)
    except OSError:
        return

    def answer() -> None:
        me = _thread.get_ident()
        while True:
            try:
                fd = os.open(ask, os.O_RDONLY)  # until the kernel side opens it to ask
                try:
                    asked = os.read(fd, 64)
                finally:
                    os.close(fd)
                if asked[:1] in (StackAsk.COLLECTIVES, StackAsk.LOOK, StackAsk.REPORT):  # a Ctrl-C's, a look, a report
                    try:
                        from air_magic.rank.inspect import collectives

                        collectives.answer(work_dir, rank, asked[1:].decode("ascii", "replace"), asked[:1].decode())
                    except Exception:  # no answer: the kernel reads the rank as one it cannot ask
                        pass
                elif asked[:1] == StackAsk.CUT:  # a pool's hang: cut its group's connections
                    try:
                        if cut is not None:
                            cut()
                    except Exception:  # the kernel sees the collective still waiting
                        pass
                elif asked:
                    os.write(out, format_thread_stacks(skip=me).encode("utf-8", "replace"))
            except BaseException:  # the rank is ending (its files gone): requests come by signal
                return

    try:
        _thread.start_new_thread(answer, ())
    except RuntimeError:  # no thread to be had (a process limit): requests come by signal
        os.unlink(ask)
