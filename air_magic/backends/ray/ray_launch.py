"""One launch on Ray, in a thread of its own (the backend that starts it is
:mod:`air_magic.backends.ray.backend`).  For each launch, a thread of this module:

1. checks the cluster has room (CPUs or GPUs) and makes a placement group, one bundle per
   rank (``{"CPU": 1}``, or ``{"CPU": 1, "GPU": 1}`` for GPU ranks; strategy
   ``AIR_MAGIC_RAY_STRATEGY``, PACK by default);
2. places one :class:`~air_magic.backends.ray.agent.RankAgent` per bundle, asks each where it runs,
   and derives torchrun's variables from the placement: ``NODE_RANK`` (nodes in the order of
   their lowest rank), ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (rank 0's node),
   ``MASTER_PORT`` (free there), ``CUDA_VISIBLE_DEVICES`` (the GPUs Ray gave the node's
   ranks, in local-rank order, so ``cuda:LOCAL_RANK`` is the rank's own);
3. starts the ranks (each a fresh Python process on its node, meeting in torch's TCP store);
4. polls the agents: their ranks' log and MLflow spool bytes are appended to the kernel's own
   files (the cell's output, the panel and the MLflow writer read them as for local ranks),
   an exit code becomes ``Exited`` once the rank's result record is in the launch's folder
   (its large tensors come as raw buffers beside it, mapped from this node's object store,
   and are written once into the launch's shared-memory folder, where the record finds
   them as a local rank's); the first failure stops the others (fail fast), as do a
   timeout and a ``Stop``;
5. removes the actors and the placement group, then says ``Done``.

A node that dies takes its agents along: their ranks are reported lost (``StartFailed``
with the node's address and ranks) and the others are stopped.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import time
import traceback
from typing import Any, Protocol

from air_magic.errors import LaunchError
from air_magic.protocol import (
    STOP_ESCALATION,
    Done,
    Exited,
    LaunchRequest,
    Started,
    StartFailed,
    Stopping,
    ToKernel,
    UnpicklableRecord,
    result_path,
    spool_file,
    stack_path,
)
from air_magic.protocol.spool import SPOOL_DIR_ENV, artifact_dir, read_run
from air_magic.rank import results as _results
from air_magic.settings import settings

__all__ = ["RayLaunch", "Kept", "remove_agents", "placement_environment"]

#: How often the agents are asked for new output and exits.
_POLL = 0.1
#: How long the ranks get to write their stacks before a timeout stops them.
_STACK_GRACE = 0.5
#: Why a launch ended when this process left Ray under it.
_LEFT = "this process left the Ray cluster (ray.shutdown())"


class Backend(Protocol):
    """What a launch asks of its backend (:class:`air_magic.backends.ray.backend.RayBackend`)."""

    ray: Any  # the connected ray module (without its automatic reconnect)

    @property
    def agent_class(self) -> Any: ...
    def emit(self, message: ToKernel) -> None: ...
    def forget(self, launch: RayLaunch) -> None: ...
    def keep_agents(self, launch: RayLaunch, gpu: bool) -> Kept: ...
    def take_agents(self, launch: RayLaunch, n: int, gpu: bool) -> Kept | None: ...
    def return_agents(self, launch: RayLaunch) -> None: ...


class RayLaunch:
    """One launch on the cluster, driven by its own thread (:meth:`run`)."""

    def __init__(self, backend: Backend, request: LaunchRequest) -> None:
        self.backend = backend
        self.ray = backend.ray
        self.request = request
        self.id = request.launch_id
        self.agents: list[Any] = []
        self.nodes: list[dict[str, Any]] = []
        self.group: Any = None
        self.kept: Kept | None = None  # the pool's agents this launch runs on
        self.running: set[int] = set()
        self.lost: list[int] = []  # ranks whose node died under them
        self.stopping: str | None = None
        self._steps: list[tuple[float, int]] = []  # (when, signal) still to send
        self._lock = threading.Lock()
        self.finished = threading.Event()
        self.spool = request.env.get(SPOOL_DIR_ENV)
        self.run_text: str | None = None
        self.leaving = False  # ended because this process leaves the cluster (ray.shutdown())

    # -- the thread ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            try:
                pids = self._start()
            except BaseException as exc:  # any failure to place or start: the launch's error
                text = str(exc) if isinstance(exc, LaunchError) else traceback.format_exc()
                self._remove()
                self.backend.emit(StartFailed(self.id, text))
                return
            self.backend.emit(Started(self.id, pids, self._node_names()))
            if self.stopping is not None:  # stopped while starting
                self._schedule(self.stopping)
            try:
                self._watch()
            except Exception as exc:  # the cluster went away under the launch (Ray shut down)
                why = str(exc) if self.ray.is_initialized() else _LEFT
                self._remove()
                self.backend.emit(StartFailed(self.id, f"the connection to the Ray cluster was lost: {why}"))
                return
            self._remove()
            if self.leaving:
                self.backend.emit(StartFailed(self.id, f"the connection to the Ray cluster was lost: {_LEFT}"))
            elif self.lost:
                self.backend.emit(StartFailed(self.id, self._lost_text()))
            else:
                self.backend.emit(Done(self.id))
        finally:
            self.backend.forget(self)
            self.finished.set()

    def _start(self) -> dict[int, int]:
        ray = self.ray
        n = self.request.world_size
        gpu = self.request.device == "cuda"
        kept = self.backend.take_agents(self, n, gpu)
        if kept is not None:  # a pool's agents: no placement, no actor to start
            self.kept = kept
            self.agents, self.nodes = kept.agents[:n], kept.nodes[:n]
        else:
            self._place(n, gpu)
            if self.request.pool:
                self.kept = self.backend.keep_agents(self, gpu)
        port = ray.get(self.agents[0].free_port.remote())
        rank_env = placement_environment(self.nodes, port)
        request = dataclasses.replace(self.request, rank_env=rank_env)
        with open(self.request.payload_path, "rb") as handle:
            payload = ray.put(handle.read())
        pids = ray.get([a.start.remote(request, payload, rank, port) for rank, a in enumerate(self.agents)])
        self.running = set(range(n))
        if self.kept is not None and not self.request.pool:  # the next launch finds a rank process started
            for agent in self.agents:
                agent.prepare_spare.remote()
        return dict(enumerate(pids))

    def _place(self, n: int, gpu: bool) -> None:
        """A placement group of one bundle per rank, and an agent in each."""
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": 1.0, "GPU": 1.0} if gpu else {"CPU": 1.0}
        self._check_room(bundle, n)
        self.group = placement_group([dict(bundle) for _ in range(n)], strategy=settings.ray_strategy)
        ready, _ = ray.wait([self.group.ready()], timeout=settings.ray_place_timeout)
        if not ready:
            raise LaunchError(
                f"the Ray cluster could not place {n} rank{'s' * (n != 1)} of {_bundle(bundle)} within "
                f"{settings.ray_place_timeout:g} s (strategy {settings.ray_strategy}; it has "
                f"{_resources(ray.available_resources())} free of {_resources(ray.cluster_resources())}). "
                "Free some of it or ask for fewer ranks (AIR_MAGIC_RAY_PLACE_TIMEOUT sets the wait)."
            )
        agent = self.backend.agent_class()
        for rank in range(n):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
            options: dict[str, Any] = {"num_cpus": 1, "scheduling_strategy": strategy, "max_restarts": 0}
            if gpu:
                options["num_gpus"] = 1
            self.agents.append(agent.options(**options).remote())
        self.nodes = ray.get([a.node.remote() for a in self.agents])

    def _node_names(self) -> dict[int, str]:
        """``{rank: "node 1 (10.0.0.7)"}``: its NODE_RANK and address."""
        order: list[str] = []
        for node in self.nodes:
            if node["node_id"] not in order:
                order.append(node["node_id"])
        return {r: f"node {order.index(n['node_id'])} ({n['address']})" for r, n in enumerate(self.nodes)}

    def _check_room(self, bundle: dict[str, float], n: int) -> None:
        total = self.ray.cluster_resources()
        for key, amount in bundle.items():
            if total.get(key, 0) < amount * n:
                raise LaunchError(
                    f"the Ray cluster has {_resources(total)}: not enough for {n} rank{'s' * (n != 1)} "
                    f"of {_bundle(bundle)} each. Ask for fewer ranks, or add nodes to the cluster."
                )

    def _watch(self) -> None:
        ray = self.ray
        timeout_at = None if self.request.timeout is None else time.monotonic() + self.request.timeout
        while self.running:
            if not ray.is_initialized():
                raise ConnectionError(_LEFT)
            if timeout_at is not None and time.monotonic() >= timeout_at:
                self._timeout()
            self._send_due_signals()
            if self.spool and self.run_text is None:
                self.run_text = read_run(self.spool)  # id and details: each node's agent publishes them
            ranks = sorted(self.running)
            refs = [self.agents[r].poll.remote(self.id, self.run_text) for r in ranks]
            for rank, ref in zip(ranks, refs):
                try:
                    log, spool, code = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                    self._rank_lost(rank)
                    continue
                self._append(self.request.log_paths[rank], log)
                if self.spool:
                    self._append(spool_file(self.spool, rank), spool)
                if code is not None:
                    if timeout_at is not None and time.monotonic() >= timeout_at:
                        self._timeout()  # the time was up before this exit was seen
                    self._rank_ended(rank, code)
            if self.running:
                time.sleep(_POLL)

    def _rank_ended(self, rank: int, code: int) -> None:
        try:
            result, tensors, artifacts = self.ray.get(self.agents[rank].finish.remote(self.id))
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.ObjectLostError):
            self._rank_lost(rank)
            return
        if result is not None:
            try:
                self._place_tensors(tensors)
            except OSError as exc:  # no room on this machine, in shared memory or on disk
                result = pickle.dumps(UnpicklableRecord("value with large tensors", str(exc)))
            del tensors  # this node's object store lets go of them
            path = result_path(self.request.work_dir, rank)
            with open(os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
                handle.write(result)
            os.replace(f"{path}.tmp", path)
        if artifacts and self.spool:
            root = artifact_dir(self.spool, rank)
            for relative, data in artifacts.items():
                target = os.path.join(root, relative)
                os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
                with open(target, "wb") as handle:
                    handle.write(data)
        self.running.discard(rank)
        self.backend.emit(Exited(self.id, rank, code, time.monotonic()))
        if code != 0 and self.stopping is None:
            self.stop("failure")

    def _place_tensors(self, tensors: dict[str, Any]) -> None:
        """Write each tensor file of a rank's record (bytes mapped from the object store) once,
        under its name, into the launch's shared-memory folder, or into its folder where
        that has no room: where the record's reader looks for a local rank's."""
        folders = (self.request.shm_dir, self.request.work_dir)
        placed: list[str] = []
        try:
            for name in list(tensors):
                placed.append(_results.place_tensor_file(name, tensors.pop(name), folders))
        except BaseException:  # none of them is left behind; re-raised
            for path in placed:
                os.unlink(path)
            raise

    def _rank_lost(self, rank: int) -> None:
        if self.kept is not None:  # an agent of them is gone: the set is not used again
            self.kept.released = True
        self.running.discard(rank)
        self.lost.append(rank)
        self.backend.emit(Exited(self.id, rank, -9, time.monotonic()))
        if self.stopping is None:
            self.stop("failure")

    def _lost_text(self) -> str:
        by_node: dict[str, list[int]] = {}
        for rank in sorted(self.lost):
            by_node.setdefault(self.nodes[rank]["node_id"], []).append(rank)
        parts = []
        for node_id, ranks in by_node.items():
            address = self.nodes[ranks[0]]["address"]
            which = ", ".join(map(str, ranks))
            parts.append(
                f"the Ray node {address} (node id {node_id[:12]}) went away while rank{'s' * (len(ranks) != 1)} "
                f"{which} ran there"
            )
        return "; ".join(parts) + (
            f"; the other ranks of {self.request.world_size} were stopped. "
            "The node died or was removed from the cluster (its raylet's log says why)."
        )

    def _timeout(self) -> None:
        """The time is up: the launch is stopping from this moment (a rank that returns while
        its stacks are taken does not make it a success), then its ranks are stopped."""
        with self._lock:
            if self.stopping is not None:
                return
            self.stopping = "timeout"
        self.backend.emit(Stopping(self.id, "timeout", time.monotonic()))
        self.stacks(_STACK_GRACE)  # where each rank was: the timeout's error says it
        with self._lock:
            self._schedule("timeout")
        self._send_due_signals()

    def _append(self, path: str, data: bytes) -> None:
        if data:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    # -- stopping ------------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """Stop the ranks (a stop of reason ``kill`` also overrides one under way)."""
        with self._lock:
            if self.stopping is not None and reason != "kill":
                return
            first = self.stopping is None
            self.stopping = self.stopping or reason
            if not self.running and not self.agents:
                return  # still being placed: the thread applies the stop once started
            self._schedule(reason)
        if first:
            self.backend.emit(Stopping(self.id, reason, time.monotonic()))
        self._send_due_signals()

    def _schedule(self, reason: str) -> None:
        now = time.monotonic()
        self._steps = sorted(self._steps + [(now + delay, signum) for delay, signum in STOP_ESCALATION[reason]])

    def _send_due_signals(self) -> None:
        with self._lock:
            now = time.monotonic()
            due = [signum for at, signum in self._steps if at <= now]
            self._steps = [step for step in self._steps if step[0] > now]
            ranks = sorted(self.running)
        if due and not self.ray.is_initialized():
            return  # this process left the cluster: its actors and ranks went with it
        for signum in due:
            for rank in ranks:
                self.agents[rank].signal.remote(self.id, signum)

    def signal_ranks(self, ranks: list[int], signum: int) -> None:
        if not self.ray.is_initialized():
            return
        for rank in ranks:
            if rank in self.running:
                self.agents[rank].signal.remote(self.id, signum)

    def collectives(self, ranks: list[int], how: str, timeout: float) -> dict[int, Any]:
        """The running ranks' Flight Recorders (None for one that did not answer)."""
        asked = [r for r in ranks if r in self.running] if self.ray.is_initialized() else []
        refs = {rank: self.agents[rank].collectives.remote(self.id, how, timeout) for rank in asked}
        found: dict[int, Any] = {rank: None for rank in ranks}
        for rank, ref in refs.items():
            try:
                found[rank] = self.ray.get(ref, timeout=timeout + 2)
            except Exception:  # a rank or node gone: it says nothing
                continue
        return found

    def stacks(self, timeout: float) -> dict[int, str]:
        """The running ranks' stacks, by rank, also written where a local rank writes its own
        (the launch's folder), for :func:`air_magic.kernel.inspect.stacks.read_stacks`."""
        ranks = sorted(self.running) if self.ray.is_initialized() else []
        refs = {rank: self.agents[rank].stacks.remote(self.id, min(timeout, _STACK_GRACE)) for rank in ranks}
        found = {}
        for rank, ref in refs.items():
            try:
                text = self.ray.get(ref, timeout=timeout + 2)
            except Exception:  # a rank or node gone: no stack from it
                continue
            if text:
                found[rank] = text
                path = stack_path(self.request.work_dir, rank)
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
                    handle.write(text)
        return found

    def _remove(self) -> None:
        if not self.ray.is_initialized():
            return  # this process left the cluster: its actors and placement group went with it
        if self.kept is not None:  # a pool's agents stay: this launch's ranks are ended
            for agent in self.agents:
                try:
                    agent.end.remote(self.id)
                except Exception:  # an actor already gone
                    pass
            self.backend.return_agents(self)
            return
        remove_agents(self.ray, self.agents, self.group)


def remove_agents(ray: Any, agents: list[Any], group: Any) -> None:
    """Kill the agents (their ranks and spares end with them) and remove their placement group."""
    for agent in agents:
        try:
            ray.kill(agent, no_restart=True)
        except Exception:  # an actor already gone
            pass
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(group)
        except Exception:  # the cluster is gone
            pass


@dataclasses.dataclass
class Kept:
    """The agents of a pool, kept for its life: its restarts place nothing, and a launch
    that comes between the pool's calls borrows them (one rank per agent beside the pool's)."""

    group: Any
    agents: list[Any]
    nodes: list[dict[str, Any]]
    gpu: bool
    pool: str | None  # the id of the pool's launch running on them
    last_pool: str = ""  # the id of the pool's latest launch (it names the pool to release)
    lent_to: str | None = None  # the id of a launch that borrowed them
    released: bool = False  # the pool closed: removed once the borrower is done


def placement_environment(nodes: list[dict[str, Any]], port: int) -> dict[int, dict[str, str]]:
    """torchrun's variables for each rank from where Ray placed it (``nodes[rank]``)."""
    order: list[str] = []
    for node in nodes:
        if node["node_id"] not in order:
            order.append(node["node_id"])
    on_node = {node_id: [r for r, n in enumerate(nodes) if n["node_id"] == node_id] for node_id in order}
    master = nodes[0]["address"]
    env: dict[int, dict[str, str]] = {}
    for rank, node in enumerate(nodes):
        ranks = on_node[node["node_id"]]
        node_rank = order.index(node["node_id"])
        values = {
            "LOCAL_RANK": str(ranks.index(rank)),
            "NODE_RANK": str(node_rank),
            "GROUP_RANK": str(node_rank),
            "LOCAL_WORLD_SIZE": str(len(ranks)),
            "GROUP_WORLD_SIZE": str(len(order)),
            "LOCAL_SIZE": str(len(ranks)),
            "CROSS_RANK": str(node_rank),
            "CROSS_SIZE": str(len(order)),
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            # No agent hosts the store (torchrun's agent does): rank 0's init_process_group() does.
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }
        gpus = [g for r in ranks for g in nodes[r]["gpu_ids"]]
        if gpus:
            values["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        env[rank] = values
    return env


def _bundle(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def _resources(resources: dict[str, float]) -> str:
    cpus, gpus = resources.get("CPU", 0), resources.get("GPU", 0)
    return f"{cpus:g} CPU{'s' * (cpus != 1)} and {gpus:g} GPU{'s' * (gpus != 1)}"
