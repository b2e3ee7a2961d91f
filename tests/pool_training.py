"""Pool cells that train on 2 CPU ranks without end, for Ctrl-C at random points of them
(``tests/kernel/test_kernel_pool_interrupts.py`` and ``benchmarks/pool/interrupts.py``)."""

from __future__ import annotations

#: The notebook's message for an interrupted pool cell whose ranks all stopped.
INTACT = "you interrupted the pool's cell; every rank stopped it, and the pool and its state are intact."

#: A model and an optimizer on the pool's ranks, and a step count.
SETUP = {
    "ddp": """%%distributed --pool
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(8, 1024)
steps = 0
""",
    "fsdp2": """%%distributed --pool
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(8, 1024)
steps = 0
""",
}

#: Training until interrupted.
TRAIN = """%%distributed --pool
while True:
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    steps += 1
"""

#: Two more steps on the same model; each rank's step count.
CHECK = """%%distributed --pool
for _ in range(2):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    steps += 1
steps
"""
