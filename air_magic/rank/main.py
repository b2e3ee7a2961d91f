"""What a rank does, in the child forked from the helper process.

``child_main`` never returns: it becomes a process-group leader in its own session
(so stopping a rank takes its DataLoader workers along), sends its output to its
log file, takes the kernel's environment, working directory and ``sys.path`` *as
they were at this launch*, runs the user's function or cell, writes its result
record, and leaves with ``os._exit``.

It dies with the kernel even when nobody tells it to: it holds the read end of a
pipe whose only write end is in the kernel, opened for signal-driven I/O, so the
kernel's death (EOF) makes Linux send SIGIO, whose default action ends the process,
to the rank's whole process group -- no thread, no handler (Linux also sends
SIGKILL when the helper it was forked from dies).

Apart from what the notebook is for (captured globals, results, the kernel's
cwd/env/``sys.path``), a rank looks like a fresh process that ``torchrun`` started:
``sys.argv``, fresh random state, signal dispositions, umask and resource limits,
one thread, ``__name__ == "__main__"``; ``tests/process/test_process_torchrun_parity.py``
compares the two and lists every difference that remains, with its reason.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import fcntl
import linecache
import os
import random
import resource
import signal
import sys
import time
import traceback
import types
from typing import Any

import cloudpickle

from air_magic.protocol import (
    INTERRUPTED_EXIT,
    LEFT_PREFIX,
    RESULT_NAME,
    STACK_SIGNAL,
    STOP_MARK,
    TRACEBACK_MARK,
    ErrorRecord,
    LaunchRequest,
    Record,
    UnpicklableRecord,
    ValueRecord,
    elastic_error_path,
    joined_path,
    printable,
    rendezvous_path,
    result_path,
    stack_path,
)
from air_magic.protocol.debugging import POSTMORTEM_ENV
from air_magic.rank import groups as _groups
from air_magic.rank import output as _output
from air_magic.rank import results as _results
from air_magic.rank import tracking_shim as _rank_tracking
from air_magic.rank.inspect import debugger as _debugger
from air_magic.rank.inspect import stacks as _stacks

# Where they were defined before the protocol had a module of its own.
__all__ = ["child_main", "format_user_traceback", "RESULT_NAME", "STACK_SIGNAL", "TRACEBACK_MARK"]
__all__ += ["joined_path", "stack_path"]

#: air_magic's own folder: frames of files under it are not the user's.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PR_SET_PDEATHSIG = 1
_MAX_THREADS_PER_CPU = 4


def child_main(request: LaunchRequest, rank: int, port: int, alive_fd: int, close_fds: list[int]) -> None:
    code = 70
    try:
        os.setsid()
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        _fresh_signal_state()
        _die_with_parent()
        atexit._clear()  # the helper's exit hooks are not the rank's
        _register_process_exit_hooks()
        _fresh_random_state()
        # Rank 0's output is shown in the cell: where it wrote to sys.stderr is kept.
        _output.redirect(request.log_paths[rank], stderr_ranges=rank == 0)
        _stacks.answer_requests(request.work_dir, rank, cut=_cut_the_pools_group)
        _watch_kernel(alive_fd)
        _apply_environment(request, rank, port)
        if request.private_rendezvous:
            _private_rendezvous(request.work_dir, port)
        _apply_process_limits(request)
        _install_notebook_builtins()
        _groups.keep_destroyed_groups()  # torch 2.13: DDP + gloo can hang as the model is freed
        _debugger.install(request.work_dir, rank, request.sources)  # breakpoint(): a prompt in the cell
        code = _run(request, rank)
    except BaseException:  # anything at all: the rank must still leave by os._exit
        try:
            traceback.print_exc()
        except BaseException:  # a broken stderr: nothing left to tell
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _fresh_signal_state() -> None:
    """Signal dispositions as a new Python process has them (torchrun's workers are such
    processes): SIGINT raises KeyboardInterrupt, SIGPIPE and SIGXFSZ are ignored (Python's
    start-up does that), every other signal has its default action.  The mask is emptied
    by :func:`_let_signals_in`, once the rank is ready for them."""
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if signum == signal.SIGINT:
            handler: Any = signal.default_int_handler
        elif signum in (signal.SIGPIPE, signal.SIGXFSZ):
            handler = signal.SIG_IGN
        else:
            handler = signal.SIG_DFL
        try:
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)
        except (OSError, ValueError):  # signals the C library reserves
            pass


def _let_signals_in() -> None:
    """Empty the signal mask, as a new process has it.  The helper forks a rank with every
    signal held, so a stop that came while the rank set itself up (the helper's handlers
    still installed) waits until now and acts as it would on the user's code: SIGINT raises
    KeyboardInterrupt, SIGTERM ends the rank."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _fresh_random_state() -> None:
    """Random state as fresh as a new process's, different on every rank and launch.

    A fork copies the helper's generators: without this every rank of every launch
    would draw the same numbers (dropout masks, shuffles, initial weights).  torch's CPU
    generator and the CUDA ones (applied when CUDA is first used) get a seed from the
    OS, as at torch's import; NumPy's legacy global generator and ``random`` are
    reseeded from the OS too, whether or not the helper preloaded them.
    """
    random.seed()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def _die_with_parent() -> None:
    # The helper forks from its only thread, which lives as long as the helper, so
    # PDEATHSIG is reliable here (it is not in a kernel, whose threads come and go).
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _register_process_exit_hooks() -> None:
    """Give back the exit hooks that act on this process's own state, as a fresh
    Python process that imported the same modules would have them.

    They were registered in the helper (when it imported torch) and cleared with the
    helper's other hooks: multiprocessing's (stops the rank's daemonic children,
    such as persistent DataLoader workers, and joins the others), torch's DataLoader
    exit flag, ``weakref.finalize``'s (``TemporaryDirectory`` cleanup) and logging's
    (flushes file handlers).  Same order as at import, so they run in the usual one.
    """
    import logging
    import multiprocessing.util
    import weakref

    atexit.register(logging.shutdown)
    data_utils = sys.modules.get("torch.utils.data._utils")
    if data_utils is not None and hasattr(data_utils, "_set_python_exit_flag"):
        atexit.register(data_utils._set_python_exit_flag)
    atexit.register(multiprocessing.util._exit_function)  # type: ignore[attr-defined]
    registry = getattr(weakref.finalize, "_registry", {})
    for info in list(registry.values()):
        info.atexit = False  # the helper's objects (torch's op libraries): not this rank's to finalize
    if getattr(weakref.finalize, "_registered_with_atexit", False):
        atexit.register(weakref.finalize._exitfunc)  # type: ignore[attr-defined]


def _cut_the_pools_group() -> None:
    """A pool's hang: its group's connections cut (:func:`air_magic.rank.pool.interrupts.regroup.cut`)."""
    from air_magic.rank.pool.interrupts import regroup

    regroup.cut()


def _watch_kernel(alive_fd: int) -> None:
    """Die with the kernel, without a thread: the kernel holds the only write end of the
    alive pipe, and closing it (even by SIGKILL) sends SIGIO -- default action: end the
    process -- to every process of this rank's group (DataLoader workers included).

    Every rank inherited the same open file of the pipe, and a file has one SIGIO
    owner, so each rank opens the pipe anew through ``/proc`` and owns that one.
    """
    fd = os.open(f"/proc/self/fd/{alive_fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    os.close(alive_fd)
    fcntl.fcntl(fd, fcntl.F_SETOWN, -os.getpgrp())
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    try:
        if os.read(fd, 1) == b"":  # the kernel died before the owner was set
            os.killpg(0, signal.SIGKILL)
    except BlockingIOError:
        pass  # the kernel is alive: nothing to read, and nobody ever writes


def _apply_process_limits(request: LaunchRequest) -> None:
    """The kernel's umask and soft resource limits *at this launch*, as a process it
    started now would inherit them (the helper got them when it was started)."""
    if request.umask is not None:
        os.umask(request.umask)
    for name, soft in request.rlimits.items():
        limit = getattr(resource, name, None)
        if limit is None:
            continue
        try:
            current_soft, hard = resource.getrlimit(limit)
            if soft != current_soft:
                resource.setrlimit(limit, (soft, hard))
        except (OSError, ValueError):  # a limit above this process's hard limit stays as it is
            pass


def _install_notebook_builtins() -> None:
    """IPython's builtins, as a program outside IPython would want them.

    They are never captured from the notebook (IPython's own objects hold its history
    database); notebook code that calls them still runs: ``exit``/``quit`` are Python's
    own (they end the rank like ``sys.exit``), ``display`` prints the text form of its
    arguments (rank 0's output is shown in the cell), and ``get_ipython()`` returns
    ``None``, as IPython's ``get_ipython`` does outside IPython.
    """
    builtins.display = _display  # type: ignore[attr-defined]
    builtins.get_ipython = _get_ipython  # type: ignore[attr-defined]


def _display(*objs: Any, **_options: Any) -> None:
    from IPython.lib.pretty import pretty  # the text form IPython itself shows

    for obj in objs:
        print(pretty(obj), flush=True)


def _get_ipython() -> None:
    return None


def _apply_environment(request: LaunchRequest, rank: int, port: int) -> None:
    env = dict(request.env)
    world_size = request.world_size
    env.update(
        # What torchrun's agent gives each worker (TORCHELASTIC_RUN_ID also makes
        # torch.distributed.is_torchelastic_launched() true, as code may check).
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        NODE_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RUN_ID=request.launch_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        # Where torch.distributed.elastic's @record writes a failure (read by nobody
        # here: the rank's own traceback is the error); removed with the launch's files.
        TORCHELASTIC_ERROR_FILE=elastic_error_path(request.work_dir, rank),
        # What DeepSpeed's own launcher adds: its CPU accelerator counts the local
        # devices by LOCAL_SIZE (else by NUMA nodes, 1 on most machines).
        LOCAL_SIZE=str(world_size),
        CROSS_RANK="0",
        CROSS_SIZE="1",
    )
    if request.rank_env:  # where the ranks were placed across machines (a Ray launch)
        env.update(request.rank_env.get(rank, {}))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request.cwd)
    sys.path[:] = request.sys_path
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        # The OpenMP runtime read OMP_NUM_THREADS when the helper imported torch;
        # apply this launch's value explicitly, within what a machine can run (a pool of
        # a million threads ends the process with a segmentation fault).
        wanted = int(threads)
        bound = _MAX_THREADS_PER_CPU * (os.cpu_count() or 1)
        if wanted > bound:
            print(
                f"[air_magic] OMP_NUM_THREADS={wanted} is more than this machine can run; "
                f"using {bound} threads ({_MAX_THREADS_PER_CPU} per CPU).",
                file=sys.stderr,
                flush=True,
            )
            wanted = bound
        torch.set_num_threads(wanted)


def _private_rendezvous(work_dir: str, port: int) -> None:
    """``init_process_group()`` (``env://``) meets in a ``FileStore`` in the launch's private
    folder (0700) instead of a TCP store: another local user can neither read the ranks'
    addresses nor write keys they read back.  What the code sees is unchanged (the same
    environment; torch's own handler is used when MASTER_ADDR/MASTER_PORT were changed,
    e.g. to a port of the user's choosing)."""
    try:
        import importlib

        import torch.distributed as dist

        # the module, not the function torch.distributed exports under the same name
        rendezvous = importlib.import_module("torch.distributed.rendezvous")
    except ImportError:
        return
    handlers = getattr(rendezvous, "_rendezvous_handlers", None)
    if not dist.is_available() or not isinstance(handlers, dict) or "env" not in handlers:
        return
    torch_handler = handlers["env"]
    path = rendezvous_path(work_dir)

    def env_rendezvous(url: str, timeout: Any = None, **kwargs: Any) -> Any:
        if os.environ.get("MASTER_ADDR") != "127.0.0.1" or os.environ.get("MASTER_PORT") != str(port):
            yield from (torch_handler(url, timeout, **kwargs) if timeout is not None else torch_handler(url, **kwargs))
            return
        query = dict(part.split("=", 1) for part in url.partition("?")[2].split("&") if "=" in part)
        rank = int(query.get("rank", os.environ["RANK"]))
        world_size = int(query.get("world_size", os.environ["WORLD_SIZE"]))
        # Say this rank joins; a rank that ended without joining means the group can never form.
        os.close(os.open(joined_path(work_dir, rank), os.O_WRONLY | os.O_CREAT, 0o600))
        gone = sorted(int(name[len(LEFT_PREFIX) :]) for name in os.listdir(work_dir) if name.startswith(LEFT_PREFIX))
        if gone:
            raise RuntimeError(
                f"init_process_group() cannot complete: rank {', '.join(map(str, gone))} of {world_size} "
                "ended without joining the process group (every rank must call init_process_group())"
            )
        store = dist.FileStore(path, -1)
        if timeout is not None:
            store.set_timeout(timeout)
        # The prefix torch puts on its agent's store (restart count 0): keys look the same.
        yield (
            dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store),
            rank,
            world_size,
        )
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    handlers["env"] = env_rendezvous


def _install_sources(sources: dict[str, tuple[str, str]]) -> None:
    for filename, (_, source) in sources.items():
        lines = source.splitlines(True)
        linecache.cache[filename] = (len(source), None, lines, filename)


def _run(request: LaunchRequest, rank: int) -> int:
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    # What a script's argparse/hydra/click parser reads: the cell or function name, then
    # the arguments given after `--` on the %%distributed line (none by default).
    sys.argv[:] = list(request.argv or ["air_magic"])
    path = result_path(request.work_dir, rank)
    shm_dir = request.shm_dir
    sources = request.sources
    _install_sources(sources)
    code = 0
    try:
        _let_signals_in()
        _rank_tracking.install(request.work_dir, rank, os.environ.get("AIR_MAGIC_MLFLOW_RUN_ID"))
        with open(request.payload_path, "rb") as handle:
            payload = cloudpickle.load(handle)
        if payload["kind"] == "pool":  # a rank that stays: the kernel's cells until it closes the pool
            from air_magic.rank.pool import serve as _pool

            _pool.serve(main, rank, payload, _error_record, shm_dir, request.work_dir)
            value = None
        elif payload["kind"] == "function":
            func = _load(payload["func"], "the function")
            args = [_load(blob, f"argument {i}") for i, blob in enumerate(payload["args"])]
            kwargs = {key: _load(blob, f"keyword argument {key}") for key, blob in payload["kwargs"].items()}
            # Functions and classes defined in the notebook also live in __main__, so
            # pickle-by-reference (torch.save of a model, multiprocessing) finds them.
            for key, value in getattr(func, "__globals__", {}).items():
                if not key.startswith("__"):
                    main.__dict__.setdefault(key, value)
            value = func(*args, **kwargs)
        else:  # a cell, or a script (its __file__ among the names)
            for name, blob in payload["names"].items():
                main.__dict__[name] = _load(blob, f"the captured name {name!r}")
            exec(payload["code"], main.__dict__)
            value = main.__dict__.pop(RESULT_NAME, None)
        _hold_stop_signals()
        record: Record = ValueRecord(value)
    except SystemExit as exc:
        _hold_stop_signals()
        if exc.code in (None, 0):
            record = ValueRecord(None)
        else:
            record = _error_record(exc, sources)
            code = 1
    except BaseException as exc:  # the user's code: SystemExit, KeyboardInterrupt included, is its outcome
        if os.environ.get(POSTMORTEM_ENV) == "1" and _debugger.wants_post_mortem(exc):
            _debugger.post_mortem(exc)  # the kernel's %pdb is on: pdb in this rank's frames first
        _hold_stop_signals()
        record = _error_record(exc, sources)
        # An interrupt (q at its breakpoint, a Ctrl-C) is no failure: 130, as a shell says it.
        code = INTERRUPTED_EXIT if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        _flush_exit_hooks()
    # The record first: it travels on air_magic's own channel (a file of the launch's folder),
    # whatever the user's code did to its streams (closed fds 1 and 2, replaced sys.stderr).
    try:
        prefix = _results.rank_prefix(rank)
        _results.write_record(path, record, shm_dir if code == 0 else None, prefix, fallback_dir=request.work_dir)
    except BaseException as exc:  # the return value cannot be pickled (any error a __reduce__ raises)
        reason = f"{type(exc).__name__}: {printable(exc)}"
        value_type = type(record[0]).__module__ + "." + type(record[0]).__qualname__
        _results.write_record(path, UnpicklableRecord(value_type, reason), None, _results.rank_prefix(rank))
        code = 0
    if isinstance(record, ErrorRecord):
        # A KeyboardInterrupt in a rank is air_magic's stop (SIGINT: a cancel, a timeout, the
        # panel's Stop, another rank's failure): the rank did not fail, it was stopped.
        stopped = record.type_name == "KeyboardInterrupt"
        _to_log((STOP_MARK if stopped else TRACEBACK_MARK) + record.traceback)
    return code


def _to_log(text: str) -> None:
    """``text`` last in the rank's log, after anything the exit hooks printed, on fd 2 itself:
    the user's code may have replaced ``sys.stderr``, or closed the descriptors (then the log
    has no traceback; the record has it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # a stream the user's code closed or broke
            pass
    try:
        data = text.encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(2, data) :]
    except OSError:
        pass


def _load(blob: bytes, what: str) -> Any:
    """One value sent from the kernel; an error its unpickling raises (a ``__setstate__``
    of the user's) says which value it was loading."""
    try:
        return cloudpickle.loads(blob)
    except Exception as exc:
        exc.add_note(f"[air_magic] while loading {what}, sent from the kernel, on this rank")
        raise


def _hold_stop_signals() -> None:
    """The user's code has ended: a stop (another rank failed, an interrupt) that arrives
    now must not cut the report of how it ended, or a rank that finished or failed on its
    own would read as stopped.  SIGINT and SIGTERM wait (for ever: the rank leaves with
    os._exit); a rank whose exit hooks hang is still killed by the stop's SIGKILL."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _flush_exit_hooks() -> None:
    # Hooks the user's code registered (MLflow's end_run, loggers) run as at a normal exit.
    try:
        atexit._run_exitfuncs()
    except BaseException:  # a user's exit hook: shown in the rank's log, the exit goes on
        traceback.print_exc()


def _error_record(exc: BaseException, sources: dict[str, tuple[str, str]]) -> ErrorRecord:
    failed_at = time.monotonic()  # one clock for every process: tells which rank failed first
    text = format_user_traceback(exc, sources)
    try:
        blob: bytes | None = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)  # it must come back, or the kernel gets the text only
    except BaseException:  # whatever pickling the user's exception raises
        blob = None
    exc_type = type(exc)
    name = (
        exc_type.__qualname__
        if exc_type.__module__ in ("builtins", "__main__")
        else (f"{exc_type.__module__}.{exc_type.__qualname__}")
    )
    return ErrorRecord(blob, name, printable(exc), text, failed_at)


def format_user_traceback(exc: BaseException, sources: dict[str, tuple[str, str]]) -> str:
    """The exception's traceback without air_magic's own frames, with cell names."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE_ROOT):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    if printable(exc).startswith("<unprintable "):  # Python's own words for it, made to say what it is
        text = text.replace("<exception str() failed>", printable(exc))
    for filename, (display, _) in sources.items():
        text = text.replace(f'File "{filename}"', display)
    return text
