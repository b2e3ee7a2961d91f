"""Imported at start-up by the kernels the test harness starts (it puts this folder on their
``PYTHONPATH``): SIGUSR2 then writes every thread's Python stack to the file named by
``AIR_MAGIC_TEST_KERNEL_STACKS``, so a cell that never finishes shows where the kernel was.
The variable is removed at once: the helper and the ranks a kernel starts register nothing.
"""

import os

_path = os.environ.pop("AIR_MAGIC_TEST_KERNEL_STACKS", None)
if _path:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, file=open(_path, "w"), all_threads=True)

# ``AIR_MAGIC_TEST_SLOW_MLFLOW=S``: the kernel's ``import mlflow`` takes S seconds more (for a
# test of a kernel killed before its MLflow store exists).  Popped too: not the helper's.
# The time is spent running the module, as a slow import spends it: only the importing thread
# waits, and others that import ``mlflow`` (a finder that sleeps would hold Python's global
# import lock, and every import of every thread would wait).
_slow = os.environ.pop("AIR_MAGIC_TEST_SLOW_MLFLOW", None)
if _slow:
    import importlib.abc
    import importlib.machinery
    import sys
    import time

    class _SlowMlflow(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
            if fullname != "mlflow":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                real = spec.loader.exec_module

                def exec_module(module):  # type: ignore[no-untyped-def]
                    time.sleep(float(_slow))
                    real(module)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _SlowMlflow())

# ``AIR_MAGIC_TEST_FAKE_GPUS=N``: NVML answers as a machine with N GPUs would (the edge this CPU
# machine does not have), in the kernel, its helper and its ranks (kept in the environment).
# ``AIR_MAGIC_TEST_FAKE_GPU_BUSY=INDEX:MIB`` adds a process outside air_magic using MIB on one.
_fake = os.environ.get("AIR_MAGIC_TEST_FAKE_GPUS")
if _fake:
    import sys
    import types

    _nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class _Proc:
        def __init__(self, pid: int, used: int) -> None:
            self.pid, self.usedGpuMemory = pid, used

    class _Memory:
        def __init__(self, used: int, total: int) -> None:
            self.used, self.total, self.free = used, total, total - used

    class _Rates:
        gpu = 0
        memory = 0

    _busy: dict[int, int] = {}
    for _item in filter(None, os.environ.get("AIR_MAGIC_TEST_FAKE_GPU_BUSY", "").split(",")):
        _index, _mib = _item.split(":")
        _busy[int(_index)] = int(_mib) << 20

    def _procs(handle: int) -> list:
        return [_Proc(999_999, _busy[handle])] if handle in _busy else []

    _nv.NVMLError = NVMLError  # type: ignore[attr-defined]
    _nv.nvmlInit = lambda: None  # type: ignore[attr-defined]
    _nv.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    _nv.nvmlDeviceGetCount = lambda: int(_fake)  # type: ignore[attr-defined]
    _nv.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    _nv.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    _nv.nvmlDeviceGetUUID = lambda h: f"GPU-00000000-0000-0000-0000-{h:012d}"  # type: ignore[attr-defined]
    _nv.nvmlDeviceGetMemoryInfo = lambda h: _Memory(_busy.get(h, 0), 80 << 30)  # type: ignore[attr-defined]
    _nv.nvmlDeviceGetUtilizationRates = lambda h: _Rates()  # type: ignore[attr-defined]
    _nv.nvmlDeviceGetComputeRunningProcesses = _procs  # type: ignore[attr-defined]
    # Device nodes: GPU h is /dev/nvidia<h> (AIR_MAGIC_DEVICE_NODES names the folder of files
    # standing in for them); a MIG instance (handle 1000 + slot) is GPU instance <slot> of GPU 0.
    _nv.nvmlDeviceGetMinorNumber = lambda h: h  # type: ignore[attr-defined]
    _nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle = lambda h: 0  # type: ignore[attr-defined]
    _nv.nvmlDeviceGetGpuInstanceId = lambda h: h - 1000  # type: ignore[attr-defined]
    # ``AIR_MAGIC_TEST_FAKE_MIG=K``: GPU 0 is in MIG mode with K instances (handles 1000 + slot).
    _mig = int(os.environ.get("AIR_MAGIC_TEST_FAKE_MIG", "0"))
    if _mig:
        _nv.NVML_DEVICE_MIG_ENABLE = 1  # type: ignore[attr-defined]

        def _mig_mode(handle: int) -> tuple[int, int]:
            if handle >= 1000:
                raise NVMLError("a MIG instance has no MIG mode")
            return (1, 1) if handle == 0 else (0, 0)

        def _mig_handle(handle: int, slot: int) -> int:
            if handle != 0 or slot >= _mig:
                raise NVMLError("Not Found")
            return 1000 + slot

        def _uuid_of(handle: int) -> str:
            if handle >= 1000:
                return f"MIG-11111111-0000-0000-0000-{handle - 1000:012d}"
            return f"GPU-00000000-0000-0000-0000-{handle:012d}"

        _nv.nvmlDeviceGetMigMode = _mig_mode  # type: ignore[attr-defined]
        _nv.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7  # type: ignore[attr-defined]
        _nv.nvmlDeviceGetMigDeviceHandleByIndex = _mig_handle  # type: ignore[attr-defined]
        _nv.nvmlDeviceGetUUID = _uuid_of  # type: ignore[attr-defined]
        _nv.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3" + (" MIG 1g.10gb" if h >= 1000 else "")  # type: ignore[attr-defined]
    sys.modules["pynvml"] = _nv
