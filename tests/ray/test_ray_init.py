"""``air_magic.ray_init()`` against the test cluster: joining it from a kernel (one line names
its nodes and dashboard), calling it again, the errors for another address, missing GPUs,
an address where nothing or no Ray head answers, a missing token and another Ray version,
and a head started on this machine when there is no address (then shut down, leaving
nothing behind)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from typing import Any, Iterator

import pytest
from harness import Kernel
from ray_support import NODE_MARK, RayCluster, free_port, kill_marked, marked_processes

import air_magic
from air_magic import AcceleratorMismatchError, RayClusterError
from air_magic.accelerators import detect_hardware

HOW = (
    "Pass the head node's address as `ray start --head` prints it (host:port, port 6379 by default), "
    "or no address (and no RAY_ADDRESS) to start a Ray cluster on this machine."
)
TOKEN = (
    "set RAY_AUTH_MODE=token and give this process the cluster's token (in ~/.ray/auth_token, in the file "
    "RAY_AUTH_TOKEN_PATH names, or in RAY_AUTH_TOKEN) before it starts; for a notebook, in the environment "
    "of its kernel."
)


def live(cluster: RayCluster) -> int:
    return sum(1 for node in cluster.nodes() if node["state"] == "ALIVE")


def status_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[air_magic]")]


def joined(k: Kernel) -> None:
    """The kernel is connected (again) to the cluster of its RAY_ADDRESS."""
    k.ok("import ray, air_magic\nif not ray.is_initialized():\n    ctx = air_magic.ray_init()", timeout=120)


# -- from a kernel ---------------------------------------------------------------------------

pytestmark = pytest.mark.kernel


def test_a_kernel_joins_the_cluster_of_its_ray_address(ray_kernel: Kernel, ray_cluster: RayCluster) -> None:
    n = live(ray_cluster)
    res = ray_kernel.ok("import ray, air_magic\nctx = air_magic.ray_init()", timeout=120)
    assert status_lines(res.stdout) == [
        f"[air_magic] Joined the Ray cluster at {ray_cluster.address}: {n} nodes, {n} CPUs, 0 GPUs; "
        f"dashboard {ray_cluster.dashboard_url}"
    ]
    assert ray_kernel.value("ctx.dashboard_url") == ray_cluster.dashboard_url.removeprefix("http://")
    assert ray_kernel.value("ray.get_runtime_context().gcs_address") == ray_cluster.address


def test_calling_it_again_returns_the_same_context(ray_kernel: Kernel, ray_cluster: RayCluster) -> None:
    joined(ray_kernel)
    port = ray_cluster.port
    res = ray_kernel.ok(
        "again = [air_magic.ray_init(), air_magic.ray_init(ray.get_runtime_context().gcs_address), "
        f"air_magic.ray_init('localhost:{port}')]"
    )
    assert ray_kernel.value("[c is ctx for c in again]") == [True, True, True]
    n = live(ray_cluster)
    line = (
        f"[air_magic] Already connected to the Ray cluster at {ray_cluster.address}: {n} nodes, {n} CPUs, 0 GPUs; "
        f"dashboard {ray_cluster.dashboard_url}"
    )
    assert status_lines(res.stdout) == [line] * 3


def test_another_address_while_connected_is_an_error(ray_kernel: Kernel, ray_cluster: RayCluster) -> None:
    joined(ray_kernel)
    res = ray_kernel.run("air_magic.ray_init('127.0.0.1:1')")
    assert res.error is not None and res.error["ename"] == "RayClusterError"
    assert res.error["evalue"] == (
        f"this process is already connected to the Ray cluster at {ray_cluster.address}; it cannot join "
        "127.0.0.1:1 as well. Call ray.shutdown() first to leave it, or call ray_init() without an address "
        "to keep using it."
    )
    assert res.error["traceback"] == [f"RayClusterError: {res.error['evalue']}"]  # no frames of air_magic
    res = ray_kernel.run("air_magic.ray_init(namespace='other')")
    assert res.error is not None and res.error["evalue"] == (
        f"this process is already connected to the Ray cluster at {ray_cluster.address}, and ray.init()'s "
        "arguments (namespace) apply when it connects. Call ray.shutdown() first to connect again with them."
    )
    assert ray_kernel.value("ray.is_initialized()") is True


def test_a_cluster_without_the_gpus_asked_for(ray_kernel: Kernel, ray_cluster: RayCluster) -> None:
    joined(ray_kernel)
    n = live(ray_cluster)
    res = ray_kernel.run("air_magic.ray_init(min_gpus=1)")
    assert res.error is not None and res.error["ename"] == "AcceleratorMismatchError"
    assert res.error["evalue"] == (
        f"min_gpus=1 was asked for, but the Ray cluster at {ray_cluster.address} has 0 GPUs on {n} live nodes. "
        "Join a cluster with GPU nodes, add GPU nodes to this one, or ask for fewer GPUs."
    )
    assert ray_kernel.value("ray.is_initialized()") is True  # connected before: stays connected
    # joining with the requirement: refused, and left again
    ray_kernel.ok("ray.shutdown()")
    res = ray_kernel.run("air_magic.ray_init(min_gpus=2)", timeout=120)
    assert res.error is not None and res.error["evalue"] == (
        f"min_gpus=2 was asked for, but the Ray cluster at {ray_cluster.address} has 0 GPUs on {n} live nodes "
        "(this process left it again). Join a cluster with GPU nodes, add GPU nodes to this one, "
        "or ask for fewer GPUs."
    )
    assert ray_kernel.value("ray.is_initialized()") is False
    joined(ray_kernel)  # and it can join again


# -- addresses that are no Ray head (in this process: nothing connects) ------------------------


@pytest.fixture
def no_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def timed_error(address: str | None, **kwargs: Any) -> tuple[str, float]:
    began = time.monotonic()
    with pytest.raises(RayClusterError) as info:
        air_magic.ray_init(address, **kwargs)
    return str(info.value), time.monotonic() - began


def test_a_refused_address_fails_fast_and_names_it(no_ray_address: None) -> None:
    port = free_port()
    message, took = timed_error(f"127.0.0.1:{port}")
    refused = "the connection was refused (nothing listens there)"
    assert message == f"cannot reach the Ray cluster at 127.0.0.1:{port}: {refused}. {HOW}"
    assert took < 10


def test_the_address_of_ray_address_is_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    message, took = timed_error(None)
    assert message.startswith(f"cannot reach the Ray cluster at 127.0.0.1:{port} (from RAY_ADDRESS): the connection")
    assert took < 10


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose queue of connections is full: a new connection gets no answer at all."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    held = []
    for _ in range(2):  # fill the queue; the second waits until it times out
        client = socket.socket()
        client.settimeout(0.5)
        try:
            client.connect(("127.0.0.1", port))
        except OSError:
            pass
        held.append(client)
    yield port
    for sock in (*held, server):
        sock.close()


def test_an_address_that_never_answers_times_out_as_asked(no_ray_address: None, silent_port: int) -> None:
    message, took = timed_error(f"127.0.0.1:{silent_port}", connect_timeout=1)
    assert message == (
        f"cannot reach the Ray cluster at 127.0.0.1:{silent_port}: no answer within 1 s "
        f"(the host is down, or a firewall drops the connection). {HOW}"
    )
    assert took < 5


@pytest.fixture
def mute_server() -> Iterator[int]:
    """Accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for sock in accepted:
        sock.close()


def test_what_answers_but_is_no_ray_head_is_named_fast(
    no_ray_address: None, ray_cluster: RayCluster, mute_server: int
) -> None:
    dashboard = f"127.0.0.1:{ray_cluster.dashboard_port}"
    message, took = timed_error(dashboard)
    assert message == f"something answers at {dashboard}, but it is not a Ray head (GCS): it does not speak gRPC. {HOW}"
    assert took < 10
    client = f"127.0.0.1:{ray_cluster.client_server_port}"
    message, _ = timed_error(client)
    assert message == (
        f"something answers at {client}, but it is not a Ray head (GCS): it is a gRPC server of another kind "
        f"(a Ray Client server is one: join that as 'ray://{client}'). {HOW}"
    )
    message, took = timed_error(f"127.0.0.1:{mute_server}", connect_timeout=2)
    assert message == (
        f"something answers at 127.0.0.1:{mute_server}, but it is not a Ray head (GCS): it accepts connections "
        f"but says nothing within 2 s. {HOW}"
    )
    assert took < 8


# -- in processes of their own ---------------------------------------------------------------


def run_python(code: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=timeout
    )


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(extra)
    return env


REPORT = """
import time, air_magic
began = time.monotonic()
try:
    air_magic.ray_init()
except air_magic.AirMagicError as exc:
    print("ERROR", type(exc).__name__, exc)
print("TOOK", time.monotonic() - began)
"""


def reported(done: subprocess.CompletedProcess[str]) -> tuple[str, float]:
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    error = next(line for line in lines if line.startswith("ERROR "))
    took = float(next(line for line in lines if line.startswith("TOOK ")).split()[1])
    return error.removeprefix("ERROR "), took


def test_a_process_without_the_token_is_told_so(ray_cluster: RayCluster) -> None:
    env = clean_env(RAY_ADDRESS=ray_cluster.address, HOME=ray_cluster.env["HOME"] + "-none")
    error, took = reported(run_python(REPORT, env))
    assert error == (
        f"RayClusterError the Ray cluster at {ray_cluster.address} (from RAY_ADDRESS) asks for an authentication "
        f"token, and this process has none: {TOKEN}"
    )
    assert took < 10


def test_a_token_the_cluster_does_not_know_is_refused(ray_cluster: RayCluster, tmp_path: Any) -> None:
    wrong = tmp_path / "token"
    wrong.write_text("0" * 64)
    env = clean_env(**{**ray_cluster.env, "RAY_AUTH_TOKEN_PATH": str(wrong)})
    error, took = reported(run_python(REPORT, env))
    assert error == (
        f"RayClusterError the Ray cluster at {ray_cluster.address} (from RAY_ADDRESS) refused this process's "
        f"authentication token: {TOKEN}"
    )
    assert took < 30


def test_another_ray_version_than_the_clusters(ray_cluster: RayCluster) -> None:
    import ray

    code = "import ray\nray.__version__ = '2.0.0'\n" + REPORT
    error, _ = reported(run_python(code, clean_env(**ray_cluster.env)))
    python = ".".join(map(str, sys.version_info[:3]))
    assert error == (
        f"RayClusterError the Ray cluster at {ray_cluster.address} (from RAY_ADDRESS) runs Ray {ray.__version__} "
        f"on Python {python}, and this process Ray 2.0.0 on Python {python}: Ray wants the same versions on "
        f"both sides. Use an environment with Ray {ray.__version__} (pip install 'ray[default]=={ray.__version__}'), "
        "or a cluster started with this process's versions."
    )


def test_without_an_address_a_head_starts_here_and_shuts_down_cleanly(tmp_path: Any) -> None:
    mark = uuid.uuid4().hex
    home = tmp_path / "home"
    home.mkdir()
    code = """
    import ray, air_magic
    ctx = air_magic.ray_init()
    print("CPUS", ray.cluster_resources().get("CPU"), "GPUS", ray.cluster_resources().get("GPU", 0))
    print("AGAIN", air_magic.ray_init() is ctx)
    ray.shutdown()
    """
    # Ray's temp folder of its own (Ray's default, /tmp/ray, is every Ray user's of the machine);
    # short, as Ray's unix sockets live under it
    ray_tmp = tempfile.mkdtemp(prefix="amray-")
    env = clean_env(HOME=str(home), SPT_NOENV="1", RAY_TMPDIR=ray_tmp, **{NODE_MARK: mark})
    try:
        done = run_python(code, env)
        if done.returncode != 0 and "timed out during startup" in done.stderr:
            # Ray 2.60's raylet waits 15 s for its dashboard agent, which a loaded 2-core
            # machine can exceed: that is Ray's start-up, not ray_init(); once more.
            kill_marked(NODE_MARK, mark)
            done = run_python(code, env)
        assert done.returncode == 0, done.stderr[-4000:]
        lines = done.stdout.splitlines()
        started = status_lines(done.stdout)[0]
        match = re.fullmatch(
            r"\[air_magic\] Started a Ray cluster on this machine at 127\.0\.0\.1:\d+: 1 node, (\d+) CPUs?, "
            r"(\d+) GPUs?(?: \([^)]*\))?; dashboard http://127\.0\.0\.1:\d+",
            started,
        )
        assert match, started
        assert int(match[2]) == detect_hardware().gpu_count  # this machine's GPUs, as a launch counts them
        cpus = next(line for line in lines if line.startswith("CPUS")).split()
        assert cpus == ["CPUS", f"{float(match[1])}", "GPUS", f"{float(match[2])}" if int(match[2]) else "0"]
        assert "AGAIN True" in lines
        # ray.shutdown() took the head's processes along (a few seconds' grace)
        deadline = time.monotonic() + 15
        while marked_processes(NODE_MARK, mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marked_processes(NODE_MARK, mark) == []
    finally:
        kill_marked(NODE_MARK, mark)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_without_an_address_and_gpus_asked_for_nothing_starts(no_ray_address: None) -> None:
    if detect_hardware().gpu_count:
        pytest.skip("this machine has a GPU")
    began = time.monotonic()
    with pytest.raises(AcceleratorMismatchError) as info:
        air_magic.ray_init(min_gpus=1)
    assert str(info.value) == (
        "min_gpus=1 was asked for, but this machine has no NVIDIA GPU (CPU only), so a Ray cluster started here "
        "would not have them. Pass the address of a cluster with GPU nodes, or ask for fewer GPUs."
    )
    assert time.monotonic() - began < 10
    import ray

    assert not ray.is_initialized()
