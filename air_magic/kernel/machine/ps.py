"""``air-magic ps`` and ``air-magic stop`` (and ``%distributed_ps``): the machine's launches and
pools, from the records of :mod:`air_magic.protocol.registry`::

    records() --> yours: id, kind, kernel and notebook, ranks, pids, GPUs (index, UUID), GPU memory
                  per rank (NVML, by pid), host memory (RSS), state, age
              --> another user's: owner, kind, ranks, GPUs, age (nothing that was private)
    NVML's processes that no record names --> the orphan check (pid, user, memory)

    stop(ID) --> the record (unknown: an error naming the id) --> yours, or you are root (else
                 refused, naming the owner) --> ID.stop.<random> says who asked (the launch's
                 outcome names them) --> SIGTERM to the ranks the record names (each checked: it
                 started when the record says and runs as the record's user; never a kill by
                 name) and what they started (it carries the launch's id in its environment),
                 SIGKILL after 5 s --> the record gone (the holder saw its ranks end)
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

from air_magic.accelerators import gpu_label, gpu_processes
from air_magic.protocol import registry
from air_magic.protocol.processes import carriers

__all__ = ["rows", "orphans", "table", "stop", "StopError"]

#: Seconds the ranks have to end after SIGTERM, before SIGKILL.
GRACE = 5.0


class StopError(Exception):
    """A stop that cannot be done (unknown id, someone else's launch): the message says why."""


def _gpu_memory() -> dict[int, int]:
    """Bytes of GPU memory each process uses (NVML; empty without it)."""
    used: dict[int, int] = {}
    for _, _, procs in gpu_processes():
        for pid, nbytes in procs:
            used[pid] = used.get(pid, 0) + nbytes
    return used


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def rows(records: list[registry.Record] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """One dict per live launch or pool (what ``--json`` prints), and the records skipped."""
    skipped: list[str] = []
    if records is None:
        records, skipped = registry.records()
    me = os.getuid()
    gpu_memory = _gpu_memory()
    out = []
    for record in records:
        row: dict[str, Any] = {
            "id": record.id,
            "owner": record.user,
            "kind": record.kind,
            "ranks": record.ranks,
            "gpus": [dict(g) for g in record.gpus],
            "age_s": round(record.age(), 1),
        }
        if record.uid == me or me == 0:
            row |= {
                "pids": list(record.pids),
                "state": record.state,
                "notebook": record.notebook,
                "kernel": record.kernel,
                "label": record.label,
                "host_memory": [_rss(pid) for pid in record.pids],
                "gpu_memory": [gpu_memory.get(pid) for pid in record.pids],
            }
        else:  # another user's: what it holds, not what it runs
            row |= {"pids": [], "state": "", "notebook": "", "kernel": "", "label": ""}
        out.append(row)
    return out, skipped


def orphans(records: list[registry.Record] | None = None) -> list[dict[str, Any]]:
    """Processes using GPU memory that no launch's record names."""
    if records is None:
        records, _ = registry.records()
    known = {pid for record in records for pid in record.pids}
    found = []
    for pid, used in sorted(_gpu_memory().items()):
        if pid in known:
            continue
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            user = registry.user_name(uid)
        except OSError:
            user = "?"  # another pid namespace (a container): NVML's pid is the host's
        found.append({"pid": pid, "user": user, "gpu_memory": used})
    return found


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    if value >= 1 << 30:
        return f"{value / 2**30:.1f}G"
    return f"{value / 2**20:.0f}M"


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def table(found: list[dict[str, Any]], strays: list[dict[str, Any]], skipped: list[str]) -> str:
    """What ``air-magic ps`` prints."""
    if not found:
        lines = ["no air_magic launch or pool is running on this machine"]
    else:
        header = ("ID", "OWNER", "KIND", "RANKS", "GPUS", "GPU MEM", "HOST MEM", "STATE", "AGE", "NOTEBOOK / KERNEL")
        body = []
        for row in found:
            gpus = ",".join(gpu_label(g["index"], g.get("uuid", "")) for g in row["gpus"]) or "-"
            gpu_mem = row.get("gpu_memory") or []
            host_mem = row.get("host_memory") or []
            body.append(
                (
                    row["id"],
                    row["owner"],
                    row["kind"],
                    str(row["ranks"]),
                    gpus,
                    " ".join(_size(v) for v in gpu_mem) if any(v is not None for v in gpu_mem) else "-",
                    " ".join(_size(v) for v in host_mem) if host_mem else "-",
                    row["state"] or "-",
                    _age(row["age_s"]),
                    row["notebook"] or row["kernel"] or "-",
                )
            )
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip() for r in [header, *body]]
    if strays:
        lines.append("")
        lines.append("GPU memory held by processes that are no air_magic launch's:")
        lines += [f"  pid {s['pid']} ({s['user']}): {_size(s['gpu_memory'])}" for s in strays]
    lines += [f"[air_magic] skipped a record: {line}" for line in skipped]
    return "\n".join(lines)


def _ranks_of(record: registry.Record) -> list[int]:
    """The record's rank pids that are still those ranks (the start time the record names)
    and run as the record's user, and what they started that carries the launch's id in its
    environment (the record's user's too): never another user's process."""
    pids = [
        pid
        for pid, start in zip(record.pids, record.pid_starts)
        if start is not None and registry.process_start(pid) == start and registry.process_owner(pid) == record.uid
    ]
    return pids + [pid for pid in carriers(record.id) if pid not in pids and registry.process_owner(pid) == record.uid]


def _running(pids: list[int], record: registry.Record) -> list[int]:
    starts = dict(zip(record.pids, record.pid_starts))
    alive = []
    for pid in pids:
        start = registry.process_start(pid)
        if start is not None and (pid not in starts or starts[pid] == start):
            alive.append(pid)
    return alive


def stop(launch_id: str, grace: float = GRACE, via: str = "air-magic stop") -> str:
    """Stop the launch or pool ``launch_id`` of this user's (root: anyone's); what was done.
    ``via`` is what its cell will name as the stopper (``air-magic stop``, the JupyterLab sidebar)."""
    records, _ = registry.records()
    record = next((r for r in records if r.id == launch_id), None)
    if record is None:
        raise StopError(
            f"no air_magic launch or pool {launch_id!r} is running on this machine (air-magic ps lists them)"
        )
    me = os.getuid()
    if record.uid != me and me != 0:
        owner = record.user if record.uid == 0 else f"{record.user} or root"
        raise StopError(f"{launch_id} is {record.user}'s (uid {record.uid}): only {owner} can stop it")
    who = {
        "via": via,
        "user": registry.user_name(me),
        "uid": me,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "at": time.strftime("%H:%M:%S"),
    }
    path = registry.request_stop(launch_id, who)  # (a new name: nobody can have taken it first)
    ranks = _ranks_of(record)
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _running(ranks, record):
        time.sleep(0.05)
    killed = _running(ranks, record)
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(r.id == launch_id for r in registry.records()[0]):
        time.sleep(0.05)
    if path is not None:
        try:
            os.unlink(path)  # the holder read it (or could not remove another user's file)
        except FileNotFoundError:
            pass
    count = len([pid for pid in ranks if pid in record.pids])
    what = f"{record.kind} {launch_id} of {record.user}: {count} rank{'s' * (count != 1)} stopped"
    return what + (f" ({len(killed)} with SIGKILL after {grace:g} s)" if killed else "")
