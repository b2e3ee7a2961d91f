"""``air_magic.ray_init()`` without a cluster: bad arguments are refused before Ray is
imported, Ray missing is one clear line, and the summary line counts what the nodes have.
(Joining and starting clusters: tests/ray/test_ray_init.py, in a network namespace.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

import air_magic
from air_magic import ConfigurationError, RayClusterError, RayNotInstalledError
from air_magic.backends.ray.ray_init import ClusterSummary, cluster_summary

HOW = (
    "Pass the head node's address as `ray start --head` prints it (host:port, port 6379 by default), "
    "or no address (and no RAY_ADDRESS) to start a Ray cluster on this machine."
)


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_import_air_magic_does_not_import_ray() -> None:
    done = run("import sys, air_magic; print(sorted(m for m in ('ray', 'grpc') if m in sys.modules))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_ray_not_installed_is_one_line_that_says_how_to_install_it() -> None:
    done = run(
        """
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        import air_magic
        try:
            air_magic.ray_init("127.0.0.1:6379")
        except ImportError as exc:
            print(type(exc).__name__, isinstance(exc, air_magic.AirMagicError), exc, sep="|")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().split("|") == [
        "RayNotInstalledError",
        "True",
        f"ray_init() needs Ray, which is not installed in this Python environment ({sys.executable}): "
        "pip install 'ray[default]>=2.40' (in a notebook: %pip install 'ray[default]>=2.40').",
    ]
    assert issubclass(RayNotInstalledError, (ImportError, RayClusterError))


def test_a_folder_named_ray_is_not_taken_for_ray() -> None:
    done = run(
        """
        import sys, types
        folder = types.ModuleType("ray")
        folder.__path__ = ["/home/me/notebooks/ray"]  # what `import ray` gives for a folder without Ray installed
        sys.modules["ray"] = folder
        import air_magic
        try:
            air_magic.ray_init("127.0.0.1:6379")
        except air_magic.RayNotInstalledError as exc:
            print(exc)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "ray_init() needs Ray, and `import ray` finds /home/me/notebooks/ray, which is not Ray: "
        "pip install 'ray[default]>=2.40' (in a notebook: %pip install 'ray[default]>=2.40')."
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_gpus": -1}, "min_gpus must be a whole number of GPUs (0 or more), got -1."),
        ({"min_gpus": True}, "min_gpus must be a whole number of GPUs (0 or more), got True."),
        ({"min_gpus": 1.5}, "min_gpus must be a whole number of GPUs (0 or more), got 1.5."),
        ({"connect_timeout": 0}, "connect_timeout must be a number of seconds > 0, got 0."),
        ({"connect_timeout": "5"}, "connect_timeout must be a number of seconds > 0, got '5'."),
        ({"address": 6379}, "address must be a string 'host:port', got int 6379."),
        ({"address": "head-node"}, f"address='head-node' is not 'host:port'. {HOW}"),
        ({"address": "head-node:http"}, f"address='head-node:http' is not 'host:port'. {HOW}"),
        ({"address": "head-node:70000"}, f"address='head-node:70000' is not 'host:port'. {HOW}"),
    ],
)
def test_bad_arguments_are_refused_before_anything_connects(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        air_magic.ray_init(**kwargs)
    assert str(info.value) == message


def test_a_bad_ray_address_is_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "head-node")
    with pytest.raises(ConfigurationError) as info:
        air_magic.ray_init()
    assert str(info.value) == f"RAY_ADDRESS='head-node' is not 'host:port'. {HOW}"


class FakeRay:
    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self._nodes = nodes

    def nodes(self) -> list[dict[str, Any]]:
        return self._nodes


class FakeContext:
    dashboard_url = "127.0.0.1:8265"


def test_the_summary_counts_the_live_nodes_and_their_gpu_models() -> None:
    ray = FakeRay(
        [
            {"Alive": True, "Resources": {"CPU": 2.0, "head_node": 1.0}},
            {"Alive": True, "Resources": {"CPU": 96.0, "GPU": 8.0, "accelerator_type:H100": 1.0}},
            {"Alive": True, "Resources": {"CPU": 16.0, "GPU": 1.0, "accelerator_type:A10G": 1.0}},
            {"Alive": False, "Resources": {"CPU": 96.0, "GPU": 8.0, "accelerator_type:H100": 1.0}},
        ]
    )
    summary = cluster_summary(ray, "10.0.0.1:6379", FakeContext())
    assert summary == ClusterSummary(
        address="10.0.0.1:6379",
        nodes=3,
        cpus=114.0,
        gpus=9.0,
        gpu_models={"H100": 8.0, "A10G": 1.0},
        dashboard_url="http://127.0.0.1:8265",
    )
    assert summary.describe() == "3 nodes, 114 CPUs, 9 GPUs (1 A10G, 8 H100); dashboard http://127.0.0.1:8265"


def test_the_summary_of_one_cpu_node_without_a_dashboard() -> None:
    summary = cluster_summary(FakeRay([{"Alive": True, "Resources": {"CPU": 1.0}}]), "127.0.0.1:6379")
    assert summary.describe() == "1 node, 1 CPU, 0 GPUs; no dashboard"
