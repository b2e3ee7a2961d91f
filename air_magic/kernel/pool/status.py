"""What a pool says of itself: its ranks, their memory, the call they run, how it stands
(``%distributed_pool``, ``Pool.current()``, ``pool.status()``; the engine is
:mod:`air_magic.kernel.pool.engine`).  One model, drawn as text here and as HTML by
:mod:`air_magic.panel._pool_status`, so every place says the same thing in the same words::

    engine (ranks, the call running, its per-rank states) --status()--> a dict
        --facts()--> the phrases: title, state, calls, age, restarts, memory, run, and a row
                     per rank (state, memory, the call it runs)
        --text()---> "[air_magic] pool of 2 CPU ranks: idle, 3 calls run, up 42 s; ..."
                     then "  rank 0: idle, 210 MB" per rank
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from air_magic.kernel.launch import Launch
from air_magic.protocol.units import fmt_bytes
from air_magic.spec import LaunchSpec

__all__ = ["status", "facts", "describe", "text", "PoolFacts", "RankRow", "PoolEngine", "GpuMemory"]


class PoolEngine(Protocol):
    """What these functions read of :class:`air_magic.kernel.pool.engine.PoolEngine` (named here so
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
    state = str(engine.state)  # (the plain word, as rank_states)
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


@dataclass(frozen=True)
class RankRow:
    rank: int
    state: str
    memory: str  # "GPU 12.9 GB · 210 MB", "210 MB" or ""
    call: str  # the call it runs, or ""


@dataclass(frozen=True)
class PoolFacts:
    """The phrases every surface says of a pool, in the same words."""

    title: str  # "pool of 2 CPU ranks on ray"
    state: str  # "idle", "running", "broken"...
    broken_because: str  # why, for a broken pool ("" otherwise)
    calls: str  # "3 calls run"
    age: str  # "up 42 s"
    restarts: str  # "restarted 1 time" or ""
    memory: str  # "memory per rank: 210 MB, 205 MB" or ""
    gpu_memory: str  # "GPU memory per rank: 12.9 GB, 1.6 GB" or ""
    run: str  # "MLflow run 'name' (id ...) has a child run for each cell that logs" or ""
    rows: list[RankRow] = field(default_factory=list)
    launch: Any = None  # the pool's launch (its MLflow run's id, name, link, command), if started


def _uptime(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"up {seconds:.0f} s"
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"up {hours} h {minutes:02d} min" if hours else f"up {minutes} min {sec:02d} s"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def facts(engine: PoolEngine) -> PoolFacts:
    info = status(engine)
    n = info["ranks"] or engine.spec.num_accelerators or 0
    where = f" on {engine.spec.backend}" if engine.spec.backend != "local" else ""
    device = str(info["device"] or "cpu").upper()
    memory, gpus = info["memory"], info["gpu_memory"]
    rows = []
    for rank in range(info["ranks"]):
        mem = "" if memory[rank] is None else fmt_bytes(memory[rank])
        if gpus[rank] is not None:
            mem = f"GPU {fmt_bytes(gpus[rank])}" + (f" · {mem}" if mem else "")
        state = info["rank_states"][rank]
        rows.append(RankRow(rank, state, mem, info["call"] if state == "running" else ""))
    restarts = info["restarts"]
    return PoolFacts(
        title=f"pool of {n} {device} rank{'s' * (n != 1)}{where}",
        state=info["state"],
        broken_because=engine.broken_because if info["state"] == "broken" else "",
        calls=f"{_plural(info['cells'], 'call')} run",
        age=_uptime(info["uptime"]),
        restarts=f"restarted {_plural(restarts, 'time')}" if restarts else "",
        memory="memory per rank: " + ", ".join(fmt_bytes(m) for m in memory)
        if any(m is not None for m in memory)
        else "",
        gpu_memory="GPU memory per rank: " + ", ".join(fmt_bytes(g) for g in gpus)
        if any(g is not None for g in gpus)
        else "",
        run=_run_text(engine),
        rows=rows,
        launch=engine.launch,
    )


def describe(engine: PoolEngine, told: PoolFacts | None = None) -> str:
    """The pool's one line (``[air_magic] pool of 2 CPU ranks: idle, 3 calls run, up 42 s...``)."""
    f = told or facts(engine)
    state = f.state
    if f.broken_because:
        state = f"broken ({f.broken_because}; the next call starts fresh ranks)"
    head = ", ".join(part for part in (state, f.calls, f.age, f.restarts) if part)
    tail = "".join(f"; {part}" for part in (f.memory, f.gpu_memory, f.run) if part)
    return f"[air_magic] {f.title}: {head}{tail}"


def text(engine: PoolEngine, told: PoolFacts | None = None) -> str:
    """The line, then a line per rank (``  rank 1: running train, 210 MB``)."""
    f = told or facts(engine)
    lines = [describe(engine, f)]
    for row in f.rows:
        doing = f"running {row.call}" if row.call else row.state
        lines.append(f"  rank {row.rank}: {doing}" + (f", {row.memory}" if row.memory else ""))
    return "\n".join(lines)


def _run_text(engine: PoolEngine) -> str:
    launch = engine.launch
    if launch is None or not launch.run_id:
        return ""
    name = getattr(launch, "run_name", None)
    named = f"'{name}' " if name else ""
    return f"MLflow run {named}(id {launch.run_id}) has a child run for each cell that logs"


class GpuMemory:
    """Each rank's GPU memory, by NVML (kept open once asked: the panel asks every half second)."""

    def __init__(self) -> None:
        self._nvml: Any = None

    def sample(self, launch: Launch | None, pids: list[int]) -> list[int | None]:
        """Each rank's GPU memory (with its child processes'), for a pool of GPU ranks; None
        where it is not known (CPU ranks, no NVML)."""
        found: list[int | None] = [None] * len(pids)
        if launch is None or launch.placement.device != "cuda" or not pids:
            return found
        try:
            import psutil

            from air_magic.accelerators import NvmlDevices

            family: dict[int, list[int]] = {}
            for rank, pid in enumerate(pids):
                try:
                    family[rank] = [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
                except psutil.Error:
                    family[rank] = [pid]
            if self._nvml is None:
                self._nvml = NvmlDevices()
            sampled = self._nvml.sample(family)
            return [sampled.get(rank, (None, None, None, None))[2] for rank in range(len(pids))]
        except Exception:  # no NVML (a missing driver or nvidia-ml-py): the GPU numbers are left out
            return found

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None
