"""A Ray cluster of several nodes on this one machine, for the tests of tests/ray/.

Every Ray test runs inside a network namespace that has only the loopback interface
(``conftest.py`` re-runs them under ``unshare -n`` when needed): there Ray's nodes find no
other address than 127.0.0.1, so nothing they send can leave the machine, and no test ever
talks to another address.

A :class:`RayCluster` is ``ray start --head`` plus ``ray start --address`` nodes, each with a
temp folder of its own, one CPU and a custom resource that names it (``head_node``,
``worker_node``, ``worker_node_2`` ...), token authentication (the token in a private
``HOME``) and the GCS's health checks tightened so that a killed node is seen dead within
about two seconds. Ray's processes are found by a marker in their environment (with
``SPT_NOENV=1`` Ray's process titles leave the environment readable); ``ray stop`` is
never used: it stops every Ray process of the machine, other users' and other tests' too.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

#: This folder; the test that re-runs the others in a namespace of their own.
HERE = Path(__file__).resolve().parent
WRAPPER = "test_ray_namespace.py"
#: The node ids of the Ray tests the outer session selected (the wrapper runs them), and
#: the lines the wrapper reports for the terminal summary.
INNER = pytest.StashKey[list[str]]()
SUMMARY = pytest.StashKey[list[str]]()
#: What each of them did in the namespace, by node id: (outcome, what it said), set by the
#: wrapper and read by the items that stand for them in the outer session.
RESULTS = pytest.StashKey[dict[str, tuple[str, str]]]()

#: Set in the environment of every process of one cluster (its value is the cluster's id).
CLUSTER_MARK = "AIR_MAGIC_TEST_RAY_CLUSTER"
#: Which node of the cluster a process belongs to.
NODE_MARK = "AIR_MAGIC_TEST_RAY_NODE"

#: The inner pytest session started in a loopback-only namespace sets this (to its run id);
#: every process started in it inherits it, so the outer session can find what is left.
NAMESPACE_RUN = "AIR_MAGIC_TEST_RAY_NETNS"

#: How to get Ray for these tests.
INSTALL_HINT = "pip install -e '.[ray]' (scripts/setup_env.sh installs it with the test tools)"

#: Object store per node: small, so that two nodes fit in a container's /dev/shm.
OBJECT_STORE_BYTES = 200 * 1024 * 1024

#: The GCS declares a node dead after 3 missed checks 0.5 s apart (Ray's default: 5 x 3 s).
_FAST_HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}

#: Variables of the test process that must not steer a cluster or its clients.
_FOREIGN = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_NAMESPACE")


def ray_version() -> str | None:
    """The installed Ray's version, or None (``tests/ray`` on ``sys.path`` is no Ray)."""
    from importlib import metadata

    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return None


# -- the network namespace -----------------------------------------------------------------


def interfaces() -> list[str]:
    """The network interfaces of this process's namespace (``/sys/class/net`` shows the
    namespace that mounted it, not necessarily this one)."""
    return sorted(name for _, name in socket.if_nameindex())


def loopback_only() -> bool:
    """True when this process's network namespace has the loopback interface, up, and nothing else."""
    return interfaces() == ["lo"] and _loopback_up()


_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def _loopback_flags(sock: socket.socket) -> int:
    request = struct.pack("16sH", b"lo", 0)
    return int(struct.unpack("16sH", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request)[:18])[1])


def _loopback_up() -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        return bool(_loopback_flags(sock) & _IFF_UP)


def bring_loopback_up() -> None:
    """``ip link set lo up`` without iproute2 (a new namespace's ``lo`` starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = _loopback_flags(sock)
        if not flags & _IFF_UP:
            fcntl.ioctl(sock.fileno(), _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


def unshare_prefix() -> tuple[list[str] | None, str]:
    """The command prefix that runs a program in a new network namespace of its own:
    ``unshare -n`` (root), else ``unshare -rn`` (a user namespace, where the kernel allows
    them); ``(None, why)`` when neither works here."""
    tool = shutil.which("unshare")
    if tool is None:
        return None, "the unshare command (util-linux) is not installed"
    failures = []
    for prefix in ([tool, "--net"], [tool, "--map-root-user", "--net"]):
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            failures.append(f"`{' '.join(prefix[1:])}`: {exc}")
            continue
        if probe.returncode == 0:
            return prefix, ""
        failures.append(f"`unshare {' '.join(prefix[1:])}`: {probe.stderr.strip() or f'exit {probe.returncode}'}")
    return None, "; ".join(failures)


# -- processes -----------------------------------------------------------------------------


def marked_processes(name: str, value: str) -> list[psutil.Process]:
    """Live processes whose environment has ``name=value``, with every descendant of them."""
    found: dict[int, psutil.Process] = {}
    me = os.getpid()
    for proc in psutil.process_iter():
        try:
            if proc.pid != me and proc.environ().get(name) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    for proc in list(found.values()):
        try:
            for child in proc.children(recursive=True):
                if child.pid != me and child.status() != psutil.STATUS_ZOMBIE:
                    found.setdefault(child.pid, child)
        except psutil.Error:
            continue
    return list(found.values())


def kill_marked(name: str, value: str, timeout: float = 15.0) -> list[psutil.Process]:
    """SIGKILL every process marked ``name=value`` (and its descendants) until none is left;
    returns those still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        procs = marked_processes(name, value)
        if not procs:
            return []
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=max(0.1, min(3.0, deadline - time.monotonic())))
        if time.monotonic() > deadline:
            return [p for p in marked_processes(name, value)]
        if alive:
            time.sleep(0.1)


def describe(procs: list[psutil.Process]) -> str:
    rows = []
    for proc in procs:
        try:
            rows.append(f"pid {proc.pid} ppid {proc.ppid()} {proc.name()}: {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            rows.append(f"pid {proc.pid} (gone)")
    return "\n".join(rows)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the cluster ---------------------------------------------------------------------------


class ClusterError(RuntimeError):
    """The test cluster could not be started, checked or stopped."""


@dataclass
class Node:
    """One node of a :class:`RayCluster`."""

    name: str  # head, worker, worker-2 ...
    resource: str  # the custom resource only this node has (1 unit): head_node, worker_node ...
    temp_dir: str
    node_id: str = ""
    resources: dict[str, float] = field(default_factory=dict)  # as the GCS reports them
    started_s: float = 0.0  # how long `ray start` took


class RayCluster:
    """``ray start --head`` and ``ray start --address`` nodes on this machine, in a loopback-only namespace.

    ``address`` (GCS), ``dashboard_url``, ``head``, ``workers``, ``env`` (what a client
    process needs to join: ``RAY_ADDRESS``, ``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN_PATH``,
    ``HOME``); ``start_worker()``, ``kill_worker()``, ``nodes()`` and ``actors()`` (the GCS's
    view, from the dashboard's state API), ``processes()``, ``stop()``.
    """

    def __init__(self, *, cpus_per_node: int = 1, log_monitor: bool = False) -> None:
        if not loopback_only():
            raise ClusterError(
                f"refusing to start Ray outside a loopback-only network namespace (interfaces: {interfaces()})"
            )
        self.id = uuid.uuid4().hex
        self.cpus_per_node = cpus_per_node
        self.log_monitor = log_monitor
        # Short: Ray's unix sockets live under it (at most 107 bytes a path).
        self.root = tempfile.mkdtemp(prefix="amray-")
        self.home = os.path.join(self.root, "home")
        os.makedirs(os.path.join(self.home, ".ray"), mode=0o700)
        self.token = secrets.token_hex(32)
        self.token_path = os.path.join(self.home, ".ray", "auth_token")
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(self.token)
        self.port = free_port()
        self.dashboard_port = free_port()
        self.client_server_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.head: Node | None = None
        self.workers: list[Node] = []
        self.started_s = 0.0  # head and first workers, `ray start` to alive in the GCS
        self._worker_count = 0
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy

    # -- what a client needs -------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The variables a driver (a kernel, a subprocess) sets to join this cluster."""
        return {
            "RAY_ADDRESS": self.address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": self.token_path,
            "HOME": self.home,
            "RAY_USAGE_STATS_ENABLED": "0",
            "SPT_NOENV": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }

    def _node_env(self, node: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _FOREIGN}
        env.update(self.env)
        env.pop("RAY_ADDRESS")
        env.update(_FAST_HEALTH_CHECKS)
        env[CLUSTER_MARK] = self.id
        env[NODE_MARK] = node
        return env

    # -- life ----------------------------------------------------------------------------------

    def start(self, workers: int = 1) -> RayCluster:
        started = time.monotonic()
        self.head = Node("head", "head_node", os.path.join(self.root, "head"))
        self._ray_start(
            self.head,
            "--head",
            f"--port={self.port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={self.client_server_port}",
            "--no-monitor",  # the autoscaler's monitor: nothing to scale here
        )
        for _ in range(workers):
            self.start_worker()
        self.started_s = time.monotonic() - started
        return self

    def start_worker(self) -> Node:
        """Add a worker node (``worker_node``, then ``worker_node_2`` ...) and wait until the GCS lists it alive."""
        self._worker_count += 1
        suffix = "" if self._worker_count == 1 else f"_{self._worker_count}"
        name = "worker" if self._worker_count == 1 else f"worker-{self._worker_count}"
        node = Node(name, f"worker_node{suffix}", os.path.join(self.root, name))
        self._ray_start(node, f"--address={self.address}")
        self.workers.append(node)
        return node

    def _ray_start(self, node: Node, *args: str) -> None:
        """``ray start`` one node, once more if it fails: on a loaded machine Ray 2.60's raylet can
        give up on its own agents (it waits 15 s for the dashboard agent's port file)."""
        began = time.monotonic()
        failure = self._ray_start_once(node, args)
        if failure is not None:
            kill_marked(NODE_MARK, node.name)
            shutil.rmtree(node.temp_dir, ignore_errors=True)
            print(f"`ray start` of the {node.name} node failed once, trying again:\n{failure[-3000:]}")
            second = self._ray_start_once(node, args)
            if second is not None:
                raise ClusterError(second)
        node.started_s = time.monotonic() - began

    def _ray_start_once(self, node: Node, args: tuple[str, ...]) -> str | None:
        command = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            *args,
            f"--num-cpus={self.cpus_per_node}",
            "--num-gpus=0",
            f"--resources={json.dumps({node.resource: 1})}",
            f"--temp-dir={node.temp_dir}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--include-log-monitor={str(self.log_monitor).lower()}",
            "--disable-usage-stats",
            "--log-style=record",
            "--log-color=false",
        ]
        try:
            done = subprocess.run(
                command,
                env=self._node_env(node.name),
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=240,
            )
        except subprocess.TimeoutExpired as exc:
            return f"`ray start` of the {node.name} node did not return in 240 s:\n{exc.output}"
        if done.returncode != 0:
            return f"`ray start` of the {node.name} node failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
        try:
            self._wait_alive(node, timeout=60)
        except ClusterError as exc:
            return str(exc)
        return None

    def _wait_alive(self, node: Node, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                for entry in self.nodes():
                    if entry["state"] == "ALIVE" and entry.get("resources_total", {}).get(node.resource):
                        if entry["node_ip"] != "127.0.0.1":
                            raise ClusterError(
                                f"the {node.name} node advertises {entry['node_ip']}, not 127.0.0.1: "
                                "this is no loopback-only namespace"
                            )
                        node.node_id = entry["node_id"]
                        node.resources = dict(entry["resources_total"])
                        return
                last = "not listed alive yet"
            except OSError as exc:  # the dashboard is still starting
                last = exc
            time.sleep(0.2)
        raise ClusterError(f"the {node.name} node is not alive in the GCS after {timeout} s (last: {last})")

    def nodes(self) -> list[dict[str, Any]]:
        """Every node the GCS knows (alive and dead), from the dashboard's state API."""
        return self._state("nodes")

    def _state(self, what: str) -> list[dict[str, Any]]:
        request = urllib.request.Request(
            f"{self.dashboard_url}/api/v0/{what}?detail=1&limit=1000",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        with self._opener.open(request, timeout=10) as reply:
            body = json.load(reply)
        return list(body["data"]["result"]["result"])

    def actors(self) -> list[dict[str, Any]]:
        """Every actor the GCS knows (alive and dead), from the dashboard's state API."""
        return self._state("actors")

    def state_of(self, node: Node) -> str:
        for entry in self.nodes():
            if entry["node_id"] == node.node_id:
                return str(entry["state"])
        return "UNKNOWN"

    def kill_worker(self, node: Node | None = None, wait: bool = True, timeout: float = 30.0) -> float:
        """SIGKILL every process of a worker node (its raylet, agents and workers: a machine
        that dies); with ``wait``, until the GCS marks it dead. Returns the seconds that took."""
        node = node or self.workers[0]
        began = time.monotonic()
        left = kill_marked(NODE_MARK, node.name) if self._is_ours(node) else []
        if left:
            raise ClusterError(f"processes of the {node.name} node survive SIGKILL:\n{describe(left)}")
        if node in self.workers:
            self.workers.remove(node)
        if wait:
            deadline = began + timeout
            while self.state_of(node) != "DEAD":
                if time.monotonic() > deadline:
                    raise ClusterError(f"the GCS still lists the {node.name} node as alive {timeout} s after its death")
                time.sleep(0.1)
        return time.monotonic() - began

    def _is_ours(self, node: Node) -> bool:
        return node is self.head or node in self.workers

    def processes(self, node: Node | None = None) -> list[psutil.Process]:
        """The live processes of the cluster, or of one node of it."""
        procs = marked_processes(CLUSTER_MARK, self.id)
        if node is None:
            return procs
        mine = []
        for proc in procs:
            try:
                if proc.environ().get(NODE_MARK) == node.name:
                    mine.append(proc)
            except psutil.Error:
                continue
        return mine

    def stop(self) -> None:
        """Kill every process of the cluster; raise if any survives. The temp folder goes too."""
        left = kill_marked(CLUSTER_MARK, self.id)
        self.head, self.workers = None, []
        shutil.rmtree(self.root, ignore_errors=True)
        # The folders of agents killed with their nodes (a killed node's agent cannot remove
        # its own): what a node's next agent sweeps when it starts, swept now.
        from air_magic.backends.ray.agent import sweep

        for parent in (tempfile.gettempdir(), "/dev/shm"):
            sweep(parent, min_age=0)
        if left:
            raise ClusterError(f"Ray processes of the test cluster survive SIGKILL:\n{describe(left)}")


# -- what the tests of Ray launches look for -----------------------------------------------

# In a namespace whose only interface is lo, the host name resolves to no address of it:
# gloo is told where to listen (on a real cluster it finds the node's own address).
GLOO = {"GLOO_SOCKET_IFNAME": "lo"}


def ray_processes(ranks_only: bool = False) -> list[str]:
    """The command lines of the agents (Ray actors of class RankAgent) and ranks of Ray
    launches still alive (zombies, already dead, left out)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        text = " ".join(proc.info["cmdline"] or [])
        if "air_magic.backends.ray.rank_entry" in text or (not ranks_only and "RankAgent" in text):
            found.append(text)
    return found


def running_ranks() -> int:
    return len(ray_processes(ranks_only=True))


def live_agents(cluster: RayCluster) -> list[str]:
    """The RankAgent actors the GCS does not list as dead (its state API)."""
    return [
        f"{actor['actor_id'][:12]} {actor['state']}"
        for actor in cluster.actors()
        if actor.get("class_name") == "RankAgent" and actor.get("state") != "DEAD"
    ]


def assert_nothing_left(timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    if ray_processes():
        left = [text[:120] for text in ray_processes()]
        pytest.fail(f"left running {timeout} s after the launch ended: {left}")
