"""The training script both launchers run: DDP or FSDP2 on a small MLP, fixed steps.

Each rank stamps the time after every optimizer step (``time.perf_counter``, after
``torch.cuda.synchronize()`` on GPUs) and reports its steps per second over the steps
after the warm-up, so what is measured is the training loop itself, not start-up.

    torchrun --standalone --nproc-per-node 2 benchmarks/training/train.py --kind ddp --out DIR

writes ``DIR/rank-<r>.json``; :mod:`run` imports :func:`train` in a kernel and launches it
with ``@distributed`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def train(
    kind: str = "ddp",
    steps: int = 400,
    warmup: int = 100,
    device: str = "cpu",
    batch: int = 64,
    width: int = 256,
    depth: int = 4,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        dev = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        dev = torch.device("cpu")
    world_size = dist.get_world_size()

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model: nn.Module = nn.Sequential(*layers, nn.Linear(width, 1)).to(dev)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[local_rank] if dev.type == "cuda" else None)
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(dev.type, (world_size,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        raise ValueError(f"kind must be 'ddp' or 'fsdp2', got {kind!r}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    data = [
        (torch.randn(batch, width, generator=generator).to(dev), torch.randn(batch, 1, generator=generator).to(dev))
        for _ in range(16)
    ]
    loss_fn = nn.MSELoss()

    stamps = []
    dist.barrier()
    for step in range(steps):
        x, y = data[step % len(data)]
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
    dist.barrier()
    dist.destroy_process_group()
    timed = stamps[warmup:]
    return {
        "rank": rank,
        "world_size": world_size,
        "kind": kind,
        "device": dev.type,
        "steps": steps,
        "warmup": warmup,
        "steps_per_s": (len(timed) - 1) / (timed[-1] - timed[0]),
        "threads": torch.get_num_threads(),
        "final_loss": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", required=True, help="folder for rank-<r>.json")
    args = parser.parse_args()
    result = train(args.kind, args.steps, args.warmup, args.device)
    with open(os.path.join(args.out, f"rank-{result['rank']}.json"), "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
