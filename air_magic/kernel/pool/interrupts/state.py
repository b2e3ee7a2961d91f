"""Whether a pool's ranks still hold one model after an interrupt: the kernel side of
:mod:`air_magic.rank.pool.interrupts.state`.  The pool says "intact" only after this check::

    every rank back from the interrupted call (and its group rebuilt where it had to be)
      settle(conns, id)   ("settle", id, {}) to every rank: each puts back what the interrupt
                          left half-way (FSDP2's iteration, DDP's reducer) and answers each
                          module's, optimizer's and DeepSpeed engine's fingerprint
      compare(answers)    name by name: tensors that differ between ranks, DTensor counts,
                          optimizer steps -> StateCheck: what was checked, what differs, and
                          the line that says how to repair it (pool.sync)

:func:`compare` is a pure function of the ranks' answers (unit-tested without processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from air_magic.kernel.pool.wire import ask_every_rank

__all__ = ["StateCheck", "settle", "compare", "SETTLE_WAIT"]

#: Seconds the ranks have to put back their state and answer its fingerprint.
SETTLE_WAIT = 30.0


@dataclass
class StateCheck:
    """What the check found: ``checked`` (a phrase per name: ``model (4 tensors)``),
    ``differs`` (a phrase per name that differs between ranks), ``repaired`` (what the ranks
    put back, a line each), ``unread`` (names a rank could not read), ``unchecked`` (why no
    check was made: the ranks did not answer)."""

    checked: list[str] = field(default_factory=list)
    differs: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    unchecked: str = ""
    names: list[str] = field(default_factory=list)  # the names that differ (what pool.sync takes)

    @property
    def intact(self) -> bool:
        return not self.differs and not self.unchecked

    def note(self) -> str:
        """The line after the interrupt's headline: what was checked or put back."""
        parts = []
        if self.repaired:
            parts.append("put back: " + "; ".join(self.repaired))
        if self.checked and not self.differs:
            parts.append("checked on every rank: " + ", ".join(self.checked) + ": equal")
        if self.unread:
            parts.append("not checked: " + "; ".join(self.unread))
        return "[air_magic] " + ". ".join(parts) + "." if parts else ""

    def repair_hint(self) -> str:
        names = ", ".join(repr(n) for n in self.names)
        return (
            f"pool.sync({names}) copies rank 0's to the others (air_magic.Pool.current().sync(...)), or run the "
            "cells that build them again"
        )


def settle(conns: list[Connection], call_id: int, timeout: float = SETTLE_WAIT) -> dict[int, Any] | str:
    """Every rank puts back what an interrupt left half-way and says its fingerprints:
    ``{rank: {"repaired": [...], "names": {...}}}``, or why not (a string)."""
    return ask_every_rank(conns, "settle", call_id, {}, timeout, "check its state")


def compare(answers: dict[int, Any]) -> StateCheck:
    """The ranks' fingerprints compared, name by name (see the module's docstring)."""
    check = StateCheck()
    ranks = sorted(answers)
    for rank in ranks:
        for line in answers[rank].get("repaired") or []:
            said = f"{line} (every rank)" if all(line in (answers[r].get("repaired") or []) for r in ranks) else line
            said = said if said.endswith("(every rank)") else f"{line} (rank {rank})"
            if said not in check.repaired:
                check.repaired.append(said)
    prints = {rank: answers[rank].get("names") or {} for rank in ranks}
    names = sorted(set().union(*(p.keys() for p in prints.values()))) if prints else []
    for name in names:
        have = [r for r in ranks if name in prints[r]]
        if len(have) != len(ranks):
            check.differs.append(f"{name}: defined on {_ranks(have)} only")
            check.names.append(name)
            continue
        each = {r: prints[r][name] for r in ranks}
        errors = {r: p["error"] for r, p in each.items() if p.get("error")}
        if errors:
            rank, error = min(errors.items())
            check.unread.append(f"{name} (rank {rank}: {error})")
            continue
        differs = _differences(name, each)
        if differs:
            check.differs.append(differs)
            check.names.append(name)
        elif _checked(name, each[ranks[0]]) != name:  # (a module with no tensor, a loss: nothing to say)
            check.checked.append(_checked(name, each[ranks[0]]))
    return check


def _differences(name: str, each: dict[int, dict[str, Any]]) -> str:
    """``model: rank 0 and rank 1 differ in 3 of 4 tensors; ...`` ('' when equal)."""
    ranks = sorted(each)
    first = each[ranks[0]]
    said: list[str] = []
    counts = {r: tuple(p.get("dtensors") or (0, 0)) for r, p in each.items()}
    if len(set(counts.values())) > 1:
        said.append(
            ", ".join(f"{d} of {n} parameters are DTensors on rank {r}" for r, (d, n) in sorted(counts.items()))
        )
    steps = {r: p.get("steps") for r, p in each.items()}
    if any(s is not None for s in steps.values()) and len(set(steps.values())) > 1:
        said.append(", ".join(f"{_steps(s)} on rank {r}" for r, s in sorted(steps.items())))
    keys = [k for k, v in (first.get("tensors") or {}).items() if v is not None]
    compared = [k for k in keys if all((p.get("tensors") or {}).get(k) is not None for p in each.values())]
    apart: dict[int, int] = {}
    for rank in ranks[1:]:
        tensors = each[rank].get("tensors") or {}
        n = sum(1 for k in compared if tensors.get(k) != first["tensors"][k])
        if n:
            apart[rank] = n
    if apart:
        if len(apart) == 1 and len(ranks) == 2:
            ((rank, n),) = apart.items()
            said.append(f"rank {ranks[0]} and rank {rank} differ in {n} of {len(compared)} tensors")
        else:
            said.append(
                "; ".join(
                    f"rank {r} differs from rank {ranks[0]} in {n} of {len(compared)} tensors" for r, n in apart.items()
                )
            )
    if not said:
        return ""
    text = f"{name}: " + "; ".join(said)
    if first.get("kind") == "module" and not first.get("wrapped") and apart and not any(c[0] for c in counts.values()):
        text += " (a module not wrapped in DDP, FSDP or DeepSpeed: if its ranks are meant to differ, nothing is wrong)"
    return text


def _checked(name: str, first: dict[str, Any]) -> str:
    tensors = [k for k, v in (first.get("tensors") or {}).items() if v is not None]
    parts = []
    if tensors:
        parts.append(f"{len(tensors)} tensor{'s' * (len(tensors) != 1)}")
    dtensors, params = first.get("dtensors") or (0, 0)
    if dtensors:
        parts.append(f"{dtensors} of {params} parameters DTensors")
    if first.get("steps") is not None:
        parts.append(_steps(first["steps"]))
    return f"{name} ({', '.join(parts)})" if parts else name


def _steps(n: Any) -> str:
    return "no step" if not n else f"{n} step{'s' * (n != 1)}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
