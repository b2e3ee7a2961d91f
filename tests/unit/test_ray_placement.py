"""torchrun's variables from where Ray placed each rank, and what a rank on another node
keeps of the kernel's environment (pure functions; no Ray needed)."""

from __future__ import annotations

from air_magic.backends.ray.agent import node_environment
from air_magic.backends.ray.ray_launch import placement_environment


def _node(node_id: str, address: str, gpus: list[str] | None = None) -> dict:
    return {"node_id": node_id, "address": address, "hostname": node_id, "pid": 1, "gpu_ids": gpus or []}


def test_nodes_are_numbered_by_their_lowest_rank_and_local_ranks_count_within_a_node() -> None:
    # Ray packed ranks 0 and 2 on node B, rank 1 and 3 on node A: B holds rank 0, so B is node 0.
    nodes = [_node("B", "10.0.0.2"), _node("A", "10.0.0.1"), _node("B", "10.0.0.2"), _node("A", "10.0.0.1")]
    env = placement_environment(nodes, 29500)
    assert [env[r]["NODE_RANK"] for r in range(4)] == ["0", "1", "0", "1"]
    assert [env[r]["LOCAL_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert {env[r]["LOCAL_WORLD_SIZE"] for r in range(4)} == {"2"}
    assert {env[r]["GROUP_WORLD_SIZE"] for r in range(4)} == {"2"}
    assert {env[r]["MASTER_ADDR"] for r in range(4)} == {"10.0.0.2"}  # rank 0's node
    assert {env[r]["MASTER_PORT"] for r in range(4)} == {"29500"}
    # Rank 0 hosts the store itself (there is no torchrun agent to host it).
    assert {env[r]["TORCHELASTIC_USE_AGENT_STORE"] for r in range(4)} == {"False"}
    assert all("CUDA_VISIBLE_DEVICES" not in env[r] for r in range(4))  # CPU ranks


def test_a_node_sees_the_gpus_of_its_ranks_in_local_rank_order() -> None:
    # Ray gave rank 0 GPU 3 and rank 1 GPU 1 of the same node: cuda:LOCAL_RANK is each one's own.
    nodes = [_node("A", "10.0.0.1", ["3"]), _node("A", "10.0.0.1", ["1"]), _node("B", "10.0.0.2", ["0"])]
    env = placement_environment(nodes, 1234)
    assert env[0]["CUDA_VISIBLE_DEVICES"] == env[1]["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert (env[0]["LOCAL_RANK"], env[1]["LOCAL_RANK"]) == ("0", "1")
    assert env[2]["CUDA_VISIBLE_DEVICES"] == "0"
    assert env[2]["LOCAL_RANK"] == "0" and env[2]["NODE_RANK"] == "1"


def test_a_rank_on_a_node_keeps_the_users_variables_and_the_nodes_machine_variables() -> None:
    kernel = {
        "PATH": "/kernel/bin",
        "HOME": "/home/kernel",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "MY_SETTING": "from the notebook",
        "OMP_NUM_THREADS": "1",
        "RAY_ADDRESS": "10.0.0.1:6379",
        "VIRTUAL_ENV": "/kernel/venv",
    }
    node = {"PATH": "/node/bin", "HOME": "/home/node", "CUDA_VISIBLE_DEVICES": "2", "RAY_NODE_THING": "x"}
    env = node_environment(kernel, node)
    assert env["MY_SETTING"] == "from the notebook" and env["OMP_NUM_THREADS"] == "1"
    assert env["PATH"] == "/node/bin" and env["HOME"] == "/home/node"
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert "VIRTUAL_ENV" not in env  # the node has none: the kernel's would name a folder of another machine
    assert "RAY_ADDRESS" not in env and env["RAY_NODE_THING"] == "x"
