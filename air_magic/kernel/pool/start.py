"""A pool's ranks start and end, kernel side: a launch whose payload is "serve the pool"
(:mod:`air_magic.rank.pool.serve`), and every rank connected to the kernel's listener
(:mod:`air_magic.kernel.pool.listener`)::

    start_ranks()   torch imported meanwhile; a Unix socket in a private folder (auth key);
                    the launch; each rank's hello checked -> Ranks (a failed or interrupted
                    start kills what it started)
    end_ranks()     each rank asked to leave its loop (an idle pool), then killed
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection

import cloudpickle

from air_magic import capture
from air_magic.errors import LaunchError
from air_magic.kernel.launch import Launch
from air_magic.kernel.launcher import Launcher
from air_magic.kernel.pool.call import Ranks
from air_magic.kernel.pool.listener import greet as _greet
from air_magic.kernel.pool.listener import listener as _listener
from air_magic.kernel.pool.mirror import KernelMirror
from air_magic.protocol import Stop
from air_magic.settings import settings
from air_magic.spec import LaunchSpec

__all__ = ["POOL_START_TIMEOUT", "start_ranks", "end_ranks", "kill", "import_torch_meanwhile"]

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
    with _listener(backend, launcher.session_dir) as (server, address):
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
                greeted = _greet(sock, authkey, launch.world_size)
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
                conn.send_bytes(cloudpickle.dumps(("close",)))
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
