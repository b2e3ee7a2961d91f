"""A GPU claimed by a lock on its device node: the claim no other user can take, free or fake
(standard library only).

A claim is an open file description lock (``fcntl(F_OFD_SETLK)``, Linux ≥ 3.15) on a byte range
of the GPU's device node (``/dev/nvidia<minor>``), held by the kernel (or ``air-magic run``) for
the launch's life::

    a whole GPU            bytes [0, 1024) of /dev/nvidia<minor>
    a MIG instance         byte 1 + its GPU instance id, on its GPU's node
                           (so a whole-GPU claim and any MIG claim on that GPU exclude each other)

The node is a file of ``/dev``, which no user can remove or replace; the lock is the kernel's to
keep, released when the holder closes it or dies (a SIGKILL included), and only a process that
holds a conflicting lock keeps another from taking it.  Unlike ``flock`` the lock is on a range
(MIG instances share their GPU's node), and unlike POSIX record locks it is not dropped when the
process closes some other descriptor of the node (NVML, CUDA).  A node that cannot be opened or
locked for another reason than a conflict raises: a GPU launch is then refused, never run
unclaimed.  ``AIR_MAGIC_DEVICE_NODES`` names another folder than ``/dev`` (tests put files there
standing in for the nodes, as they stand in for NVML).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

__all__ = ["NODES_ENV", "WHOLE", "node_path", "lock_range", "take", "release", "held"]

#: A folder standing in for ``/dev`` (tests).
NODES_ENV = "AIR_MAGIC_DEVICE_NODES"
#: The range a whole GPU's claim locks.
WHOLE = (0, 1024)

_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)


def node_path(minor: int) -> str:
    """The device node of the GPU whose minor number is ``minor``."""
    return os.path.join(os.environ.get(NODES_ENV) or "/dev", f"nvidia{int(minor)}")


def lock_range(instance: int | None) -> tuple[int, int]:
    """``(start, length)`` of what a claim locks: the whole GPU, or one MIG GPU instance of it."""
    return WHOLE if instance is None else (1 + int(instance), 1)


def _flock(kind: int, start: int, length: int) -> bytes:
    # struct flock: l_type, l_whence (shorts), l_start, l_len (off_t), l_pid (pid_t), padding
    return struct.pack("hhqqii", kind, os.SEEK_SET, start, length, 0, 0)


def take(path: str, start: int, length: int) -> int | None:
    """The claim's descriptor (its lock held), or None when another holder has the range.
    Raises ``OSError`` when the node cannot be opened or locked (missing, not allowed, a
    kernel without OFD locks): the caller refuses the launch."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _flock(fcntl.F_WRLCK, start, length))
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def release(fd: int) -> None:
    """The claim ends (its lock goes with the descriptor)."""
    try:
        os.close(fd)
    except OSError:
        pass


def held(path: str, start: int, length: int) -> bool:
    """Whether some process holds a claim on the range (``air-magic ps``'s question); False
    where the node cannot be read."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return False
    try:
        answer = fcntl.fcntl(fd, _F_OFD_GETLK, _flock(fcntl.F_WRLCK, start, length))
        return struct.unpack("hhqqii", answer)[0] != fcntl.F_UNLCK
    except OSError:
        return False
    finally:
        os.close(fd)
