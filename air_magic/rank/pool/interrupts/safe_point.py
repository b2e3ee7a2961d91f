"""A pool rank's Ctrl-C: every rank stops at the same point of the training, a point it can
go on from, and no collective completes with data a rank did not send.

A KeyboardInterrupt raised in the middle of torch's distributed machinery leaves it in a
state its peers do not share (FSDP's pre-forward hook interrupted after it unsharded a
layer skips that layer's all-gather in the next forward, while the peer makes it), and
ranks stopped at different lines leave replicated state different (rank 0 stopped before
``opt.step()`` and its peer after it).  So a SIGINT during a pool call (or ``q`` at a
breakpoint: :func:`request_here`) raises only at a *safe point*, a line of code outside
torch, DeepSpeed and the debugger, and only at one where every rank has issued the same
collectives, process group by process group (each group's sequence number), and is at the
same line.  The ranks agree through the process group's own store (torch's TCPStore)::

    SIGINT --> handler(frame)
                 no process group (or 1 rank): KeyboardInterrupt at the first safe point
                 stack free of torch/DeepSpeed/pdb frames: a safe point now, else the frames
                 outside the outermost such frame get a line tracer (sys.settrace, only
                 until the interrupt is raised): each of their lines is a safe point

    at a safe point:  post {group: sequence number} and the line (each frame's file and
                      line) under the call's key in the store (compare-and-set: one JSON
                      object for all ranks)
                        every rank posted, all equal  --> "stop" set; KeyboardInterrupt here
                        "stop" already set            --> KeyboardInterrupt here
                        a peer has issued more, or as
                        many and is at a later line   --> withdraw, run on to the next one
                        no agreement in AGREE_WAIT s  --> withdraw, run on (a peer may wait
                                                          in a collective this rank has yet
                                                          to make: running on makes it, with
                                                          the rank's own data)
    no agreement for AGREE_FOR s: the fence (air_magic.rank.pool.interrupts.fence): the rank's next
                collective raises before it starts, wherever it comes from (FSDP's hooks,
                DDP's reducer in C++): every rank stops before the first collective that
                not all of them made; a peer left waiting in it is cut free by the kernel
                (its collective raises) and the group rebuilt
    last resorts:  ALONE_AFTER s, the next safe point whatever the peers do (or a second
                SIGINT, at a safe point: a rank in sleep() reaches no line); SAFE_CPU_SECONDS
                of CPU time inside torch (a long computation, no way out): KeyboardInterrupt
                where it is, as a plain Ctrl-C would.  The kernel then compares the ranks'
                state (air_magic.rank.pool.interrupts.state) before it calls the pool intact

CPU time, not wall time, bounds the wait inside torch: it does not pass while the thread
waits for its peers.  Withdrawing and stopping are compare-and-set operations on the one
key, so no rank runs on once another has seen the agreement.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import types
from typing import Any, Callable

__all__ = [
    "install",
    "uninstall",
    "request_here",
    "pending",
    "active",
    "SAFE_CPU_SECONDS",
    "AGREE_WAIT",
    "AGREE_FOR",
    "ALONE_AFTER",
]

#: CPU seconds the main thread may spend inside torch after a SIGINT before the
#: KeyboardInterrupt raises where it is.
SAFE_CPU_SECONDS = 1.5
#: Wall seconds a rank at a safe point waits for its peers to reach the same one.
AGREE_WAIT = 0.25
#: Wall seconds after the SIGINT after which the rank's next collective raises (the fence).
AGREE_FOR = 1.0
#: Wall seconds after the SIGINT after which a rank stops at its next safe point alone.
ALONE_AFTER = 2.0

#: Path parts of the packages whose state a KeyboardInterrupt raised inside them can leave
#: out of step with the peers' (collectives, hooks, sharding state).
_UNSAFE_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}deepspeed{os.sep}")
_KEY = "air_magic/interrupt/{call}"
_STOP = "stop"
_SEEN = "seen"  # the ranks that came to a safe point at least once (they run Python)
#: Wall seconds a rank waits at a safe point while some peer has not come to one yet.
QUICK_WAIT = 0.02

_call: dict[str, Any] = {}  # the pool call running now: its id
_pending: dict[str, Any] = {}  # while an interrupt waits for a safe point: its deadline and frames


def _debugger_files() -> frozenset[str]:
    """The files of the debugger a rank may be stopped in: a stop inside them is no safe point
    (the rank goes on from the user's own line)."""
    import bdb
    import cmd
    import importlib.util
    import pdb

    # Found, not imported (it imports this module), wherever its room is.
    spec = importlib.util.find_spec("air_magic.rank.inspect.debugger")
    ours = os.path.abspath(spec.origin) if spec is not None and spec.origin else ""
    return frozenset([ours] + [str(getattr(m, "__file__", "") or "") for m in (bdb, cmd, pdb)])


_DEBUGGER: frozenset[str] = frozenset()


def install(call_id: Any = None) -> None:
    """From now on a SIGINT raises KeyboardInterrupt at the main thread's next safe point
    (``call_id`` names the call, the same on every rank: the key the ranks agree under)."""
    global _DEBUGGER
    if not _DEBUGGER:
        _DEBUGGER = _debugger_files()
    _call["id"] = call_id
    signal.signal(signal.SIGINT, _on_sigint)


def uninstall() -> None:
    """SIGINT ignored again (the rank is between calls); a pending interrupt is dropped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _clear()
    _call.clear()


def active() -> bool:
    """Whether a pool call runs (a quit debugger then stops the rank as a Ctrl-C does)."""
    return _call.get("id") is not None


def pending() -> bool:
    """Whether an interrupt waits for the rank's stop."""
    return bool(_pending)


def _unsafe(code: types.CodeType) -> bool:
    name = code.co_filename
    return any(part in name for part in _UNSAFE_PARTS) or name in _DEBUGGER


def _on_sigint(signum: int, frame: types.FrameType | None) -> None:
    if _pending:  # a second Ctrl-C while one waits: the user insists
        if time.thread_time() >= _pending["deadline"]:
            _raise()
        if time.monotonic() >= _pending["alone"] and not any(_unsafe(f.f_code) for f in _stack(frame)):
            _raise()  # past ALONE_AFTER, at a safe point (a call in C, such as sleep(), that no line ends)
        return
    _begin(frame)
    if _pending["safe_now"] and _settle(frame):  # a safe point already
        _raise()


def request_here(frame: types.FrameType) -> Callable[..., Any] | None:
    """``q`` at a breakpoint, in a pool call: the rank stops as for a Ctrl-C that came at
    ``frame``'s current line (a safe point: the user's code).  Raises KeyboardInterrupt
    where the ranks agree to stop here; else returns the line tracer to give ``frame`` (the
    rank runs on to the point where they all stop).  None outside a pool call."""
    if not active():
        return None
    if not _pending:
        _begin(frame)
    elif frame not in _pending["frames"]:
        _pending["frames"].append(frame)
    for each in _pending["frames"]:
        each.f_trace = _in_safe_frame
        each.f_trace_lines = True
    sys.settrace(_on_call)
    if _settle(frame):
        _raise()
    return _in_safe_frame


def _begin(frame: types.FrameType | None) -> None:
    """An interrupt waits for its stop from now on: the frames outside the outermost unsafe
    one (torch's, DeepSpeed's, the debugger's) get the line tracer."""
    outermost_unsafe = None
    walk = frame
    while walk is not None:
        if _unsafe(walk.f_code):
            outermost_unsafe = walk
        walk = walk.f_back
    safe: list[types.FrameType] = []
    walk = frame if outermost_unsafe is None else outermost_unsafe.f_back
    while walk is not None:
        safe.append(walk)
        walk = walk.f_back
    if not safe:  # the whole stack is torch's: nowhere better to stop
        raise KeyboardInterrupt
    now = time.monotonic()
    _pending.update(
        deadline=time.thread_time() + SAFE_CPU_SECONDS,
        fence=now + AGREE_FOR,
        alone=now + ALONE_AFTER,
        frames=safe,
        thread=threading.get_ident(),
        peers=_peers(),
        safe_now=outermost_unsafe is None,
    )
    for each in safe:
        each.f_trace = _in_safe_frame
        each.f_trace_lines = True
    sys.settrace(_on_call)


def _stack(frame: types.FrameType | None) -> list[types.FrameType]:
    found = []
    while frame is not None:
        found.append(frame)
        frame = frame.f_back
    return found


def _on_call(frame: types.FrameType, event: str, arg: Any) -> None:
    """The global tracer while an interrupt waits: no tracing of new frames, but the deadline
    and the fence (a call of Python code: FSDP's hooks, the user's functions)."""
    if _pending and threading.get_ident() == _pending["thread"]:
        if time.thread_time() >= _pending["deadline"]:
            _raise()
        _fence_when_due()
    return None


def _in_safe_frame(frame: types.FrameType, event: str, arg: Any) -> Any:
    """A frame outside torch got control back: a safe point at each of its lines."""
    if not _pending or threading.get_ident() != _pending["thread"]:
        return None
    if event == "line" and _settle(frame):
        _raise()
    return _in_safe_frame


def _fence_when_due() -> None:
    """Past AGREE_FOR without an agreement: the rank's next collective raises."""
    if not _pending.get("fenced") and time.monotonic() >= _pending["fence"] and _pending.get("peers") is not None:
        from air_magic.rank.pool.interrupts import fence

        _pending["fenced"] = True
        fence.arm(
            "the pool's interrupt: the ranks did not all reach one line, so each stops before its next collective"
        )


def _raise() -> None:
    _clear()
    raise KeyboardInterrupt


def _clear() -> None:
    frames = _pending.get("frames") or []
    _pending.clear()
    sys.settrace(None)
    for each in frames:
        try:
            each.f_trace = None
        except Exception:  # a frame that has ended
            pass
    from air_magic.rank.pool.interrupts import fence

    fence.disarm()


# -- agreeing with the peers -----------------------------------------------------------------


class _Peers:
    """The process group's store, this rank and the world, and how to read this rank's
    position: each of its process groups' sequence number (collectives issued so far)."""

    def __init__(self, store: Any, rank: int, world: int, groups: list[Any], key: str) -> None:
        self.store, self.rank, self.world, self.groups, self.key = store, rank, world, groups, key

    def position(self) -> dict[str, int]:
        from air_magic.rank.pool.interrupts import regroup

        return {str(g.group_name): regroup.sequence_number(g) for g in self.groups}


def _peers() -> _Peers | None:
    """None where there is nobody to agree with: no process group, one rank, no store."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or _call.get("id") is None:
        return None
    try:
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        c10d = dist.distributed_c10d
        peers = _Peers(
            c10d._get_default_store(),
            dist.get_rank(),
            dist.get_world_size(),
            list(c10d._world.pg_map),
            _KEY.format(call=_call["id"]),
        )
        peers.position()  # every group can say where it is
        return peers
    except Exception:  # a backend without sequence numbers, a store gone: stop alone
        return None


def _settle(frame: types.FrameType | None) -> bool:
    """At a safe point: True when this rank stops here (its peers stop at the same point)."""
    peers = _pending.get("peers")
    if peers is None or time.monotonic() >= _pending["alone"]:
        return True
    _fence_when_due()
    try:
        return _agree(peers, _lines(frame))
    except Exception:  # the store is gone (a peer's process ended): stop where it is
        return True


def _lines(frame: types.FrameType | None) -> list[list[Any]]:
    """Where the code is: each frame's file and line, the outermost first."""
    found: list[list[Any]] = []
    while frame is not None:
        found.append([frame.f_code.co_filename, frame.f_lineno])
        frame = frame.f_back
    return found[::-1]


def _agree(peers: _Peers, lines: list[list[Any]]) -> bool:
    me = str(peers.rank)
    here = {"seq": peers.position(), "at": lines}

    def post(s: dict[str, Any]) -> dict[str, Any]:
        if s.get(_STOP):
            return s
        seen = sorted({*s.get(_SEEN, []), peers.rank})
        return {**s, me: here, _SEEN: seen}

    state = _update(peers, post)
    # Peers that have not come to a safe point yet may be in a C call that waits for this
    # rank (a collective it has yet to make): a short wait, and on.  Once every rank has shown
    # it runs Python, the wait gives the others time to reach this point.
    everyone = len(state.get(_SEEN, [])) >= peers.world
    wait_until = time.monotonic() + (AGREE_WAIT if everyone else QUICK_WAIT)
    while True:
        if state.get(_STOP):
            return True
        posted = {r: p for r, p in state.items() if r not in (_STOP, _SEEN)}
        if _behind(here, posted):
            break
        if len(posted) == peers.world and _even(posted):
            state = _update(peers, lambda s: {**s, _STOP: True} if _complete(s, peers.world) else s)
            continue
        if time.monotonic() >= wait_until:
            break
        time.sleep(0.005)
        state = _read(peers)
    # Run on to the next safe point, unless the others agreed meanwhile.
    state = _update(peers, lambda s: s if s.get(_STOP) else {r: p for r, p in s.items() if r != me})
    return bool(state.get(_STOP))


def _behind(here: dict[str, Any], posted: dict[str, dict[str, Any]]) -> bool:
    """A peer has issued a collective this rank has not, or has issued the same ones and is
    further on in the code (by line: between two collectives, the lower line runs on)."""
    mine = here["seq"]
    for other in posted.values():
        shared = [g for g in other["seq"] if g in mine]
        if any(other["seq"][g] > mine[g] for g in shared):
            return True
        if all(other["seq"][g] == mine[g] for g in shared) and other["at"] > here["at"]:
            return True
    return False


def _even(posted: dict[str, dict[str, Any]]) -> bool:
    """Every rank at the same line, each group's members having issued the same collectives."""
    seen: dict[str, int] = {}
    lines = None
    for position in posted.values():
        if lines is None:
            lines = position["at"]
        elif position["at"] != lines:
            return False
        for group, seq in position["seq"].items():
            if seen.setdefault(group, seq) != seq:
                return False
    return True


def _complete(state: dict[str, Any], world: int) -> bool:
    posted = {r: p for r, p in state.items() if r not in (_STOP, _SEEN)}
    return len(posted) == world and _even(posted)


def _read(peers: _Peers) -> dict[str, Any]:
    raw = peers.store.compare_set(peers.key, "", "{}")  # made empty where it is not there yet
    return dict(json.loads(raw))


def _update(peers: _Peers, change: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """The call's agreement changed as ``change`` says, atomically (compare-and-set)."""
    while True:
        raw = peers.store.compare_set(peers.key, "", "{}")
        state = dict(json.loads(raw))
        new = change(state)
        if new == state:
            return state
        wanted = json.dumps(new, sort_keys=True)
        if peers.store.compare_set(peers.key, raw.decode(), wanted) == wanted.encode():
            return new
