"""Where the ranks' logs are kept: one folder per launch in the user's own log folder, so a
log named in a summary or an error can still be opened after the kernel has exited.

::

    settings.log_dir   ($AIR_MAGIC_LOG_DIR, else $XDG_CACHE_HOME/air_magic/logs,
      |                 else ~/.cache/air_magic/logs; created 0700 and checked private)
      +-- 20261130-234512-0003-1a2b3c4d/     one launch: <local start time>-<launch id>
            rank-0.log  rank-1.log  ...      each rank's stdout and stderr (bounded at the end)
            mlflow.log                       MLflow's own lines, when tracking is on

The folder is pruned when a kernel's launcher starts (in a background thread): launch
folders older than ``settings.log_keep_days`` go, then the oldest until the rest holds
less than ``settings.log_keep_mb``.  A folder written to within the last hour is never
removed: a launch of another kernel may still be running.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

from air_magic.errors import ConfigurationError
from air_magic.protocol.private import private_dir
from air_magic.settings import LOG_DIR_ENV, settings

__all__ = ["LogFolder", "logs_root", "launch_log_dir", "prune", "prune_in_background"]

#: A launch folder written to more recently than this (seconds) is never pruned.
RECENT = 3600.0


def logs_root() -> str:
    """The user's log folder, created if needed (``PrivateFolderError``/``OSError`` if unusable)."""
    return private_dir(settings.log_dir, "the launches' logs")


def launch_log_dir(root: str, launch_id: str, started: float) -> str:
    """The log folder of one launch (not created here)."""
    return os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}-{launch_id}")


def _last_write(path: str) -> float:
    latest = os.lstat(path).st_mtime
    for entry in os.scandir(path):
        try:
            latest = max(latest, entry.stat(follow_symlinks=False).st_mtime)
        except OSError:  # removed meanwhile
            continue
    return latest


def _size(path: str) -> int:
    total = 0
    for entry in os.scandir(path):
        try:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


def prune(root: str, keep_days: float, keep_bytes: int, now: float | None = None) -> list[str]:
    """Remove old launch folders under ``root``; returns the names removed (oldest first)."""
    now = time.time() if now is None else now
    folders = []
    for entry in os.scandir(root):
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            folders.append((_last_write(entry.path), _size(entry.path), entry.name, entry.path))
        except OSError:  # removed meanwhile, or not ours to read
            continue
    folders.sort()
    removed = []
    total = sum(size for _, size, _, _ in folders)
    for written, size, name, path in folders:
        if now - written < RECENT:
            break  # sorted by age: the rest is recent too
        if now - written <= keep_days * 86400 and total <= keep_bytes:
            break
        shutil.rmtree(path, ignore_errors=True)
        total -= size
        removed.append(name)
    return removed


def prune_in_background(root: str) -> None:
    """:func:`prune` with the settings' limits, in a daemon thread (never delays a launch).
    A bad limit in the environment is a ``ConfigurationError`` here, in the caller's thread."""
    keep_days, keep_bytes = settings.log_keep_days, int(settings.log_keep_mb * 2**20)

    def run() -> None:
        try:
            prune(root, keep_days, keep_bytes)
        except OSError:  # the folder went away or cannot be listed: nothing to prune
            pass

    threading.Thread(target=run, name="air_magic-log-prune", daemon=True).start()


class LogFolder:
    """A launcher's log folder: made (and pruned in the background) at the first launch,
    said once when it cannot be used; the logs then stay in the kernel's session folder."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._root: str | None = None  # "" when the user's log folder cannot be used

    def root(self) -> str | None:
        with self._lock:
            if self._root is None:
                try:
                    self._root = logs_root()
                except OSError as exc:  # PrivateFolderError included
                    self._root = ""
                    print(
                        f"[air_magic] {exc} This kernel's launch logs are kept in its session folder "
                        f"and removed when it exits; set {LOG_DIR_ENV} to a folder only you can use.",
                        file=sys.stderr,
                    )
                else:
                    try:
                        prune_in_background(self._root)
                    except ConfigurationError as exc:
                        print(f"[air_magic] old launch logs are not pruned: {exc}", file=sys.stderr)
            return self._root or None
