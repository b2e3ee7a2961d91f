"""Wires the optional pieces (MLflow tracking, the live panel) into the launcher.

The launcher knows only :class:`~air_magic.launcher.LaunchObserver`; the fronts
(``@distributed``, ``%%distributed``, ``%load_ext``) get their launcher here, and the
first call registers the plug-ins' factories with ``Launcher.add_observer``::

    front --get_launcher()--> register (once): tracking, panel, "tracking is off" line
                              (observer factories), the panel as a launch's notebook view
                              --> launcher.get_launcher()

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
        _registered = True


def get_launcher() -> "Launcher":
    """The kernel's launcher, with the plug-ins registered."""
    register()
    from . import launcher

    return launcher.get_launcher()
