"""Folders only the current user can use: created 0700, and checked whenever they are used
(a real folder, not a symbolic link, owned by this user, closed to others), so that another
user of the machine can neither plant files in them nor redirect them elsewhere."""

from __future__ import annotations

import os
import stat

__all__ = ["PrivateFolderError", "check_private", "private_dir", "user_cache_dir"]


class PrivateFolderError(PermissionError):
    """A folder that should be the user's own is not (another owner, a symlink, open to others)."""


def check_private(path: str, what: str) -> None:
    """Raise :class:`PrivateFolderError` unless ``path`` is a real folder of this user, mode 0700 or less."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        reason = "it is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        reason = "it is not a folder"
    elif st.st_uid != os.getuid():
        reason = f"it belongs to uid {st.st_uid}, not to you (uid {os.getuid()})"
    elif st.st_mode & 0o077:
        reason = f"others may read or write it (mode {stat.S_IMODE(st.st_mode):#o}); chmod 700 it"
    else:
        return
    raise PrivateFolderError(f"cannot use {path} for {what}: {reason}.")


def private_dir(path: str, what: str) -> str:
    """Create ``path`` (0700, parents too) unless it exists; check it either way."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    check_private(path, what)
    return path


def user_cache_dir() -> str:
    """``$XDG_CACHE_HOME/air_magic``, else ``~/.cache/air_magic``: never a shared /tmp path."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "air_magic")
