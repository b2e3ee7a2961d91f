"""One GPU box, many notebooks: each launch and pool in the machine's list, and the GPUs it
claims (the list is :mod:`air_magic.protocol.registry`, the claims
:mod:`air_magic.protocol.gpu_locks`; ``air-magic ps`` and ``stop`` read both)::

    before the ranks start (an observer, the first):
        GPU ranks: the GPUs this kernel may use (NVML, CUDA_VISIBLE_DEVICES honoured) less those
        processes outside air_magic use heavily (AIR_MAGIC_GPU_BUSY_MIB), in order: each one's
        lock on its device node taken --> enough taken: the record written with them (a
        description), the ranks get CUDA_VISIBLE_DEVICES = their UUIDs, the locks held until
        the launch ends
                                   --> not enough: the ones taken let go; wait (said once: who
        holds them, from the records), looking again every 0.2 s; --no-wait / wait=False:
        refuse at once, in the same words
                                   --> a node that cannot be locked (missing, not allowed): the
        launch is refused, saying why (fail closed; AIR_MAGIC_GPU_CLAIMS=off runs unclaimed)
        CPU ranks: the record only
    when the ranks have started: their pids in the record
    when the launch has ended: the locks let go, the record gone

A claim dies with its holder (the kernel's process): the kernel drops its locks at once, and a
killed kernel's GPUs are free for the next look.  No file another user can write decides who
gets a GPU.
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from air_magic.accelerators import gpu_label, gpu_nodes, gpu_processes, is_mig
from air_magic.errors import LaunchError
from air_magic.protocol import gpu_locks, registry
from air_magic.settings import settings

if TYPE_CHECKING:
    from air_magic.kernel.launch import Launch

__all__ = ["ClaimObserver", "GPU", "visible_gpus", "choose", "GPUsBusyError", "GPUClaimsError", "describe_holders"]

#: How often a waiting launch looks again.
POLL = 0.2


class GPUsBusyError(LaunchError):
    """The GPUs a launch asks for are held (and it was not to wait)."""


@dataclass(frozen=True)
class GPU:
    index: int  # NVML's (the machine's) index
    uuid: str


def visible_gpus(machine: list[tuple[int, str, list[tuple[int, int]]]]) -> list[GPU]:
    """The GPUs of ``machine`` (:func:`~air_magic.accelerators.gpu_processes`) this process may
    use, in ``CUDA_VISIBLE_DEVICES``' order where it is set."""
    found = [GPU(index, uuid) for index, uuid, _ in machine]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    chosen = []
    for entry in (e.strip() for e in visible.split(",")):
        match = [
            g for g in found if (entry.isdigit() and g.index == int(entry)) or (entry and g.uuid.startswith(entry))
        ]
        if not match:
            break  # CUDA stops at the first entry it does not know
        chosen.append(match[0])
    return chosen


def outside_use(machine: list[tuple[int, str, list[tuple[int, int]]]], known: set[int]) -> dict[str, int]:
    """Bytes of each GPU's memory that processes outside air_magic's records use."""
    return {uuid: sum(used for pid, used in procs if pid not in known) for _, uuid, procs in machine}


def choose(count: int | None, gpus: list[GPU], taken: set[str], busy: set[str]) -> list[GPU] | None:
    """``count`` free GPUs (None: every free one, at least one), or None when there are not enough."""
    free = [g for g in gpus if g.uuid not in taken and g.uuid not in busy]
    if count is None:
        return free or None
    return free[:count] if len(free) >= count else None


def describe_holders(
    wanted: list[GPU], holders: list[registry.Record], busy: set[str], held: set[str] | None = None
) -> str:
    """``GPUs 0–3 are held by alice · train.ipynb · pool · 12 min``: who holds what is wanted
    (``held``: the GPUs whose lock someone holds; the records say who, where they do)."""
    parts = []
    uuids = {g.uuid for g in wanted}
    if held is not None:
        uuids &= held
    described: set[str] = set()
    for record in holders:
        mine = [(g["index"], g["uuid"]) for g in record.gpus if g["uuid"] in uuids]
        described.update(uuid for _, uuid in mine)
        if mine:
            where = " · ".join(x for x in (record.user, record.notebook or record.kernel, record.kind) if x)
            parts.append(
                f"GPU{'s' * (len(mine) > 1)} {_span(mine)} {'are' if len(mine) > 1 else 'is'} held by {where} · {_age(record.age())}"
            )
    unnamed = [(g.index, g.uuid) for g in wanted if held is not None and g.uuid in held and g.uuid not in described]
    if unnamed:
        parts.append(
            f"GPU{'s' * (len(unnamed) > 1)} {_span(unnamed)} {'are' if len(unnamed) > 1 else 'is'} claimed by a "
            "process no record of the machine's list names"
        )
    outside = [(g.index, g.uuid) for g in wanted if g.uuid in busy]
    if outside:
        parts.append(f"GPU{'s' * (len(outside) > 1)} {_span(outside)} used by processes outside air_magic")
    return "; ".join(parts) or "no GPU is free"


def _unsafe(why: str) -> str:
    return (
        f"GPUs cannot be claimed safely here: {why}. A launch on GPUs is refused rather than run on GPUs other "
        "notebooks may be using: make the GPUs' device nodes readable and writable by their users (as CUDA "
        "needs them), or set AIR_MAGIC_GPU_CLAIMS=off to run unclaimed."
    )


def _span(gpus: list[tuple[int, str]]) -> str:
    """``0–3`` for GPUs 0, 1, 2, 3; each by its label where MIG instances are among them."""
    if any(is_mig(uuid) for _, uuid in gpus):
        return ", ".join(gpu_label(index, uuid) for index, uuid in sorted(gpus))
    indices = sorted(index for index, _ in gpus)
    if len(indices) > 2 and indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}–{indices[-1]}"
    return ", ".join(map(str, indices))


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _kernel_id() -> str:
    try:
        from ipykernel.connect import get_connection_file  # type: ignore[import-untyped]

        name = os.path.basename(get_connection_file())
        return name.removeprefix("kernel-").removesuffix(".json")
    except Exception:  # not in a kernel (air-magic run, a script)
        return ""


#: What this process's launches are in the list: ``air-magic run`` sets ``"run"``.
FRONT = "launch"


def _kind(launch: "Launch") -> str:
    return "pool" if launch.kind == "pool" else FRONT


class GPUClaimsError(LaunchError):
    """GPUs cannot be claimed safely here (their device nodes cannot be locked): the launch is
    refused rather than run on GPUs other notebooks may be using."""


class ClaimObserver:
    """The launch's record in the machine's list, and its GPUs' locks."""

    def __init__(self, launch: "Launch") -> None:
        self.launch = launch
        self.holder: registry.Holder | None = None
        self.locks: list[int] = []  # the claims' descriptors (each holds a GPU's lock)

    def before_start(self, launch: "Launch", env: dict[str, str]) -> None:
        me = os.getpid()
        record = registry.Record(
            id=launch.id,
            uid=os.getuid(),
            user=registry.user_name(os.getuid()),
            holder_pid=me,
            holder_start=registry.process_start(me),
            kind=_kind(launch),
            ranks=launch.world_size,
            notebook=os.environ.get("JPY_SESSION_NAME", ""),
            kernel=_kernel_id(),
            label=launch.label or "",
        )
        if launch.placement.device != "cuda" or not launch.local_processes or not settings.gpu_claims:
            self._publish(record)
            return
        machine = gpu_processes()
        gpus = visible_gpus(machine)
        if not gpus:
            self._publish(record)
            return
        nodes = gpu_nodes()
        for gpu in gpus:
            if gpu.uuid not in nodes:
                raise GPUClaimsError(
                    _unsafe(f"NVML does not say which device node GPU {gpu_label(gpu.index, gpu.uuid)} is")
                )
        count = launch.world_size if launch.spec.num_accelerators is not None else None
        said = False
        wait = launch.spec.wait
        while True:
            try:
                holders, _ = registry.records()  # (descriptions: who holds what, for the words)
            except OSError:  # a list that cannot be trusted describes nobody
                holders = []
            known = {p for r in holders for p in r.pids}
            limit = int(settings.gpu_busy_mib * 2**20)
            busy = {uuid for uuid, used in outside_use(machine, known).items() if used > limit}
            chosen, held = self._take(count, [g for g in gpus if g.uuid not in busy], nodes)
            if chosen is not None:
                record.gpus = [{"index": g.index, "uuid": g.uuid} for g in chosen]
                record.ranks = len(chosen) if count is None else record.ranks
                try:
                    self._publish(record)
                except BaseException:
                    self._release()
                    raise
                break
            wanted = gpus if count is None else [g for g in gpus if g.uuid in held or g.uuid in busy]
            words = describe_holders(wanted, holders, busy, held)
            if not wait:
                raise GPUsBusyError(
                    f"{count if count is not None else 'the'} GPU{'s' * (count != 1)} asked for "
                    f"{'are' if count != 1 else 'is'} not free: {words}. Wait for them (without --no-wait / wait=False), or ask for fewer."
                )
            if not said:
                line = f"[air_magic] {words}; waiting (Interrupt to stop waiting)"
                print(line, file=sys.stderr, flush=True)
                said = True
            time.sleep(POLL * random.uniform(0.75, 1.25))  # (two waiters do not retry in step)
            machine = gpu_processes()  # what outside processes use now
        uuids = [g["uuid"] for g in record.gpus]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(uuids)
        if any(is_mig(uuid) for uuid in uuids):
            # A CUDA process sees one MIG instance only (the first it is given): each rank is given
            # its own, which it sees as cuda:0.
            for rank, uuid in enumerate(uuids):
                launch.rank_env.setdefault(rank, {})["CUDA_VISIBLE_DEVICES"] = uuid
            print(
                f"[air_magic] {len(uuids)} MIG instance{'s' * (len(uuids) > 1)} claimed, one per rank: each rank sees its own "
                "as cuda:0 (CUDA shows a process one MIG instance), so use torch.cuda.set_device(0) or "
                "torch.device('cuda') rather than cuda:LOCAL_RANK.",
                file=sys.stderr,
                flush=True,
            )

    def _publish(self, record: registry.Record) -> None:
        """The launch's record in the machine's list; where the list cannot be written (its
        folder cannot be trusted) one line says so, and the launch goes on: its GPUs are claimed
        by their locks, not by the record."""
        try:
            self.holder = registry.publish(record)
        except OSError as exc:
            print(
                f"[air_magic] the machine's list of launches cannot be written ({exc}): this launch holds its GPUs "
                "(if any) all the same, but air-magic ps and the sidebar will not show it.",
                file=sys.stderr,
                flush=True,
            )

    def _take(
        self, count: int | None, free: list[GPU], nodes: dict[str, tuple[str, int, int]]
    ) -> tuple[list[GPU] | None, set[str]]:
        """Each GPU's lock taken in order until ``count`` are (None: every one free): those
        GPUs, or None (every lock taken let go) when there are not enough; and the GPUs found
        held by someone else.  A node that cannot be locked raises :class:`GPUClaimsError`."""
        chosen: list[GPU] = []
        held: set[str] = set()
        for gpu in free:
            if count is not None and len(chosen) == count:
                break
            path, start, length = nodes[gpu.uuid]
            try:
                fd = gpu_locks.take(path, start, length)
            except OSError as exc:
                self._release()
                raise GPUClaimsError(
                    _unsafe(
                        f"{path}, GPU {gpu_label(gpu.index, gpu.uuid)}'s device node, cannot be locked ({exc.strerror or exc})"
                    )
                ) from None
            if fd is None:
                held.add(gpu.uuid)
                continue
            self.locks.append(fd)
            chosen.append(gpu)
        if not chosen or (count is not None and len(chosen) < count):
            self._release()
            return None, held
        return chosen, held

    def _release(self) -> None:
        for fd in self.locks:
            gpu_locks.release(fd)
        self.locks = []

    def after_start(self, launch: "Launch") -> None:
        if self.holder is not None:
            pids = [state.pid for state in launch.ranks if state.pid]
            starts = [registry.process_start(pid) for pid in pids]
            self.holder.update(pids=pids, pid_starts=starts, state="running")

    def state_changed(self, launch: "Launch", state: str) -> None:
        """What the launch does now, in its record (a pool: idle, or running a call)."""
        if self.holder is not None and self.holder.record.state != state:
            self.holder.update(state=state)

    def after_end(self, launch: "Launch") -> None:
        self._release()
        if self.holder is None:
            return
        self.holder.close()
        self.holder = None


def claim_observer(launch: "Launch") -> ClaimObserver:
    """The observer factory (registered first by :mod:`air_magic.plugins`)."""
    return ClaimObserver(launch)
