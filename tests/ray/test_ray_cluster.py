"""The test cluster itself: two nodes on 127.0.0.1 that a driver joins with the cluster's
environment, a worker node that dies and is seen dead within seconds, and nothing of a
node left once it is killed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from ray_support import Node, RayCluster, interfaces


def test_two_nodes_each_with_a_resource_of_its_own_on_loopback(ray_cluster: RayCluster) -> None:
    assert interfaces() == ["lo"]
    alive = [n for n in ray_cluster.nodes() if n["state"] == "ALIVE"]
    assert {n["node_ip"] for n in alive} == {"127.0.0.1"}
    head, worker = ray_cluster.head, ray_cluster.workers[0]
    assert head is not None and head.node_id != worker.node_id
    assert {n["node_id"] for n in alive} >= {head.node_id, worker.node_id}
    assert head.resources["head_node"] == 1 and "worker_node" not in head.resources
    assert worker.resources["worker_node"] == 1 and "head_node" not in worker.resources
    assert head.resources["CPU"] == worker.resources["CPU"] == 1
    assert ray_cluster.processes(head) and ray_cluster.processes(worker)


def test_a_driver_with_the_cluster_env_runs_a_task_on_each_node(ray_cluster: RayCluster) -> None:
    code = textwrap.dedent(
        """
        import json, ray
        ray.init(log_to_driver=False)  # RAY_ADDRESS and the token come from the environment

        @ray.remote(num_cpus=0)
        def where():
            return ray.get_runtime_context().get_node_id()

        print(json.dumps({
            name: ray.get(where.options(resources={name: 0.01}).remote())
            for name in ("head_node", "worker_node")
        }))
        ray.shutdown()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**_base_env(), **ray_cluster.env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    placed = json.loads(done.stdout.strip().splitlines()[-1])
    assert ray_cluster.head is not None
    assert placed == {"head_node": ray_cluster.head.node_id, "worker_node": ray_cluster.workers[0].node_id}


def test_a_killed_worker_node_is_dead_in_the_gcs_within_seconds(ray_cluster: RayCluster, spare_worker: Node) -> None:
    assert ray_cluster.state_of(spare_worker) == "ALIVE"
    assert ray_cluster.processes(spare_worker)
    took = ray_cluster.kill_worker(spare_worker)
    assert took < 15, f"the GCS took {took:.1f} s to see the node die"
    assert ray_cluster.state_of(spare_worker) == "DEAD"
    assert ray_cluster.processes(spare_worker) == []
    # the rest of the cluster lives on
    assert ray_cluster.head is not None
    assert ray_cluster.state_of(ray_cluster.head) == "ALIVE"
    assert ray_cluster.state_of(ray_cluster.workers[0]) == "ALIVE"


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
