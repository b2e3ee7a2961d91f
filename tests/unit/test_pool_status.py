"""What ``%distributed_pool`` says of a pool of GPU ranks: each rank's GPU memory from NVML
(faked: the machine has no GPU), beside its RSS, in the status line and the table."""

from __future__ import annotations

import subprocess
import sys
import types
from types import SimpleNamespace
from typing import Iterator

import pytest

from air_magic.kernel.pool import status as pool_status
from air_magic.kernel.pool.engine import PoolEngine, _Ranks
from air_magic.spec import make_spec


def _fake_nvml(monkeypatch: pytest.MonkeyPatch, procs: dict[int, list[SimpleNamespace]]) -> None:
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nv.NVMLError = NVMLError  # type: ignore[attr-defined]
    nv.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nv.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: len(procs)  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    nv.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=50)  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=40 * 2**30, total=80 * 2**30)  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: procs[h]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def ranks() -> Iterator[list[int]]:
    """Two processes standing in for the pool's ranks (siblings, as ranks are)."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def _engine(device: str, pids: list[int]) -> PoolEngine:
    engine = PoolEngine(make_spec(2, None, None, tracking=False, panel=False), lambda: None)  # type: ignore[arg-type, return-value]
    launch = SimpleNamespace(
        local_processes=True, placement=SimpleNamespace(device=device), run_id=None, done=lambda: False
    )
    engine._ranks = _Ranks(launch, [None] * len(pids), list(pids))  # type: ignore[arg-type, list-item]
    return engine


def test_a_gpu_pool_says_each_rank_s_gpu_memory(monkeypatch: pytest.MonkeyPatch, ranks: list[int]) -> None:
    first, second = ranks
    _fake_nvml(
        monkeypatch,
        {
            0: [SimpleNamespace(pid=first, usedGpuMemory=12 * 2**30)],
            1: [SimpleNamespace(pid=second, usedGpuMemory=3 * 2**29)],
        },
    )
    engine = _engine("cuda", ranks)
    assert pool_status.status(engine)["gpu_memory"] == [12 * 2**30, 3 * 2**29]
    assert "; GPU memory per rank: 12.9 GB, 1.6 GB" in pool_status.describe(engine)  # the panel's units
    text = pool_status.text(engine)
    ranks = text.splitlines()[1:]
    assert [line.split(",")[1].strip().split(" · ")[0] for line in ranks] == ["GPU 12.9 GB", "GPU 1.6 GB"]
    from air_magic.panel._pool_status import html

    markup = html(pool_status.facts(engine))
    assert "GPU 12.9 GB · " in markup and ">memory</th>" in markup


def test_a_cpu_pool_never_asks_nvml(monkeypatch: pytest.MonkeyPatch, ranks: list[int]) -> None:
    nv = types.ModuleType("pynvml")
    nv.nvmlInit = lambda: pytest.fail("NVML asked for a pool of CPU ranks")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    engine = _engine("cpu", ranks)
    assert pool_status.status(engine)["gpu_memory"] == [None, None]
    assert "GPU memory" not in pool_status.describe(engine)
