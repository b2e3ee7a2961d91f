"""What a program can observe about the process it runs in.

Run as a script by ``torchrun`` (it writes ``probe-<RANK>.json`` into the folder given as
its argument), and as the launched function of ``@distributed`` by
``test_process_torchrun_parity.py``.  Nothing is imported at module level but the
standard library, so that both see the interpreter as a fresh worker would.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
from typing import Any


def _disposition(handler: Any) -> str:
    if handler == signal.SIG_DFL:
        return "SIG_DFL"
    if handler == signal.SIG_IGN:
        return "SIG_IGN"
    if handler is signal.default_int_handler:
        return "default_int_handler"
    return "a Python handler" if handler is not None else "None"


def probe() -> dict[str, Any]:
    torch_preloaded = "torch" in sys.modules
    import gc
    import logging
    import multiprocessing
    import random
    import warnings

    import numpy
    import torch

    main = sys.modules["__main__"]
    signals = {}
    for signum in sorted(signal.valid_signals()):
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = str(signum)
        try:
            signals[name] = _disposition(signal.getsignal(signum))
        except (OSError, ValueError):
            pass
    umask = os.umask(0)
    os.umask(umask)
    return {
        "env_names": sorted(os.environ),
        "env": dict(os.environ),
        "argv": list(sys.argv),
        "main_name": main.__name__,
        "flags": {
            k: getattr(sys.flags, k)
            for k in dir(sys.flags)
            if not k.startswith(("_", "n_")) and not callable(getattr(sys.flags, k))
        },
        "signals": signals,
        "blocked_signals": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "umask": umask,
        "stdin": os.readlink("/proc/self/fd/0"),
        "rlimits": {
            n: list(resource.getrlimit(getattr(resource, n))) for n in dir(resource) if n.startswith("RLIMIT_")
        },
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "own_session": os.getsid(0) == os.getpid(),
        "stdout": [
            sys.stdout.encoding,
            sys.stdout.errors,
            sys.stdout.line_buffering,
            sys.stdout.write_through,
            sys.stdout.isatty(),
        ],
        "stderr": [sys.stderr.encoding, sys.stderr.errors, sys.stderr.line_buffering, sys.stderr.write_through],
        "recursion_limit": sys.getrecursionlimit(),
        "switch_interval": sys.getswitchinterval(),
        "excepthook": sys.excepthook is sys.__excepthook__,
        "displayhook": sys.displayhook is sys.__displayhook__,
        "gc": [gc.isenabled(), list(gc.get_threshold())],
        "faulthandler": __import__("faulthandler").is_enabled(),
        "warning_filters": len(warnings.filters),
        "multiprocessing": [multiprocessing.get_start_method(allow_none=True), multiprocessing.current_process().name],
        "root_logger": [len(logging.getLogger().handlers), logging.getLogger().level],
        "torch_default_dtype": str(torch.get_default_dtype()),
        "torch_grad": torch.is_grad_enabled(),
        "exit_builtin": type(getattr(__import__("builtins"), "exit", None)).__name__,
        "torchelastic_launched": torch.distributed.is_torchelastic_launched(),
        "torch_preloaded": torch_preloaded,
        "str_hash": hash("air_magic"),
        # Random state: a draw from each global generator, and torch's seed.
        "torch_seed": torch.initial_seed(),
        "torch_draw": torch.rand(1).item(),
        "numpy_draw": float(numpy.random.random()),
        "random_draw": random.random(),
    }


if __name__ == "__main__":
    with open(os.path.join(sys.argv[1], f"probe-{os.environ['RANK']}.json"), "w") as handle:
        json.dump(probe(), handle)
