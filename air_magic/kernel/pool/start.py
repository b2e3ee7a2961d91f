"""A pool's ranks start and end, kernel side: a launch whose payload is "serve the pool"
(:mod:`air_magic.rank.pool.serve`), every rank connected to the kernel, and how the kernel
knows each is one of its own::

    start_ranks()   torch imported meanwhile; listener(): a Unix socket in a private folder
                    (or a short one of its own), or for ranks on other machines a TCP port
                    at the address they reach the kernel at; the launch;
                    ranks --connect--> accept --greet()--> multiprocessing's challenge both
                    ways (the pool's key), then the rank's RankHello(rank, pid)
                    --> Ranks; anything else (a reset, garbage, a wrong key, silence past
                    the handshake's time) is closed and the pool waits on.  A failed or
                    interrupted start kills what it started.
    end_ranks()     each rank asked to leave its loop (an idle pool), then killed
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
import uuid
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Iterator

import cloudpickle

from air_magic import capture
from air_magic.errors import LaunchError
from air_magic.kernel.launch import Launch
from air_magic.kernel.launcher import Launcher
from air_magic.kernel.pool.call import Ranks
from air_magic.kernel.pool.mirror import KernelMirror
from air_magic.protocol import Stop
from air_magic.protocol.pool import PoolClose, RankHello
from air_magic.settings import settings
from air_magic.spec import LaunchSpec

__all__ = ["POOL_START_TIMEOUT", "start_ranks", "end_ranks", "kill", "import_torch_meanwhile", "listener", "greet"]

#: Seconds a pool waits for its ranks to connect (the helper may still be importing torch).
POOL_START_TIMEOUT = 300.0


def start_ranks(spec: LaunchSpec, launcher: Launcher, key: str, mirror: KernelMirror) -> tuple[Ranks, float]:
    """Start the ranks of the pool named ``key`` and wait until every one is connected; the
    ranks and the seconds it took.  ``mirror`` learns that the ranks start with the kernel's
    environment and ``sys.path`` as they are now."""
    launcher._ensure_session_folders()
    importing = import_torch_meanwhile()
    backend = launcher.backend_for(spec.backend)
    authkey = os.urandom(32)
    placement = spec.resolve(backend.hardware())
    began = time.monotonic()
    hello: dict[int, tuple[Connection, int]] = {}
    launch: Launch | None = None
    with listener(backend, launcher.session_dir) as (server, address):
        payload = capture.Payload(
            kind="pool",
            label="pool",
            data={"address": address, "authkey": authkey, "device": placement.device},
            argv=["pool"],
            group=key,
        )
        try:
            mirror.reset()
            launch = launcher.start(spec, payload)
            while len(hello) < launch.world_size:
                if launch.done():
                    launch.result()  # its error: the ranks could not start
                    raise LaunchError("the pool's ranks ended before they connected")
                if time.monotonic() - began > POOL_START_TIMEOUT:
                    raise LaunchError(
                        f"the pool's ranks did not connect within {POOL_START_TIMEOUT:g} s "
                        f"({len(hello)} of {launch.world_size} did)"
                    )
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    continue
                greeted = greet(sock, authkey, launch.world_size)
                if greeted is not None and greeted[0] not in hello:
                    hello[greeted[0]] = greeted[1:]
                elif greeted is not None:
                    greeted[1].close()
        except BaseException:
            if launch is not None:
                kill(launch)
            for conn, _ in hello.values():
                conn.close()
            if importing is not None:
                importing.join()
            raise
    ranks = Ranks(launch, [hello[r][0] for r in range(len(hello))], [hello[r][1] for r in range(len(hello))])
    if launch.helper is not None:
        launch.helper.pool_started(launch.id)  # Ray: the agents' spares start now
    if importing is not None:  # done before any call: a torch half imported is no torch
        importing.join()
    return ranks, time.monotonic() - began


def end_ranks(ranks: Ranks, close_first: bool) -> None:
    """Stop these ranks: ask each to leave its loop first (an idle pool), then kill what is left."""
    if close_first:
        for conn in ranks.conns:
            try:
                conn.send_bytes(cloudpickle.dumps(PoolClose()))
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        while not ranks.launch.done() and time.monotonic() < deadline:
            time.sleep(0.01)
    kill(ranks.launch)
    for conn in ranks.conns:
        conn.close()


def kill(launch: Launch) -> None:
    """End a launch's ranks (the helper kills them); back once they are gone, or after 10 s."""
    if launch.done():
        return
    try:
        launch.launcher.send(Stop(launch.id, "kill"))
    except OSError:
        pass
    deadline = time.monotonic() + 10.0
    while not launch.done() and time.monotonic() < deadline:
        time.sleep(0.01)


def import_torch_meanwhile() -> threading.Thread | None:
    """The kernel imports torch while the pool's ranks start (it waits for them anyway; the
    start joins the thread before the first call, as code that finds torch half imported in
    ``sys.modules`` fails): the pool's first ``state_dict``, ``model`` or ``pull`` of a tensor
    then costs what the next does.  ``AIR_MAGIC_WARM=0`` leaves it to the first use."""
    if "torch" in sys.modules:
        return None
    try:
        if not settings.warm:
            return None
    except Exception:  # (a bad setting is said by what reads it)
        return None

    def work() -> None:
        try:
            import torch  # noqa: F401
        except Exception:  # no torch here: what needs it says so
            pass

    thread = threading.Thread(target=work, name="air_magic-import-torch", daemon=True)
    thread.start()
    return thread


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
        hello = conn.recv()
        if not isinstance(hello, RankHello):
            raise ValueError("not a rank's hello")
        rank, pid = hello.rank, hello.pid
        if not isinstance(rank, int) or not 0 <= rank < world_size or not isinstance(pid, int):
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
