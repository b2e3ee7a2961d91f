"""Every workaround of the panel that touches private ipykernel attributes, in one place.

The observer calls these with the shell or a widget it already has; each one looks the
private attributes up with ``getattr`` and does nothing when they are not there, so a
kernel that is not an ipykernel (or a newer one that changed them) only loses the
improvement, never the panel::

    observer thread ends     --> release_iopub(shell)        its iopub socket closed now
    Stop / Where? built      --> clicks_where_sent(button)   clicks run on their subshell
    the lab extension's comm --> messages_where_sent(comm)   its messages too
    Stop's state each tick   --> subshells_active(shell)     can a click arrive mid-cell?
    a blocking panel shown   --> keep_busy(shell)            the kernel reads busy all along

Written against ipykernel 7.4 (installed: 7.4.0), ipywidgets 8.1 and comm 0.2.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

__all__ = ["clicks_where_sent", "keep_busy", "messages_where_sent", "release_iopub", "subshells_active"]


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
    messages_where_sent(getattr(button, "comm", None))


def messages_where_sent(comm: Any) -> None:
    """Handle this comm's messages on the subshell the front end sent them on (as
    :func:`clicks_where_sent`): the lab extension's Stop during a blocking launch."""
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


def _nothing() -> None:
    pass


def keep_busy(shell: Any) -> Callable[[], None]:
    """While the running cell lasts, say "busy" again after each "idle" of another request.

    JupyterLab shows the kernel's state from every iopub ``status`` message, whichever
    request it answers (only ``untracked_message_types`` are left out).  A widget panel in
    a cell that blocks brings requests that ipykernel (7.4) handles beside the cell: the
    front end's ``create_subshell_request`` for the widgets' comms (control channel), and
    clicks on a subshell; each ends with an "idle" status, and the status bar read Idle
    while the cell still ran.  ``Kernel._publish_status`` (called for every status) is
    wrapped on the kernel instance: after such an "idle", a "busy" with the cell's parent.

    Called on the cell's thread (the parent of the shell channel is the cell's request);
    returns the undo, to call before the cell ends (its own "idle" also undoes it).
    """
    kernel: Any = getattr(shell, "kernel", None)
    publish = getattr(kernel, "_publish_status", None)
    get_parent = getattr(kernel, "get_parent", None)
    if publish is None or get_parent is None or "_publish_status" in vars(kernel):
        return _nothing  # not an ipykernel 7, or another cell's wrapper is still there
    try:
        cell = get_parent("shell")
        cell_id = cell["header"]["msg_id"]
    except Exception:  # a private API: no parent to keep busy for
        return _nothing
    lock = threading.Lock()
    active = [True]

    def publish_status(status: str, channel: str, parent: Any = None) -> None:
        with lock:
            publish(status, channel, parent)
            if status != "idle" or not active[0]:
                return
            try:
                which = (parent or get_parent(channel))["header"]["msg_id"]
            except Exception:  # no header to tell whose idle it is: leave it
                return
            if which == cell_id:  # the cell itself has ended
                remove()
            else:
                publish("busy", "shell", cell)

    def remove() -> None:
        active[0] = False
        if vars(kernel).get("_publish_status") is publish_status:
            del kernel._publish_status

    def undo() -> None:
        with lock:
            remove()

    try:
        kernel._publish_status = publish_status
    except Exception:  # a kernel class that refuses new attributes
        return _nothing
    return undo
