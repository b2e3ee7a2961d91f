"""A pool's process groups, given fresh connections after a hang, in the same Python objects:
the model, optimizer, DDP wrapper, FSDP mesh or DeepSpeed engine that hold a group keep
working.

torch 2.13 cannot re-initialise a group once aborted (gloo's ``abort()`` and
``shutdown()`` leave a collective that waits for a peer waiting), and a DDP module keeps
the ``ProcessGroup`` it was made with.  What works, tried on 2 and 4 gloo ranks:

    each gloo group, as it is made (the pool's default group; ``new_group`` of the user's
    code, DeepSpeed's and a DeviceMesh's): the TCP connections it opened are noted

    the kernel (an interrupt left ranks in collectives that cannot complete, or a collective
    timed out and gloo closed its connections)
      "x" on each rank's stack pipe -> cut(): shut down every noted connection: a
          collective waiting in one raises "Connection closed by peer" at once, on every rank
      ("regroup", id, {"round": n}) -> rebuild(n): for each gloo group this rank is in,
          in the order they were made (the same on every rank), a new gloo backend over the
          group's own store under the prefix ``air_magic-regroup-<n>`` (its members meet
          there), with the group's timeout, registered in the group's ``ProcessGroup`` under
          a backend type it has not used yet (torch keeps the first backend of a type:
          registering under the same one would keep the closed one); one all_reduce each

The old backends are kept referenced (never destructed: see :mod:`air_magic.rank.groups`).
NCCL groups are not rebuilt (a GPU pool restarts instead).

torch has 5 backend types left to register under; from the 6th round on, each gloo group gets
a new ``ProcessGroup`` of its own (a gloo backend under the same prefix scheme) and every
``c10d`` operator a kernel at the ``Autograd`` key that hands the new group to the operator in
place of the old one (below Autograd, as torch's dispatcher runs it), so the objects that hold
the old group keep working, any number of rounds: 0.03 ms more per collective (tried: a gloo
all_reduce of 2 floats on 2 ranks, 0.52 ms, became 0.55 ms).  The fence
(:mod:`air_magic.rank.pool.interrupts.fence`) registers over these kernels while it is armed; torch puts them
back when it is disarmed.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

__all__ = ["note_links", "watch_new_groups", "cut", "rebuild", "set_timeout", "sequence_number", "TYPE_ROUNDS"]

#: The TCP connections (fd, local address, peer address) of each gloo group's current backend,
#: by the group's name: what :func:`cut` shuts down.
_links: dict[str, set[tuple[int, Any, Any]]] = {}
#: Every backend a group had, kept alive (see the module's docstring).
_kept: list[Any] = []
#: The default group's collective timeout (``init_process_group(timeout=...)`` of the user's).
_timeout: list[timedelta] = []
#: The backend types a rebuilt backend is registered under, in order; later rounds redirect.
_TYPES = ("CUSTOM", "UNDEFINED", "UCC", "MPI", "XCCL")
TYPE_ROUNDS = len(_TYPES)
_DEFAULT = "default"
#: From round TYPE_ROUNDS + 1 on: each rebuilt group (the object its holders keep) -> the
#: ProcessGroup its collectives go to now; and the torch library of the redirecting kernels.
_redirect: dict[Any, Any] = {}
_library: list[Any] = []
#: The groups rebuilt at least once (their own sequence number is their first backend's).
_rebuilt: list[Any] = []


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


def note_links(before: set[tuple[int, Any, Any]] | None = None, group: str = _DEFAULT) -> None:
    """Note the connections made since ``before`` (all but the store's when None) as the
    group's (the default group's unless named)."""
    now = _connections()
    _links[group] = now - (before or set())


def watch_new_groups() -> None:
    """From now on each gloo group the rank's code makes (``new_group``, DeepSpeed's, a
    DeviceMesh's) has its connections noted as it is made."""
    import torch.distributed.distributed_c10d as c10d

    real = c10d._new_process_group_helper
    if getattr(real, "_air_magic_notes_links", False):
        return

    def helper(*args: Any, **kwargs: Any) -> Any:
        before = _connections()
        made = real(*args, **kwargs)
        try:
            group = made[0] if isinstance(made, tuple) else made
            name = str(getattr(group, "group_name", "") or "")
            if name and _gloo(group):
                note_links(before, name)
        except Exception:  # (a group that is not this rank's)
            pass
        return made

    helper._air_magic_notes_links = True  # type: ignore[attr-defined]
    c10d._new_process_group_helper = helper


def _gloo(group: Any) -> bool:
    import torch.distributed as dist

    try:
        return "gloo" in str(dist.get_backend(group)).lower()
    except Exception:
        return False


def cut() -> int:
    """Shut down every gloo group's connections: a collective waiting in one raises."""
    done = 0
    current = {(laddr, raddr): fd for fd, laddr, raddr in _connections()}
    for links in list(_links.values()):
        for fd, laddr, raddr in list(links):
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
    """New gloo backends for every gloo group of this rank (see the module's docstring);
    returns the backend type they were registered under.  Every rank calls it with the same
    ``round_``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    cut()
    default = c10d._get_default_group()
    if not _gloo(default):
        raise RuntimeError("only gloo groups are rebuilt")
    kind = _TYPES[round_ - 1] if round_ <= TYPE_ROUNDS else "redirected"
    from air_magic.rank.inspect import collectives

    collectives.retire_groups()  # (the recorder's numbers of the backends replaced here)
    for group, (_backend, store) in list(c10d._world.pg_map.items()):
        if not _gloo(group):
            continue
        name = _DEFAULT if group is default else str(group.group_name)
        before = _connections()
        if round_ <= TYPE_ROUNDS:
            _rebuild_one(group, store, round_, kind, default is group)
        else:
            _redirect_one(group, store, round_, default is group)
        note_links(before, name)
        if not any(seen is group for seen in _rebuilt):
            _rebuilt.append(group)
    if round_ > TYPE_ROUNDS:
        _install_redirect()
    for group in list(c10d._world.pg_map):
        if _gloo(group):
            dist.all_reduce(torch.zeros(1), group=group)  # every member is on the new backend
    return kind


def sequence_number(group: Any) -> int:
    """How many collectives ``group`` has issued, counted where they run now: a rebuilt group's
    own number is its first backend's, frozen at the rebuild (the ranks then all looked even
    while one of them had issued a collective more, and a pool's interrupt cut them)."""
    if any(seen is group for seen in _rebuilt):
        import torch

        current = _redirect.get(group) or group
        return int(current._get_backend(torch.device("cpu"))._get_sequence_number_for_group())
    return int(group._get_sequence_number_for_group())


def _gloo_backend(group: Any, store: Any, round_: int, default: bool) -> Any:
    """A new gloo backend for ``group``'s members, meeting under this round's prefix; the
    backend it replaces is kept referenced."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    c = torch._C._distributed_c10d
    base = getattr(store, "underlying_store", store) if default else store
    old = (_redirect.get(group) or group)._get_backend(torch.device("cpu"))
    options = c.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    timeout = getattr(getattr(old, "options", None), "_timeout", None)
    options._timeout = (_timeout[0] if _timeout and default else timeout) or c10d.default_pg_timeout
    options._devices = [c.ProcessGroupGloo.create_default_device()]
    _kept.append(old)
    return c.ProcessGroupGloo(c.PrefixStore(f"air_magic-regroup-{round_}", base), group.rank(), group.size(), options)


def _redirect_one(group: Any, store: Any, round_: int, default: bool) -> None:
    """``group``'s collectives go to a new ProcessGroup of the same members from now on."""
    import torch

    c = torch._C._distributed_c10d
    base = getattr(store, "underlying_store", store) if default else store
    backend = _gloo_backend(group, store, round_, default)
    new = c.ProcessGroup(c.PrefixStore(f"air_magic-regroup-{round_}-group", base), group.rank(), group.size())
    new._register_backend(torch.device("cpu"), c.ProcessGroup.BackendType.GLOO, backend)
    new._set_default_backend(c.ProcessGroup.BackendType.GLOO)
    try:  # (the Flight Recorder's entries carry the group's name, as the hang report reads them)
        new._set_group_name(group.group_name)
        new._set_group_desc(group.group_desc)
    except Exception:
        pass
    if group in _redirect:
        _kept.append(_redirect[group])
    _redirect[group] = new


def _install_redirect() -> None:
    """Once: a kernel for each c10d operator that gives it the group's new ProcessGroup."""
    if _library:
        return
    import torch

    from air_magic.rank.pool.interrupts.fence import OPERATORS

    library = torch.library.Library("c10d", "IMPL")
    for name in OPERATORS:
        op = getattr(getattr(torch.ops.c10d, name, None), "default", None)
        if op is None:
            continue
        where = [i for i, a in enumerate(op._schema.arguments) if str(a.type).endswith("c10d.ProcessGroup")]
        if where:
            library.impl(name, _redirecting(torch, op, where[0]), "Autograd")
    _library.append(library)


def _redirecting(torch: Any, op: Any, index: int) -> Any:
    unbox = torch._C._distributed_c10d.ProcessGroup.unbox
    below = torch._C._AutoDispatchBelowAutograd

    def redirect(*args: Any, **kwargs: Any) -> Any:
        new = _redirect.get(unbox(args[index])) if len(args) > index else None
        if new is not None:
            args = (*args[:index], new.boxed(), *args[index + 1 :])
        with below():
            return op(*args, **kwargs)

    return redirect


def _rebuild_one(group: Any, store: Any, round_: int, kind: str, default: bool) -> None:
    import torch

    c = torch._C._distributed_c10d
    backend = _gloo_backend(group, store, round_, default)
    group._register_backend(torch.device("cpu"), getattr(c.ProcessGroup.BackendType, kind), backend)
    try:  # the new backend takes the group's name (the Flight Recorder's entries carry it)
        group._set_group_name(group.group_name)
        group._set_group_desc(group.group_desc)
    except Exception:  # (a torch without them: the entries have no name)
        pass
