"""A pool's default process group, given a fresh connection after a hang, in the same
Python object: the model, optimizer and DDP wrapper that hold the group keep working.

torch 2.13 cannot re-initialise a group once aborted (gloo's ``abort()`` and
``shutdown()`` leave a collective that waits for a peer waiting), and a DDP module keeps
the ``ProcessGroup`` it was made with.  What works, tried on 2 and 4 gloo ranks:

    the kernel (a pool's Ctrl-C found ranks stuck in collectives no peer will make, or a
    collective timed out and gloo closed its connections)
      "x" on each rank's stack pipe -> cut(): shut down the TCP connections of the
          group's gloo context (noted as the group was made): a collective waiting in
          one raises "Connection closed by peer" at once, on every rank
      ("regroup", id, {"round": n}) -> rebuild(n): a new gloo backend over the same
          TCPStore under the prefix ``air_magic-regroup-<n>`` (every rank meets there),
          with the group's timeout, registered in the default group's ``ProcessGroup``
          under a backend type it has not used yet (torch keeps the first backend of a
          type: registering under the same one would keep the closed one)

The old backends are kept referenced (never destructed: see :mod:`air_magic.rank.groups`).
Groups the user's code made (``new_group``, a ``DeviceMesh``) are not rebuilt; NCCL groups
are not either (a GPU pool restarts instead).  Each pool can rebuild its group as many
times as torch has backend types left (5); then it restarts.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

__all__ = ["note_links", "cut", "rebuild", "set_timeout", "ROUNDS"]

#: The TCP connections (fd, local address, peer address) of the default group's current
#: gloo backend: what :func:`cut` shuts down.
_links: set[tuple[int, Any, Any]] = set()
#: Every backend the default group had, kept alive (see the module's docstring).
_kept: list[Any] = []
#: The default group's collective timeout (``init_process_group(timeout=...)`` of the user's).
_timeout: list[timedelta] = []
#: The backend types a rebuilt backend is registered under, in order.
_TYPES = ("CUSTOM", "UNDEFINED", "UCC", "MPI", "XCCL")
ROUNDS = len(_TYPES)


def _connections() -> set[tuple[int, Any, Any]]:
    """This process's TCP connections but the rendezvous store's."""
    import psutil

    port = int(os.environ.get("MASTER_PORT", "0") or 0)
    found = set()
    for conn in psutil.Process().net_connections(kind="tcp"):
        if not conn.raddr or conn.fd < 0:
            continue
        if port in (conn.laddr.port, conn.raddr.port):
            continue
        found.add((conn.fd, tuple(conn.laddr), tuple(conn.raddr)))
    return found


def note_links(before: set[tuple[int, Any, Any]] | None = None) -> None:
    """Note the connections made since ``before`` (all but the store's when None) as the
    default group's."""
    now = _connections()
    _links.clear()
    _links.update(now - (before or set()))


def cut() -> int:
    """Shut down the default group's connections: a collective waiting in one raises."""
    done = 0
    current = {(laddr, raddr): fd for fd, laddr, raddr in _connections()}
    for fd, laddr, raddr in list(_links):
        if current.get((laddr, raddr)) != fd:  # closed, or the fd is another socket now
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass
        finally:
            sock.close()
    return done


def set_timeout(timeout: timedelta) -> None:
    """The default group's collective timeout, now and for a rebuilt backend."""
    import torch.distributed.distributed_c10d as c10d

    _timeout[:] = [timeout]
    c10d._set_pg_timeout(timeout, None)


def rebuild(round_: int) -> str:
    """A new gloo backend for the default group (see the module's docstring); returns its
    backend type.  Every rank of the group calls it with the same ``round_``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if round_ > ROUNDS:
        raise RuntimeError(f"the pool's process group was rebuilt {ROUNDS} times already")
    cut()
    c = torch._C._distributed_c10d
    group = c10d._get_default_group()
    if "gloo" not in str(dist.get_backend(group)).lower():
        raise RuntimeError("only a gloo group is rebuilt")
    store = c10d._get_default_store()
    base = getattr(store, "underlying_store", store)
    options = c.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = _timeout[0] if _timeout else c10d.default_pg_timeout
    options._devices = [c.ProcessGroupGloo.create_default_device()]
    before = _connections()
    backend = c.ProcessGroupGloo(
        c.PrefixStore(f"air_magic-regroup-{round_}", base), group.rank(), group.size(), options
    )
    _kept.append(group._get_backend(torch.device("cpu")))
    kind = _TYPES[round_ - 1]
    group._register_backend(torch.device("cpu"), getattr(c.ProcessGroup.BackendType, kind), backend)
    try:  # the new backend takes the group's name (the Flight Recorder's entries carry it)
        group._set_group_name(group.group_name)
        group._set_group_desc(group.group_desc)
    except Exception:  # (a torch without them: the entries have no name)
        pass
    note_links(before)
    check = torch.zeros(1)
    dist.all_reduce(check)  # every rank is on the new backend
    return kind
