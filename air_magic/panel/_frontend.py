"""Which panel a launch gets: widgets, text lines, or none, decided from the shell and the environment.

Read once per launch by ``panel_observer``::

    settings.panel_mode (AIR_MAGIC_PANEL), the launch's own panel= (else settings.panel,
    which %config DistributedMagics.panel writes), the IPython shell (kernel or not),
    front-end markers (JPY_SESSION_NAME, VSCODE_PID, __vsc_ipynb_file__, google.colab)
        --> panel_mode(): "widget" | "text" | None

The rules are in the package docstring (``air_magic.panel``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from air_magic.settings import settings


def _shell() -> Any:
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        return ipython.get_ipython()
    except (AttributeError, ImportError):  # IPython still being imported: no shell yet
        return None


def widget_front_end(shell: Any) -> bool:
    """True where a front end that renders ipywidgets is recognised (see the module docstring)."""
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    if os.environ.get("JPY_SESSION_NAME") or os.environ.get("VSCODE_PID"):
        return True
    namespace = getattr(shell, "user_ns", {}) or {}
    return "__vsc_ipynb_file__" in namespace or "google.colab" in sys.modules


def panel_mode(shell: Any = None, wanted: bool | None = None) -> str | None:
    """``"widget"``, ``"text"``, or ``None`` (panel off) for a launch from here now;
    ``wanted`` is the launch's own ``panel=`` (``None``: the kernel's setting)."""
    shell = _shell() if shell is None else shell
    value = settings.panel_mode
    if value == "off":
        return None
    if not (settings.panel if wanted is None else wanted):
        return None
    if value == "text":
        return "text"
    if value == "widget":
        return "widget" if shell is not None and getattr(shell, "kernel", None) is not None else "text"
    return "widget" if widget_front_end(shell) else "text"
