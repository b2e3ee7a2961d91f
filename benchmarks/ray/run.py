"""Ray backend benchmark: air_magic on a Ray cluster vs. air_magic's local backend vs. Ray
Train's ``TorchTrainer``, on the same work, on a 2-node cluster simulated on this machine.

    python benchmarks/ray/run.py            # about 6 minutes on 2 cores
    python benchmarks/ray/run.py --quick    # fewer repetitions

Like the test suite, it runs inside a loopback-only network namespace (``unshare -n`` as
root, ``unshare -rn`` otherwise), where Ray's nodes use 127.0.0.1; the cluster is a head
and one more node, 1 CPU each, started with ``ray start`` and removed at the end.

Two measurements, each tool in turn in one run:

* **warm launch**: 2 ranks (one per node) run ``init_process_group`` + ``all_reduce`` +
  ``destroy_process_group`` and return; wall time of the call, after one untimed launch.
  ``TorchTrainer`` makes the process group itself, so its loop only runs the ``all_reduce``.
* **steady-state throughput**: the same DDP training loop (an MLP on random data) on the
  same 2 ranks; steps per second measured inside rank 0 between step 50 and the last
  step, so start-up is not counted.

Results: ``benchmarks/ray/results/ray.json`` and ``ray.md`` (printed too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MARK = "AIR_MAGIC_BENCH_NETNS"


def in_loopback_namespace() -> bool:
    # (if_nameindex asks the kernel about this process's namespace; /sys/class/net shows the
    # namespace that mounted /sys)
    return os.environ.get(MARK) == "1" and [name for _, name in socket.if_nameindex()] == ["lo"]


def reexec_in_namespace(argv: list[str]) -> int:
    unshare = shutil.which("unshare")
    if unshare is None:
        sys.exit("unshare (util-linux) is needed: the benchmark runs in a loopback-only network namespace")
    flags = ["-n"] if os.geteuid() == 0 else ["-rn"]
    inner = f"ip link set lo up && exec {sys.executable} {os.path.abspath(__file__)} " + " ".join(argv)
    if os.environ.get(MARK) == "1":
        sys.exit("could not make a loopback-only network namespace (this is one already, with other interfaces)")
    env = {**os.environ, MARK: "1"}
    # -p -f --mount-proc: a PID namespace too, so that nothing of the cluster outlives the run
    return subprocess.call([unshare, *flags, "-p", "-f", "--mount-proc", "sh", "-c", inner], env=env)


# -- the work ----------------------------------------------------------------------------------


def payload() -> float:
    """What a warm launch runs on each rank."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    return float(value.item())


def trainer_payload(config: dict) -> None:
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)


def training(steps: int, init: bool = True) -> float:
    """A DDP training loop; rank 0's steps per second after the first 50 steps."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if init:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.randn(64, 256)
    target = torch.randint(0, 10, (64,))
    began = 0.0
    for step in range(steps):
        if step == 50:
            began = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(data), target)
        loss.backward()
        optimizer.step()
    rate = (steps - 50) / (time.perf_counter() - began)
    if init:
        dist.destroy_process_group()
    return rate


# -- the cluster -------------------------------------------------------------------------------


def start_cluster(folder: str) -> tuple[str, dict[str, str]]:
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    home = os.path.join(folder, "home")
    os.makedirs(home)
    env = {
        **os.environ,
        "HOME": home,
        "RAY_AUTH_MODE": "token",
        "RAY_USAGE_STATS_ENABLED": "0",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    }
    subprocess.run([ray_bin, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    temp = os.path.join(folder, "ray")
    head = [ray_bin, "start", "--head", "--port=6391", "--num-cpus=1", "--dashboard-host=127.0.0.1"]
    subprocess.run([*head, f"--temp-dir={temp}", "--disable-usage-stats"], env=env, check=True, capture_output=True)
    subprocess.run(
        [ray_bin, "start", "--address=127.0.0.1:6391", "--num-cpus=1"], env=env, check=True, capture_output=True
    )
    return "127.0.0.1:6391", env


# -- measurements ------------------------------------------------------------------------------


def timed(call, repeats: int) -> list[float]:
    call()  # untimed: imports, the first connection
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return times


def measure(quick: bool) -> dict:
    folder = tempfile.mkdtemp(prefix="air_magic-bench-ray-")
    os.chdir(folder)
    os.environ["AIR_MAGIC_LOG_DIR"] = os.path.join(folder, "logs")
    address, env = start_cluster(folder)
    os.environ.update(env)  # before Ray is imported: it reads the token from $HOME/.ray

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import air_magic

    ray.init(address=address, log_to_driver=False)
    reps = 3 if quick else 10
    ray_reps = 3 if quick else 5
    steps = 300 if quick else 1000

    local_payload = air_magic.distributed(num_accelerators=2, tracking=False, panel=False)(payload)
    ray_payload = air_magic.distributed(num_accelerators=2, tracking=False, panel=False, backend="ray")(payload)
    storage = os.path.join(folder, "train")

    def trainer(loop, config=None):
        return TorchTrainer(
            loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=storage),
        ).fit()

    results: dict = {"warm_launch": {}, "throughput": {}}
    results["warm_launch"]["air_magic local"] = timed(local_payload.distributed, reps)
    results["warm_launch"]["air_magic ray"] = timed(ray_payload.distributed, ray_reps)
    results["warm_launch"]["TorchTrainer"] = timed(lambda: trainer(trainer_payload), ray_reps)

    ray_training = air_magic.distributed(num_accelerators=2, tracking=False, panel=False, backend="ray")(training)

    def trainer_training(config: dict) -> None:
        import ray.train

        rate = training(config["steps"], init=False)
        ray.train.report({"rate": rate})

    ray_rates, trainer_rates = [], []
    for _ in range(3):  # alternated, so that a slower minute of the machine hits both
        ray_rates.append(ray_training.distributed(steps)[0])
        result = trainer(trainer_training, {"steps": steps})
        trainer_rates.append(float(result.metrics["rate"]))
    results["throughput"]["air_magic ray"] = ray_rates
    results["throughput"]["TorchTrainer"] = trainer_rates
    results["steps"] = steps
    ray.shutdown()
    return results


def report(results: dict) -> str:
    warm = {k: statistics.median(v) for k, v in results["warm_launch"].items()}
    rate = {k: statistics.median(v) for k, v in results["throughput"].items()}
    cpu = platform.processor() or platform.machine()
    lines = [
        f"Machine: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"Ray {results['ray_version']}, torch {results['torch_version']}; a 2-node Ray cluster on it "
        "(head and one more node, 1 CPU each, loopback only); 2 CPU ranks, one per node, gloo.",
        "",
        "| warm launch (init, all_reduce, destroy, return) | median | runs | ÷ air_magic ray |",
        "|---|---|---|---|",
    ]
    for name, value in warm.items():
        runs = len(results["warm_launch"][name])
        lines.append(f"| {name} | {value:.2f} s | {runs} | {value / warm['air_magic ray']:.2f} |")
    lines += [
        "",
        f"| steady-state DDP throughput ({results['steps']} steps, rank 0) | median steps/s | runs | ÷ TorchTrainer |",
        "|---|---|---|---|",
    ]
    for name, value in rate.items():
        runs = len(results["throughput"][name])
        lines.append(f"| {name} | {value:.1f} | {runs} | {value / rate['TorchTrainer']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for ray.json and ray.md")
    args, _ = parser.parse_known_args()
    if not in_loopback_namespace():
        return reexec_in_namespace(sys.argv[1:])
    results = measure(args.quick)
    import ray
    import torch

    results["ray_version"] = ray.__version__
    results["torch_version"] = torch.__version__
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ray.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    text = report(results)
    with open(os.path.join(args.out, "ray.md"), "w") as handle:
        handle.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
