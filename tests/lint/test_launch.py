"""Converted TorchDistributor code launches with air_magic: two CPU ranks with gloo."""

from __future__ import annotations

from typing import Any

import pytest

from air_magic import decorator
from air_magic.lint import fix_source, lint_source

SPARK_CODE = '''\
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
'''


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
