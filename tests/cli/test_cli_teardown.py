"""A DDP training on gloo that destroys its group ends, every time.

In torch 2.13 the gloo group's destructor can deadlock with its worker thread when a DDP
model holds the last reference to a destroyed group (:mod:`air_magic.rank.groups`).  The
script below is PyTorch's usual shape (init, DDP, a few steps, ``destroy_process_group()``,
the model freed as the function returns), 150 times in one process: under ``torchrun``
it hung within the first 20 rounds on a 2-core machine; each rank of air_magic keeps the
destroyed groups, and the rounds end."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_cli_run import air_magic_run, rank_log

pytestmark = pytest.mark.process

ROUNDS = 150

SCRIPT = textwrap.dedent(
    """\
    import os
    import sys

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP


    def train_once(round):
        store = dist.FileStore(os.path.join("stores", str(round)), int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(
            "gloo", store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
        )
        model = DDP(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        inputs = torch.randn(16, 4)
        for _ in range(3):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), inputs.sum(1, keepdim=True)).backward()
            optimizer.step()
        dist.destroy_process_group()
        # the model (its reducer holds the destroyed group) is freed here


    if __name__ == "__main__":
        for round in range(int(sys.argv[1])):
            train_once(round)
        print(f"rank {os.environ['RANK']}: {sys.argv[1]} rounds", flush=True)
    """
)


def test_ddp_on_gloo_ends_every_time_it_destroys_its_group(tmp_path: Path) -> None:
    (tmp_path / "stores").mkdir()
    (tmp_path / "rounds.py").write_text(SCRIPT)
    done = air_magic_run(
        tmp_path, "rounds.py", "-n", "2", "--no-tracking", "--timeout", "150", "--", str(ROUNDS), timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert rank_log(done, 0) == f"rank 0: {ROUNDS} rounds\n"
    assert rank_log(done, 1) == f"rank 1: {ROUNDS} rounds\n"


def test_a_rank_that_imports_torch_itself_keeps_its_destroyed_groups_too(tmp_path: Path) -> None:
    """Without the helper's preload (torch imported by the rank's code), the same patch."""
    probe = textwrap.dedent(
        """\
        import sys
        from air_magic.rank import groups
        groups.keep_destroyed_groups()
        assert "torch" not in sys.modules
        import torch.distributed as dist
        from torch.distributed import destroy_process_group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        group = dist.group.WORLD
        destroy_process_group()
        print(not dist.is_initialized(), groups.kept == [group], dist.destroy_process_group is destroy_process_group)
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True True True\n"
