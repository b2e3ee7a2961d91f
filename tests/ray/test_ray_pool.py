"""A pool on the Ray backend, from a real kernel on the 2-node test cluster (one CPU each):
one rank per node whose namespace and gloo group stay across cells, push and pull, Ctrl-C
that keeps the state, a killed rank that breaks the pool and a next cell that restarts it
on the same agents, a launch between pool cells that borrows the pool's agents, and a
kernel that dies taking the pool's agents, ranks and spare processes along."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from harness import user_lines, wait_until
from ray_support import GLOO, RayCluster, assert_nothing_left, live_agents, ray_processes

pytestmark = [pytest.mark.kernel, pytest.mark.process]


@pytest.fixture
def pool(kernel: Any) -> Any:
    """A 2-rank pool on Ray, started with the line magic; stopped (nothing left) at the end."""
    result = kernel.ok("%distributed_pool -n 2 --backend ray", timeout=180)
    assert "[air_magic] pool of 2 CPU ranks on ray: idle" in result.stdout
    yield kernel
    kernel.ok("%distributed_pool --stop", timeout=60)
    assert_nothing_left()


STATE = """\
%%distributed --pool
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")            # pasted from a script: the pool's group
w = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(w)
os.environ["NODE_RANK"], os.environ["AIR_MAGIC_POOL"]
"""

AGAIN = """\
%%distributed --pool
dist.destroy_process_group()               # leaves the pool's group alive
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
w.item(), t.item(), dist.is_initialized(), lr
"""


def test_a_ray_pool_keeps_its_namespace_and_its_group_across_cells_on_both_nodes(pool: Any) -> None:
    pool.ok(STATE, timeout=60)
    assert pool.value("_") == [("0", "1"), ("1", "1")]  # one rank on each node
    pool.ok("p = air_magic.Pool.current()\np.push(lr=0.5)")
    pool.ok(AGAIN, timeout=60)
    assert pool.value("_") == [(3.0, 3.0, True, 0.5), (3.0, 3.0, True, 0.5)]
    assert pool.value("p.pull('w')[1].item()") == 3.0
    assert "on ray: idle, 4 calls run" in pool.ok("%distributed_pool").shown_text


def test_a_launch_between_pool_cells_borrows_the_pool_s_agents_and_the_pool_stays(
    pool: Any, ray_cluster: RayCluster
) -> None:
    pool.ok("%%distributed --pool\nkept = 41")
    agents = live_agents(ray_cluster)
    assert len(agents) == 2
    # The cluster has no CPU left (the pool's bundles hold both): the launch runs on the
    # pool's agents, beside its ranks, with no actor or placement of its own.
    pool.ok("%%distributed -n 2 --backend ray\nimport os\nint(os.environ['RANK']) + 1", timeout=120)
    assert pool.value("_") == [1, 2]
    assert live_agents(ray_cluster) == agents
    pool.ok("%%distributed --pool\nkept + 1")
    assert pool.value("_") == [42, 42]


def test_ctrl_c_in_a_ray_pool_cell_keeps_the_pool_and_its_state(pool: Any) -> None:
    pool.ok("%%distributed --pool\ny = 5")
    msg_id = pool.execute("%%distributed --pool\nimport time\nprint('waiting', flush=True)\ntime.sleep(300)\n")
    pool.collect(msg_id, timeout=60, until=lambda so_far: "waiting" in so_far.stdout)
    began = time.monotonic()
    pool.km.interrupt_kernel()
    result = pool.collect(msg_id, timeout=60)
    assert time.monotonic() - began < 10
    assert result.error is not None and result.error["ename"] == "KeyboardInterrupt"
    last = [line for line in user_lines(result.error_text) if line.strip()][-1]
    assert last.endswith(
        "you interrupted the pool's cell; every rank stopped it, and the pool and its state are intact."
    )
    pool.ok("%%distributed --pool\ny")
    assert pool.value("_") == [5, 5]


def test_a_killed_ray_rank_breaks_the_pool_and_the_next_cell_restarts_it_on_its_agents(
    pool: Any, ray_cluster: RayCluster
) -> None:
    pool.ok("%%distributed --pool\nstate = 'old'")
    agents = live_agents(ray_cluster)
    pool.ok("import time\ndef wait_long():\n    time.sleep(300)\n\ncall = air_magic.Pool.current().submit(wait_long)")
    time.sleep(1)
    pid = pool.value("air_magic.Pool.current().status()['pids'][1]")
    os.kill(pid, signal.SIGKILL)  # the cluster's nodes are this machine's processes
    killed = time.monotonic()
    pool.ok("err = call.exception(timeout=30)", timeout=60)
    assert time.monotonic() - killed < 5 + 2  # detected within 5 s (and the kernel's round trip)
    text = pool.value("str(err)")
    assert text.startswith("rank 1 of 2 of the pool was killed by SIGKILL"), text
    assert "the pool is broken" in text
    result = pool.ok("%%distributed --pool\n'state' in globals()", timeout=120)
    assert "[air_magic] the pool was broken (rank 1 ended (exit -9)); starting 2 fresh ranks" in result.stderr
    assert pool.value("_") == [False, False]
    assert live_agents(ray_cluster) == agents  # the same agents: nothing placed again


def test_a_killed_kernel_takes_its_ray_pool_along(kernel_factory: Any, ray_cluster: RayCluster) -> None:
    doomed = kernel_factory(extra_env={**ray_cluster.env, **GLOO})
    doomed.ok("import air_magic\nair_magic.ray_init()", timeout=120)
    doomed.ok("%distributed_pool -n 2 --backend ray", timeout=180)
    doomed.ok("%%distributed --pool\nx = 1")
    assert wait_until(lambda: any("--spare" in text for text in ray_processes()), 30)  # a spare per agent
    os.kill(doomed.km.provisioner.process.pid, signal.SIGKILL)
    doomed.forget()
    assert_nothing_left(timeout=20)
