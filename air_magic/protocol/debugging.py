"""What a rank stopped at a breakpoint and the kernel say to each other (stdlib only).

Both ends live in the launch's private folder (0700), one pair per rank::

    rank (air_magic.rank.inspect.debugger)                 kernel (air_magic.kernel.inspect.debugger)
    ------------------------------                 ----------------------------------
    breakpoint(): debug-<rank>.in (a FIFO) made
    {"kind": "stop", "first": true, "where",
     "prompt", "text"} appended to
    debug-<rank>.events  ----------------------->  the waiting cell's loop reads it:
                                                   ANSWER_SKIP / _ERROR (no stdin, or the
                         <-----------------------  setting), else each command the
    runs the command; its output and the next      user types at the kernel's own input()
    prompt in the next "stop" event  ------------>  shown in the cell, the next input()
    continues: {"kind": "resumed", "text"}  ----->  the rest of its output shown
    ANSWER_QUIT (q, EOF, Interrupt): KeyboardInterrupt at the breakpoint's line

The kernel takes up a first "stop" at once (ANSWER_HERE, before its prompt waits for the user).
While a cell serves the prompts (``debug-desk`` is in the folder), a stopped rank waits for its
turn however long the prompts of the ranks before it take; a rank whose first "stop" is not
taken up within ``ASK_SECONDS`` while no cell serves them (a background launch: its
``AIR_MAGIC_BREAKPOINT_WAIT``) goes on as if skipped.  Events are JSON lines, each one ``write``.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = [
    "ANSWER_EOF",
    "ANSWER_ERROR",
    "ANSWER_HERE",
    "ANSWER_QUIT",
    "ANSWER_SKIP",
    "ASK_SECONDS",
    "BACKGROUND_WAIT",
    "BREAKPOINT_WAIT_ENV",
    "POSTMORTEM_ENV",
    "answers_path",
    "desk_path",
    "encode_event",
    "events_path",
    "paused_at",
    "paused_path",
    "read_events",
]

#: Control answers start with a NUL byte: no pdb command does.
ANSWER_SKIP = "\x00skip"
ANSWER_ERROR = "\x00error"
ANSWER_QUIT = "\x00quit"
#: Ctrl-D at a prompt that is not pdb's own (``interact``'s console): that prompt ends.
ANSWER_EOF = "\x00eof"
#: The kernel took up a first stop (its prompt is on its way): the rank waits as long as it takes.
ANSWER_HERE = "\x00here"

#: Set in a launch's ranks when the kernel has ``%pdb on``: a rank that raises opens pdb in its
#: frames first (a pool's call carries it as ``postmortem``).
POSTMORTEM_ENV = "AIR_MAGIC_POSTMORTEM"

#: How long (seconds) a rank waits at a breakpoint for the kernel to take it up: a background
#: launch's ranks get BACKGROUND_WAIT (``launch.debug()`` takes it up), others ASK_SECONDS.
BREAKPOINT_WAIT_ENV = "AIR_MAGIC_BREAKPOINT_WAIT"
BACKGROUND_WAIT = 300.0

#: How long a rank waits for the kernel to take up its first stop before it goes on.
ASK_SECONDS = 5.0


def events_path(work_dir: str, rank: int) -> str:
    """What ``rank``'s debugger tells the kernel (JSON lines, appended)."""
    return os.path.join(work_dir, f"debug-{rank}.events")


def answers_path(work_dir: str, rank: int) -> str:
    """The FIFO on which ``rank``'s debugger reads the kernel's answers (one per line)."""
    return os.path.join(work_dir, f"debug-{rank}.in")


def desk_path(work_dir: str) -> str:
    """There while a cell (or ``launch.debug()``) serves the ranks' prompts: a rank stopped at a
    breakpoint then waits for its turn however long the prompts before it take."""
    return os.path.join(work_dir, "debug-desk")


def paused_path(work_dir: str, rank: int) -> str:
    """There while ``rank`` waits in its debugger: where it is ("Cell In[3], line 4"), for
    the panel and the sidebar ("paused"; its peers wait for it, they are not hung)."""
    return os.path.join(work_dir, f"debug-{rank}.paused")


def paused_at(work_dir: str, rank: int) -> str | None:
    """Where ``rank`` is paused in its debugger, or None."""
    try:
        with open(paused_path(work_dir, rank), encoding="utf-8") as handle:
            return handle.read() or "?"
    except OSError:
        return None


def encode_event(kind: str, **fields: Any) -> bytes:
    return (json.dumps({"kind": kind, **fields}) + "\n").encode("utf-8")


def read_events(path: str, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The whole events after ``offset`` (a line not yet ended waits), and the new offset."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    events = []
    for line in data[:end].splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events, offset + end
