"""``air-magic run``: a script whose rank skips a collective gets the hang report on stderr
while it hangs, and the launch's timeout says it again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_run import environment

pytestmark = pytest.mark.process

SCRIPT = """import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(16)
for _ in range(2):
    dist.all_reduce(t)
if dist.get_rank() == 0:
    dist.all_reduce(t)
else:
    time.sleep(300)
"""


def test_a_script_that_hangs_gets_the_report_on_stderr(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = environment(tmp_path) | {"AIR_MAGIC_HANG_SECONDS": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "air_magic.cli", "run", "train.py", "-n", "2", "--no-tracking", "--timeout", "15"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    verdict = (
        "[air_magic] hang report: rank 1 is behind, blocked (neither in a collective nor computing): its last "
        "collective is #2 (train.py:5 in <module>); "
        "it is at train.py:9 in <module>; rank 0 waits in all_reduce #3 (train.py:7 in <module>)"
    )
    assert done.stderr.count(verdict) == 2, done.stderr  # while it hung, and with the timeout
    table = done.stderr[done.stderr.index(verdict) :].splitlines()
    assert table[1].split() == ["rank", "state", "group", "seq", "op", "shapes", "where", "read", "by"]
    assert table[2].split()[:8] == ["0", "in", "collective", "default", "#3", "all_reduce", "[16]", "float32"]
    assert "ran past its timeout of 15 s" in done.stderr + done.stdout


DDP_SCRIPT = """import argparse, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    for i in range(args.steps):
        if dist.get_rank() == 1 and i == 3:
            continue
        opt.zero_grad()
        loss = nn.MSELoss()(model(torch.randn(20, 10)), torch.randn(20, 5))
        loss.backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def test_a_script_whose_rank_skipped_a_ddp_step_gets_the_report_naming_ddp_s_all_reduce(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(DDP_SCRIPT)
    env = environment(tmp_path) | {"AIR_MAGIC_HANG_SECONDS": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "air_magic.cli", "run", "train.py", "-n", "2", "--no-tracking", "--timeout", "15"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    verdict = "[air_magic] hang report: ranks disagree at #11: rank 0 all_reduce [165] float32, rank 1 barrier"
    assert verdict in done.stderr, done.stderr
    table = done.stderr[done.stderr.index(verdict) :].splitlines()
    assert table[2].split()[:8] == ["0", "in", "collective", "default", "#11", "all_reduce", "[165]", "float32"]
    assert "train.py:17 in main (DDP's gradient all-reduce)" in table[2], table[2]
    assert "rank 0: in all_reduce (DDP's gradient all-reduce), called at " in done.stderr, done.stderr
