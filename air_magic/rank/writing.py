"""Bytes written into a file another process maps (a returned tensor, a model's part): all of a
buffer at one offset with ``pwrite``, whose pages are allocated as they are written (none zeroed
first), so a full file system is an ``ENOSPC`` error at the write, never a SIGBUS at a later touch.
Used by :mod:`air_magic.rank.results` and :mod:`air_magic.rank.pool.model_back`."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["pwrite_all"]


def pwrite_all(fd: int, data: Any, at: int) -> None:
    """Write the buffer ``data`` to ``fd`` at byte ``at``, all of it (``pwrite`` may write less)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        done = os.pwrite(fd, view, at)
        view, at = view[done:], at + done
