"""A pool's process groups rebuilt again and again (``air_magic.rank.pool.interrupts.regroup``), in two real
gloo processes: 8 rounds, past the 5 backend types torch has to spare (rounds 6 to 8 hand each
collective to a new ProcessGroup on its way through the dispatcher).  After every round the
same DDP model trains on and the same ``new_group`` reduces, with the right numbers, and each
collective counts in the group's sequence number (what the ranks compare to stop at one
point: a rebuilt group's own number had stayed where the rebuild left it); in a
redirected round the fence still stops the next collective (and, disarmed, collectives go on),
and cutting the connections still frees a rank left waiting in an all_reduce."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

RANK = """
import json, os, sys, time, torch, torch.distributed as dist, torch.nn as nn
from air_magic.rank.pool.interrupts import fence, regroup
rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
before = regroup._connections()
dist.init_process_group("gloo", rank=rank, world_size=2)
regroup.note_links(before)
regroup.watch_new_groups()
pair = dist.new_group([0, 1])
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1, bias=False))
x = torch.ones(2, 4) * (rank + 1)
said = {"rounds": []}
for round_ in range(1, 9):
    kind = regroup.rebuild(round_)
    model.zero_grad()
    model(x).sum().backward()  # DDP's reducer, in C++, on the old group object
    t = torch.ones(1) * (rank + 1)
    default = dist.distributed_c10d._get_default_group()
    before = regroup.sequence_number(default)
    dist.all_reduce(t)
    counted = regroup.sequence_number(default) - before  # (what the ranks agree on to stop)
    u = torch.ones(1) * (rank + 1)
    dist.all_reduce(u, group=pair)
    said["rounds"].append([kind, model.module.weight.grad.tolist(), t.item(), u.item(), counted])
fence.arm("a test")
try:
    dist.all_reduce(torch.ones(1))
    said["fenced"] = "completed"
except KeyboardInterrupt as exc:
    said["fenced"] = str(exc)
fence.disarm()
t = torch.ones(1)
dist.all_reduce(t)
said["after_fence"] = t.item()
# A rank left in an all_reduce its peer never makes is freed by cutting the connections.
if rank == 0:
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        said["cut"] = "completed"
    except Exception as exc:
        said["cut"] = type(exc).__name__
    said["cut_after"] = time.monotonic() - began
else:
    time.sleep(1.0)
    regroup.cut()
    said["cut"] = "cut"
kind = regroup.rebuild(9)
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
said["after_cut"] = [kind, t.item()]
print(json.dumps(said))
"""


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_groups_are_rebuilt_past_the_backend_types_and_keep_working(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), port], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    kinds = ["CUSTOM", "UNDEFINED", "UCC", "MPI", "XCCL", "redirected", "redirected", "redirected"]
    grad = [[3.0, 3.0, 3.0, 3.0]]  # (2 rows of 1s and of 2s: 2 + 4 summed, averaged over 2 ranks)
    for said in outs:
        assert said["rounds"] == [[kind, grad, 3.0, 3.0, 1] for kind in kinds], said
        assert said["fenced"] == "stopped before a collective (all_reduce): a test", said
        assert said["after_fence"] == 2.0, said
        assert said["after_cut"] == ["redirected", 3.0], said
    assert outs[0]["cut"] == "DistBackendError" or outs[0]["cut"] == "RuntimeError", outs[0]
    assert outs[0]["cut_after"] < 10, outs[0]
