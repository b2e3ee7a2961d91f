"""The Ray backend: a launch's ranks as Ray actors on the nodes of a cluster.

It speaks the same messages as the local helper process (:mod:`air_magic.backends.local`), so the
:class:`~air_magic.kernel.launch.Launch`, tracking and the panel see a Ray launch as a local one::

    Launcher --send(StartLaunch | Stop | Shutdown)--> RayBackend
    Launcher <--on_message(backend, Started | Exited | Stopping | Done | StartFailed)-- a thread per launch

Each launch is a thread of its own (:mod:`air_magic.backends.ray.ray_launch`): placed, started,
polled and stopped there.  The actors belong to the kernel's Ray driver (never detached): a
kernel that exits or dies takes them with it, and each rank dies with its agent.  A kernel that exits (a restart, a shutdown) first kills its
ranks and removes its actors itself, while it is still connected: the backend's exit hook
runs before Ray's own (``ray.shutdown``).  The user's ``ray.shutdown()`` does the same
first: the backend wraps ``ray.shutdown`` when it connects, so the kernel's Ray launches
end (their ranks killed, actors and placement groups removed, each launch's error saying
the kernel left the cluster) before Ray disconnects, and no launch thread is inside a Ray
call while Ray tears its connection down.  Should the process leave Ray some other way,
a launch makes no more Ray calls once ``ray.is_initialized()`` is false, and its calls
never connect by themselves: ``ray.get`` and ``ray.kill`` would connect it again (Ray's
automatic ``ray.init()``), or start a new local cluster, from a process on its way out.
"""

from __future__ import annotations

import atexit
import functools
import threading
import time
import weakref
from typing import Any, Callable

from air_magic.accelerators import Hardware
from air_magic.backends.ray import agent as _ray_agent
from air_magic.backends.ray.ray_launch import Kept, RayLaunch, remove_agents
from air_magic.protocol import (
    Shutdown,
    StartLaunch,
    Stop,
    ToHelper,
    ToKernel,
)


class RayBackend:
    """The kernel's connection to a Ray cluster, used by launches with ``backend="ray"``."""

    name = "ray"
    #: The ranks' pids are processes of other machines: nothing here signals or samples them.
    local_processes = False

    def __init__(self, on_message: Callable[[Any, ToKernel], None], on_gone: Callable[[Any], None]) -> None:
        self.ray = connect()
        self.ready = threading.Event()
        self.ready.set()
        self._alive = True
        self._on_message = on_message
        self._on_gone = on_gone
        self._lock = threading.Lock()
        self._launches: dict[str, RayLaunch] = {}
        self._agent_class: Any = None
        self._kept: list[Kept] = []  # the agents of this kernel's pools
        # Registered after `import ray` registered ray.shutdown: at exit, this runs first.
        atexit.register(self.close)
        _BACKENDS.add(self)

    @property
    def alive(self) -> bool:
        """Usable for a new launch: not closed, and this process is still in the cluster
        (after a ``ray.shutdown()`` the launcher connects a new backend)."""
        return self._alive and bool(self.ray.is_initialized())

    @alive.setter
    def alive(self, value: bool) -> None:
        self._alive = value

    # -- what the launcher uses ------------------------------------------------------------

    def hardware(self) -> Hardware:
        """What the cluster offers, as :meth:`LaunchSpec.resolve` reads a machine."""
        resources = self.ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        kinds = [key.split(":", 1)[1] for key in resources if key.startswith("accelerator_type:")]
        name = f"NVIDIA {kinds[0]}" if gpus and kinds else None
        return Hardware(gpu_count=gpus, gpu_name=name, cpu_count=max(1, int(resources.get("CPU", 1))))

    def waiting_for(self, world_size: int) -> str:
        return f"placing {world_size} rank{'s' * (world_size != 1)} on the Ray cluster"

    def send(self, message: ToHelper) -> None:
        if isinstance(message, StartLaunch):
            launch = RayLaunch(self, message.request)
            with self._lock:
                self._launches[launch.id] = launch
            threading.Thread(target=launch.run, name=f"air_magic-ray-{launch.id}", daemon=True).start()
        elif isinstance(message, Stop):
            with self._lock:
                found = self._launches.get(message.launch_id)
            if found is not None:
                found.stop(message.reason)
        elif isinstance(message, Shutdown):
            self.close()

    def try_send(self, message: ToHelper) -> None:
        self.send(message)

    def returncode(self) -> int | None:
        return None

    def stacks(self, launch_id: str, timeout: float) -> dict[int, str]:
        """Every running rank's stacks, by rank (asked of the agents)."""
        with self._lock:
            found = self._launches.get(launch_id)
        return found.stacks(timeout) if found is not None else {}

    def collectives(self, launch_id: str, ranks: list[int], how: str, timeout: float) -> dict[int, Any]:
        """Each rank's Flight Recorder, as its stack thread answers ``how`` (asked of the agents);
        None for a rank that did not answer."""
        with self._lock:
            found = self._launches.get(launch_id)
        return found.collectives(ranks, how, timeout) if found is not None else {r: None for r in ranks}

    def signal_ranks(self, launch_id: str, ranks: list[int], signum: int) -> None:
        """``signum`` to these ranks of a launch (by their agents)."""
        with self._lock:
            found = self._launches.get(launch_id)
        if found is not None:
            found.signal_ranks(ranks, signum)

    def kernel_address(self) -> str:
        """This machine's address in the cluster (the one Ray's nodes reach this driver at)."""
        return str(self.ray.util.get_node_ip_address())

    def close(self, wait: float = 5.0) -> None:
        """Kill every rank of every launch and remove their actors (a pool's kept ones too)."""
        self._end_launches(wait, leaving=False)
        with self._lock:
            kept, self._kept = self._kept, []
        if kept and self.ray.is_initialized():
            for each in kept:
                remove_agents(self.ray, each.agents, each.group)
        atexit.unregister(self.close)

    def leave(self, wait: float = 5.0) -> None:
        """Before ``ray.shutdown()``: end every launch (ranks killed, actors removed) while
        still connected; each fails with "this process left the Ray cluster"."""
        self._end_launches(wait, leaving=True)

    def _end_launches(self, wait: float, leaving: bool) -> None:
        with self._lock:
            launches = list(self._launches.values())
        for launch in launches:
            launch.leaving = launch.leaving or leaving
            launch.stop("kill")
        deadline = time.monotonic() + wait
        for launch in launches:
            launch.finished.wait(max(0.0, deadline - time.monotonic()))
        self.alive = False

    # -- a pool's agents, kept ------------------------------------------------------------

    def keep_agents(self, launch: "RayLaunch", gpu: bool) -> Kept:
        """Keep the agents a pool's launch placed, for the pool's life."""
        kept = Kept(launch.group, list(launch.agents), list(launch.nodes), gpu, pool=launch.id, last_pool=launch.id)
        with self._lock:
            self._kept.append(kept)
        return kept

    def take_agents(self, launch: "RayLaunch", n: int, gpu: bool) -> Kept | None:
        """Kept agents for ``launch``: a pool's own (its restart), or, for another launch, a
        pool's that no launch borrows now, with room for ``n`` ranks of this kind."""
        with self._lock:
            for kept in self._kept:
                if kept.released or kept.gpu != gpu or len(kept.agents) < n:
                    continue
                if launch.request.pool and kept.pool is None and len(kept.agents) == n:
                    kept.pool = kept.last_pool = launch.id
                    return kept
                if not launch.request.pool and kept.lent_to is None:
                    kept.lent_to = launch.id
                    return kept
        return None

    def return_agents(self, launch: "RayLaunch") -> None:
        """A launch on kept agents ended: they are free for the next (or removed, their pool closed)."""
        kept = launch.kept
        assert kept is not None
        with self._lock:
            if kept.pool == launch.id:
                kept.pool = None
            if kept.lent_to == launch.id:
                kept.lent_to = None
            remove = kept.released and kept.pool is None and kept.lent_to is None
            if remove:
                self._kept.remove(kept)
        if remove:
            remove_agents(self.ray, kept.agents, kept.group)

    def pool_started(self, launch_id: str) -> None:
        """The pool's ranks are up: each of its agents starts a spare rank process now (not
        while the pool's own ranks import torch on the same CPUs)."""
        with self._lock:
            found = [k for k in self._kept if k.pool == launch_id]
        if found and self.ray.is_initialized():
            for agent in found[0].agents:
                agent.prepare_spare.remote()

    def release_pool(self, launch_id: str) -> None:
        """The pool whose last launch is ``launch_id`` closed: its agents are removed (once a
        launch that borrowed them has ended)."""
        with self._lock:
            found = [k for k in self._kept if k.pool == launch_id or k.last_pool == launch_id]
        for kept in found:
            with self._lock:
                kept.released = True
                remove = kept.pool in (None, launch_id) and kept.lent_to is None
                if remove and kept in self._kept:
                    self._kept.remove(kept)
            if remove and self.ray.is_initialized():
                remove_agents(self.ray, kept.agents, kept.group)

    # -- for the launches ----------------------------------------------------------------------

    def agent_class(self) -> Any:
        if self._agent_class is None:
            self._agent_class = self.ray.remote(_ray_agent.RankAgent)
        return self._agent_class

    def emit(self, message: ToKernel) -> None:
        try:
            self._on_message(self, message)
        except Exception as exc:  # pragma: no cover - a bug must not stop the launch's thread
            import sys

            sys.stderr.write(f"[air_magic] internal error handling {message.KIND!r}: {exc}\n")

    def forget(self, launch: "RayLaunch") -> None:
        with self._lock:
            self._launches.pop(launch.id, None)


_BACKENDS: "weakref.WeakSet[RayBackend]" = weakref.WeakSet()


def _leave_first(ray: Any) -> None:
    """Make ``ray.shutdown()`` end this process's Ray launches first (once per process)."""
    shutdown = ray.shutdown
    if getattr(shutdown, "_air_magic_leaves_first", False):
        return

    @functools.wraps(shutdown)
    def leave_then_shutdown(*args: Any, **kwargs: Any) -> Any:
        for backend in list(_BACKENDS):
            backend.leave()
        return shutdown(*args, **kwargs)

    leave_then_shutdown._air_magic_leaves_first = True  # type: ignore[attr-defined]
    ray.shutdown = leave_then_shutdown


def connect() -> Any:
    """The ``ray`` module, connected: to the cluster ``ray_init()`` joined, else as
    ``ray_init()`` with no address joins one (``RAY_ADDRESS``, else a new one here)."""
    from air_magic.backends.ray.ray_init import _import_ray, ray_init

    ray = _import_ray()  # RayNotInstalledError says how to install it
    if not ray.is_initialized():
        ray_init()
    _leave_first(ray)
    return _WithoutReconnect(ray)


class _WithoutReconnect:
    """The ``ray`` module, but its calls that connect a process by themselves when it is
    not connected (``ray.get``, ``ray.kill``, ... wrap ``auto_init_ray``) do not: once the
    kernel left the cluster (``ray.shutdown()``, or its exit), a launch's thread must fail
    rather than join the cluster again, or start a new one, however late its next call."""

    _NO_AUTO_INIT = frozenset({"get", "kill", "wait", "put"})

    def __init__(self, ray: Any) -> None:
        self._ray = ray

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._ray, name)
        if name in self._NO_AUTO_INIT:
            return getattr(found, "__wrapped__", found)
        return found
