"""Fixed code launches with air_magic: two CPU ranks with gloo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lint_support import FIXTURES

import air_magic
from air_magic import decorator
from air_magic.lint import fix_source, lint_source

SPARK_CODE = """\
from pyspark.ml.torch.distributor import TorchDistributor


def train(learning_rate):
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    return int(os.environ["RANK"]), value.item(), learning_rate


distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
result = distributor.run(train, 0.5)
"""


@pytest.mark.process
def test_converted_torch_distributor_code_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    fixed = fix_source(SPARK_CODE)
    assert lint_source(fixed) == []
    assert fixed.splitlines()[0] == "from air_magic import distributed"
    assert fixed.splitlines()[-1] == (
        'result = distributed(num_accelerators=2, accelerator_type="CPU")(train).distributed(0.5)[0]'
    )
    real = decorator.make_spec  # MLflow has tests of its own: keep this launch lean

    def without_tracking(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **{**kwargs, "tracking": False})

    monkeypatch.setattr(decorator, "make_spec", without_tracking)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(fixed, "converted.py", "exec"), namespace)
    # TorchDistributor.run returned rank 0's value; the converted launch keeps that.
    assert namespace["result"] == (0, 3.0, 0.5)


#: The documentation's complete DDP example: its model and helpers, the import and the
#: training function, as a user copies them (the launch line is the test's own).
DDP_SECTIONS = ("Complete example: the model and utility functions", "Import the library", "The training function")


def _page_sections(text: str) -> dict[str, str]:
    """``# -- Title ---`` sections of a seeds page, each with its marker line."""
    marks = list(re.finditer(r"^# -- (.+?) -+\n", text, flags=re.M))
    return {
        m.group(1): text[m.start() : (marks[i + 1].start() if i + 1 < len(marks) else len(text))]
        for i, m in enumerate(marks)
    }


@pytest.mark.process
def test_fixed_documentation_ddp_example_trains_on_two_cpu_ranks() -> None:
    page = _page_sections((FIXTURES / "seeds" / "serverless_gpu_page.py").read_text())
    fixed = fix_source("".join(page[name] for name in DDP_SECTIONS))
    assert lint_source(fixed) == []
    # What makes it run without a GPU: the portability fixes.
    for line in (
        '    if torch.cuda.is_available():\n        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n',
        '    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")\n',
        '    device = torch.device(f"cuda:{int(os.environ[\'LOCAL_RANK\'])}" if torch.cuda.is_available() else "cpu")\n',
        "    model = DDP(model, device_ids=[device] if torch.cuda.is_available() else None)\n",
    ):
        assert line in fixed
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(fixed, "serverless_gpu_page.py", "exec"), namespace)
    run_train = namespace["run_train"]
    assert (run_train.num_accelerators, str(run_train.accelerator_type)) == (8, "GPU_8xH100")
    on_cpu = run_train.with_overrides(num_accelerators=2, accelerator_type="CPU", tracking=False)
    # 5000 samples, 2500 per rank: batches of 500 keep the epoch to 5 steps.
    assert on_cpu.distributed(num_epochs=1, batch_size=500) == [None, None]


#: A training script in today's PyTorch idioms (torch.accelerator, the rank's number as the
#: device, device_id= for the process group, a checkpoint loaded onto the rank's GPU): none of
#: it runs without a GPU until it is fixed.
ACCELERATOR_SCRIPT = """\
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, model, gpu_id, checkpoint):
        self.gpu_id = gpu_id
        self.model = model.to(self.gpu_id)
        if os.path.exists(checkpoint):
            state = torch.load(checkpoint, map_location=f"cuda:{gpu_id}", weights_only=True)
            self.model.load_state_dict(state)
        self.model = DDP(self.model, device_ids=[self.gpu_id])
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def step(self, inputs, targets):
        inputs, targets = inputs.to(self.gpu_id), targets.to(self.gpu_id)
        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpoint", default="model.pt")
    args = parser.parse_args(argv)
    accelerator = torch.accelerator.current_accelerator()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.accelerator.set_device_index(local_rank)
    device = torch.device(f"{accelerator}:{local_rank}")
    dist.init_process_group(backend=dist.get_default_backend_for_device(accelerator), device_id=device)
    torch.manual_seed(dist.get_rank())  # each rank its own batch: DDP averages their gradients
    trainer = Trainer(torch.nn.Linear(4, 1), local_rank, args.checkpoint)
    inputs = torch.randn(16, 4)
    losses = [trainer.step(inputs, inputs.sum(dim=1, keepdim=True)) for _ in range(args.steps)]
    weights = [p.detach().cpu().tolist() for p in trainer.model.parameters()]
    dist.destroy_process_group()
    return losses, weights
"""


@pytest.mark.process
def test_fixed_accelerator_idioms_train_on_two_cpu_ranks(tmp_path: Any) -> None:
    import torch

    findings = {d.code for d in lint_source(ACCELERATOR_SCRIPT)}
    assert {"AM404", "AM405", "AM406", "AM407", "AM408", "AM409"} <= findings, findings
    fixed = fix_source(ACCELERATOR_SCRIPT)
    assert lint_source(fixed) == []
    for line in (
        '        self.model = model.to(self.gpu_id if torch.cuda.is_available() else "cpu")\n',
        '            state = torch.load(checkpoint, map_location=f"cuda:{gpu_id}" if torch.cuda.is_available() '
        'else "cpu", weights_only=True)\n',
        '    accelerator = torch.accelerator.current_accelerator() or torch.device("cpu")\n',
        "    if torch.accelerator.is_available():\n        torch.accelerator.set_device_index(local_rank)\n",
        "    dist.init_process_group(backend=dist.get_default_backend_for_device(accelerator), "
        "device_id=device if torch.cuda.is_available() else None)\n",
    ):
        assert line in fixed
    checkpoint = tmp_path / "model.pt"
    torch.manual_seed(7)
    start = torch.nn.Linear(4, 1)
    torch.save(start.state_dict(), checkpoint)
    # Run as a user runs a script: `air-magic run` in its folder, each rank leaving what it got.
    (tmp_path / "train.py").write_text(
        fixed + "\n\nif __name__ == '__main__':\n    import json\n    import sys\n\n"
        "    with open(f\"result-{os.environ['RANK']}.json\", 'w') as out:\n"
        "        json.dump(main(sys.argv[1:]), out)\n"
    )
    env = {**os.environ, "AIR_MAGIC_LOG_DIR": str(tmp_path / "logs")}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(air_magic.__file__).parent.parent), env.get("PYTHONPATH")])
    )
    command = [sys.executable, "-m", "air_magic.cli", "run", "train.py", "-n", "2", "--no-tracking", "--timeout", "180"]
    done = subprocess.run(
        [*command, "--", "--checkpoint", str(checkpoint)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    (losses_0, weights_0), (losses_1, weights_1) = (
        json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)
    )
    assert len(losses_0) == len(losses_1) == 3
    assert weights_0 == weights_1  # one model: DDP kept the ranks' copies the same
    assert weights_0 != [p.detach().tolist() for p in start.parameters()]  # it trained from the checkpoint
