"""Where a pool's ranks connect to the kernel, and how the kernel knows each is one of its own
(:mod:`air_magic.kernel.pool.engine` starts the ranks and keeps the connections)::

    listener()  a Unix socket in a private folder (or a short one of its own), or for ranks
                on other machines a TCP port at the address they reach the kernel at
        ranks --connect--> accept --greet()--> multiprocessing's challenge both ways (the
                pool's key), then the rank's ("hello", rank, pid)
                --> (rank, connection, pid); None for anything else (a reset, garbage, a
                    wrong key, silence past the handshake's time): closed, the pool waits on
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import tempfile
import uuid
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Iterator

from air_magic.errors import LaunchError

__all__ = ["listener", "greet"]

#: The longest path a Unix socket's address may have (``sun_path`` holds 108 bytes).
_UNIX_PATH_MAX = 107

#: How long a connection to the pool's listener has to prove it is a rank of this pool.
_HANDSHAKE_SECONDS = 60


def greet(sock: socket.socket, authkey: bytes, world_size: int) -> tuple[int, Connection, int] | None:
    """``(rank, connection, pid)`` of a rank that connected, or None for a connection that is
    not one of this pool's ranks (wrong key, nothing said in time, a reset, a bad hello): it
    is closed and the pool goes on waiting for its ranks, which a stranger cannot hold up for
    longer than the handshake's time."""
    sock.settimeout(None)
    # Blocking reads that give up after the handshake's time (a Connection reads the descriptor).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", _HANDSHAKE_SECONDS, 0))
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
        if not conn.poll(_HANDSHAKE_SECONDS):
            raise EOFError("no hello")
        kind, rank, pid = conn.recv()
        if kind != "hello" or not isinstance(rank, int) or not 0 <= rank < world_size or not isinstance(pid, int):
            raise ValueError("not a rank's hello")
        with socket.socket(fileno=os.dup(conn.fileno())) as same:  # reads block again
            same.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
    except Exception:  # whatever a stranger sends, the pool goes on waiting for its ranks
        conn.close()
        return None
    return rank, conn, pid


@contextlib.contextmanager
def listener(backend: Any, session_dir: str) -> Iterator[tuple[socket.socket, Any]]:
    """Where the ranks connect: a Unix socket in a private folder (the session's, or a short
    one of its own when the session's path is too long for a socket's address), or for
    ranks on other machines a TCP port at the address they reach the kernel at."""
    folder: str | None = None
    if backend.local_processes:
        address: Any = os.path.join(session_dir, f"pool-{uuid.uuid4().hex[:12]}.sock")
        if len(os.fsencode(address)) > _UNIX_PATH_MAX:
            folder = _short_private_folder()
            address = os.path.join(folder, "pool.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(address)
            os.chmod(address, 0o600)
        except BaseException:
            server.close()
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
            raise
    else:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind((backend.kernel_address(), 0))
        address = server.getsockname()[:2]
    try:
        server.listen(1024)
        server.settimeout(0.05)
        yield server, address
    finally:
        server.close()
        if isinstance(address, str):
            try:
                os.unlink(address)
            except OSError:
                pass
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def _short_private_folder() -> str:
    """A new folder only this user can use, at a short path (``/tmp/am-xxxxxxxx``)."""
    for base in ("/tmp", "/dev/shm", "/var/tmp"):
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            try:
                return tempfile.mkdtemp(prefix="am-", dir=base)  # 0700, a name no one else has
            except OSError:
                continue
    raise LaunchError(
        "the pool needs a Unix socket, and no short folder is writable here (/tmp, /dev/shm, /var/tmp) while "
        "the temporary folder's path is too long for one; set TMPDIR to a shorter folder."
    )
