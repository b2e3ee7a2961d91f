"""GPU check for air_magic: run on a machine with NVIDIA GPUs, from the repository root.

    python benchmarks/gpu_check.py            # about 2-4 minutes on one GPU
    python benchmarks/gpu_check.py --quick    # the documentation's example for 1 epoch, not 3

This process stands for the notebook kernel, and it touches CUDA first (a context and a
tensor on cuda:0), as a kernel that ran some GPU code would. Then, each on every GPU of the
machine, with NCCL:

1. ``cuda_probe``: ranks start with no CUDA state of their own (none inherited from the
   kernel) and each one uses ``cuda:LOCAL_RANK``;
2. ``seed_ddp``: the training example of the distributed-training-in-notebooks
   documentation, unchanged but for its decorator line (``@distributed(gpus=8,
   gpu_type='H100')`` becomes ``@distributed(num_accelerators=torch.cuda.device_count())``),
   called as the documentation calls it; its MLflow run must hold every loss point;
3. ``fsdp2``: FSDP2 (``fully_shard``) training, shards split across the ranks (with 2 or more
   GPUs), a sharded DCP checkpoint saved and loaded back;
4. ``deepspeed_zero1`` and ``deepspeed_zero3``: DeepSpeed ZeRO from a config dict, torch's AdamW;
5. ``kill_releases_memory``: ranks hold GPU memory and train; one rank gets SIGKILL; the
   launch must fail naming SIGKILL and NVML must show the memory back at its level before
   the launch within a few seconds.

GPU memory is read through NVML (``nvidia-ml-py``) before, during and after. The report is
one line per check; the exit code is 1 if any check failed, 0 otherwise. Without a GPU it
prints why it skips and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    print(
        "SKIP: no CUDA GPU here (torch.cuda.is_available() is False). "
        "Run benchmarks/gpu_check.py on a machine with NVIDIA GPUs and a CUDA build of torch."
    )
    sys.exit(0)

# Where MLflow writes unless the caller chose: a private sqlite store.
_STORE = tempfile.mkdtemp(prefix="air_magic-gpu-check-")
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{_STORE}/mlflow.db")

# Stand in for a kernel that already ran GPU code: a CUDA context and a tensor here.
if __name__ == "__main__":
    torch.cuda.init()
    _KERNEL_TENSOR = torch.ones(1024, 1024, device="cuda:0")

# ---- the documentation's example, verbatim (only the decorator line differs) -------------

import os

import torch
import torch.distributed as dist
import torch.nn as nn


def setup():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")


def cleanup():
    dist.destroy_process_group()


class SimpleMLP(nn.Module):
    def __init__(self, input_dim=10, hidden_dim=64, output_dim=1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden_dim, output_dim),
        )

    def forward(self, x):
        return self.net(x)


from air_magic import distributed


@distributed(num_accelerators=torch.cuda.device_count())
def run_train(num_epochs: int, batch_size: int) -> None:
    import mlflow
    import torch.optim as optim
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    # 1. Set up multi-GPU environment
    setup()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")

    # 2. Apply the Torch distributed data parallel (DDP) library for data-parellel training.
    model = SimpleMLP().to(device)
    model = DDP(model, device_ids=[device])

    # 3. Create and load dataset.
    x = torch.randn(5000, 10)
    y = torch.randn(5000, 1)

    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset)
    dataloader = DataLoader(dataset, sampler=sampler, batch_size=batch_size)

    # 4. Define the training loop.
    optimizer = optim.Adam(model.parameters(), lr=0.001)
    loss_fn = nn.MSELoss()

    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        model.train()
        total_loss = 0.0
        for step, (xb, yb) in enumerate(dataloader):
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            # Log loss to MLflow metric
            mlflow.log_metric("loss", loss.item(), step=step)

            loss.backward()
            optimizer.step()
            total_loss += loss.item() * xb.size(0)

        mlflow.log_metric("total_loss", total_loss)
        print(f"Total loss for epoch {epoch}: {total_loss}")

    cleanup()


# ---- the other checks ---------------------------------------------------------------------

NUM_GPUS = torch.cuda.device_count()


@distributed(num_accelerators=NUM_GPUS, tracking=False, timeout=300)
def cuda_probe() -> dict[str, Any]:
    initialized_at_start = torch.cuda.is_initialized()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    value = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(value)
    result = {
        "initialized_at_start": initialized_at_start,
        "device": torch.cuda.current_device(),
        "local_rank": local_rank,
        "sum": value.item(),
    }
    dist.destroy_process_group()
    return result


@distributed(num_accelerators=NUM_GPUS, tracking=False, timeout=300)
def train_fsdp2(steps: int, checkpoint_dir: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    setup()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (world_size,))

    def sharded(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    model = sharded(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shards = {name: (p.to_local().numel(), p.numel(), p.shape[0]) for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(rank)
    direction = torch.randn(64, 1, generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        x = torch.randn(256, 64, generator=generator)
        y = torch.tanh(x @ direction / 8) * 2
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint_dir)
    restored = sharded(1)
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    model_state, optim_state = get_state_dict(restored, restored_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(restored, restored_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    equal = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), restored.parameters(), strict=True)
    )
    cleanup()
    return {"shards": shards, "first": sum(losses[:10]) / 10, "last": sum(losses[-10:]) / 10, "reloaded_equal": equal}


@distributed(num_accelerators=NUM_GPUS, tracking=False, timeout=300)
def train_deepspeed(stage: int, steps: int) -> dict[str, Any]:
    import warnings

    import deepspeed

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))
    full = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": 256,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(dist.get_rank())
    direction = torch.randn(64, 1, generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        x = torch.randn(256, 64, generator=generator)
        y = torch.tanh(x @ direction / 8) * 2
        loss = nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    held = sum(p.ds_tensor.numel() for p in engine.module.parameters()) if stage == 3 else full
    result = {
        "stage": engine.zero_optimization_stage(),
        "device": str(engine.device),
        "backend": dist.get_backend(),
        "first": sum(losses[:10]) / 10,
        "last": sum(losses[-10:]) / 10,
        "held": held,
        "full": full,
    }
    dist.destroy_process_group()
    return result


@distributed(num_accelerators=NUM_GPUS, tracking=False, timeout=300)
def hold_memory_and_train(gib: float) -> None:
    setup()
    ballast = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    ballast.fill_(1)
    model = nn.Linear(2048, 2048).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    print("holding", flush=True)
    while True:  # until killed
        loss = model(torch.randn(512, 2048, device="cuda")).square().mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        torch.cuda.synchronize()


# ---- NVML ------------------------------------------------------------------------------------


class Nvml:
    """Used memory and compute processes summed over the machine's GPUs, from NVML."""

    def __init__(self) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def used_mib(self) -> float:
        return sum(self.nvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles) / 2**20

    def processes(self) -> int:
        count = 0
        for handle in self.handles:
            try:
                count += len(self.nvml.nvmlDeviceGetComputeRunningProcesses(handle))
            except self.nvml.NVMLError:
                pass
        return count

    def describe(self) -> str:
        names = []
        for handle in self.handles:
            name = self.nvml.nvmlDeviceGetName(handle)
            names.append(name.decode() if isinstance(name, bytes) else name)
        driver = self.nvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        return f"{len(names)} x {names[0] if names else '?'} (driver {driver})"


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# ---- the checks --------------------------------------------------------------------------


def check_cuda_probe(nvml: Nvml, args: argparse.Namespace) -> str:
    results = cuda_probe.distributed()
    n = NUM_GPUS
    assert all(not r["initialized_at_start"] for r in results), results
    assert [r["device"] for r in results] == [r["local_rank"] for r in results] == list(range(n)), results
    assert all(r["sum"] == n * (n + 1) / 2 for r in results), results
    return f"{n} rank(s) started without CUDA state although this process has a context; all_reduce over NCCL ok"


def check_seed_ddp(nvml: Nvml, args: argparse.Namespace) -> str:
    import mlflow

    epochs = 1 if args.quick else 3
    run_train.distributed(num_epochs=epochs, batch_size=1)
    launch = run_train.last_launch
    assert launch.status == "finished", launch.status
    run = mlflow.get_run(launch.run_id)
    assert run.info.status == "FINISHED", run.info.status
    client = mlflow.MlflowClient()
    # rank 0's points under "loss", rank r's under "rank<r>/loss"
    keys = ["loss"] + [f"rank{rank}/loss" for rank in range(1, NUM_GPUS)]
    points = sum(len(client.get_metric_history(launch.run_id, key)) for key in keys)
    expected = epochs * NUM_GPUS * math.ceil(5000 / NUM_GPUS)
    assert points == expected, (points, expected)
    return f"{epochs} epoch(s), batch 1: MLflow run {run.info.run_id[:8]} FINISHED with {points} loss points"


def check_fsdp2(nvml: Nvml, args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory(prefix="fsdp2-") as folder:
        results = train_fsdp2.distributed(steps=100, checkpoint_dir=folder)
        files = sorted(os.listdir(folder))
    n = NUM_GPUS
    for name, (_, full, rows) in results[0]["shards"].items():
        local = [r["shards"][name][0] for r in results]
        assert sum(local) == full, (name, local, full)
        if rows >= n > 1:
            assert max(local) < full, (name, local)
    assert all(r["last"] < r["first"] for r in results), results
    assert all(r["reloaded_equal"] for r in results)
    assert len([f for f in files if f.endswith(".distcp")]) == n, files
    held = [sum(v[0] for v in r["shards"].values()) for r in results]
    return f"loss {results[0]['first']:.3f} -> {results[0]['last']:.3f}; parameters held per rank {held}; DCP round trip ok"


def check_deepspeed(stage: int) -> Callable[[Nvml, argparse.Namespace], str]:
    def check(nvml: Nvml, args: argparse.Namespace) -> str:
        results = train_deepspeed.distributed(stage=stage, steps=100)
        for r in results:
            assert r["stage"] == stage and r["backend"] == "nccl" and r["device"].startswith("cuda"), r
            assert r["last"] < r["first"], r
        if stage == 3 and NUM_GPUS > 1:
            assert all(r["held"] < r["full"] for r in results), results
        r = results[0]
        return f"ZeRO-{r['stage']} on {r['device']} ({r['backend']}): loss {r['first']:.3f} -> {r['last']:.3f}; holds {r['held']} of {r['full']}"

    return check


def check_kill_releases_memory(nvml: Nvml, args: argparse.Namespace) -> str:
    from air_magic import RankCrashedError

    gib = 2.0
    baseline, baseline_procs = nvml.used_mib(), nvml.processes()
    launch = hold_memory_and_train.submit(gib)
    target = baseline + NUM_GPUS * gib * 1024 * 0.9
    if not wait_for(lambda: nvml.used_mib() >= target or launch.done(), timeout=120) or launch.done():
        launch.cancel()
        launch.result(timeout=30)  # raises what went wrong on the ranks
        raise AssertionError(f"the ranks never held the memory ({nvml.used_mib():.0f} MiB used)")
    time.sleep(1.0)  # training for a moment
    during = nvml.used_mib()
    victim = launch.ranks[-1]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        launch.result(timeout=60)
    except RankCrashedError as exc:
        assert "SIGKILL" in str(exc), str(exc)
    else:
        raise AssertionError("the launch finished although a rank was killed")
    ended = time.monotonic() - killed_at
    released = wait_for(lambda: nvml.used_mib() <= baseline + 256 and nvml.processes() <= baseline_procs, timeout=30)
    took = time.monotonic() - killed_at
    after = nvml.used_mib()
    assert released, f"memory still {after:.0f} MiB ({baseline:.0f} before the launch) {took:.0f} s after the kill"
    assert took <= args.release_limit, f"memory released only after {took:.1f} s (limit {args.release_limit} s)"
    return (
        f"used {baseline:.0f} -> {during:.0f} -> {after:.0f} MiB; SIGKILL on rank {victim.rank}: launch failed in "
        f"{ended:.1f} s, memory released in {took:.1f} s"
    )


def _all_reduce_on_the_rank_s_gpu() -> float:
    import time as _time

    import torch as _torch
    import torch.distributed as _dist

    t = _torch.ones(1, device=f"cuda:{_torch.cuda.current_device()}")
    begin = _time.perf_counter()
    _dist.all_reduce(t)
    _torch.cuda.synchronize()
    assert t.item() == _dist.get_world_size()
    return _time.perf_counter() - begin


def check_pool(nvml: Nvml, args: argparse.Namespace) -> str:
    """A pool on every GPU: NCCL's set-up is paid at the pool's start (device_id bound), so the
    first all_reduce cell is as fast as the tenth; a restart releases the old ranks' memory."""
    from air_magic import Pool

    baseline = nvml.used_mib()
    began = time.perf_counter()
    pool = Pool(NUM_GPUS, tracking=False)
    started = time.perf_counter() - began
    try:
        cells = []
        for _ in range(10):
            begin = time.perf_counter()
            inside = pool.run(_all_reduce_on_the_rank_s_gpu)
            cells.append((time.perf_counter() - begin, max(inside)))
        first, tenth = cells[0][0] * 1000, cells[-1][0] * 1000
        assert first < 10 * max(tenth, 1.0), (first, tenth)  # NCCL's set-up was not paid in the first cell
        before = pool.run(os.getpid)
        pool.restart()
        released = wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in before), timeout=30)
        assert released, "the old ranks outlived the restart"
        assert pool.run(_all_reduce_on_the_rank_s_gpu)
    finally:
        pool.close()
    freed = wait_for(lambda: nvml.used_mib() <= baseline + 256, timeout=30)
    assert freed, f"memory still {nvml.used_mib():.0f} MiB after the pool closed ({baseline:.0f} before)"
    return (
        f"pool of {NUM_GPUS} started in {started:.1f} s; all_reduce cell 1st {first:.1f} ms, 10th {tenth:.1f} ms "
        f"(in the ranks {cells[0][1] * 1000:.2f} / {cells[-1][1] * 1000:.2f} ms); restart and close released the memory"
    )


CHECKS: list[tuple[str, Callable[[Nvml, argparse.Namespace], str]]] = [
    ("cuda_probe", check_cuda_probe),
    ("seed_ddp", check_seed_ddp),
    ("fsdp2", check_fsdp2),
    ("deepspeed_zero1", check_deepspeed(1)),
    ("deepspeed_zero3", check_deepspeed(3)),
    ("kill_releases_memory", check_kill_releases_memory),
    ("pool", check_pool),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="air_magic on this machine's GPUs: DDP, FSDP2, DeepSpeed, a kill.")
    parser.add_argument("--quick", action="store_true", help="the documentation's example for 1 epoch instead of 3")
    parser.add_argument("--only", nargs="*", help="run only these checks")
    parser.add_argument(
        "--release-limit", type=float, default=10.0, help="seconds for GPU memory to come back after a kill"
    )
    args = parser.parse_args(argv)
    nvml = Nvml()
    started = time.monotonic()
    print(
        f"air_magic GPU check: {nvml.describe()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"{NUM_GPUS} rank(s); this process holds a CUDA context ({nvml.used_mib():.0f} MiB used)",
        flush=True,
    )
    report = []
    for name, check in CHECKS:
        if args.only and name not in args.only:
            continue
        t0 = time.monotonic()
        try:
            detail, ok = check(nvml, args), True
        except Exception as exc:  # a failed check is reported, and the others still run
            detail, ok = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300], False
            traceback.print_exc()
        report.append((name, ok, time.monotonic() - t0, detail))
        print(f"[gpu_check] {'PASS' if ok else 'FAIL'} {name} ({report[-1][2]:.1f} s)", flush=True)
    print("\n## air_magic GPU check\n")
    for name, ok, seconds, detail in report:
        print(f"{'PASS' if ok else 'FAIL'}  {name:22s} {seconds:6.1f} s  {detail}")
    failed = sum(not ok for _, ok, _, _ in report)
    print(f"\n{len(report) - failed} passed, {failed} failed in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
