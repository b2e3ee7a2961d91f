"""A rank's collectives, as torch's Flight Recorder saw them: what the kernel asks while the
rank's code waits in one.

torch records every collective of every process group (gloo and NCCL alike) when
``TORCH_FR_BUFFER_SIZE`` is set: the launch sets it (``AIR_MAGIC_FLIGHT_RECORDER``) unless
the user did.  The rank's stack thread answers without touching the thread that waits::

    kernel                                          rank (its stack thread; the GIL is free:
                                                    a collective waits in C with it released)
    ask_for_collectives(work_dir, rank) --"c<token>"-->  answer(): torch's dump, cut to what
                                                    the kernel needs: each group's last
                                                    enqueued / completed sequence number and
                                                    its pending entries (op, sizes, dtypes,
                                                    the user's file:line)
                             <-- collectives-<rank>.json {"token": ..., "groups": ..., "pending": ...}

A collective is never made here for a peer: one a rank was left waiting in, that its peers
will not make, raises once the kernel cuts the group's connections (air_magic.rank.pool.interrupts.regroup).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from typing import Any

__all__ = ["FR_ENV", "dump", "answer", "retire_groups"]

#: torch's switch for its Flight Recorder (the number of entries kept per process).
FR_ENV = "TORCH_FR_BUFFER_SIZE"


#: The recorder's ids of groups whose backend was replaced (a pool's rebuilt groups): their
#: numbers stay in torch's dump, frozen where the cut left them, and are no longer the group's.
_retired: set[str] = set()


def retire_groups() -> None:
    """Every group the recorder knows now is about to get a new backend (a new id in the
    recorder): their old numbers are left out of what :func:`dump` answers from now on."""
    found = dump("q")
    if found is not None:
        _retired.update(found["groups"])


def dump(how: str = "c") -> dict[str, Any] | None:
    """What the Flight Recorder holds now, for each group: its sequence numbers, its ranks,
    and the collectives not completed yet; None where torch records nothing.

    ``how``: ``"q"`` (the hang watch's look each second) reads no stack trace; ``"c"`` reads
    them when a collective is pending (torch's first read of them costs a second of CPU: it
    loads the symbols); ``"r"`` (a hang report) also gives each group's last completed
    collective (``"last"``), with where the rank's code made it."""
    torch = sys.modules.get("torch")
    if torch is None or not os.environ.get(FR_ENV) and not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        return None
    c10d = getattr(torch._C, "_distributed_c10d", None)
    if getattr(c10d, "_dump_fr_trace", None) is None:
        return None
    if how == "r":
        raw = _recorded(c10d, stacks=True, active=False)
        return None if raw is None else _described(raw)
    if how == "q":  # the groups' numbers only (no entry is copied: 0.05 ms, not 20 ms for 2,000)
        raw = _recorded(c10d, stacks=False, collectives=False)
        return None if raw is None else _quick(raw)
    raw = _recorded(c10d, stacks=False)
    if raw is None:
        return None
    found = _described(raw)
    if found["pending"] and how == "c":
        with_stacks = _recorded(c10d, stacks=True)
        if with_stacks is not None:
            found = _described(with_stacks)
    return found


def _recorded(c10d: Any, stacks: bool, active: bool = True, collectives: bool = True) -> dict[str, Any] | None:
    """torch's dump: the generic recorder's, and NCCL's where a CUDA build has one
    (``active``: only the collectives not completed; ``collectives=False``: the groups' numbers)."""
    try:
        raw: dict[str, Any] = pickle.loads(
            c10d._dump_fr_trace(includeCollectives=collectives, includeStackTraces=stacks, onlyActive=active)
        )
    except Exception:  # a torch without it, or no group yet
        return None
    nccl = getattr(c10d, "_dump_nccl_trace", None)
    if nccl is not None:  # a CUDA build: NCCL's groups have a recorder of their own
        try:
            extra = pickle.loads(nccl(includeCollectives=collectives, includeStackTraces=stacks, onlyActive=active))
            raw.setdefault("entries", []).extend(extra.get("entries") or [])
            raw.setdefault("pg_status", {}).update(extra.get("pg_status") or {})
            raw.setdefault("pg_config", {}).update(extra.get("pg_config") or {})
        except Exception:  # no NCCL group: the generic recorder has them all
            pass
    return raw


def _quick(raw: dict[str, Any]) -> dict[str, Any]:
    """Each group's sequence numbers, and a pending mark (its next collective, no details) for
    each group that enqueued more than it completed: what the hang watch's looks need."""
    groups: dict[str, dict[str, Any]] = {}
    pending = []
    for pg_id, status in (raw.get("pg_status") or {}).items():
        if str(pg_id) in _retired:
            continue
        enqueued = _int(status.get("last_enqueued_collective"))
        completed = _int(status.get("last_completed_collective"))
        groups[str(pg_id)] = {"enqueued": enqueued, "completed": completed}
        if enqueued > completed:
            pending.append({"pg": str(pg_id), "seq": completed + 1, "quick": True})
    return {"groups": groups, "pending": pending}


def _described(raw: dict[str, Any]) -> dict[str, Any]:
    """Each group's sequence numbers, names and ranks, and its collectives not completed."""
    groups: dict[str, dict[str, Any]] = {}
    for pg_id, status in (raw.get("pg_status") or {}).items():
        if str(pg_id) in _retired:
            continue
        groups[str(pg_id)] = {
            "enqueued": _int(status.get("last_enqueued_collective")),
            "completed": _int(status.get("last_completed_collective")),
        }
    names = {}
    entries = [e for e in raw.get("entries") or [] if str(e.get("pg_id")) not in _retired]
    for entry in entries:
        group = entry.get("process_group") or ("", "")
        names[str(entry.get("pg_id"))] = (str(group[0]), str(group[1]))
    for pg_id, (name, desc) in names.items():
        groups.setdefault(pg_id, {"enqueued": -1, "completed": -1}).update(name=name, desc=desc)
    for name, config in (raw.get("pg_config") or {}).items():
        for info in groups.values():
            if info.get("name") == name:
                info["ranks"] = _ranks(config.get("ranks"))
    pending = []
    for entry in entries:
        pg_id = str(entry.get("pg_id"))
        seq = _int(entry.get("collective_seq_id"))
        if entry.get("is_p2p"):
            continue
        if seq <= groups.get(pg_id, {}).get("completed", -1):  # (a full dump: a report's)
            info = groups.setdefault(pg_id, {"enqueued": -1, "completed": -1})
            if seq > (info.get("last") or {}).get("seq", -1):
                info["last"] = _entry(pg_id, seq, entry)
            continue
        pending.append(_entry(pg_id, seq, entry))
    pending.sort(key=lambda e: (e["pg"], e["seq"]))
    return {"groups": groups, "pending": pending}


def _entry(pg_id: str, seq: int, entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "pg": pg_id,
        "seq": seq,
        "op": str(entry.get("profiling_name") or ""),
        "input_sizes": entry.get("input_sizes") or [],
        "input_dtypes": entry.get("input_dtypes") or [],
        "output_sizes": entry.get("output_sizes") or [],
        "output_dtypes": entry.get("output_dtypes") or [],
        "where": _user_frame(entry.get("frames") or []),
        "via": _via(entry.get("frames") or [], str(entry.get("profiling_name") or "")),
        "state": str(entry.get("state") or ""),
    }


def _via(frames: list[dict[str, Any]], op: str) -> str:
    """Who issued a collective the user's code did not call itself: ``DDP's gradient
    all-reduce`` (the reducer, from autograd's backward), ``FSDP's all-gather``, ``DeepSpeed's
    all_reduce``; ``''`` for a call of the user's own."""
    names = [str(f.get("filename") or "") for f in frames]
    kind = op.split(":", 1)[-1]
    nice = {
        "_allgather_base": "all-gather",
        "all_gather_into_tensor": "all-gather",
        "allgather_into_tensor_coalesced": "all-gather",
        "_reduce_scatter_base": "reduce-scatter",
        "reduce_scatter_tensor": "reduce-scatter",
        "reduce_scatter_tensor_coalesced": "reduce-scatter",
        "allreduce": "all-reduce",
        "allreduce_coalesced": "all-reduce",
    }.get(kind, kind.strip("_").replace("_", "-"))
    if any(f"{os.sep}fsdp{os.sep}" in n for n in names):
        return f"FSDP's {nice}"
    if any(f"{os.sep}deepspeed{os.sep}" in n for n in names):
        return f"DeepSpeed's {nice}"
    if any(n.endswith(os.path.join("nn", "parallel", "distributed.py")) for n in names):
        return f"DDP's {nice}"
    if any(n.endswith("distributed_c10d.py") for n in names):
        return ""  # torch.distributed's own function, called by the code named in ``where``
    if any(n.endswith(os.path.join("autograd", "graph.py")) for n in names):
        return (
            "DDP's gradient all-reduce" if "all_reduce" in kind or "allreduce" in kind else f"a backward hook's {nice}"
        )
    return ""


def answer(work_dir: str, rank: int, token: str, how: str = "c") -> None:
    """Write :func:`dump`'s answer, with the kernel's token, where the kernel reads it."""
    from air_magic.protocol import collectives_path

    found = dump(how)
    path = collectives_path(work_dir, rank)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"token": token, "recorded": found is not None, **(found or {})}, handle)
    os.replace(tmp, path)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _ranks(text: Any) -> list[int]:
    try:
        found = json.loads(text) if isinstance(text, str) else list(text or [])
        return [int(r) for r in found]
    except (TypeError, ValueError):
        return []


#: Frames of these files are torch's and air_magic's own: the user's line is the first other.
_NOT_USER = ("/torch/", "/air_magic/", "/site-packages/", "/lib/python")


def _user_frame(frames: list[dict[str, Any]]) -> str:
    """``file:line in func`` of the innermost frame of the user's code (the cell's name is put
    in place of its file name by the kernel)."""
    for frame in frames:
        name = str(frame.get("filename") or "")
        if name.startswith("<air_magic cell") or not any(part in name for part in _NOT_USER):
            return f"{name}:{frame.get('line')} in {frame.get('name')}"
    return ""
