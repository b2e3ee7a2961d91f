"""Fixing is idempotent and leaves code that compiles, for any mix of legacy snippets."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lint_support import undefined_names

from air_magic.lint import fix_source, lint_source

IMPORTS = [
    "from serverless_gpu import distributed",
    "from databricks.air import distributed",
    "import serverless_gpu as sg\ndistributed = sg.distributed",
    "import databricks.air\ndistributed = databricks.air.distributed",
    "from serverless_gpu import distributed, GPUType",
    "from serverless_gpu import distributed as dist_fn\ndistributed = dist_fn",
    "import serverless_gpu\nfrom serverless_gpu import distributed",
    "from serverless_gpu import distributed, ray_launch",
    "from air_magic import distributed",
]
EXTRA_IMPORTS = [
    "",
    "from pyspark.ml.torch.distributor import TorchDistributor",
    "from serverless_gpu.data import UCVolumeWriter, UCVolumeDataset, DataLoader",
    "import databricks.air.data as air_data",
    "import os",
    "from air_magic import GPUType",
    "import torch.distributed as dist",
]
COUNTS = ["", "gpus=8", "gpus=1", "num_accelerators=2", "gpus=2, num_accelerators=2", "4"]
TYPES = [
    "",
    "gpu_type='H100'",
    'gpu_type="a10g"',
    "gpu_type=GPUType.B300",
    'accelerator_type="H100"',
    "accelerator_type='GPU_8xH100'",
    'gpu_type="H100", accelerator_type="GPU_1xH100"',
]
OTHER = ["", "remote=True", "timeout=600", "remote=False"]
DATA = [
    "",
    "data = load_table('/Volumes/x')",
    "import torch\ndata = torch.randn(10, 10)",
    "data = [1, 2, 3]",
]
BODIES = [
    "    return 1",
    "    return len(data)",
    "    import mlflow\n    mlflow.set_experiment('/x')\n    return 0",
    "    import os\n    os.environ['MASTER_PORT'] = '1234'\n    return 0",
    "    w = UCVolumeWriter('/Volumes/a')\n    return w",
    "    ds = UCVolumeDataset('/Volumes/a')\n    return DataLoader(ds)",
    "    return air_data.UCVolumeReader('/Volumes/a')",
    "    import torch\n    torch.cuda.set_device(0)\n    return torch.device('cuda', 0)",
    "    dist.init_process_group(backend='nccl')\n    return len(data)",
]
LAUNCHES = [
    "train.distributed()",
    "train(1)",
    "train.with_overrides(gpus=2, gpu_type='A10').distributed()",
    "result = TorchDistributor(num_processes=2, use_gpu=False).run(train.func)",
    "d = TorchDistributor(num_processes=2)\nd.run(train.func)",
    "TorchDistributor(num_processes=2, local_mode=False).run(train.func)",
    "os.environ.setdefault('MASTER_ADDR', 'x')",
]


@st.composite
def programs(draw: st.DrawFn) -> str:
    args = ", ".join(
        a for a in (draw(st.sampled_from(COUNTS)), draw(st.sampled_from(TYPES)), draw(st.sampled_from(OTHER))) if a
    )
    parts = [
        draw(st.sampled_from(IMPORTS)),
        draw(st.sampled_from(EXTRA_IMPORTS)),
        draw(st.sampled_from(DATA)),
        f"@distributed({args})\ndef train(*args):\n{draw(st.sampled_from(BODIES))}",
        *draw(st.lists(st.sampled_from(LAUNCHES), max_size=3)),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.booleans())
def test_fixing_twice_equals_fixing_once_and_compiles(source: str, unsafe: bool) -> None:
    once = fix_source(source, unsafe=unsafe)
    assert fix_source(once, unsafe=unsafe) == once
    compile(once, "fixed.py", "exec")
    # A fix never leaves a name unbound (a removed import still in use, an import not added).
    assert undefined_names(once) <= undefined_names(source)
    # Nothing a fix at this level could still do is left behind.
    allowed = {"safe"} | ({"unsafe"} if unsafe else set())
    assert not [d for d in lint_source(once) if d.fixable and str(d.applicability) in allowed]
