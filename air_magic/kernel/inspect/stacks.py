"""Where each rank is: its Python stacks, asked for, read and said (the rank's half is
:mod:`air_magic.rank.inspect.stacks`)::

    request_stacks --stack-<r>.ask (or STACK_SIGNAL)--> stack-<r>.txt (each rank writes its
                    threads' stacks; by signal, its main thread's)
    stack-<r>.txt  --read_stacks (the cells' names as the notebook shows them)
                   --describe_stacks--> "where each rank was": each rank's innermost line of
                    the launched code and the collective it waits in; the rank the others
                    wait for is named as behind
    py_spy_stacks  a process's stacks read from outside (py-spy), for a rank that cannot answer
    StallWatch     no rank has written a line for a while: the stacks, and the straggler named
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any, Iterable, Mapping, Protocol, Sequence

import air_magic.protocol
from air_magic.protocol import THREAD_ANSWER_SECONDS, ask_for_stacks, file_size, stack_path

__all__ = [
    "request_stacks",
    "read_stacks",
    "describe_stacks",
    "user_frame",
    "py_spy_stacks",
    "StallWatch",
    "Watched",
]


def request_stacks(
    work_dir: str, running: dict[int, int], timeout: float, thread_wait: float = THREAD_ANSWER_SECONDS
) -> None:
    """Ask every running rank (``{rank: pid}``) for its stacks (see
    :func:`~air_magic.protocol.ask_for_stacks`); wait (at most ``timeout`` s) until each
    stack file has stopped growing.  A rank whose thread has not answered in ``thread_wait``
    s (at most half the timeout) is asked by signal: faulthandler then writes the stacks from
    the signal handler, which reads other threads' frames as they change (a busy thread's can
    come out garbled), so a caller that can wait gives the thread longer."""
    asked = {rank: pid for rank, pid in running.items() if ask_for_stacks(work_dir, rank, pid)}
    begin = time.monotonic()
    deadline = begin + timeout
    resignalled = False
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = {rank: file_size(stack_path(work_dir, rank)) for rank in asked}
        if all(now[r] > 0 and now[r] == sizes.get(r) for r in asked):
            break
        if not resignalled and time.monotonic() - begin >= min(thread_wait, timeout / 2):
            resignalled = True
            for rank in [r for r in asked if now[r] == 0]:
                ask_for_stacks(work_dir, rank, asked[rank], by_signal=True)
        sizes = now


def read_stacks(work_dir: str, ranks: Iterable[int], sources: dict[str, tuple[str, str]]) -> dict[int, str]:
    """The stacks the ranks wrote, by rank, with the cells' names as the notebook shows them."""
    found = {}
    for rank in ranks:
        try:
            with open(stack_path(work_dir, rank), encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        except OSError:
            continue
        if text.strip():
            for filename, (display, _) in sources.items():
                text = text.replace(f'File "{filename}"', display)
            found[rank] = text
    return found


#: Frames of these files are torch's collectives and rendezvous: a rank in one waits for the others.
_COLLECTIVE_FILES = (
    "torch/distributed/distributed_c10d.py",
    "torch/distributed/rendezvous.py",
    "torch/distributed/c10d_logger.py",
)
_FRAME = re.compile(r'^\s*(?:File "(?P<file>[^"]+)"|(?P<cell>Cell In\[\d+\])), line (?P<line>\d+) in (?P<func>\S+)')


def describe_stacks(
    stacks: dict[int, str],
    world_size: int,
    absent: str | Mapping[int, str] = "had ended",
    waiting: Mapping[int, str] | None = None,
) -> str:
    """``[air_magic] where each rank was:`` and a line per rank; ``''`` with no stacks.
    A rank without a stack is said to be ``absent`` (one text for all, or each rank's own:
    a pool's rank that came back with its error, or done with the call).

    From each rank's main thread (the one running the launched code): its innermost
    frame of the user's code, and the torch collective it waits in, if any.  When some
    ranks wait in a collective and others do not, those others are behind: named.
    ``waiting``: the collective a rank waits in where its stack does not show it (one that
    DDP's or FSDP's hooks issued from autograd's backward, as its Flight Recorder says:
    ``all_reduce (DDP's gradient all-reduce)``).
    """
    if not stacks:
        return ""
    where: dict[int, tuple[str, str | None]] = {}
    for rank, text in sorted(stacks.items()):
        frames = _main_thread_frames(text)
        collective = next(
            (
                f["func"]
                for f in frames
                if any(f["file"].endswith(c) for c in _COLLECTIVE_FILES) and f["func"] != "wrapper"
            ),
            None,
        )
        user = next((f for f in frames if _is_user_frame(f["file"])), None)
        at = f"{user['file']}, line {user['line']} in {user['func']}" if user else "(no frame of the launched code)"
        if collective is None and waiting and rank in waiting:
            collective = waiting[rank]
        where[rank] = (at, collective)
    waiters = sorted(r for r, (_, c) in where.items() if c)
    lines = ["[air_magic] where each rank was:"]
    for rank, (at, collective) in sorted(where.items()):
        named = collective if collective and "(" in collective else f"{collective} (torch.distributed)"
        line = f"  rank {rank}: " + (f"in {named}, called at {at}" if collective else f"at {at}")
        if not collective and waiters:
            who = ", ".join(map(str, waiters))
            line += (
                f"  <- behind: rank{'s' if len(waiters) > 1 else ''} {who} wait{'' if len(waiters) > 1 else 's'} for it"
            )
        lines.append(line)
    missing: dict[str, list[int]] = {}
    for rank in range(world_size):
        if rank not in where:
            words = absent if isinstance(absent, str) else absent.get(rank, "had ended")
            missing.setdefault(words, []).append(rank)
    for words, ranks in missing.items():
        lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {words}")
    return "\n".join(lines)


def user_frame(text: str) -> tuple[str, bool]:
    """``file:N in func`` of the innermost frame of the launched code in a rank's stacks
    (its main thread; ``''`` if none), and whether that thread waits in a collective."""
    frames = _main_thread_frames(text)
    user = next((f for f in frames if _is_user_frame(f["file"])), None)
    waits = any(any(f["file"].endswith(c) for c in _COLLECTIVE_FILES) and f["func"] != "wrapper" for f in frames)
    return (f"{user['file']}:{user['line']} in {user['func']}" if user else ""), waits


_PY_SPY_FRAME = re.compile(r"^\s+(?P<func>.+?) \((?P<file>.+):(?P<line>\d+)\)$")


def py_spy_stacks(pid: int, timeout: float = 10.0) -> str:
    """A process's Python stacks read from outside by py-spy (``pip install py-spy``; it
    needs to be allowed to trace the process), in faulthandler's layout; ``''`` without
    py-spy, or when it could not read them.  Works while a C call holds the GIL."""
    import shutil
    import subprocess

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return ""
    try:
        done = subprocess.run(
            [spy, "dump", "--pid", str(pid), "--full-filenames", "--nonblocking"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = []
    for line in done.stdout.splitlines():
        if line.startswith("Thread "):
            lines.append(line)
            continue
        match = _PY_SPY_FRAME.match(line)
        if match:
            lines.append(f'  File "{match["file"]}", line {match["line"]} in {match["func"]}')
    return "\n".join(lines) if done.returncode == 0 else ""


#: No source file has this many lines: a frame that says so was read while it changed.
_NO_SUCH_LINE = 10_000_000


def _main_thread_frames(text: str) -> list[dict[str, str]]:
    """The frames, most recent first, of the thread that runs the launched code."""
    threads: list[list[dict[str, str]]] = [[]]
    for line in text.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            threads.append([])
            continue
        match = _FRAME.match(line)
        if match and int(match["line"]) < _NO_SUCH_LINE:  # (a frame faulthandler read half-changed)
            frame = match.groupdict()
            frame["file"] = frame["file"] or frame["cell"]
            threads[-1].append(frame)
    threads = [t for t in threads if t]
    for frames in threads:
        if any(f["file"].endswith("air_magic/rank/main.py") and f["func"] == "_run" for f in frames):
            return frames
    return threads[0] if threads else []


def _is_user_frame(filename: str) -> bool:
    if filename.startswith("Cell In["):
        return True
    parts = filename.replace(os.sep, "/")
    return not (
        "/site-packages/" in parts
        or "/lib/python" in parts
        or parts.startswith("<frozen")
        or os.path.abspath(filename).startswith(_PACKAGE_ROOT)
    )


#: air_magic's own folder: frames of files under it are not the user's.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(air_magic.protocol.__file__))) + os.sep


class Watched(Protocol):
    """What the stall watch uses of a launch (:class:`~air_magic.kernel.launch.Launch`)."""

    @property
    def ranks(self) -> Sequence[Any]:
        """Each rank's state: ``log_path`` is read."""

    def stacks(self, timeout: float = 2.0) -> dict[int, str]:
        """Every running rank's stacks, by rank."""

    def where(self, stacks: dict[int, str]) -> str:
        """Where each rank was, from its stacks."""

    def notify(self, line: str, stream: str = "stdout") -> None:
        """Print a line with the launch's other lines."""


class StallWatch:
    """Names a straggler: when no rank has written a line for ``seconds``, look at every
    rank's stack; if some wait in a collective and others do not, say where each one is
    (once per quiet spell).  Silence alone is not a stall: a long step prints nothing."""

    def __init__(self, launch: Watched, seconds: float) -> None:
        self.launch = launch
        self.seconds = seconds
        self.sizes: list[int] = []
        self.quiet_since = time.monotonic()
        self.next_check = self.quiet_since + 1.0

    def check(self) -> None:
        now = time.monotonic()
        if self.seconds <= 0 or now < self.next_check:
            return
        self.next_check = now + 1.0
        sizes = [file_size(state.log_path) for state in self.launch.ranks]
        if sizes != self.sizes:
            self.sizes, self.quiet_since = sizes, now
            return
        if now - self.quiet_since < self.seconds:
            return
        self.quiet_since = now  # next look after another quiet spell
        where = self.launch.where(self.launch.stacks(timeout=1.0))
        if "<- behind" in where:  # printed with the launch's other lines, on a line of its own
            self.launch.notify(f"[air_magic] no rank has written anything for {self.seconds:g} s.\n{where}", "stderr")
