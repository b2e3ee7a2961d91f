"""Signals, the launch id that marks a launch's processes, and how a rank is asked for its stacks."""

from __future__ import annotations

import enum
import os
import signal
from typing import Any

from air_magic.protocol.paths import stack_path, stack_request_path

# -- shared constants ------------------------------------------------------------------------------


class StackAsk(bytes, enum.Enum):
    """What the kernel asks a rank's answering thread on its stack pipe (one byte first; a
    collectives' request then carries its token): :mod:`air_magic.rank.inspect.stacks`."""

    STACKS = b"?"  # every thread's Python stack, into the stack file
    COLLECTIVES = b"c"  # the pending collectives, with where the code made them (a pool's Ctrl-C)
    LOOK = b"q"  # each group's numbers only (the hang watch's quick look)
    REPORT = b"r"  # a hang report's: the last completed collective of each group too
    CUT = b"x"  # a pool's hang: its group's connections cut


#: The signal that makes a rank write its main thread's Python stack to its stack file
#: (``faulthandler``; a real-time signal no library is known to use).  The main thread's
#: only: reading other threads' frames from a signal handler crashes a rank whose other
#: thread imports at that moment.
STACK_SIGNAL = signal.SIGRTMAX - 3
#: The same, once a launch's time is up: the rank writes its stacks and then ends by this
#: signal (faulthandler chained to the default action), so no user code runs after the
#: limit has passed -- a C call that the signal cut short cannot return a value.
FINAL_STACK_SIGNAL = signal.SIGRTMAX - 4
#: A rank's exit code when its code ended by KeyboardInterrupt (``q`` at its breakpoint, a
#: Ctrl-C): an interrupt, not a failure, as a shell's 128 + SIGINT says it.
INTERRUPTED_EXIT = 130

#: How a backend stops a launch's ranks, by the stop's reason: (delay in seconds, signal).
STOP_ESCALATION: dict[str, list[tuple[float, signal.Signals]]] = {
    # A user's interrupt first reaches Python code as KeyboardInterrupt (finally blocks run).
    "cancel": [(0.0, signal.SIGINT), (1.0, signal.SIGTERM), (3.0, signal.SIGKILL)],
    # The other ranks are most likely blocked inside a collective: terminate them.
    "failure": [(0.0, signal.SIGTERM), (2.0, signal.SIGKILL)],
    "timeout": [(0.0, signal.SIGTERM), (2.0, signal.SIGKILL)],
    "kill": [(0.0, signal.SIGKILL)],
}


def signal_rank(pid: int, signum: int) -> None:
    """Send ``signum`` to a rank's process group (the rank and what it started), or to the
    rank alone while it has no group yet.  A rank calls ``setsid()`` first thing, and a
    stop can come before that: a peer that failed at once, on a loaded machine."""
    try:
        os.killpg(pid, signum)
        return
    except ProcessLookupError:  # no group of that id (yet; or the rank has been reaped)
        pass
    except PermissionError:
        return
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


#: Every process of a launch carries its id in this variable (set in the ranks'
#: environment and inherited by whatever they start, in a session of its own or not).
LAUNCH_ID_ENV = "AIR_MAGIC_LAUNCH_ID"


def carriers(launch_id: str) -> list[int]:
    """This user's processes (not this one) whose environment carries ``launch_id``: the
    ranks and everything they started, also what left their process group and session."""
    mark = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    uid, me, found = os.getuid(), os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/environ", "rb") as handle:
                if mark in handle.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


def end_carriers(launch_id: str, rounds: int = 5) -> list[int]:
    """SIGKILL every process that carries ``launch_id`` (see :func:`carriers`), looking
    again a few times for what one of them forked meanwhile; the pids killed."""
    killed: list[int] = []
    for _ in range(rounds):
        found = [pid for pid in carriers(launch_id) if pid not in killed]
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        killed.extend(found)
    return killed


def printable(exc: BaseException) -> str:
    """``str(exc)``, or ``<unprintable ValueError>`` when its ``__str__`` raises."""
    try:
        return str(exc)
    except BaseException:
        return f"<unprintable {type(exc).__name__}>"


#: How long a rank's answering thread has to write its stacks before the request is made
#: again by signal (the thread waits for the GIL, which a C call may hold).
THREAD_ANSWER_SECONDS = 0.3


def ask_for_stacks(work_dir: str, rank: int, pid: int, *, by_signal: bool = False) -> bool:
    """Ask ``rank`` (process ``pid``) to write its threads' stacks to its stack file,
    emptied first.  Through its stack pipe when its answering thread is listening (the
    user's code is not interrupted: a C call such as ``sleep()`` computes what it would
    have); else, or with ``by_signal``, by ``STACK_SIGNAL`` (works while a C call holds
    the GIL, but cuts a system call such as ``nanosleep`` short).  True when asked."""
    try:
        os.truncate(stack_path(work_dir, rank), 0)
    except OSError:
        return False  # the rank has not made it yet, or its launch is gone
    if not by_signal:
        try:
            fd = os.open(stack_request_path(work_dir, rank), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no pipe, or nobody reading it (ENXIO): the signal then
            pass
        else:
            try:
                os.write(fd, StackAsk.STACKS.value)
                return True
            except OSError:
                pass
            finally:
                os.close(fd)
    try:
        os.kill(pid, STACK_SIGNAL)
        return True
    except OSError:  # ended meanwhile
        return False


def ask_for_collectives(work_dir: str, rank: int, how: str = "c") -> str | None:
    """Ask ``rank``'s stack thread for its collectives (torch's Flight Recorder, read without
    interrupting its code); the token its answer will carry, or None when it cannot be asked
    (no thread listens: the rank has ended, or never started one).  ``how``: ``c`` (with
    the pending collectives' stacks), ``q`` (none: a quick look), ``r`` (a report's: the
    last completed collective of each group too)."""
    token = os.urandom(6).hex()
    try:
        fd = os.open(stack_request_path(work_dir, rank), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        os.write(fd, StackAsk(how.encode()).value + token.encode())
        return token
    except OSError:
        return None
    finally:
        os.close(fd)


def ask_to_cut(work_dir: str, rank: int) -> bool:
    """Ask ``rank``'s stack thread to shut down its pool group's connections (a hang's way
    out: :mod:`air_magic.rank.pool.interrupts.regroup`); False when it cannot be asked."""
    try:
        fd = os.open(stack_request_path(work_dir, rank), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.write(fd, StackAsk.CUT.value)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def format_thread_stacks(skip: int | None = None) -> str:
    """Every Python thread's stack but ``skip``'s, in faulthandler's layout (the main
    thread first, most recent call first), as the stack file holds them."""
    import sys
    import threading

    frames = sys._current_frames()
    main = threading.main_thread().ident
    order = sorted(frames, key=lambda ident: ident != main)
    lines = []
    for ident in order:
        if ident == skip:
            continue
        lines.append(f"Thread 0x{ident:016x} (most recent call first):")
        frame: Any = frames[ident]
        while frame is not None:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
            frame = frame.f_back
        lines.append("")
    return "\n".join(lines) + "\n"


# -- limits on processes ---------------------------------------------------------------------------


def cgroup_pid_folders() -> list[str]:
    """This process's cgroup folders (v2 and v1's pids controller), innermost first."""
    found: list[str] = []
    try:
        with open("/proc/self/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        root = "/sys/fs/cgroup" if not controllers else f"/sys/fs/cgroup/{controllers}"
        if controllers and "pids" not in controllers.split(","):
            continue
        while True:
            found.append(os.path.normpath(root + path))
            if path in ("/", ""):
                break
            path = os.path.dirname(path)
    return found


def pid_limits() -> list[tuple[int, int, str]]:
    """The cgroup limits on processes that apply here: (pids.max, pids.current, folder)."""
    limits = []
    for path in cgroup_pid_folders():
        try:
            with open(os.path.join(path, "pids.max")) as handle:
                most = handle.read().strip()
            with open(os.path.join(path, "pids.current")) as handle:
                now = int(handle.read().strip())
        except (OSError, ValueError):
            continue
        if most.isdigit():
            limits.append((int(most), now, path))
    return limits


def pids_room() -> tuple[int, str] | None:
    """How many more processes the tightest cgroup limit lets start, and that limit in
    words; None where no such limit applies."""
    tightest = None
    for most, now, path in pid_limits():
        room = max(0, most - now)
        if tightest is None or room < tightest[0]:
            tightest = (room, f"the cgroup limit pids.max is {most} ({now} processes in it now: {path})")
    return tightest
