"""What the helper asks of the system: why a fork was refused, the shared memory that ranks'
libraries leave behind, whether pidfds tell exits, a process's children, and becoming the
reaper of the ranks' orphans (Linux)."""

from __future__ import annotations

import os
import resource

from air_magic.protocol import pid_limits

__all__ = ["fork_refused", "remove_peer_segments", "pidfds_work", "children", "become_subreaper"]

_PR_SET_CHILD_SUBREAPER = 36


def fork_refused(rank: int, world_size: int, exc: OSError) -> str:
    """What a launch says when the system refuses to fork its rank ``rank``."""
    limits = [
        f"the cgroup limit pids.max is {most} ({now} processes in it now: {path})" for most, now, path in pid_limits()
    ]
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        limits.append(f"ulimit -u (RLIMIT_NPROC) is {soft} processes for this user")
    which = "; ".join(limits) or "a limit on the number of processes was reached"
    could = f"{rank} of its {world_size} ranks could start" if rank else "none of its ranks could start"
    return (
        f"the system refused to start rank {rank} ({type(exc).__name__}: {exc.strerror or exc}): {which}. "
        f"{could[0].upper()}{could[1:]}. Ask for fewer ranks, or raise the limit."
    )


#: Shared-memory segments a library names after the launch's rendezvous: DeepSpeed's CPU
#: all-reduce creates ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``
#: (about 66 MB each) in /dev/shm and never unlinks them.  Left there they fill a small
#: /dev/shm (a container's 64 MB) and a later launch that draws the same port would map a
#: dead launch's flags and wait on them forever.
_PEER_SEGMENT_PATTERNS = ("deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_",)


def remove_peer_segments(port: int, shm: str = "/dev/shm") -> list[str]:
    """Delete the shared-memory segments named after loopback port ``port`` that ranks
    of this user left in ``shm``; the names removed."""
    prefixes = tuple(pattern.format(uid=os.getuid(), port=port) for pattern in _PEER_SEGMENT_PATTERNS)
    try:
        names = os.listdir(shm)
    except OSError:
        return []
    removed = []
    for name in names:
        if any(name.startswith(prefix) and name[len(prefix) :].isdigit() for prefix in prefixes):
            try:
                os.unlink(os.path.join(shm, name))
            except OSError:
                continue
            removed.append(name)
    return removed


def pidfds_work() -> bool:
    """Linux >= 5.3 tells a process's exit through a pidfd; elsewhere exits are polled."""
    try:
        fd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return False
    os.close(fd)
    return True


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from ``/proc``; a few hundred entries to read)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(name))
    return found


def become_subreaper() -> None:
    """Orphans of the ranks (a DataLoader worker whose rank died) become this process's
    children, to be reaped here (Linux's PR_SET_CHILD_SUBREAPER)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
