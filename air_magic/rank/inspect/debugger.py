"""A rank's debugger: ``breakpoint()`` and its kin stop the rank and open pdb in the cell
that waits for it, through the kernel's own stdin.

A rank's stdin is ``/dev/null``: a plain pdb would read EOF at once and quit.  Here every
way into pdb goes to :class:`RankPdb`, whose commands come from the kernel and whose output
goes to it (:mod:`air_magic.protocol.debugging` draws the exchange)::

    breakpoint()             sys.breakpointhook  (PYTHONBREAKPOINT=0 skips; another hook it names runs)
    pdb.set_trace()          patched at the rank's start
    IPython's set_trace()    patched once IPython.core.debugger is imported
    dist.breakpoint(rank=k)  patched once torch.distributed is imported: rank k stops; the
                             others run on to their next collective and wait there (no barrier
                             that spins, no group timeout changed)
        |
        v
    RankPdb.interaction --> cmdloop --> _Answers.readline():
        the output so far and the prompt as a "stop" event; the answer read from the FIFO
        (a pdb command, or a control answer: skip, error, quit)

Quitting (``q``, EOF or Interrupt in the notebook) in a launch raises KeyboardInterrupt at
the line the rank was at, with tracing off: the launch then ends as after Ctrl-C.  In a
pool's call it stops the rank as a Ctrl-C that came at that line would
(:func:`air_magic.rank.pool.interrupts.request_here`): where its peers are not at the same point
(one waits in the gradient all-reduce this rank's ``loss.backward()`` would join), the rank
runs on, breakpoints skipped, to the point where they all stop, so that no rank keeps a step
its peers did not make.
"""

from __future__ import annotations

import os
import pdb
import select
import sys
import time
import types
from typing import Any

import air_magic.protocol
from air_magic.protocol.debugging import (
    ANSWER_EOF,
    ANSWER_ERROR,
    ANSWER_HERE,
    ANSWER_QUIT,
    ANSWER_SKIP,
    ASK_SECONDS,
    BREAKPOINT_WAIT_ENV,
    answers_path,
    desk_path,
    encode_event,
    events_path,
    paused_path,
)

__all__ = ["install", "RankPdb", "set_trace", "remember_sources", "reset", "BreakpointError", "post_mortem"]

#: filename -> the name the notebook knows it by ("Cell In[3]"), for the places pdb names.
_display: dict[str, str] = {}
_where: dict[str, Any] = {"work_dir": None, "rank": 0}


class BreakpointError(RuntimeError):
    """A breakpoint where nobody can debug, with ``AIR_MAGIC_ON_BREAKPOINT=error``."""


def install(work_dir: str, rank: int, sources: dict[str, tuple[str, str]]) -> None:
    """Every way into pdb in this rank goes to :class:`RankPdb`."""
    _where.update(work_dir=work_dir, rank=rank)
    remember_sources(sources)
    sys.breakpointhook = _breakpointhook
    pdb.set_trace = set_trace  # type: ignore[assignment]
    from air_magic.rank import patching

    patching.on_import("IPython.core.debugger", _patch_ipython)
    patching.on_import("torch.distributed", _patch_torch)


def remember_sources(sources: dict[str, tuple[str, str]]) -> None:
    """The names of the code a rank runs that pdb would not know: a cell's "Cell In[3]" (a
    script's file is its own name)."""
    for filename, (display, _source) in sources.items():
        if not display.startswith('File "'):
            _display[filename] = display


def _breakpointhook(*args: Any, **kwargs: Any) -> Any:
    hook = os.environ.get("PYTHONBREAKPOINT")
    if hook == "0":
        return None
    if hook and hook not in ("pdb.set_trace", "pdb:set_trace"):
        return sys.__breakpointhook__(*args, **kwargs)  # the user's own debugger, as Python does
    return set_trace(sys._getframe().f_back)


def set_trace(frame: types.FrameType | None = None, *, header: str | None = None) -> None:
    """Stop this rank at ``frame`` (the caller's by default) in the notebook's debugger."""
    if _where["work_dir"] is None:  # not in a rank (imported elsewhere): plain pdb
        pdb.Pdb().set_trace(frame or sys._getframe().f_back)
        return
    frame = frame or sys._getframe().f_back
    from air_magic.rank.pool.interrupts import safe_point

    if safe_point.pending():  # quit, or interrupted: the rank runs on to where every rank stops
        return
    debugger = RankPdb()
    debugger.called_at = _place(frame)
    if header:
        debugger.message(header)
    debugger.set_trace(frame)


#: What a pool's rank keeps of its last call's exception, for ``%distributed_debug``.
last_error: dict[str, Any] = {"exc": None}


def post_mortem(exc: BaseException, header: str = "") -> None:
    """pdb in the frames of ``exc``'s traceback, from the notebook (its prompt first says
    so); ``q`` or ``c`` end it.  Nothing happens where nobody waits or a setting says skip."""
    if _where["work_dir"] is None or exc.__traceback__ is None:
        return
    debugger = RankPdb()
    debugger.post_mortem = True
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    debugger.called_at = _place(tb.tb_frame)
    debugger.message(header or f"{type(exc).__name__}: {exc}")
    debugger.reset()
    try:
        debugger.interaction(None, exc.__traceback__)
    except KeyboardInterrupt:  # q: the post-mortem ends; the error stays the call's outcome
        pass
    finally:
        debugger.answers.asked = True


def wants_post_mortem(exc: BaseException) -> bool:
    """An error the user would look into (not a stop, an exit, or a quit debugger)."""
    import bdb

    return not isinstance(exc, (KeyboardInterrupt, SystemExit, bdb.BdbQuit, BreakpointError))


def _patch_ipython(module: types.ModuleType) -> None:
    def ipython_set_trace(frame: types.FrameType | None = None) -> None:
        set_trace(frame or sys._getframe().f_back)

    module.set_trace = ipython_set_trace  # type: ignore[attr-defined]


def _patch_torch(module: types.ModuleType) -> None:
    def breakpoint(rank: int = 0, skip: int = 0, timeout_s: int = 3600) -> None:  # noqa: A001 - torch's name
        """torch.distributed.breakpoint, in a rank of air_magic: rank ``rank`` stops in the
        notebook's debugger; the others go on until they need it (their next collective)."""
        if skip > 0:
            key = "_air_magic_breakpoint_calls"
            counter = getattr(breakpoint, key, 0) + 1
            setattr(breakpoint, key, counter)
            if counter <= skip:
                return
        if module.get_rank() == rank:
            set_trace(sys._getframe().f_back)

    module.breakpoint = breakpoint  # type: ignore[attr-defined]


class _Output:
    """pdb's stdout: kept until the next prompt (or the rank goes on), then sent."""

    def __init__(self) -> None:
        self.text: list[str] = []

    def write(self, text: str) -> int:
        self.text.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text, self.text = "".join(self.text), []
        for filename, display in _display.items():
            text = text.replace(filename, display)
        return text


_fifo: dict[str, Any] = {"fd": None, "buffer": b""}  # the answers' FIFO, opened at the first stop
_nobody = {"waits": False}  # a first stop nobody took up: later ones are skipped at once


def reset() -> None:
    """A new call of a pool's rank: whoever waits for it may take up its breakpoints."""
    _nobody["waits"] = False


def _answers_fd() -> int:
    if _fifo["fd"] is None:
        path = answers_path(_where["work_dir"], _where["rank"])
        try:
            os.mkfifo(path, 0o600)
        except FileExistsError:
            pass
        _fifo["fd"] = os.open(path, os.O_RDWR)  # never EOF; the kernel opens it to answer
    return int(_fifo["fd"])


class _Answers:
    """pdb's stdin: each ``readline`` sends the output so far and the prompt, then waits for
    the kernel's answer."""

    def __init__(self, debugger: "RankPdb") -> None:
        self.debugger = debugger
        self.asked = False

    def readline(self) -> str:
        debugger = self.debugger
        if _nobody["waits"]:
            debugger.skipped = True
            return "continue\n"
        fd = _answers_fd()
        if not self.asked:  # a new stop: what was left unread for an earlier one is not for it
            _fifo["buffer"] = b""
            while select.select([fd], [], [], 0)[0]:
                os.read(fd, 65536)
        text = debugger.out.take()
        prompt = debugger.prompt
        if text.endswith(prompt):
            text = text[: -len(prompt)]
        where = debugger.where()
        first = not self.asked
        self.asked = True
        _say_paused(where)
        _send("stop", first=first, where=where, prompt=prompt, text=text, post_mortem=debugger.post_mortem)
        # A cell that serves the prompts is there: this rank waits for its turn, however long the
        # prompts of the ranks before it take.  Else (a background launch) a while, then on.
        served = os.path.exists(desk_path(_where["work_dir"]))
        line = self._line(_ask_seconds() if first and not served else None)
        if line == ANSWER_HERE:  # the kernel took it up: its user answers when they will
            line = self._line(None)
        if line is None or line == ANSWER_SKIP:
            debugger.skipped = True
            _nobody["waits"] = line is None
            _send("resumed", text="")  # (a kernel that reads later knows it waits no more)
            why = (
                f"nobody opened its prompt within {_ask_seconds():g} s (launch.debug() does, for a background launch)"
                if line is None
                else "there is no stdin to debug it from"
            )
            what = "post-mortem" if debugger.post_mortem else "breakpoint"
            sys.stderr.write(
                f"[air_magic] {what} at {where} on rank {_where['rank']} skipped: {why} "
                "(PYTHONBREAKPOINT=0 turns breakpoints off)\n"
            )
            sys.stderr.flush()
            return "continue\n"
        if line == ANSWER_ERROR:
            raise BreakpointError(
                f"breakpoint at {where} on rank {_where['rank']}: there is no stdin to debug it from "
                "(AIR_MAGIC_ON_BREAKPOINT=error; PYTHONBREAKPOINT=0 turns breakpoints off)"
            )
        if line == ANSWER_QUIT:
            from air_magic.rank.pool.interrupts import safe_point

            if safe_point.active() and not debugger.post_mortem:  # a pool's call: stop as its Ctrl-C does
                debugger.quit_asked = True
                return "continue\n"
            raise KeyboardInterrupt(f"you quit the debugger on rank {_where['rank']}")
        return line + "\n"

    def ask(self, prompt: str) -> str | None:
        """One line for something other than pdb's prompt (``interact``'s console); None at
        Ctrl-D."""
        text = self.debugger.out.take()
        _send("stop", first=False, where=self.debugger.where(), prompt=prompt, text=text)
        line = self._line(None)
        if line == ANSWER_QUIT:
            raise KeyboardInterrupt(f"you quit the debugger on rank {_where['rank']}")
        return None if line == ANSWER_EOF else line

    def _line(self, timeout: float | None) -> str | None:
        from air_magic.rank.pool.interrupts import safe_point

        fd = _answers_fd()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in _fifo["buffer"]:
            left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            readable = select.select([fd], [], [], max(left, 0.0))[0]
            if not readable:
                if safe_point.pending():  # the pool's call was interrupted while this prompt waited
                    return ANSWER_QUIT
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            _fifo["buffer"] += os.read(fd, 4096)
        line, _, _fifo["buffer"] = _fifo["buffer"].partition(b"\n")
        return str(line.decode("utf-8", "replace").rstrip("\r"))


def _ask_seconds() -> float:
    try:
        return float(os.environ.get(BREAKPOINT_WAIT_ENV, "") or ASK_SECONDS)
    except ValueError:
        return ASK_SECONDS


#: air_magic's own folder: frames of files under it run the rank, they are not the user's.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(air_magic.protocol.__file__))) + os.sep


def _runs_the_rank(frame: types.FrameType) -> bool:
    name = frame.f_code.co_filename
    return name.startswith(_PACKAGE) or name.startswith("<frozen ")


def _place(frame: types.FrameType | None) -> str:
    if frame is None:
        return "?"
    name = frame.f_code.co_filename
    shown = _display.get(name)
    if shown is None:  # a file: as the working directory names it, where it is under it
        try:
            relative = os.path.relpath(name)
        except ValueError:
            relative = name
        shown = name if relative.startswith("..") else relative
    return f"{shown}, line {frame.f_lineno}"


def _say_paused(where: str | None) -> None:
    """The rank's paused file: where it waits in pdb (None: it runs again)."""
    path = paused_path(_where["work_dir"], _where["rank"])
    try:
        if where is None:
            os.unlink(path)
            return
        tmp = f"{path}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as handle:
            handle.write(where)
        os.replace(tmp, path)
    except OSError:  # (gone already; a launch folder being removed)
        pass


def _send(kind: str, **fields: Any) -> None:
    path = events_path(_where["work_dir"], _where["rank"])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, encode_event(kind, rank=_where["rank"], **fields))
    finally:
        os.close(fd)


class RankPdb(pdb.Pdb):
    """pdb whose commands come from the notebook's input box, for one rank."""

    def __init__(self) -> None:
        self.out = _Output()
        self.answers = _Answers(self)
        # nosigint: the rank's own SIGINT handling (a pool's safe points) stays in place.
        super().__init__(stdin=self.answers, stdout=self.out, nosigint=True)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.prompt = f"(Pdb rank {_where['rank']}) "
        self.skipped = False
        self.called_at = ""  # the line of the breakpoint() (pdb stops at the next one)
        self.post_mortem = False  # in an exception's frames: quitting ends this, not the call
        self.quit_asked = False  # quit in a pool's call: the rank stops where its peers stop
        self.at: types.FrameType | None = None  # the frame the rank stopped in
        self.handoff: Any = None  # the interrupt's line tracer, for that frame once pdb lets go

    def where(self) -> str:
        """Where the rank stopped: the breakpoint's own line at the first stop, then pdb's."""
        if self.called_at and not self.answers.asked:
            return self.called_at
        return _place(self.curframe)

    def interaction(self, frame: Any, tb: Any) -> None:
        self.at = frame
        super().interaction(frame, tb)

    def trace_dispatch(self, frame: Any, event: str, arg: Any) -> Any:
        result = super().trace_dispatch(frame, event, arg)
        if self.handoff is not None and frame is self.at:
            handoff, self.handoff = self.handoff, None
            return handoff  # (what a line's tracer returns becomes its frame's tracer)
        return result

    def _cmdloop(self) -> None:
        # pdb's own loop prints "--KeyboardInterrupt--" and asks again: here an interrupt (or
        # a quit from the notebook) ends the debugging and raises in the rank's code.
        self.allow_kbdint = True
        try:
            self.cmdloop()
        except BaseException:
            self._stop_tracing()
            raise
        finally:
            self.allow_kbdint = False
            _say_paused(None)
        if self.skipped or self.post_mortem or self.quit_asked:
            self._stop_tracing()
        if not self.skipped:
            text = self.out.take()
            _send("resumed", text=text)
        if self.quit_asked and self.at is not None:
            from air_magic.rank.pool.interrupts import safe_point

            # Raises KeyboardInterrupt here where every rank stops here; else the rank runs on.
            self.handoff = safe_point.request_here(self.at)

    def get_stack(self, f: Any, t: Any) -> tuple[list[tuple[Any, int]], int]:
        """pdb's stack without the frames that run the rank (the helper, the rank's main,
        runpy): ``w`` starts at the user's code, ``u`` stops there."""
        stack, index = super().get_stack(f, t)
        cut = 0
        while cut < len(stack) - 1 and _runs_the_rank(stack[cut][0]):
            cut += 1
        return stack[cut:], max(0, index - cut)

    def do_interact(self, arg: str) -> None:
        """interact

        An interactive interpreter in the notebook's input box, with the names of the current
        scope; Ctrl-D (or an empty answer to ``exit()``) returns to pdb."""
        import code

        frame = self.curframe
        if frame is None:
            return
        namespace = {**frame.f_globals, **self.curframe_locals}
        console = code.InteractiveConsole(namespace, "*interactive*")
        answers = self.answers

        def raw_input(prompt: str = "") -> str:
            line = answers.ask(prompt)
            if line is None:
                raise EOFError
            return line

        console.raw_input = raw_input  # type: ignore[method-assign]
        out, err = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = self.out  # type: ignore[assignment]
        try:
            console.interact(banner="*interactive* (Ctrl-D or exit() returns to pdb)", exitmsg="")
        except SystemExit:  # exit() in the console: back to pdb
            pass
        finally:
            sys.stdout, sys.stderr = out, err

    def do_clear(self, arg: str) -> Any:
        if not arg:  # pdb asks "Clear all breaks?" with input(): there is no input here
            self.clear_all_breaks()
            self.message("Deleted all breakpoints")
            return None
        return super().do_clear(arg)

    def _stop_tracing(self) -> None:
        self.clear_all_breaks()
        self.set_continue()
        sys.settrace(None)
        frame = sys._getframe().f_back
        while frame is not None:
            frame.f_trace = None  # type: ignore[assignment]
            frame = frame.f_back
