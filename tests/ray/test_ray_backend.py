"""``backend="ray"`` from a real kernel on a 2-node cluster (a head and a worker node, one
CPU each, on 127.0.0.1): one rank per node with gloo across them, the environment contract,
values in rank order, large tensors back as raw buffers, a rank's own exception, MLflow
points from both nodes, the panel's rows naming the nodes, interrupt, cancel, timeout, a
node that dies, a kernel that is killed and one that is restarted — each leaving no agent
and no rank behind."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import time
from typing import Any

import pytest
from harness import user_lines, wait_until
from ray_support import GLOO, Node, RayCluster, assert_nothing_left, live_agents, ray_processes, running_ranks

pytestmark = [pytest.mark.kernel, pytest.mark.process]


def session_paths(kernel_pid: int) -> list[str]:
    """A kernel's air_magic folders (session folder, shared-memory folder)."""
    pattern = f"air_magic-{kernel_pid}-*"
    return glob.glob(os.path.join(tempfile.gettempdir(), pattern)) + glob.glob(os.path.join("/dev/shm", pattern))


#: A cell whose 2 Ray ranks sleep 300 s.
SLEEPS = "%%distributed -n 2 --backend ray\nimport time\ntime.sleep(300)\n"


def submit_sleeper(kernel: Any, name: str, ranks: int, handle: str, first: str = "") -> None:
    """In ``kernel``: ``@distributed(num_accelerators=ranks, backend="ray") def name()``,
    whose ranks run ``first`` then sleep 300 s, submitted as ``handle``."""
    body = "".join(f"    {line}\n" for line in ["import time", *filter(None, [first]), "time.sleep(300)"])
    kernel.ok(
        "from air_magic import distributed\n\n"
        f"@distributed(num_accelerators={ranks}, backend='ray')\ndef {name}():\n{body}\n{handle} = {name}.submit()\n",
        timeout=60,
    )


PLACED = """\
%%distributed -n 2 --backend ray
import os, socket
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("placed", os.environ["RANK"], "on node", os.environ["NODE_RANK"], flush=True)
dist.destroy_process_group()
{key: os.environ[key] for key in ("RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
 "GROUP_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")} | {"sum": t.item(), "argv": list(__import__("sys").argv)}
"""


def test_one_rank_per_node_with_torchruns_variables_and_values_in_rank_order(
    kernel: Any, ray_cluster: RayCluster
) -> None:
    result = kernel.ok(PLACED, timeout=180)
    values = kernel.value("_")
    assert [v["RANK"] for v in values] == ["0", "1"]
    assert sorted(v["NODE_RANK"] for v in values) == ["0", "1"]  # one rank on each node
    assert values[0]["NODE_RANK"] == "0"  # rank 0's node is node 0
    for v in values:
        assert v["WORLD_SIZE"] == "2" and v["LOCAL_RANK"] == "0" and v["LOCAL_WORLD_SIZE"] == "1"
        assert v["GROUP_WORLD_SIZE"] == "2" and v["MASTER_ADDR"] == "127.0.0.1"
        assert v["sum"] == 3.0  # gloo across the two nodes
    assert values[0]["TORCHELASTIC_RUN_ID"] == values[1]["TORCHELASTIC_RUN_ID"]
    assert values[0]["argv"] == values[1]["argv"]  # as a local rank's: the cell's name
    assert "placed 0 on node 0" in result.stdout  # rank 0's output reaches the cell
    assert_nothing_left()


TENSORS = """\
from air_magic import distributed

@distributed(num_accelerators=2, backend="ray")
def tensors():
    import os, torch
    rank = int(os.environ["RANK"])
    big = torch.full((16 << 20,), float(rank + 1))  # 64 MiB of float32
    halves = torch.arange(1 << 20, dtype=torch.float32).to(torch.bfloat16) * (rank + 1)  # 2 MiB of bfloat16
    return big, halves.requires_grad_()

import os, torch
from air_magic.kernel.launcher import get_launcher

values = tensors.distributed()
launch = tensors.last_launch
checks = []
for rank, (big, halves) in enumerate(values):
    expected = torch.arange(1 << 20, dtype=torch.float32).to(torch.bfloat16) * (rank + 1)
    big[0] = -1.0  # writable, as a tensor made here
    halves.data[0] = -1.0
    checks.append((
        str(big.dtype), tuple(big.shape), bool((big[1:] == rank + 1).all()), float(big[0]),
        str(halves.dtype), tuple(halves.shape), bool(torch.equal(halves.detach()[1:], expected[1:])),
        float(halves[0]), halves.requires_grad,
    ))
left_here = [name for _, _, names in os.walk(get_launcher().shm_root) for name in names]
(checks, left_here, launch.id)
"""


def test_large_tensors_come_back_as_raw_buffers_writable_and_leave_nothing_in_shared_memory(kernel: Any) -> None:
    kernel.ok(TENSORS, timeout=240)
    checks, left_here, launch_id = kernel.value("_")
    floats = ("torch.float32", (16 << 20,), True, -1.0)  # dtype, shape, values, written
    halves = ("torch.bfloat16", (1 << 20,), True, -1.0, True)  # ... and requires_grad
    assert checks == [floats + halves, floats + halves]
    assert left_here == []  # the kernel's shared-memory folder: every file mapped and unlinked
    # The nodes' folders (in their /dev/shm and temp folder) went with their agents.
    nodes = glob.glob(f"/dev/shm/air_magic-ray-{launch_id}-*") + glob.glob(
        os.path.join(tempfile.gettempdir(), f"air_magic-ray-{launch_id}-*")
    )
    assert nodes == []
    assert_nothing_left()


def test_a_failing_rank_raises_its_own_exception_and_stops_the_other(kernel: Any) -> None:
    code = """\
from air_magic import distributed

@distributed(num_accelerators=2, backend="ray")
def fails():
    import os, time
    if os.environ["RANK"] == "1":
        raise ValueError("rank one cannot go on")
    time.sleep(120)  # stopped by the other's failure

fails.distributed()
"""
    began = time.monotonic()
    result = kernel.run(code, timeout=180)
    took = time.monotonic() - began
    assert result.error is not None and result.error["ename"] == "ValueError"
    text = result.error_text
    assert "rank one cannot go on" in text and "rank 1" in text
    assert 'raise ValueError("rank one cannot go on")' in text  # the user's own line
    assert took < 60  # rank 0 did not sleep its 120 s
    assert_nothing_left()


def test_every_mlflow_point_of_both_nodes_is_stored(kernel: Any) -> None:
    code = """\
from air_magic import distributed
import mlflow

@distributed(num_accelerators=2, backend="ray", tracking=True, experiment="ray-tests")
def logs():
    import os, mlflow
    rank = int(os.environ["RANK"])
    for step in range(20):
        mlflow.log_metric("loss", 1.0 / (step + 1) + rank, step=step)
    return rank

from air_magic.panel._render import LaunchSummary
from air_magic.panel._state import LaunchState

def summary_text(launch):
    state = LaunchState(launch)
    state.refresh(0, final=True)
    return LaunchSummary(state).text

handle = logs.submit()
values = handle.result()
import air_magic.tracking
assert air_magic.tracking.flush(120)  # the run's last points are stored behind the values
client = mlflow.MlflowClient()
run = client.get_run(handle.run_id)
(values, run.info.status, len(client.get_metric_history(handle.run_id, "loss")),
 len(client.get_metric_history(handle.run_id, "rank1/loss")),
 sorted({m.value for m in client.get_metric_history(handle.run_id, "rank1/loss")})[0],
 summary_text(handle))
"""
    kernel.ok(code, timeout=240)
    values, status, rank0_points, rank1_points, rank1_lowest, summary = kernel.value("_")
    assert values == [0, 1] and status == "FINISHED"
    assert (rank0_points, rank1_points) == (20, 20)
    assert rank1_lowest == pytest.approx(1.05)  # rank 1's own points, kept apart
    # The summary's rows name the node of each rank.
    assert "rank 0 on node 0 (127.0.0.1): finished" in summary
    assert "rank 1 on node 1 (127.0.0.1): finished" in summary
    assert_nothing_left()


def test_cancel_stops_every_rank_and_leaves_no_actor(kernel: Any) -> None:
    submit_sleeper(kernel, "sleeps", 2, "sleeping", first="print('sleeping', flush=True)")
    assert wait_until(lambda: kernel.value("sleeping.status") == "running", 90, interval=0.5)
    assert wait_until(lambda: running_ranks() == 2, 60)
    time.sleep(2)  # the ranks are in the user's code
    began = time.monotonic()
    kernel.ok("sleeping.cancel()")
    kernel.ok("err = sleeping.exception(timeout=30)")
    assert time.monotonic() - began < 15
    assert kernel.value("type(err).__name__") == "LaunchCancelledError"
    assert kernel.value("sleeping.status") == "cancelled"
    assert kernel.value("[r.stopped or r.returncode == 1 for r in sleeping.ranks]") == [True, True]
    assert_nothing_left()


def test_an_interrupt_stops_the_ranks_with_one_line(kernel: Any) -> None:
    msg_id = kernel.execute(
        "%%distributed -n 2 --backend ray\nimport time\nprint('ticking', flush=True)\ntime.sleep(300)\n"
    )
    assert wait_until(lambda: running_ranks() == 2, 90)
    time.sleep(3)
    began = time.monotonic()
    kernel.km.interrupt_kernel()
    result = kernel.collect(msg_id, timeout=60)
    assert time.monotonic() - began < 20
    assert result.error is not None and result.error["ename"] == "KeyboardInterrupt"
    lines = [line for line in user_lines(result.error_text) if line.strip()]
    assert lines[-1].startswith("KeyboardInterrupt: Cell In[") and "you interrupted it after" in lines[-1]
    assert "its 2 ranks were stopped" in lines[-1]
    assert "Traceback" not in result.error_text
    assert_nothing_left()


def test_a_timeout_stops_every_rank(kernel: Any) -> None:
    result = kernel.run("%%distributed -n 2 --backend ray --timeout 8\nimport time\ntime.sleep(300)\n", timeout=120)
    assert result.error is not None and result.error["ename"] == "LaunchTimeoutError"
    assert "ran past its timeout of 8 s; all 2 ranks were stopped" in result.error_text
    assert_nothing_left()


def test_a_node_that_dies_fails_the_launch_naming_it_and_stops_the_rest(
    kernel: Any, ray_cluster: RayCluster, spare_worker: Node
) -> None:
    # Three ranks on three one-CPU nodes: one of them on the spare node, which dies.
    submit_sleeper(kernel, "long", 3, "doomed")
    assert wait_until(lambda: running_ranks() == 3, 120)
    time.sleep(2)
    ray_cluster.kill_worker(spare_worker, wait=False)
    kernel.ok("err = doomed.exception(timeout=60)", timeout=90)
    text = kernel.value("str(err)")
    assert text.startswith("could not run long: the Ray node 127.0.0.1 (node id ")
    assert f"(node id {spare_worker.node_id[:12]}) went away while rank " in text
    assert "the other ranks of 3 were stopped" in text
    assert_nothing_left()


def test_a_killed_kernel_takes_its_ranks_along(kernel_factory: Any, ray_cluster: RayCluster) -> None:
    doomed = kernel_factory(extra_env={**ray_cluster.env, **GLOO})
    doomed.ok("import air_magic\nair_magic.ray_init()", timeout=120)
    doomed.execute(SLEEPS)
    assert wait_until(lambda: running_ranks() == 2, 120)
    os.kill(doomed.km.provisioner.process.pid, signal.SIGKILL)
    doomed.forget()
    assert_nothing_left(timeout=20)


def test_a_restarted_kernel_takes_its_ranks_along_and_launches_again(
    kernel_factory: Any, ray_cluster: RayCluster
) -> None:
    restarted = kernel_factory(extra_env={**ray_cluster.env, **GLOO})
    restarted.ok("import air_magic\nair_magic.ray_init()", timeout=120)
    restarted.execute(SLEEPS)
    assert wait_until(lambda: running_ranks() == 2, 120)
    assert len(live_agents(ray_cluster)) == 2
    old_pid = restarted.pid
    requested = time.monotonic()
    # The front end's "Restart kernel": a shutdown_request with restart=True while the cell
    # runs, the process ended if it is still there after shutdown_wait_time, a new kernel.
    restarted.km.restart_kernel(now=False)
    restarted.refresh_pid()
    assert restarted.pid != old_pid
    gone = wait_until(lambda: not ray_processes() and not live_agents(ray_cluster), 20, interval=0.2)
    took = time.monotonic() - requested
    assert gone, f"left {took:.1f} s after the restart: {ray_processes()} {live_agents(ray_cluster)}"
    assert took < 12, took
    # The old kernel's own folders (its session folder, its shared-memory folder) went too.
    assert wait_until(lambda: not session_paths(old_pid), 5), session_paths(old_pid)
    restarted.kc.wait_for_ready(timeout=60)
    restarted.ok("%load_ext air_magic")
    restarted.ok("%config DistributedMagics.tracking = False")
    result = restarted.ok("import air_magic\nair_magic.ray_init()", timeout=120)
    assert "2 nodes" in result.stdout  # the same cluster
    restarted.ok("%%distributed -n 2 --backend ray\nimport os\nint(os.environ['RANK'])\n", timeout=180)
    assert restarted.value("_") == [0, 1]
    assert_nothing_left()


def test_a_launch_whose_kernel_leaves_ray_ends_without_connecting_it_again(
    kernel_factory: Any, ray_cluster: RayCluster
) -> None:
    leaving = kernel_factory(extra_env={**ray_cluster.env, **GLOO})
    leaving.ok("import air_magic, ray\nair_magic.ray_init()", timeout=120)
    submit_sleeper(leaving, "sleeps", 2, "sleeping")
    assert wait_until(lambda: running_ranks() == 2, 120)
    # ray.shutdown() ends the kernel's Ray launches before it disconnects: when it returns,
    # the ranks and their agents are gone and the launch has failed saying why.
    assert leaving.value("ray.shutdown()\nsleeping.done()", timeout=60) is True
    # Each rank's end was seen (killed by its agent), not lost with the connection.
    assert leaving.value("[s.returncode for s in sleeping.ranks]") == [-9, -9]
    assert running_ranks() == 0
    assert wait_until(lambda: live_agents(ray_cluster) == [], 10), live_agents(ray_cluster)
    leaving.ok("err = sleeping.exception(timeout=1)", timeout=60)
    # The launch's thread made no Ray call after that (ray.get, ray.kill would have joined again).
    assert leaving.value("ray.is_initialized()") is False
    assert leaving.value("str(err)").endswith(
        "the connection to the Ray cluster was lost: this process left the Ray cluster (ray.shutdown())"
    )
    assert_nothing_left()
    # The kernel joins again and launches on the cluster as before.
    leaving.ok("air_magic.ray_init()", timeout=120)
    again = leaving.ok(
        "@distributed(num_accelerators=2, backend='ray')\ndef ranks():\n    import os\n    return int(os.environ['RANK'])\n"
        "ranks.distributed()",
        timeout=180,
    )
    assert again.result == "[0, 1]", again.stdout
    assert_nothing_left()


SKIPS = """%%distributed -n 2 --backend ray --timeout 90
import time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(8)
dist.all_reduce(t)
if dist.get_rank() == 0:
    dist.all_reduce(t)
else:
    time.sleep(300)
"""


def test_a_rank_on_the_other_node_that_skips_an_all_reduce_is_named_by_the_hang_report(kernel: Any) -> None:
    """The agents ask their ranks' Flight Recorders: the same report as on one machine."""
    kernel.ok("import os\nos.environ['AIR_MAGIC_HANG_SECONDS'] = '2'")
    try:
        msg_id = kernel.execute(SKIPS)

        def reported(res: Any) -> bool:
            return any("hang report:" in str(data.get("text/plain", "")) for _, data, _ in res.displays)

        shown = kernel.collect(msg_id, timeout=120, until=reported)
        report = next(
            str(d.get("text/plain", "")) for _, d, _ in shown.displays if "hang report:" in str(d.get("text/plain", ""))
        )
        verdict = report.splitlines()[0]
        assert verdict.startswith("[air_magic] hang report: rank 1 is behind: its last collective is #1 (Cell In["), (
            report
        )
        assert "rank 0 waits in all_reduce #2 (Cell In[" in verdict, report
        kernel.km.interrupt_kernel()
        result = kernel.collect(msg_id, timeout=60)
        assert result.error is not None and result.error["ename"] == "KeyboardInterrupt"
    finally:
        kernel.ok("os.environ.pop('AIR_MAGIC_HANG_SECONDS', None)")
    assert_nothing_left()
