"""Wires the optional pieces (MLflow tracking, the live panel) into the launcher.

The launcher knows only :class:`~air_magic.launcher.LaunchObserver`; the fronts
(``@distributed``, ``%%distributed``, ``%load_ext``) get their launcher here, and the
first call registers the plug-ins' factories with ``Launcher.add_observer``::

    front --get_launcher()--> register (once): tracking, panel, "tracking is off" line,
                              the lab extension's list (observer factories), the panel as
                              a launch's notebook view --> launcher.get_launcher()
    %load_ext --connect_lab(shell)--> the lab extension's comm (panel._lab)

Nothing heavy is imported here: each factory imports its module at a launch's start.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .launcher import Launch, Launcher, LaunchObserver

_registered = False
_lock = threading.Lock()


def tracking(launch: "Launch") -> "LaunchObserver | None":
    """MLflow tracking (imported only when a launch has tracking on)."""
    if not launch.spec.tracking:
        return None
    from .tracking import tracking_observer

    return tracking_observer(launch)


def panel(launch: "Launch") -> "LaunchObserver | None":
    """The live panel (ipywidgets imported only where widgets are shown)."""
    from .panel import panel_observer

    return panel_observer(launch)


def panel_mimebundle(launch: "Launch") -> dict[str, Any]:
    """A launch shown in a notebook: its live panel, a summary once it has ended."""
    from .panel import launch_mimebundle

    return launch_mimebundle(launch)


def tracking_off(launch: "Launch") -> None:
    """Says so in the cell when a launch has tracking off (after the other plug-ins started)."""
    if not launch.spec.tracking:
        from .tracking import tracking_off_notice

        tracking_off_notice(launch)
    return None


def lab(launch: "Launch") -> "LaunchObserver | None":
    """The JupyterLab extension's list of launches (only in a kernel: panel._lab)."""
    from .panel._lab import lab_observer

    return lab_observer(launch)


def connect_lab(shell: Any) -> None:
    """``%load_ext``: the comm the JupyterLab extension talks to, opened now (a first
    launch would open it too)."""
    from .panel._lab import connect

    connect(shell)


def register() -> None:
    """Register the plug-ins with the launcher (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        from .launcher import Launch, Launcher

        Launch.render = panel_mimebundle
        Launcher.add_observer(tracking)
        Launcher.add_observer(panel)
        Launcher.add_observer(tracking_off)
        Launcher.add_observer(lab)
        _registered = True


def get_launcher() -> "Launcher":
    """The kernel's launcher, with the plug-ins registered."""
    register()
    from . import launcher

    return launcher.get_launcher()
