"""Training cells of the shapes outside code has, for interrupts at random points of a pool's
training (``tests/kernel/test_kernel_pool_interrupts.py`` and ``benchmarks/consistency``):
a DDP cell with the ToyModel of PyTorch's ``distributed/ddp`` example, and an FSDP2 cell with a
small Transformer sharded as PyTorch's FSDP2 example shards its own (every block, then the
root).  Each loop is the usual one: ``zero_grad``, forward, ``backward``, ``step``; a
``breakpoint()`` stops a rank where ``stop`` says (``(rank, step, "before_backward" |
"before_step")``)."""

from __future__ import annotations

import re

#: The notebook's message for an interrupted pool cell whose ranks all stopped at one point
#: and whose state the pool checked.
INTACT = "you interrupted the pool's cell; every rank stopped it, and the pool and its state are intact."
#: The other truthful end of a Ctrl-C (4 of 100 in benchmarks/consistency, DDP): a rank was already
#: waiting in a collective its peer had stopped before; it is cut free, the group rebuilt, the
#: state put back and compared.
INTACT_REBUILT = re.compile(
    r"you interrupted the pool's cell; ranks? [\d, ]+ waited in a collective that ranks? [\d, ]+ had stopped "
    r"before, so (it was|they were) stopped there: the process group was rebuilt; your names are kept, and "
    r"their state is intact\."
)

_DDP = """%%distributed --pool
import torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


torch.manual_seed(0)
model = DDP(ToyModel())
loss_fn = nn.MSELoss()
opt = torch.optim.SGD(model.parameters(), lr=0.001)
steps, stop = 0, None


def batch():
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + steps)
    return torch.randn(20, 10, generator=g), torch.randn(20, 5, generator=g)
"""

_FSDP2 = """%%distributed --pool
import torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
from torch.distributed.fsdp import fully_shard


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, layers=2, seq=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h))


torch.manual_seed(0)
model = Transformer()
for layer in model.layers:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
steps, stop = 0, None


def loss_fn(logits, tokens):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batch():
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + steps)
    tokens = torch.randint(0, 64, (8, 16), generator=g)
    return tokens, tokens
"""

#: A model, an optimizer, a step count and a batch function on the pool's ranks.
SETUP = {"ddp": _DDP, "fsdp2": _FSDP2}

#: Training until interrupted; a rank stops at a breakpoint where ``stop`` says.
TRAIN = """%%distributed --pool
while True:
    x, y = batch()
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    if stop == (dist.get_rank(), steps, "before_backward"):
        breakpoint()
    loss.backward()
    if stop == (dist.get_rank(), steps, "before_step"):
        breakpoint()
    opt.step()
    steps += 1
"""

#: Each rank's state (its step count, the optimizer's, how many parameters are DTensors, the
#: replicated parameters' sums), then 10 more steps and the same again, with whether the loss
#: is finite.
CHECK = """%%distributed --pool
stop = None


def state():
    params = list(model.parameters())
    dtensors = sum(1 for p in params if hasattr(p, "placements"))
    sums = [float(p.detach().double().sum()) for p in params if not hasattr(p, "placements")]
    adam = [float(s["step"]) for s in opt.state.values() if "step" in s][:1]
    return {"steps": steps, "adam": adam, "dtensors": dtensors, "params": len(params), "sums": sums}


before = state()
for _ in range(10):
    x, y = batch()
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    steps += 1
{"before": before, "after": state(), "finite": bool(torch.isfinite(loss))}
"""


def consistent(values: list[dict]) -> str:
    """'' when the ranks' CHECK values show one model (equal steps and replicated weights, every
    parameter a DTensor where any is, ten more steps trained), else what differs."""
    for when in ("before", "after"):
        got = [v[when] for v in values]
        if len({g["steps"] for g in got}) > 1:
            return f"{when}: step counts differ: {[g['steps'] for g in got]}"
        if len({tuple(g["adam"]) for g in got}) > 1:
            return f"{when}: Adam's step counts differ: {[g['adam'] for g in got]}"
        if any(g["dtensors"] not in (0, g["params"]) for g in got):
            return f"{when}: DTensor parameters: {[(g['dtensors'], g['params']) for g in got]}"
        if len({tuple(g["sums"]) for g in got}) > 1:
            return f"{when}: the replicated weights differ"
    if not all(v["finite"] for v in values):
        return "the ten steps after it gave a loss that is not finite"
    if any(v["after"]["steps"] != v["before"]["steps"] + 10 for v in values):
        return "the ten steps after it did not all run"
    return ""
