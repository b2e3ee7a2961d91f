"""The trained model back in a real kernel: ``pool.state_dict``, ``pool.model``, ``pool.save``,
``pool.pull(rank=)``, a launch's DTensors put together, ``save_safetensors`` and
``open_checkpoint`` — each compared, key by key, with what the ranks hold; each bad input's
message; and a container's 64 MB ``/dev/shm``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
from harness import Kernel, kernel_with_a_pool, the_pool_stays

pytestmark = pytest.mark.kernel

NET = """\
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 40)
        self.b = nn.Linear(40, 6)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.full((6,), 0.5), persistent=False)
    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.scale
"""

# Equal per key to what the ranks hold: the full tensors, read on every rank.
SAME = """\
def same(name, full):
    ranks = pool.run(full)
    return sorted(sd) == sorted(ranks[0]) and all(
        torch.equal(sd[k], r[k]) and sd[k].dtype == r[k].dtype for r in ranks for k in sd
    )
"""


@pytest.fixture(scope="module")
def k(kernel_factory: Any) -> Iterator[Kernel]:
    yield from kernel_with_a_pool(kernel_factory, "%load_ext air_magic")


@pytest.fixture(autouse=True)
def the_pool_may_stay(k: Kernel) -> Iterator[None]:
    yield from the_pool_stays(k)


def _setup(k: Kernel) -> None:
    k.ok(NET + "import os, air_magic\npool = air_magic.Pool.current()\n" + SAME)


def test_a_ddp_model_comes_back_once_as_a_state_dict_and_as_a_module(k: Kernel) -> None:
    _setup(k)
    k.ok(
        "%%distributed --pool\n"
        "import torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\n"
        "model = DDP(Net())\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(3):\n"
        "    torch.manual_seed(step + dist.get_rank())\n"
        "    model(torch.randn(8, 12)).pow(2).mean().backward(); opt.step(); opt.zero_grad()\n"
        "    model.module.seen += 1"
    )
    k.ok("sd = pool.state_dict('model')")
    assert k.value("list(sd)") == ["seen", "a.weight", "a.bias", "b.weight", "b.bias"]  # no "module."
    # The pool's first state dict costs what the next does: torch was imported while the ranks
    # started, and nothing of torch.distributed.checkpoint is imported for it (that import was
    # 1.7 s of the first; benchmarks/model_back/first.py times the first and the second).
    assert k.value("'torch.distributed.checkpoint' in __import__('sys').modules") is False
    assert k.value("int(sd['seen'])") == 3
    assert k.value("same('model', lambda: {k: v.detach().clone() for k, v in model.module.state_dict().items()})")
    # Converted on the way; integer buffers keep their dtype.
    assert k.value("[str(v.dtype) for v in pool.state_dict('model', dtype=torch.bfloat16).values()]") == [
        "torch.int64",
        "torch.bfloat16",
        "torch.bfloat16",
        "torch.bfloat16",
        "torch.bfloat16",
    ]
    k.ok("m = pool.model('model', Net)\nx = torch.randn(5, 12)")
    # The buffer no state dict holds (persistent=False) comes too; the outputs are the ranks'.
    assert k.value("m.scale.tolist()") == [0.5] * 6
    # The weights are equal bit for bit (above); a matmul on other thread counts may round differently.
    assert k.value("torch.allclose(m(x), pool.run(lambda x: model.module(x).detach(), x)[1], rtol=1e-5, atol=1e-6)")
    assert k.value("(m.training, m.a.weight.device.type, m.a.weight.requires_grad)") == (False, "cpu", True)


def test_tied_weights_come_back_once_and_stay_tied(k: Kernel) -> None:
    """A language model's output layer is its embedding (one Parameter, two keys), as in GPT-2."""
    tied = (
        "class Tied(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed = torch.nn.Embedding(50, 8)\n"
        "        self.head = torch.nn.Linear(8, 50, bias=False)\n"
        "        self.head.weight = self.embed.weight\n"
        "    def forward(self, ids):\n"
        "        return self.head(self.embed(ids))\n"
    )
    _setup(k)
    k.ok(tied)
    k.ok("%%distributed --pool\ntorch.manual_seed(0)\ntied = Tied()")
    k.ok("sd = pool.state_dict('tied')")
    assert k.value("(list(sd), sd['head.weight'] is sd['embed.weight'])") == (["embed.weight", "head.weight"], True)
    assert k.value("same('tied', lambda: {k: v.detach().clone() for k, v in tied.state_dict().items()})")
    k.ok("m = pool.model('tied', Tied)")
    assert k.value("m.head.weight is m.embed.weight")
    # Weights equal bit for bit (above); a matmul on other thread counts may round differently.
    assert k.value("torch.allclose(m(torch.arange(5)), pool.run(lambda: tied(torch.arange(5)).detach())[0], atol=1e-6)")


def test_fsdp2_and_tensor_parallel_shards_are_put_together_without_a_collective(k: Kernel) -> None:
    _setup(k)
    k.ok(
        "%%distributed --pool\n"
        "import torch, torch.nn as nn, torch.distributed as dist\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel\n"
        "torch.manual_seed(0)\n"
        # 33 and 7 rows: shards of uneven sizes.
        "fsdp = nn.Sequential(nn.Linear(10, 33), nn.ReLU(), nn.Linear(33, 7))\n"
        "for layer in (fsdp[0], fsdp[2], fsdp):\n"
        "    fully_shard(layer)\n"
        "opt = torch.optim.Adam(fsdp.parameters())\n"
        "for _ in range(3):\n"
        "    fsdp(torch.randn(4, 10)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "mesh = init_device_mesh('cpu', (dist.get_world_size(),))\n"
        "tp = parallelize_module(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5)), mesh,\n"
        "                        {'0': ColwiseParallel(), '2': RowwiseParallel()})"
    )
    full = "lambda: {k: v.full_tensor() for k, v in %s.state_dict().items()}"
    k.ok("sd = pool.state_dict('fsdp')")
    assert k.value("{k: list(v.shape) for k, v in sd.items()}") == {
        "0.weight": [33, 10],
        "0.bias": [33],
        "2.weight": [7, 33],
        "2.bias": [7],
    }
    assert k.value("same('fsdp', %s)" % (full % "fsdp"))
    k.ok("sd = pool.state_dict('tp')")
    assert k.value("same('tp', %s)" % (full % "tp"))
    # An area of many parts (a file each, a key each here): the ranks write them in turn.
    k.ok(
        "import air_magic.kernel.pool.model_back as model_back\n"
        "model_back.PART_BYTES, part_bytes = 1, model_back.PART_BYTES\n"
        "try:\n"
        "    sd = pool.state_dict('fsdp')\n"
        "finally:\n"
        "    model_back.PART_BYTES = part_bytes"
    )
    assert k.value("same('fsdp', %s)" % (full % "fsdp"))
    # The module: its outputs are the ranks'.
    k.ok("m = pool.model('fsdp', lambda: nn.Sequential(nn.Linear(10, 33), nn.ReLU(), nn.Linear(33, 7)))")
    k.ok("x = torch.randn(3, 10)")
    assert k.value("torch.allclose(m(x), pool.run(lambda x: fsdp(x).detach(), x)[0])")


def test_a_deepspeed_zero3_model_comes_back_from_its_partitions(k: Kernel) -> None:
    pytest.importorskip("deepspeed")
    _setup(k)
    k.ok("import os\nos.environ['DS_ACCELERATOR'] = 'cpu'")
    k.ok(
        "%%distributed --pool\n"
        "import torch, torch.nn as nn, deepspeed\n"
        "torch.manual_seed(0)\n"
        "net = nn.Sequential(nn.Linear(10, 33), nn.ReLU(), nn.Linear(33, 7))\n"
        # Every parameter partitioned (small ones are kept whole by default), and a small one kept whole.
        "config = {'train_micro_batch_size_per_gpu': 2,\n"
        "          'zero_optimization': {'stage': 3, 'stage3_param_persistence_threshold': 8},\n"
        "          'zero_allow_untested_optimizer': True, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}}\n"
        "engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)\n"
        "for _ in range(2):\n"
        "    loss = engine(torch.randn(2, 10)).sum(); engine.backward(loss); engine.step()\n"
        "def gathered():\n"
        "    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):\n"
        "        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}",
        timeout=240,
    )
    # Placeholders in the ranks' own modules (ZeRO-3 partitions), but the 7 biases kept whole; the
    # full weights here.
    assert (
        k.value("pool.run(lambda: [list(p.data.shape) for p in engine.module.parameters()])")
        == [[[0], [0], [0], [7]]] * 2
    )
    k.ok("sd = pool.state_dict('engine')")
    assert k.value("{k: list(v.shape) for k, v in sd.items()}")["0.weight"] == [33, 10]
    assert k.value("same('engine', lambda: gathered())")  # gathered() is the ranks' own


@pytest.mark.parametrize(
    ("stage", "bf16", "init"),
    [(1, True, False), (2, False, False), (2, True, False), (3, True, False), (3, False, True)],
)
def test_a_deepspeed_engine_comes_back_as_its_own_zero_to_fp32_puts_it_together(
    k: Kernel, tmp_path: Path, stage: int, bf16: bool, init: bool
) -> None:
    """ZeRO-1/2/3, bf16 or fp32, built under zero.Init or not: the full fp32 weights DeepSpeed's
    consolidated state dict holds (its optimizer's master copy), bit for bit."""
    pytest.importorskip("deepspeed")
    _setup(k)
    k.ok("import os\nos.environ['DS_ACCELERATOR'] = 'cpu'")
    build = "nn.Sequential(nn.Linear(16, 600), nn.ReLU(), nn.Linear(600, 200), nn.ReLU(), nn.Linear(200, 4))"
    k.ok(
        "%%distributed --pool\n"
        "import torch, torch.nn as nn, deepspeed\n"
        "torch.manual_seed(0)\n"
        "config = {'train_micro_batch_size_per_gpu': 4, 'optimizer': {'type': 'Adam', 'params': {'lr': 1e-2}},\n"
        f"          'zero_optimization': {{'stage': {stage}}}, 'bf16': {{'enabled': {bf16}}}}}\n"
        + (
            f"with deepspeed.zero.Init(config_dict_or_path=config):\n    net = {build}\n"
            if init
            else f"net = {build}\n"
        )
        + "engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)\n"
        "for _ in range(3):\n"
        f"    x = torch.randn(4, 16, dtype={'torch.bfloat16' if bf16 else 'torch.float32'})\n"
        "    engine.backward(engine(x).float().pow(2).mean()); engine.step()\n"
        f"engine.save_checkpoint({str(tmp_path / 'ckpt')!r})",
        timeout=300,
    )
    k.ok(
        "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint\n"
        "sd = pool.state_dict('engine')\n"
        f"theirs = get_fp32_state_dict_from_zero_checkpoint({str(tmp_path / 'ckpt')!r})"
    )
    assert k.value("sorted(sd) == sorted(theirs)")
    assert k.value("{str(v.dtype) for v in sd.values()}") == {"torch.float32"}
    assert k.value("[key for key in theirs if not torch.equal(sd[key], theirs[key])]") == []


def test_a_launch_s_dtensors_come_back_whole_and_held_once(k: Kernel) -> None:
    res = k.ok(
        "import torch\n"
        "@air_magic.distributed(2)\n"
        "def train():\n"
        "    import torch, torch.nn as nn, torch.distributed as dist\n"
        "    from torch.distributed.fsdp import fully_shard\n"
        "    dist.init_process_group('gloo')\n"
        "    torch.manual_seed(0)\n"
        "    m = nn.Sequential(nn.Linear(10, 300), nn.ReLU(), nn.Linear(300, 1001))\n"
        "    fully_shard(m)\n"
        "    return m.state_dict(), {k: v.full_tensor() for k, v in m.state_dict().items()}\n"
        "out = train.distributed()\n"
        "print(type(out[0][0]['2.weight']).__name__, list(out[0][0]['2.weight'].shape))\n"
        "print(all(out[0][0][k] is out[1][0][k] for k in out[0][0]))\n"
        "print(all(torch.equal(out[0][0][k], out[1][1][k]) for k in out[0][0]))",
        timeout=120,
    )
    assert res.stdout.splitlines()[-3:] == ["Tensor [1001, 300]", "True", "True"]


def test_pull_takes_one_rank_s_value_through_shared_memory(k: Kernel) -> None:
    _setup(k)
    k.ok(
        "%%distributed --pool\n"
        "import os, torch\n"
        "torch.manual_seed(int(os.environ['RANK']))\n"
        "big = {f'w{i}': torch.randn(1024, 1024) for i in range(48)}  # 192 MiB"
    )
    k.ok(
        "import psutil, threading, time\n"
        "me = psutil.Process()\n"
        "before, peak, pulling = me.memory_info().rss, [0], [True]\n"
        "def watch():\n"
        "    while pulling[0]:\n"
        "        peak[0] = max(peak[0], me.memory_info().rss); time.sleep(0.005)\n"
        "watcher = threading.Thread(target=watch); watcher.start()\n"
        "one = pool.pull('big', rank=1)\n"
        "total = sum(float(v.sum()) for v in one.values())  # every page read\n"
        "pulling[0] = False; watcher.join()\n"
        "peak[0] = max(peak[0], me.memory_info().rss)"
    )
    size = 48 << 22
    grown = k.value("peak[0] - before")
    assert grown <= 1.1 * size, f"the kernel grew by {grown / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB value"
    assert k.value("torch.equal(one['w7'], pool.run(lambda: big['w7'])[1])")
    assert k.value("len(pool.pull('big', ranks=[1, 0]))") == 2
    assert k.value("torch.equal(pool.pull('big', ranks=[1, 0])[1]['w0'], pool.pull('big', rank=0)['w0'])")
    # Nothing stays behind in the launch's shared-memory folder.
    assert k.value("os.listdir(pool._engine.launch.shm_dir)") == []
    k.ok("del one")
    # A value the user drops is gone (its memory back), not kept by the pool until its next call.
    k.ok("import gc, weakref\nkept = weakref.ref(pool.pull('big', rank=1)['w0'])\ngc.collect()")
    assert k.value("kept() is None")


def test_save_safetensors_and_pool_save_write_what_hugging_face_loads(k: Kernel, tmp_path: Path) -> None:
    _setup(k)
    k.ok(
        "%%distributed --pool\n"
        "import torch\n"
        "torch.manual_seed(3)\n"
        "saved = Net()\n"
        "saved.a.weight.data = saved.a.weight.data.to(torch.bfloat16).float()"
    )
    one, two = tmp_path / "one", tmp_path / "two"
    k.ok(f"sd = pool.state_dict('saved')\npaths = air_magic.save_safetensors(sd, {str(one)!r})")
    assert k.value("[os.path.basename(p) for p in paths]") == ["model.safetensors"]
    k.ok("from safetensors.torch import load_file")
    assert k.value(
        f"all(torch.equal(v, sd[k]) and v.dtype == sd[k].dtype for k, v in load_file({str(one / 'model.safetensors')!r}).items())"
    )
    # The ranks write the files themselves, sharded as asked.
    k.ok(f"paths = pool.save('saved', {str(two)!r}, max_shard_size=1000)")
    index = json.loads((two / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["a.bias", "a.weight", "b.bias", "b.weight", "seen"]
    assert len(set(index["weight_map"].values())) >= 2
    k.ok(
        "import json, os\n"
        "loaded = {}\n"
        f"for name in set(json.load(open({str(two / 'model.safetensors.index.json')!r}))['weight_map'].values()):\n"
        f"    loaded.update(load_file(os.path.join({str(two)!r}, name)))"
    )
    assert k.value("sorted(loaded) == sorted(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)")


def test_a_training_checkpoint_opens_in_the_kernel_without_a_process_group(k: Kernel, tmp_path: Path) -> None:
    _setup(k)
    where = str(tmp_path / "ckpt")
    k.ok(
        "%%distributed --pool\n"
        "import torch, torch.nn as nn\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from air_magic.data import save_training_state\n"
        "torch.manual_seed(0)\n"
        "ck_model = nn.Sequential(nn.Linear(10, 33), nn.ReLU(), nn.Linear(33, 7))\n"
        "fully_shard(ck_model)\n"
        "ck_opt = torch.optim.Adam(ck_model.parameters())\n"
        "ck_model(torch.randn(3, 10)).sum().backward(); ck_opt.step()\n"
        f"save_training_state({where!r}, ck_model, ck_opt)"
    )
    k.ok(f"from air_magic.data import open_checkpoint\nck = open_checkpoint({where!r})")
    assert k.value("torch.distributed.is_initialized()") is False
    assert "model.0.weight: float32[33, 10]" in k.value("repr(ck)")
    assert "optimizer.state.0.weight.exp_avg" in k.value("ck.keys()")
    k.ok("weights = ck.load(prefix='model.')")
    assert k.value(
        "all(torch.equal(weights[k], v) for k, v in pool.run(lambda: {k: v.full_tensor() for k, v in "
        "ck_model.state_dict().items()})[0].items())"
    )
    assert k.value("ck.load(['optimizer.param_groups.0.lr'])") == {"optimizer.param_groups.0.lr": 0.001}
    assert k.value("torch.distributed.is_initialized()") is False
    res = k.run("ck.load(['model.nope'])")
    assert res.error is not None and "not in the checkpoint" in res.error["evalue"]
    assert "ck.keys() lists its keys" in res.error["evalue"]


def test_each_bad_input_gets_a_clear_error_before_anything_is_copied(k: Kernel) -> None:
    _setup(k)
    k.ok("%%distributed --pool\nimport torch\nnot_a_module = 3\nsmall = Net()")

    def error(code: str) -> str:
        res = k.run(code)
        assert res.error is not None, f"{code!r} did not fail"
        return f"{res.error['ename']}: {res.error['evalue']}"

    assert error("pool.state_dict('not_a_module')") == (
        "ModelBackError: 'not_a_module' in the ranks is a builtins.int, not a torch.nn.Module (pool.state_dict "
        "and pool.model take the name a module is bound to; pool.pull takes any value)"
    )
    assert error("pool.state_dict('nowhere')") == "NameError: name 'nowhere' is not defined on this rank"
    mismatch = error("pool.model('small', lambda: torch.nn.Linear(12, 40))")
    assert mismatch.startswith("ModelBackError: pool.model('small', factory): the module factory() builds does not")
    assert "(missing): 'bias', 'weight'" in mismatch
    assert "(unexpected): 'a.bias', 'a.weight', 'b.bias', 'b.weight', 'seen'" in mismatch
    assert "factory builds the module" in error("pool.model('small', 3)")
    assert "dtype= is a floating-point torch dtype" in error("pool.state_dict('small', dtype=torch.int8)")
    # Larger than the kernel's free memory (the machine's memory is the edge mocked here).
    too_large = error(
        "from unittest import mock\n"
        "import psutil\n"
        "real = psutil.virtual_memory()\n"
        "with mock.patch('psutil.virtual_memory', return_value=real._replace(available=100_000)):\n"
        "    pool.state_dict('small')"
    )
    assert too_large.startswith("ModelBackError: 'small''s state dict is ")
    assert "pool.save('small', folder)" in too_large
    assert (
        error("pool.pull('small', rank=2)") == "ValueError: pool.pull: rank 2 is not one of the pool's ranks (0 to 1)"
    )
    assert error("pool.pull('small', rank=0, ranks=[1])") == "TypeError: pool.pull takes rank= or ranks=, not both"
    # FSDP (version 1), real: its full state dict needs a collective of its own; refused, never empty.
    k.ok(
        "%%distributed --pool\nfrom torch.distributed.fsdp import FullyShardedDataParallel\n"
        "fsdp1 = FullyShardedDataParallel(Net(), device_id=torch.device('cpu'))"
    )
    assert error("pool.state_dict('fsdp1')") == (
        "ModelBackError: 'fsdp1' is wrapped in FSDP (version 1), whose state dict needs a collective; use FSDP2 "
        "(torch.distributed.fsdp.fully_shard), or save it from the ranks with its own state_dict_type"
    )
    unpicklable = k.run(
        "%%distributed --pool\nimport threading\nlock_module = torch.nn.Module()\nlock_module.l = threading.Lock()"
    )
    assert unpicklable.error is None
    res = k.run("pool.pull('lock_module')")
    assert res.error is not None
    assert "pool.state_dict(name) or pool.model(name, factory)" in res.error_text
    # Nothing was left in the launch's shared-memory folder by the failed calls.
    assert k.value("os.listdir(pool._engine.launch.shm_dir)") == []


# -- a 4-rank pool, and a container's 64 MB /dev/shm --------------------------------------------


def test_fsdp2_on_four_ranks(kernel_factory: Any) -> None:
    k4 = kernel_factory()
    try:
        k4.ok("%distributed_pool -n 4 --no-tracking", timeout=240)
        k4.ok("import air_magic, torch\npool = air_magic.Pool.current()")
        k4.ok(
            "%%distributed --pool\n"
            "import torch, torch.nn as nn\n"
            "from torch.distributed.fsdp import fully_shard\n"
            "torch.manual_seed(0)\n"
            "m = nn.Sequential(nn.Linear(10, 33), nn.ReLU(), nn.Linear(33, 7))\n"
            "for layer in (m[0], m[2], m):\n"
            "    fully_shard(layer)",
            timeout=120,
        )
        k4.ok(
            "sd = pool.state_dict('m')\nranks = pool.run(lambda: {k: v.full_tensor() for k, v in m.state_dict().items()})"
        )
        assert k4.value("all(torch.equal(sd[k], r[k]) for r in ranks for k in sd) and len(ranks) == 4")
    finally:
        k4.shutdown()  # its helper and ranks go now, not at the session's end


SMALL_SHM_KERNEL = """\
import os, subprocess, sys
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", "/dev/shm"], check=True)
os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *sys.argv[1:]])
"""


def _small_shm_prefix() -> list[str] | None:
    tool = shutil.which("unshare")
    if tool is None:
        return None
    for prefix in ([tool, "-m", "--propagation", "private"], [tool, "-rm", "--propagation", "private"]):
        probe = subprocess.run(
            [*prefix, "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm && df -m /dev/shm"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0:
            return prefix
    return None


def test_a_64_mb_dev_shm_still_brings_large_values_and_models_back(
    kernel_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = _small_shm_prefix()
    if prefix is None:
        if os.environ.get("CI"):
            pytest.fail("unshare cannot give a kernel a /dev/shm of its own here")
        pytest.skip("unshare cannot give a kernel a /dev/shm of its own here")
    spec = tmp_path / "kernels" / "air-magic-small-shm"
    spec.mkdir(parents=True)
    (tmp_path / "small_shm_kernel.py").write_text(SMALL_SHM_KERNEL)
    argv = [*prefix, sys.executable, str(tmp_path / "small_shm_kernel.py"), "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "64 MB /dev/shm", "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    ks = Kernel(tempfile.mkdtemp(dir=tmp_path), kernel_name="air-magic-small-shm")
    try:
        assert ks.value("__import__('shutil').disk_usage('/dev/shm').total") <= 64 << 20
        ks.ok("%load_ext air_magic\n%config DistributedMagics.tracking = False")
        ks.ok("%distributed_pool -n 2 --no-tracking", timeout=240)
        ks.ok("import air_magic, torch\npool = air_magic.Pool.current()")
        ks.ok(
            "%%distributed --pool\n"
            "import torch, torch.nn as nn\n"
            "torch.manual_seed(0)\n"
            "big = torch.randn(32 << 20)  # 128 MiB, twice /dev/shm\n"
            "wide = nn.Linear(4096, 8192)  # 128 MiB of weights",
            timeout=120,
        )
        ks.ok("one = pool.pull('big', rank=0)\nsd = pool.state_dict('wide')")
        assert ks.value("torch.equal(one, pool.run(lambda: big)[1])")
        assert ks.value("torch.equal(sd['weight'], pool.run(lambda: wide.weight.detach())[0])")
        res = ks.ok(
            "@air_magic.distributed(2)\n"
            "def make():\n"
            "    import torch\n"
            "    torch.manual_seed(1)\n"
            "    return torch.randn(32 << 20)\n"
            "made = make.distributed()\n"
            "print(torch.equal(made[0], made[1]), made[0].numel())",
            timeout=120,
        )
        assert res.stdout.splitlines()[-1] == f"True {32 << 20}"
        ks.ok("pool.close()", timeout=60)
    finally:
        ks.shutdown()
