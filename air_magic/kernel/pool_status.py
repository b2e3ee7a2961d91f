"""What a pool says of itself: its ranks, their memory, the call they run, how it stands
(``%distributed_pool``, ``Pool.current()``, ``pool.status()``; the engine is
:mod:`air_magic.kernel.pool`)::

    engine (ranks, the call running, its per-rank states) --status()--> a dict
        --describe()--> "[air_magic] pool of 2 CPU ranks: idle, 3 calls run, up 42 s; ..."
        --table()-----> one row per rank, as text and as HTML
"""

from __future__ import annotations

import html
import time
from typing import Any, Protocol

from air_magic.kernel.launch import Launch
from air_magic.spec import LaunchSpec

__all__ = ["status", "describe", "table", "PoolEngine"]


class PoolEngine(Protocol):
    """What these functions read of :class:`air_magic.kernel.pool.PoolEngine` (named here so
    that the engine imports this module and not the other way round)."""

    spec: LaunchSpec
    current: str
    cells: int
    started_at: float
    restarts: int

    @property
    def launch(self) -> Launch | None: ...
    @property
    def pids(self) -> list[int]: ...
    @property
    def state(self) -> str: ...
    @property
    def broken_because(self) -> str: ...
    def rank_state(self, rank: int) -> str: ...
    def gpu_memory(self) -> list[int | None]: ...


def status(engine: PoolEngine) -> dict[str, Any]:
    """Ranks, state, memory per rank, the call running (or the last), cells run, uptime."""
    import psutil

    pids = list(engine.pids)
    memory: list[int | None] = []
    launch = engine.launch
    local = launch is None or launch.local_processes
    for pid in pids:
        try:
            memory.append(psutil.Process(pid).memory_info().rss if local else None)
        except psutil.Error:
            memory.append(None)
    gpu_memory = engine.gpu_memory() if local else [None] * len(pids)
    state = engine.state
    return {
        "ranks": len(pids),
        "pids": pids,
        "state": state,
        "rank_states": [engine.rank_state(r) for r in range(len(pids))],
        "call": engine.current,
        "device": launch.placement.device if launch else None,
        "backend": engine.spec.backend,
        "memory": memory,
        "gpu_memory": gpu_memory,
        "cells": engine.cells,
        "uptime": time.time() - engine.started_at if engine.started_at and state != "closed" else 0.0,
        "restarts": engine.restarts,
    }


def table(engine: PoolEngine) -> tuple[str, str]:
    """The pool's ranks as text and as HTML: state, memory, the call they run (or ran last)."""
    info = status(engine)
    rows = []
    for rank in range(info["ranks"]):
        memory, gpu = info["memory"][rank], info["gpu_memory"][rank]
        mem = "" if memory is None else f"{memory / 2**20:.0f} MiB"
        if gpu is not None:
            mem = f"GPU {gpu / 2**30:.1f} GiB" + (f" · {mem}" if mem else "")
        state = info["rank_states"][rank]
        call = info["call"] if state == "running" else ""
        rows.append((str(rank), state, mem, call))
    text = "\n".join(
        f"  rank {r}: " + (f"running {call}" if call else state) + (f", {mem}" if mem else "")
        for r, state, mem, call in rows
    )
    cells = "".join(
        "<tr>" + "".join(f"<td style='padding:0 12px 0 0'>{html.escape(v)}</td>" for v in row) + "</tr>" for row in rows
    )
    head = "".join(
        f"<th style='text-align:left;padding:0 12px 0 0'>{h}</th>" for h in ("rank", "state", "memory", "running")
    )
    return text, f"<table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>"


def describe(engine: PoolEngine) -> str:
    """The pool's one line (``[air_magic] pool of 2 CPU ranks: idle, 3 calls run, up 42 s...``)."""
    info = status(engine)
    mem = (
        ", ".join("?" if m is None else f"{m / 2**20:.0f} MiB" for m in info["memory"])
        if any(m is not None for m in info["memory"])
        else ""
    )
    where = f" on {engine.spec.backend}" if engine.spec.backend != "local" else ""
    gpus = info["gpu_memory"]
    gpu = (
        "; GPU memory per rank: " + ", ".join("?" if g is None else f"{g / 2**30:.1f} GiB" for g in gpus)
        if any(g is not None for g in gpus)
        else ""
    )
    state = info["state"]
    if state == "broken" and engine.broken_because:
        state = f"broken ({engine.broken_because}; the next call starts fresh ranks)"
    n = info["ranks"] or engine.spec.num_accelerators or 0
    return (
        f"[air_magic] pool of {n} {str(info['device'] or 'cpu').upper()} rank{'s' * (n != 1)}{where}: "
        f"{state}, {info['cells']} call{'s' * (info['cells'] != 1)} run, up {info['uptime']:.0f} s"
        + (f", restarted {info['restarts']} time{'s' * (info['restarts'] != 1)}" if info["restarts"] else "")
        + (f"; memory per rank: {mem}" if mem else "")
        + gpu
        + _run_text(engine)
    )


def _run_text(engine: PoolEngine) -> str:
    launch = engine.launch
    if launch is None or not launch.run_id:
        return ""
    name = getattr(launch, "run_name", None)
    named = f"'{name}' " if name else ""
    return f"; MLflow run {named}(id {launch.run_id}) has a child run for each cell that logs"
