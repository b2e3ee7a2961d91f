"""What a rank does, in the child forked from the helper process.

``child_main`` never returns: it becomes a process-group leader in its own session
(so stopping a rank takes its DataLoader workers along), sends its output to its
log file, takes the kernel's environment, working directory and ``sys.path`` *as
they were at this launch*, runs the user's function or cell, writes its result
record, and leaves with ``os._exit``.

It dies with the kernel even when nobody tells it to: it holds the read end of a
pipe whose only write end is in the kernel, and a thread waits for EOF on it
(Linux also sends SIGKILL when the helper it was forked from dies).
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import linecache
import os
import signal
import sys
import threading
import traceback
import types
from typing import Any

import cloudpickle

from . import _rank_tracking, _results

#: Name the cell's last expression is stored under in the rank's namespace.
RESULT_NAME = "__air_magic_result__"
#: Line written to a rank's log before the traceback of its failure: the cell shows
#: that traceback as the error, so the live copy of the log stops here.
TRACEBACK_MARK = "[air_magic] this rank failed; its traceback follows\n"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_PR_SET_PDEATHSIG = 1


def child_main(request: dict[str, Any], rank: int, port: int, alive_fd: int, close_fds: list[int]) -> None:
    code = 70
    try:
        os.setsid()
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        for signum in (signal.SIGINT,):
            signal.signal(signum, signal.default_int_handler)
        for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_DFL)
        _die_with_parent()
        atexit._clear()  # the helper's exit hooks are not the rank's
        _register_process_exit_hooks()
        _redirect_output(request["log_paths"][rank])
        _watch_kernel(alive_fd)
        _apply_environment(request, rank, port)
        code = _run(request, rank)
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


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
    atexit.register(multiprocessing.util._exit_function)
    registry = getattr(weakref.finalize, "_registry", {})
    for info in list(registry.values()):
        info.atexit = False  # the helper's objects (torch's op libraries): not this rank's to finalize
    if getattr(weakref.finalize, "_registered_with_atexit", False):
        atexit.register(weakref.finalize._exitfunc)
    # The legacy global NumPy generator is not reseeded at fork as `random` is: with
    # numpy.random preloaded, every rank would draw the same numbers.
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # Line-buffered text streams on the new descriptors (PYTHONUNBUFFERED semantics
    # for what the user prints; tqdm flushes its own carriage-return updates).
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stdin = open(0, "r", closefd=False)
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin


def _watch_kernel(alive_fd: int) -> None:
    def watch() -> None:
        try:
            while os.read(alive_fd, 1):
                pass
        except OSError:
            pass
        # EOF: the kernel died (even by SIGKILL). Take the whole process group along.
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="air_magic-kernel-watch", daemon=True).start()


def _apply_environment(request: dict[str, Any], rank: int, port: int) -> None:
    env = dict(request["env"])
    world_size = request["world_size"]
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        ROLE_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        # What DeepSpeed's own launcher adds: its CPU accelerator counts the local
        # devices by LOCAL_SIZE (else by NUMA nodes, 1 on most machines).
        LOCAL_SIZE=str(world_size),
        CROSS_RANK="0",
        CROSS_SIZE="1",
    )
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    sys.path[:] = request["sys_path"]
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        # The OpenMP runtime read OMP_NUM_THREADS when the helper imported torch;
        # apply this launch's value explicitly.
        torch.set_num_threads(int(threads))


def _install_sources(sources: dict[str, tuple[str, str]]) -> None:
    for filename, (_, source) in sources.items():
        lines = source.splitlines(True)
        linecache.cache[filename] = (len(source), None, lines, filename)


def _run(request: dict[str, Any], rank: int) -> int:
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    result_path = _results.result_path(request["work_dir"], rank)
    shm_dir = request.get("shm_dir")
    sources: dict[str, tuple[str, str]] = request.get("sources", {})
    _install_sources(sources)
    code = 0
    try:
        _rank_tracking.install(request["work_dir"], rank, os.environ.get("AIR_MAGIC_MLFLOW_RUN_ID"))
        with open(request["payload_path"], "rb") as handle:
            payload = cloudpickle.load(handle)
        if payload["kind"] == "function":
            func = cloudpickle.loads(payload["func"])
            args = [cloudpickle.loads(blob) for blob in payload["args"]]
            kwargs = {key: cloudpickle.loads(blob) for key, blob in payload["kwargs"].items()}
            # Functions and classes defined in the notebook also live in __main__, so
            # pickle-by-reference (torch.save of a model, multiprocessing) finds them.
            for key, value in getattr(func, "__globals__", {}).items():
                if not key.startswith("__"):
                    main.__dict__.setdefault(key, value)
            value = func(*args, **kwargs)
        else:
            for name, blob in payload["names"].items():
                main.__dict__[name] = cloudpickle.loads(blob)
            exec(payload["code"], main.__dict__)
            value = main.__dict__.pop(RESULT_NAME, None)
        record: tuple[Any, ...] = ("ok", value)
    except SystemExit as exc:
        if exc.code in (None, 0):
            record = ("ok", None)
        else:
            record = _error_record(exc, sources)
            code = 1
    except BaseException as exc:
        record = _error_record(exc, sources)
        code = 1
    finally:
        _flush_exit_hooks()
    if code:
        # Last in the log, after anything the exit hooks printed.
        sys.stdout.flush()
        sys.stderr.write(TRACEBACK_MARK + record[4])
        sys.stderr.flush()
    try:
        _results.write_record(result_path, record, shm_dir if code == 0 else None, f"r{rank}")
    except BaseException as exc:  # the return value cannot be pickled
        reason = f"{type(exc).__name__}: {exc}"
        value_type = type(record[1]).__module__ + "." + type(record[1]).__qualname__
        _results.write_record(
            result_path,
            ("unpicklable", value_type, reason),
            None,
            f"r{rank}",
        )
        code = 0
    return code


def _flush_exit_hooks() -> None:
    # Hooks the user's code registered (MLflow's end_run, loggers) run as at a normal exit.
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()


def _error_record(exc: BaseException, sources: dict[str, tuple[str, str]]) -> tuple[Any, ...]:
    text = format_user_traceback(exc, sources)
    try:
        blob: bytes | None = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)  # it must come back, or the kernel gets the text only
    except BaseException:
        blob = None
    exc_type = type(exc)
    name = exc_type.__qualname__ if exc_type.__module__ in ("builtins", "__main__") else (
        f"{exc_type.__module__}.{exc_type.__qualname__}"
    )
    return ("error", blob, name, str(exc), text)


def format_user_traceback(exc: BaseException, sources: dict[str, tuple[str, str]]) -> str:
    """The exception's traceback without air_magic's own frames, with cell names."""
    tb = exc.__traceback__
    while tb is not None and os.path.dirname(os.path.abspath(tb.tb_frame.f_code.co_filename)) == _PACKAGE_DIR:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    for filename, (display, _) in sources.items():
        text = text.replace(f'File "{filename}"', display)
    return text
