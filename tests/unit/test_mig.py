"""MIG: each MIG instance of a GPU in MIG mode is a GPU of its own (NVML's answer replaced, the
edge this CPU machine does not have)."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from air_magic import accelerators
from air_magic.hints import hints_for
from air_magic.kernel.machine.claims import GPU, describe_holders, visible_gpus


class NVMLError(Exception):
    pass


def _fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU 0 in MIG mode with instances in slots 0 and 2 (slot 1 empty); GPU 1 in MIG mode with
    none made; GPU 2 whole; GPU 3 an older GPU whose NVML has no MIG mode."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = NVMLError  # type: ignore[attr-defined]
    nv.NVML_DEVICE_MIG_ENABLE = 1  # type: ignore[attr-defined]
    nv.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nv.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: 4  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"  # type: ignore[attr-defined]

    def mig_mode(handle: str) -> tuple[int, int]:
        if handle == "gpu3":
            raise NVMLError("Not Supported")
        return (1, 1) if handle in ("gpu0", "gpu1") else (0, 0)

    def mig_handle(handle: str, slot: int) -> str:
        if handle == "gpu0" and slot in (0, 2):
            return f"mig0.{slot}"
        raise NVMLError("Not Found")

    uuids = {"gpu2": "GPU-2222", "gpu3": "GPU-3333", "mig0.0": "MIG-aaaa0000-1", "mig0.2": "MIG-bbbb0000-2"}
    procs = {"mig0.2": [SimpleNamespace(pid=77, usedGpuMemory=3 << 30)], "gpu2": []}
    nv.nvmlDeviceGetMigMode = mig_mode  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle  # type: ignore[attr-defined]
    nv.nvmlDeviceGetUUID = lambda h: uuids[h].encode()  # type: ignore[attr-defined]
    nv.nvmlDeviceGetName = lambda h: "NVIDIA A100-SXM4-80GB" + (" MIG 3g.40gb" if h.startswith("mig") else "")  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: procs.get(h, [])  # type: ignore[attr-defined]
    nv.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=50)  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=5 << 30, total=40 << 30)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    accelerators._physical_gpus.cache_clear()


def test_mig_instances_replace_their_gpu_in_the_machine_s_list(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvml(monkeypatch)
    assert accelerators.gpu_processes() == [
        (0, "MIG-aaaa0000-1", []),
        (0, "MIG-bbbb0000-2", [(77, 3 << 30)]),
        (2, "GPU-2222", []),
        (3, "GPU-3333", []),
    ]
    hardware = accelerators.detect_hardware()
    assert hardware.gpu_count == 4 and hardware.gpu_name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    accelerators._physical_gpus.cache_clear()


def test_a_kernel_s_cuda_visible_devices_of_mig_uuids_narrows_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-bbbb,GPU-2222")
    assert visible_gpus(accelerators.gpu_processes()) == [GPU(0, "MIG-bbbb0000-2"), GPU(2, "GPU-2222")]
    accelerators._physical_gpus.cache_clear()


def test_mig_instances_are_named_by_their_gpu_and_uuid() -> None:
    assert accelerators.gpu_label(3, "GPU-2222") == "3"
    assert accelerators.gpu_label(0, "MIG-5c3e8f1a-0000") == "0:MIG-5c3e8f1a"
    wanted = [GPU(0, "MIG-aaaa0000-1"), GPU(0, "MIG-bbbb0000-2")]
    assert describe_holders(wanted, [], {"MIG-aaaa0000-1", "MIG-bbbb0000-2"}) == (
        "GPUs 0:MIG-aaaa0000, 0:MIG-bbbb0000 used by processes outside air_magic"
    )


def test_the_panel_s_numbers_read_each_mig_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvml(monkeypatch)
    gpus = accelerators.NvmlDevices()
    # The rank on the second MIG instance: its GPU's index, its own memory.
    assert gpus.sample({0: [77]}) == {0: (0, 50, 3 << 30, 40 << 30)}
    gpus.close()


def test_a_rank_that_asks_for_a_gpu_it_cannot_see_gets_a_hint() -> None:
    (hint,) = hints_for("RuntimeError: CUDA error: invalid device ordinal")
    assert "torch.cuda.set_device(0) on MIG" in hint
