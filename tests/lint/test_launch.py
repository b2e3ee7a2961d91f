"""Fixed code launches with air_magic: two CPU ranks with gloo."""

from __future__ import annotations

import re
from typing import Any

import pytest
from lint_support import FIXTURES

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
