"""Wires the optional pieces (MLflow tracking, the live panel) into the launcher.

The launcher knows only :class:`~air_magic.kernel.launcher.LaunchObserver`; the fronts
(``@distributed``, ``%%distributed``, ``%load_ext``) get their launcher here, and the
first call registers the plug-ins' factories with ``Launcher.add_observer``::

    front --get_launcher()--> register (once): tracking, panel, "tracking is off" line,
                              the lab extension's list (observer factories), the panel as
                              a launch's notebook view, a pool call's panel
                              --> launcher.get_launcher()
    import air_magic (in a kernel) --lab_target()--> the comm target "air_magic" registered;
                              a front end's comm_open --lab_opened--> panel._lab.opened

Nothing heavy is imported here: each factory imports its module at a launch's start, and
the lab extension's module when a front end opens its comm.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from air_magic.kernel.launcher import Launch, Launcher, LaunchObserver
    from air_magic.kernel.pool.view import PoolCallView

#: The comm target the JupyterLab extension (labextension/src/channel.ts) opens its comm to.
LAB_TARGET = "air_magic"

_registered = False
_lock = threading.Lock()


def flush_tracking(timeout: float | None) -> bool:
    """Wait (bounded, said after a second) for the ended launches' points to be stored;
    nothing to do where tracking was never used (nothing is imported for it)."""
    writer = sys.modules.get("air_magic.tracking.writer")
    if writer is None:
        return True
    return bool(writer.flush(timeout))


def warm_front_end() -> None:
    """What a kernel's first launch would pay, done from ``%load_ext`` in a thread while
    the helper imports torch: the panel's modules, the machine's GPUs (NVML), and the
    linter whose findings the panel shows (its first run imports libcst: 0.2 s, which
    the end of a short first launch waited for).  Off with ``AIR_MAGIC_WARM=0``."""
    from air_magic.errors import ConfigurationError
    from air_magic.settings import settings

    try:
        if not settings.warm:
            return
    except ConfigurationError:  # the first launch says what is wrong with AIR_MAGIC_WARM
        return
    threading.Thread(target=_warm, name="air_magic-warm", daemon=True).start()


def _warm() -> None:
    try:
        from air_magic.accelerators import detect_hardware

        detect_hardware()
        from air_magic.panel import _lint

        _lint.warm()
    except Exception:  # a warm-up only saves time: the first launch does it, and says what fails
        pass


def tracking(launch: "Launch") -> "LaunchObserver | None":
    """MLflow tracking (imported only when a launch has tracking on).  A launch first waits
    for the previous launches' points to be stored (bounded)."""
    writer = sys.modules.get("air_magic.tracking.writer")
    if writer is not None:
        writer.flush(writer.FLUSH_BEFORE_LAUNCH)
    if not launch.spec.tracking:
        return None
    from air_magic.panel import shows_panel
    from air_magic.tracking import tracking_observer

    # Decided before the run can be made (the panel starts after tracking): where a panel
    # is shown, it says the run, and tracking does not say it again.
    launch.run_shown = shows_panel(launch)
    return tracking_observer(launch)


def panel(launch: "Launch") -> "LaunchObserver | None":
    """The live panel (ipywidgets imported only where widgets are shown)."""
    from air_magic.panel import panel_observer

    return panel_observer(launch)


def panel_mimebundle(launch: "Launch") -> dict[str, Any]:
    """A launch shown in a notebook: its live panel, a summary once it has ended."""
    from air_magic.panel import launch_mimebundle

    return launch_mimebundle(launch)


def pool_panel(view: "PoolCallView") -> Any:
    """The panel of a pool's call (shown only if the call runs for more than a second)."""
    from air_magic.panel import pool_call_panel

    return pool_call_panel(view)


def lab_call(view: "PoolCallView") -> Any:
    """The JupyterLab extension's pool item: the cell a pool runs (panel._lab)."""
    from air_magic.panel._lab import lab_call_watcher

    return lab_call_watcher(view)


def tracking_off(launch: "Launch") -> None:
    """Says so in the cell when a launch has tracking off (after the other plug-ins started)."""
    if not launch.spec.tracking:
        from air_magic.tracking import tracking_off_notice

        tracking_off_notice(launch)
    return None


def lab(launch: "Launch") -> "LaunchObserver | None":
    """The JupyterLab extension's list of launches (only in a kernel: panel._lab; the
    comm target was registered when air_magic was imported)."""
    from air_magic.panel._lab import lab_observer

    return lab_observer(launch)


def lab_target(shell: Any = None) -> bool:
    """Register the comm target the JupyterLab extension opens its comm to, in a kernel
    only; False elsewhere (terminal IPython, plain Python, a rank process).

    The kernel never opens a comm itself: a front end without the extension would have no
    target for it (JupyterLab logs "Exception opening new comm").  The extension opens its
    own once it sees air_magic in the kernel, and finds this target whatever imported
    air_magic (a cell, ``%load_ext``, a library): ``import air_magic`` calls this, as does
    ``%load_ext`` (registering again is harmless).  Cheap: IPython is
    looked up only if something imported it already, and ``air_magic.panel`` is imported
    when a front end opens its comm.
    """
    if shell is None:
        get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
        shell = get_ipython() if get_ipython is not None else None
    if getattr(shell, "kernel", None) is None:
        return False
    try:
        import comm

        comm.get_comm_manager().register_target(LAB_TARGET, lab_opened)
    except Exception:  # a kernel without comms: the extension just finds nothing there
        return False
    return True


def lab_opened(comm: Any, msg: dict[str, Any]) -> None:
    """A front end opened its comm to the target: the lab extension's channel adopts it."""
    from air_magic.panel._lab import opened

    opened(comm, msg)


def register() -> None:
    """Register the plug-ins with the launcher (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        from air_magic.kernel.launcher import Launch, Launcher
        from air_magic.kernel.machine.claims import claim_observer
        from air_magic.kernel.pool import wait as _pool

        Launch.render = panel_mimebundle
        _pool.CALL_WATCHERS.append(pool_panel)
        _pool.CALL_WATCHERS.append(lab_call)
        Launcher.add_observer(claim_observer)  # first: a launch waiting for GPUs has no run, no panel yet
        Launcher.add_observer(tracking)
        Launcher.add_observer(panel)
        Launcher.add_observer(tracking_off)
        Launcher.add_observer(lab)
        _registered = True


def get_launcher() -> "Launcher":
    """The kernel's launcher, with the plug-ins registered."""
    register()
    from air_magic.kernel import launcher

    found = launcher.get_launcher()
    _end_pools_at_exit()
    return found


_exit_hook = False


def _end_pools_at_exit() -> None:
    """Once: at the kernel's end (a shutdown, a restart, the end of a script) the pools are
    closed as ``pool.close()`` closes them, before the launcher stops what is left, and their
    runs are stored: a notebook that ends with its pool open leaves a FINISHED run with every
    point, not a killed one.  (Registered after the launcher's own exit hook: it runs before.)"""
    global _exit_hook
    with _lock:
        if _exit_hook:
            return
        _exit_hook = True
    import atexit

    atexit.register(_close_pools_and_store)


def _close_pools_and_store() -> None:
    pool = sys.modules.get("air_magic.kernel.pool.engine")
    if pool is not None and pool.open_pools():
        pool.close_all()
        writer = sys.modules.get("air_magic.tracking.writer")
        if writer is not None:  # (imported only where a launch tracked)
            flush_tracking(writer.FLUSH_AT_EXIT)
