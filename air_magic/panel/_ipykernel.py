"""Every workaround of the panel that touches private ipykernel attributes, in one place.

The observer calls these with the shell or a widget it already has; each one looks the
private attributes up with ``getattr`` and does nothing when they are not there, so a
kernel that is not an ipykernel (or a newer one that changed them) only loses the
improvement, never the panel::

    observer thread ends     --> release_iopub(shell)        its iopub socket closed now
    Stop / Where? built      --> clicks_where_sent(button)   clicks run on their subshell
    Stop's state each tick   --> subshells_active(shell)     can a click arrive mid-cell?

Written against ipykernel 7.4 (installed: 7.4.0), ipywidgets 8.1 and comm 0.2.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["clicks_where_sent", "release_iopub", "subshells_active"]


def subshells_active(shell: Any) -> bool:
    """Has a front end opened a subshell in this kernel (so its comm messages run beside a cell)?

    ipykernel (7.4): ``kernel.shell_channel_thread.manager.list_subshell()``, the
    kernel's own list of subshells; not a public API.
    """
    kernel = getattr(shell, "kernel", None)
    channel = getattr(kernel, "shell_channel_thread", None)
    manager = getattr(channel, "manager", None)
    try:
        return bool(manager.list_subshell()) if manager is not None else False
    except Exception:  # a private API: whatever it raises means "no subshell to rely on"
        return False


def _keep_subshell(data: Any, default: Any) -> Any:
    return default


def clicks_where_sent(button: Any) -> None:
    """Handle this button's clicks on the subshell the front end sent them on.

    ipykernel (7.4) routes a comm message to the subshell the kernel last *published* on
    for that comm (so a reply reaches the code awaiting it: ``Comm._reply_subshell_for``,
    read by ``Kernel.dispatch_shell``); the panel publishes from the cell that started the
    launch, i.e. the main shell, which a blocking launch keeps busy.  A click needs no such
    reply, so it may run where JupyterLab sent it.
    """
    comm = getattr(button, "comm", None)
    if comm is not None and hasattr(comm, "_reply_subshell_for"):
        comm._reply_subshell_for = _keep_subshell


def release_iopub(shell: Any) -> None:
    """Close the calling thread's iopub socket as its thread ends.

    ipykernel (7.4) gives each thread that writes to iopub a socket of its own
    (``IOPubThread._local.event_pipe``, listed in ``_event_pipes`` under
    ``_event_pipe_gc_lock``) and closes those of ended threads every 10 s; a launch's
    thread ends now, so its socket is closed now, once the IOPub thread has sent what was
    queued (``_events``).
    """
    pub = getattr(getattr(shell, "kernel", None), "iopub_thread", None)
    local = getattr(pub, "_local", None)
    pipe = getattr(local, "event_pipe", None)
    pipes = getattr(pub, "_event_pipes", None)
    lock = getattr(pub, "_event_pipe_gc_lock", None)
    if local is None or pipe is None or pipes is None or lock is None:
        return
    deadline = time.monotonic() + 1.0
    while getattr(pub, "_events", None) and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        with lock:
            pipes.pop(threading.current_thread(), None)
        del local.event_pipe
        pipe.close()
    except Exception:  # private state that ipykernel's own collector may change meanwhile (zmq errors too)
        pass
