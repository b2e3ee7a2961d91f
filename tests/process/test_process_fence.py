"""The fence (``air_magic.rank.pool.interrupts.fence``), in two real gloo processes: once armed, a rank's next
collective raises KeyboardInterrupt before it is issued, wherever it comes from (the user's
``dist.all_reduce``, DDP's reducer in C++ during ``backward()``); no sequence number moves, so
no peer can pair with it; disarmed, the same process group and DDP model train on (after the
state repair a pool's interrupt makes)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

RANK = """
import json, os, sys, torch, torch.distributed as dist, torch.nn as nn
from air_magic.rank.pool.interrupts import fence, state
rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2)
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.ones(4, 8) * (rank + 1)
model(x).sum().backward(); opt.step()
group = dist.distributed_c10d._get_default_group()
said = {"seq_before": group._get_sequence_number_for_group()}
fence.arm("a test")
for what, run in (("backward", lambda: model(x).sum().backward()), ("all_reduce", lambda: dist.all_reduce(torch.ones(1)))):
    try:
        run()
        said[what] = "completed"
    except KeyboardInterrupt as exc:
        said[what] = str(exc)
said["seq_armed"] = group._get_sequence_number_for_group()
fence.disarm()
said["repaired"] = state.repair({"model": model})
opt.zero_grad(); model(x).sum().backward(); opt.step()
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
said["after"] = t.item()
said["equal"] = [float(p.detach().sum()) for p in model.parameters()]
print(json.dumps(said))
"""


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_armed_rank_stops_before_its_next_collective_even_one_ddp_issues_from_cpp(tmp_path: Path) -> None:
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
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for said in outs:
        assert said["backward"].startswith("stopped before a collective ("), said
        assert said["all_reduce"] == "stopped before a collective (all_reduce): a test", said
        assert said["seq_armed"] == said["seq_before"], said  # nothing was issued
        assert said["repaired"] == ["model: DDP's reducer reset and the interrupted step's gradients cleared"]
        assert said["after"] == 3.0
    assert outs[0]["equal"] == outs[1]["equal"]
