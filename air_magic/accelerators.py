"""Accelerator names and detection of what this machine has.

``AcceleratorType`` names a node shape: ``GPU_<n>x<MODEL>`` (``GPU_8xH100``,
``GPU_1xA10``, ``GPU_4xL40S`` ...) or ``CPU``.  ``GPUType`` is the legacy chip-only
name kept for notebooks moved from ``serverless_gpu`` / ``databricks.air``.

Detection asks NVML (``nvidia-ml-py``) in the kernel: NVML never creates a CUDA
context, so the kernel stays free of CUDA state.  ``nvidia-smi`` is the fallback,
and a machine where neither answers is CPU-only.

:class:`NvmlDevices` reads live numbers the same way, for the launch panel: each
device's utilisation and memory, and which device a rank's processes use::

    {rank: [pid, child pids]}  --> NVML compute processes per device -->  {rank: (index, util %, bytes used, total)}

``pynvml`` is imported only when one is created, never by ``import air_magic``.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar, Iterator

from air_magic.errors import ConfigurationError

__all__ = [
    "AcceleratorType",
    "GPUType",
    "Hardware",
    "NvmlDevices",
    "detect_hardware",
    "model_from_device_name",
    "usable_cpu_count",
]

_SHAPE_RE = re.compile(r"^GPU_(\d+)X([A-Z0-9][A-Z0-9_]*)$")


class AcceleratorType:
    """A node shape: ``GPU_<count>x<MODEL>`` or ``CPU``.

    Parsing is case-insensitive; the canonical spelling is ``GPU_8xH100``.

    Examples
    --------
    >>> AcceleratorType.parse("gpu_8xh100")
    AcceleratorType('GPU_8xH100')
    >>> AcceleratorType.GPU_1xA10.count, AcceleratorType.GPU_1xA10.model
    (1, 'A10')
    """

    GPU_1xA10: ClassVar[AcceleratorType]
    GPU_1xH100: ClassVar[AcceleratorType]
    GPU_8xH100: ClassVar[AcceleratorType]
    GPU_8xB300: ClassVar[AcceleratorType]
    CPU: ClassVar[AcceleratorType]

    __slots__ = ("count", "model")

    #: GPUs per node (0 for ``CPU``).
    count: int
    #: The chip (``"H100"``), or ``"CPU"``.
    model: str

    def __init__(self, count: int, model: str) -> None:
        self.count = count
        self.model = model

    @property
    def value(self) -> str:
        """The canonical spelling, ``"GPU_8xH100"`` or ``"CPU"`` (also ``name``)."""
        return "CPU" if self.is_cpu else f"GPU_{self.count}x{self.model}"

    name = value

    @property
    def is_cpu(self) -> bool:
        """Whether this is the ``CPU`` shape (CPU ranks with gloo)."""
        return self.model == "CPU"

    @classmethod
    def parse(cls, value: "AcceleratorType | str") -> "AcceleratorType":
        """Parse ``GPU_<n>x<MODEL>`` or ``CPU`` (any case); raise ``ConfigurationError`` otherwise."""
        if isinstance(value, AcceleratorType):
            return value
        if not isinstance(value, str):
            raise ConfigurationError(
                f"accelerator_type must be an AcceleratorType or a string such as 'GPU_8xH100', "
                f"got {type(value).__name__} {value!r}."
            )
        text = value.strip().upper()
        if text == "CPU":
            return cls.CPU
        match = _SHAPE_RE.match(text)
        if match and int(match.group(1)) > 0:
            return cls(int(match.group(1)), match.group(2))
        raise ConfigurationError(
            f"Invalid accelerator type {value!r}. Use 'GPU_<count>x<MODEL>' "
            f"(for example {', '.join(repr(t.value) for t in _KNOWN)}) or 'CPU'; "
            "omit accelerator_type to use what this machine has."
        )

    @classmethod
    def values(cls) -> list[str]:
        """The named shapes of the reference product, plus ``CPU``."""
        return [t.value for t in _KNOWN] + ["CPU"]

    @classmethod
    def detect(cls) -> "AcceleratorType":
        """The shape of this machine: every visible GPU (``GPU_2xH200``), or ``CPU``."""
        return detect_hardware().accelerator_type

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = AcceleratorType.parse(other)
            except ConfigurationError:
                return False
        if not isinstance(other, AcceleratorType):
            return NotImplemented
        return (self.count, self.model) == (other.count, other.model)

    def __hash__(self) -> int:
        return hash((self.count, self.model))

    def __repr__(self) -> str:
        return f"AcceleratorType({self.value!r})"

    def __str__(self) -> str:
        return self.value


AcceleratorType.GPU_1xA10 = AcceleratorType(1, "A10")
AcceleratorType.GPU_1xH100 = AcceleratorType(1, "H100")
AcceleratorType.GPU_8xH100 = AcceleratorType(8, "H100")
AcceleratorType.GPU_8xB300 = AcceleratorType(8, "B300")
AcceleratorType.CPU = AcceleratorType(0, "CPU")
_KNOWN = (
    AcceleratorType.GPU_1xA10,
    AcceleratorType.GPU_1xH100,
    AcceleratorType.GPU_8xH100,
    AcceleratorType.GPU_8xB300,
)


class GPUType(enum.Enum):
    """Legacy chip names of ``serverless_gpu`` (deprecated: use :class:`AcceleratorType`)."""

    H100 = "h100_80gb"
    A10 = "a10"
    B300 = "b300"

    @classmethod
    def parse(cls, value: "GPUType | str") -> "GPUType | None":
        """The legacy type for ``value`` (``"H100"``, ``"h100_80gb"``, ``"a10g"`` ...), else ``None``."""
        if isinstance(value, GPUType):
            return value
        if not isinstance(value, str):
            return None
        text = value.strip().lower()
        if text == "a10g":
            return cls.A10
        for member in cls:
            if text in (member.value, member.name.lower()):
                return member
        return None

    def to_accelerator_type(self, count: int | None) -> AcceleratorType | None:
        """The exact replacement: A10 is always one GPU, B300 always eight, H100 follows ``count``."""
        if self is GPUType.A10:
            return AcceleratorType.GPU_1xA10
        if self is GPUType.B300:
            return AcceleratorType.GPU_8xB300
        if count is None:
            return None
        return AcceleratorType(count, "H100")


_DROP_WORDS = {"NVIDIA", "GEFORCE", "TESLA", "QUADRO"}


def model_from_device_name(name: str) -> str:
    """The chip token of an NVIDIA device name.

    Examples
    --------
    >>> model_from_device_name("NVIDIA H100 80GB HBM3")
    'H100'
    >>> model_from_device_name("NVIDIA A10G")
    'A10'
    >>> model_from_device_name("NVIDIA GeForce RTX 4090")
    'RTX4090'
    >>> model_from_device_name("NVIDIA A100-SXM4-80GB")
    'A100'
    """
    words = [w for w in re.split(r"[\s]+", name.upper().strip()) if w and w not in _DROP_WORDS]
    if not words:
        return "GPU"
    first = words[0].split("-")[0]
    if first == "RTX" and len(words) > 1:
        first = "RTX" + words[1].split("-")[0]
    # The reference product calls the A10G (AWS) and A10-24Q (Azure vGPU) "A10".
    if first in ("A10G",):
        first = "A10"
    return re.sub(r"[^A-Z0-9]", "", first) or "GPU"


def usable_cpu_count() -> int:
    """The CPU cores this process may run on (its affinity mask: ``taskset``, cgroups cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity masks
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Hardware:
    """What this machine offers to a launch."""

    gpu_count: int
    gpu_name: str | None
    #: CPU cores this kernel may use: CPU ranks beyond a few per core are refused at launch.
    cpu_count: int = field(default_factory=lambda: usable_cpu_count())

    @property
    def model(self) -> str | None:
        return model_from_device_name(self.gpu_name) if self.gpu_name else None

    @property
    def accelerator_type(self) -> AcceleratorType:
        if self.gpu_count == 0 or self.model is None:
            return AcceleratorType.CPU
        return AcceleratorType(self.gpu_count, self.model)

    def describe(self) -> str:
        if self.gpu_count == 0:
            return "no NVIDIA GPU (CPU only)"
        return f"{self.gpu_count} x {self.gpu_name} ({self.accelerator_type.value})"


@contextlib.contextmanager
def _nvml() -> Iterator[Any]:
    """One NVML session: ``pynvml``, initialised (shut down after), or ``None`` where there is no
    NVML (no package, no driver)."""
    try:
        import pynvml  # type: ignore[import-untyped]

        pynvml.nvmlInit()
    except Exception:  # ImportError, NVMLError, or whatever loading the driver's library raises
        yield None
        return
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # pragma: no cover - shutdown failures change nothing
            pass


def _cuda_devices(nvml: Any) -> list[tuple[int, Any]]:
    """What CUDA can run on, in NVML's order: each GPU, or each MIG instance of a GPU in MIG mode
    (a GPU of its own for air_magic; the index is its parent's): ``(index, handle)``."""
    found = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        migs = _mig_devices(nvml, handle)
        found += [(index, h) for h in (migs if migs is not None else [handle])]
    return found


def _mig_devices(nvml: Any, handle: Any) -> list[Any] | None:
    """The MIG instances of a GPU in MIG mode (none where none was made: the GPU itself runs
    nothing then); ``None`` for a GPU not in MIG mode."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except Exception:  # no MIG here (before Ampere, a GeForce) or an older nvidia-ml-py
        return None
    if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return None
    found = []
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            found.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
        except nvml.NVMLError:  # an empty slot
            continue
    return found


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def is_mig(uuid: str) -> bool:
    """Whether ``uuid`` names a MIG instance (``MIG-...``) rather than a whole GPU (``GPU-...``)."""
    return uuid.startswith("MIG-")


def gpu_label(index: int, uuid: str) -> str:
    """How a GPU is named to a user: its index (``3``), and for a MIG instance the start of its
    UUID too (``0:MIG-5c3e8f1a``: several instances share their GPU's index)."""
    return f"{index}:{uuid[:12]}" if is_mig(uuid) else str(index)


def _query_nvml() -> list[str] | None:
    """Names of every device CUDA can run on that NVML sees (a MIG instance's name says its
    profile), or ``None`` when NVML is not available."""
    with _nvml() as nvml:
        if nvml is None:
            return None
        return [_text(nvml.nvmlDeviceGetName(handle)) for _, handle in _cuda_devices(nvml)]


def _query_nvidia_smi() -> list[str] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


@lru_cache(maxsize=1)
def _physical_gpus() -> tuple[str, ...]:
    names = _query_nvml()
    if names is None:
        names = _query_nvidia_smi()
    return tuple(names or ())


def detect_hardware() -> Hardware:
    """The GPUs this process may use (``CUDA_VISIBLE_DEVICES`` honoured), without touching CUDA."""
    names = list(_physical_gpus())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and names:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        chosen: list[str] = []
        for entry in entries:
            if entry.isdigit():
                index = int(entry)
                if index >= len(names):
                    break  # CUDA stops at the first invalid ordinal
                chosen.append(names[index])
            elif entry.startswith(("GPU-", "MIG-")):
                chosen.append(names[0])
            else:
                break
        names = chosen
    return Hardware(gpu_count=len(names), gpu_name=names[0] if names else None, cpu_count=usable_cpu_count())


def gpu_processes() -> list[tuple[int, str, list[tuple[int, int]]]]:
    """Every device CUDA can run on that NVML sees (each GPU, or each MIG instance of a GPU in MIG
    mode), in one NVML session: ``(index, UUID, [(pid, bytes used), ...])``; ``[]`` without NVML
    (no driver, no package).  What the GPU claims and ``air-magic ps`` read."""
    with _nvml() as nvml:
        if nvml is None:
            return []
        found = []
        for index, handle in _cuda_devices(nvml):
            try:
                procs = [
                    (int(p.pid), int(p.usedGpuMemory or 0)) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                ]
            except nvml.NVMLError:
                procs = []
            found.append((index, _text(nvml.nvmlDeviceGetUUID(handle)), procs))
        return found


def gpu_nodes() -> dict[str, tuple[str, int, int]]:
    """Where each device CUDA can run on is claimed (:mod:`air_magic.protocol.gpu_locks`): its
    UUID -> (its GPU's device node, the byte range a claim locks); a device whose node NVML
    cannot name is left out (a launch on it is refused: it cannot be claimed safely)."""
    from air_magic.protocol import gpu_locks

    found: dict[str, tuple[str, int, int]] = {}
    with _nvml() as nvml:
        if nvml is None:
            return found
        for _index, handle in _cuda_devices(nvml):
            try:
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                if is_mig(uuid):
                    parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
                    minor = int(nvml.nvmlDeviceGetMinorNumber(parent))
                    instance: int | None = int(nvml.nvmlDeviceGetGpuInstanceId(handle))
                else:
                    minor, instance = int(nvml.nvmlDeviceGetMinorNumber(handle)), None
            except Exception:  # (an NVML without the call)
                continue
            found[uuid] = (gpu_locks.node_path(minor), *gpu_locks.lock_range(instance))
    return found


# -- live numbers (the launch panel) -------------------------------------------------------


class NvmlDevices:
    """GPU utilisation and memory per rank through NVML (nvidia-ml-py), without touching CUDA."""

    def __init__(self) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        devices = _cuda_devices(pynvml)  # each GPU, or each MIG instance (which has no utilisation of its own)
        self.handles = [handle for _, handle in devices]
        self.indices = [index for index, _ in devices]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        self.visible = [int(e) for e in entries] if entries and all(e.isdigit() for e in entries) else None

    def sample(self, live: dict[int, list[int]]) -> dict[int, tuple[int | None, int | None, int | None, int | None]]:
        nv = self.nv
        devices = []
        for handle in self.handles:
            try:
                util: int | None = int(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
            except nv.NVMLError:
                util = None
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            try:
                procs = {p.pid: p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)}
            except nv.NVMLError:
                procs = {}
            devices.append((util, int(memory.used), int(memory.total), procs))
        result: dict[int, tuple[int | None, int | None, int | None, int | None]] = {}
        for rank, pids in live.items():
            index = None
            used = None
            for i, (_, _, _, procs) in enumerate(devices):
                mine = [procs[p] for p in pids if p in procs]
                if mine:
                    index, used = i, sum(int(m or 0) for m in mine)
                    break
            if index is None:  # pids from another PID namespace: the rank's usual device
                order = self.visible if self.visible is not None else list(range(len(devices)))
                if order and rank < len(order) and order[rank] < len(devices):
                    index = order[rank]
                    used = devices[index][1]
            if index is None:
                result[rank] = (None, None, None, None)
            else:
                result[rank] = (self.indices[index], devices[index][0], used, devices[index][2])
        return result

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:  # called as a launch ends: a failed shutdown changes nothing there
            pass
