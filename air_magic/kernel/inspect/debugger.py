"""The kernel's side of a rank's debugger: the prompts of the ranks stopped at a breakpoint,
served in the cell that waits for them, through the kernel's own stdin.

The loop that waits for a launch (:meth:`Launch.wait_streaming`) or for a pool's call
(``PoolEngine._collect``) calls :meth:`BreakpointDesk.poll` between its looks; the rank's
side is :mod:`air_magic.rank.inspect.debugger`, the exchange :mod:`air_magic.protocol.debugging`::

    poll():  each rank's events file, from where it was read last (a stat when nothing came)
             "stop"    -> the rank waits; the lowest such rank is served now:
                          its output shown, then input(prompt) on this (the main) thread:
                          JupyterLab's, Notebook 7's and VS Code's input box, terminal IPython's
                          own line; no stdin (papermill, nbclient) -> the breakpoint is skipped
                          with one line (AIR_MAGIC_ON_BREAKPOINT=error: the rank fails)
             "resumed" -> its last output shown
    the answer -> the rank's FIFO; ":all CMD" sends CMD to every stopped rank, ":r N" serves
                  rank N next; q, EOF or Interrupt -> every stopped rank raises
                  KeyboardInterrupt, and the waiting loop stops the launch (or interrupts the
                  pool's call, which keeps the pool) as after Ctrl-C

Nothing runs while nothing stops: a rank that never hits a breakpoint costs one ``stat``
per rank and look.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

from air_magic.protocol.debugging import (
    ANSWER_EOF,
    ANSWER_ERROR,
    ANSWER_HERE,
    ANSWER_QUIT,
    ANSWER_SKIP,
    answers_path,
    desk_path,
    events_path,
    paused_at,
    read_events,
)
from air_magic.settings import settings

__all__ = ["BreakpointDesk", "HELP", "post_mortem_on"]

#: Seconds a rank's new stop waits for lower ranks to stop too, so that ranks ask in rank order.
HOLD = 0.3

HELP = """air_magic's debugger commands (besides pdb's own: help, p, pp, l, ll, w, u, d, n, s, c, b, display, interact):
  :all CMD   send CMD to every rank stopped now (e.g. ':all c' continues them all)
  :r N       answer rank N's prompt next (when several ranks are stopped)
  :ranks     list the stopped ranks and where each is
  q, Ctrl-D, Interrupt   stop debugging: every rank raises KeyboardInterrupt where it is
                         (a launch ends as interrupted; a pool's cell ends, the pool stays)
A stopped rank's peers wait in their next collective with it; gloo gives up after its
timeout (30 min unless init_process_group(timeout=...) says otherwise), NCCL after 10 min."""


class BreakpointDesk:
    """The breakpoints of one launch's (or one pool call's) ranks, served from its waiting loop."""

    def __init__(self, work_dir: str, world_size: int, *, from_now: bool = False, only_paused: bool = False) -> None:
        self.work_dir = work_dir
        self.only_paused = only_paused  # read from the start (launch.debug()): serve who still waits
        self.world_size = world_size
        self.offsets = [0] * world_size
        if from_now:  # a pool's call: what earlier calls' ranks said is theirs
            for rank in range(world_size):
                try:
                    self.offsets[rank] = os.path.getsize(events_path(work_dir, rank))
                except OSError:
                    pass
        self.stopped: dict[int, dict[str, Any]] = {}  # rank -> its waiting "stop" event
        self.next_rank: int | None = None
        self.quit_rank: int | None = None
        self.helped = False
        # While this desk serves the prompts, a stopped rank waits for its turn (not ASK_SECONDS).
        self._marker = desk_path(work_dir)
        try:
            os.close(os.open(self._marker, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        except OSError:  # (a launch folder being removed)
            pass

    def close(self) -> None:
        """The cell no longer serves prompts: a rank stopped from now on waits a while, then goes on."""
        try:
            os.unlink(self._marker)
        except OSError:
            pass

    # -- what the ranks said ---------------------------------------------------------------------

    def poll(self) -> None:
        """Read what came; serve one stopped rank's prompt (the loop calls again for the next)."""
        self._read()
        self._hold_for_lower_ranks()
        while self.stopped:  # one prompt after another while ranks wait (the answers come at once)
            self._serve()

    def _hold_for_lower_ranks(self) -> None:
        """Ranks ask in rank order: a rank that has just stopped, with lower ranks not stopped
        (yet), waits up to ``HOLD`` s from its stop for them (on a loaded machine rank 1 may
        reach the line everyone stops at before rank 0)."""
        while self.stopped:
            lowest = min(self.stopped)
            event = self.stopped[lowest]
            left = event.get("seen", 0.0) + HOLD - time.monotonic()
            if lowest == 0 or not event.get("first") or left <= 0:
                return
            time.sleep(min(0.02, left))
            self._read()

    def _read(self) -> None:
        for rank in range(self.world_size):
            path = events_path(self.work_dir, rank)
            try:
                size = os.stat(path).st_size
            except OSError:
                continue
            if size <= self.offsets[rank]:
                continue
            events, self.offsets[rank] = read_events(path, self.offsets[rank])
            for event in events:
                if event.get("kind") == "stop":
                    self.stopped[rank] = {**event, "seen": time.monotonic()}
                elif event.get("kind") == "resumed":
                    self.stopped.pop(rank, None)
                    _show(event.get("text", ""))
        if self.only_paused:
            for rank in [r for r in self.stopped if paused_at(self.work_dir, r) is None]:
                del self.stopped[rank]

    @property
    def paused(self) -> dict[int, str]:
        """The ranks stopped now, and where (file, line)."""
        return {rank: str(event.get("where", "?")) for rank, event in self.stopped.items()}

    # -- serving a prompt --------------------------------------------------------------------------

    def _serve(self) -> None:
        rank = self.next_rank if self.next_rank in self.stopped else min(self.stopped)
        self.next_rank = None
        event = self.stopped.pop(rank)
        where = event.get("where", "?")
        if event.get("first"):
            mode = settings.on_breakpoint
            if mode == "skip" or (mode == "prompt" and not _has_stdin()):
                self._answer(rank, ANSWER_SKIP)
                return
            if mode == "error":
                self._answer(rank, ANSWER_ERROR)
                return
        if event.get("first"):
            self._answer(rank, ANSWER_HERE)  # before the prompt waits: the rank waits as long as it takes
            others = sorted(self.stopped)
            others_text = ", ".join(map(str, others))
            waiting = f"; ranks {others_text} wait too" if len(others) > 1 else f"; rank {others_text} waits too"
            waiting = waiting if others else ""
            tip = "" if self.helped else " (:help for air_magic's commands; q stops every rank)"
            self.helped = True
            if event.get("post_mortem"):
                _spare_the_kernel_s_post_mortem()  # this cell's error is the rank's: its frames were shown
                _show(f"[air_magic] rank {rank}'s post-mortem, where it raised: {where}{waiting}{tip}\n")
            else:
                _show(f"[air_magic] rank {rank} stopped at a breakpoint, {where}{waiting}{tip}\n")
        _show(event.get("text", ""))  # what pdb said: where it is, a command's answer
        try:
            with _default_sigint():
                line = input(event.get("prompt") or f"(Pdb rank {rank}) ")
        except KeyboardInterrupt:
            self._quit(rank, "you interrupted the debugger", event)
            return
        except EOFError:
            if not str(event.get("prompt", "")).startswith("(Pdb"):  # interact's console: it ends, pdb asks again
                self._answer(rank, ANSWER_EOF)
                return
            self._quit(rank, "the debugger's input ended", event)
            return
        except Exception as exc:  # no stdin after all (StdinNotImplementedError): as skipped
            if type(exc).__name__ != "StdinNotImplementedError":
                raise
            self._answer(rank, ANSWER_SKIP)
            return
        self._command(rank, line, event)

    def _command(self, rank: int, line: str, event: dict[str, Any]) -> None:
        command = line.strip()
        if not str(event.get("prompt", "")).startswith("(Pdb"):  # interact's console: its lines as they are
            self._answer(rank, line)
            self._await(rank)
            return
        if command in ("help", "h"):  # pdb's commands follow air_magic's
            _show(HELP + "\n")
        if command.startswith(":"):  # about the other ranks: what they said meanwhile counts
            self._read()
        if command in ("q", "quit", "exit"):
            self._quit(rank, "you quit the debugger", event)
            return
        if command == ":help":
            _show(HELP + "\n")
            self.stopped[rank] = {**event, "first": False, "text": ""}
            return
        if command == ":ranks":
            listed = {rank: event.get("where", "?"), **self.paused}
            _show("".join(f"  rank {r}: {w}\n" for r, w in sorted(listed.items())))
            self.stopped[rank] = {**event, "first": False, "text": ""}
            return
        if command.startswith(":r "):
            wanted = command[3:].strip()
            if wanted.isdigit() and int(wanted) in self.stopped:
                self.next_rank = int(wanted)
            else:
                _show(f"[air_magic] rank {wanted} is not stopped; stopped: {sorted(self.stopped) or 'none other'}\n")
            self.stopped[rank] = {**event, "first": False, "text": ""}
            return
        if command.startswith(":all "):
            sent = command[5:].strip()
            for other in sorted(self.stopped):
                self.stopped.pop(other)
                self._answer(other, sent)
        self._answer(rank, command[5:].strip() if command.startswith(":all ") else line)
        self._await(rank)

    def _await(self, rank: int, seconds: float = 0.5) -> None:
        """A command's answer (the rank's next stop, or its going on) read at once, not at the
        waiting loop's next look (50 ms or more)."""
        offset = self.offsets[rank]
        path = events_path(self.work_dir, rank)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if os.stat(path).st_size > offset:
                    self._read()
                    return
            except OSError:
                return
            time.sleep(0.002)

    def _quit(self, rank: int, why: str, event: dict[str, Any] | None = None) -> None:
        """Every stopped rank raises KeyboardInterrupt; so does the waiting loop.  In a
        post-mortem only that one ends: the rank's error stays the outcome."""
        if event is not None and event.get("post_mortem"):
            self._answer(rank, ANSWER_QUIT)
            _show(f"[air_magic] rank {rank}'s post-mortem ended\n")
            return
        self.quit_rank = rank
        for other in [rank, *sorted(self.stopped)]:
            self._answer(other, ANSWER_QUIT)
        self.stopped.clear()
        _show(f"[air_magic] {why} on rank {rank}: every rank stops\n")
        raise KeyboardInterrupt(f"{why} on rank {rank}")

    def release(self) -> None:
        """The call is being interrupted: every rank stopped at a breakpoint now is answered as
        ``q`` answers it (its prompt, if shown, is not served)."""
        self._read()
        for rank in sorted(self.stopped):
            self._answer(rank, ANSWER_QUIT)
        self.stopped.clear()

    def _answer(self, rank: int, line: str) -> None:
        path = answers_path(self.work_dir, rank)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # the rank has gone (no reader): nothing waits for the answer
            if exc.errno not in (errno.ENXIO, errno.ENOENT):
                raise
            return
        try:
            os.write(fd, (line.replace("\n", " ") + "\n").encode("utf-8"))
        finally:
            os.close(fd)


def post_mortem_on() -> bool:
    """Whether the kernel has ``%pdb on``: a rank that raises then opens pdb in its frames.
    (Asked at every launch and pool call: a process that never imported IPython, such as
    ``air-magic run``, is not made to import it here.)"""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return bool(getattr(shell, "call_pdb", False))


def _spare_the_kernel_s_post_mortem() -> None:
    """``%pdb on`` would open the kernel's own frames (air_magic's waiting loop) once the cell
    raises the rank's error: off until this cell has run."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or not getattr(shell, "call_pdb", False):
        return
    shell.call_pdb = False

    def restore(*_: Any) -> None:
        shell.call_pdb = True
        shell.events.unregister("post_run_cell", restore)

    shell.events.register("post_run_cell", restore)


def _show(text: str) -> None:
    if text:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()


def _has_stdin() -> bool:
    """Whether a prompt can be answered: a kernel's cell asks its front end (one that allows
    stdin; else input() says so, and the breakpoint is skipped), a terminal asks its user."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None and getattr(shell, "kernel", None) is not None:
        return bool(getattr(shell.kernel, "_allow_stdin", True))
    try:
        return bool(sys.stdin is not None and sys.stdin.isatty())
    except (AttributeError, ValueError, OSError):
        return False


@contextlib.contextmanager
def _default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler while the prompt waits, so an interrupt ends the input()
    (the waiting loops record a SIGINT as a flag instead)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
