"""Verified teardown on GPUs: after a launch, no process of it still holds GPU memory.

Ranks are killed with their process groups and children in sessions of their own are
reaped by the helper; this asks NVML (through nvidia-ml-py, without touching CUDA) which
processes hold GPU memory, and names any that belongs to the launch: one of its ranks, or
a process carrying the launch's ``AIR_MAGIC_LAUNCH_ID`` (everything a rank executed).
GPU memory is given back by the driver a moment after a process ends, so the check
waits a little before it speaks.
"""

from __future__ import annotations

import time
from typing import Any

from air_magic.protocol import LAUNCH_ID_ENV

__all__ = ["gpu_holders", "describe_holders", "wait_for_release"]


def gpu_holders(rank_pids: set[int], launch_id: str) -> list[tuple[int, int, int]]:
    """``(pid, GPU index, bytes)`` for each process of the launch that holds GPU memory."""
    try:
        import pynvml  # type: ignore[import-untyped]
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver, no GPU: nothing can hold GPU memory
        return []
    found = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid in rank_pids or _carries(process.pid, launch_id):
                    found.append((process.pid, index, int(process.usedGpuMemory or 0)))
    except pynvml.NVMLError:  # a GPU that fell off the bus: report what was read
        return found
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return found


def _carries(pid: int, launch_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return f"{LAUNCH_ID_ENV}={launch_id}".encode() in handle.read().split(b"\0")
    except OSError:
        return False


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        return "?"


def wait_for_release(rank_pids: set[int], launch_id: str, grace: float = 2.0) -> list[tuple[int, int, int]]:
    """The holders still there after ``grace`` seconds (checked every 0.1 s)."""
    deadline = time.monotonic() + grace
    while True:
        holders = gpu_holders(rank_pids, launch_id)
        if not holders or time.monotonic() >= deadline:
            return holders
        time.sleep(0.1)


def describe_holders(holders: list[tuple[int, int, int]]) -> str:
    """``'[air_magic] GPU memory is still held after the launch: pid 12 (python ...) 2.0 GiB on GPU 0. ...'``"""
    parts = [f"pid {pid} ({_command(pid)}) {size / 2**30:.1f} GiB on GPU {index}" for pid, index, size in holders]
    return (
        "[air_magic] GPU memory is still held after the launch: " + "; ".join(parts) + ". A process the "
        "launched code started outlived it; stop it (kill PID) to give the memory back."
    )


def check(launch: Any) -> str | None:
    """For a GPU launch that has ended: the warning to show, or ``None``."""
    if getattr(launch.placement, "device", "cpu") != "cuda" or not getattr(launch, "local_processes", True):
        return None  # (ranks on other machines hold nothing of this machine's GPUs)
    pids = {state.pid for state in launch.ranks if state.pid}
    holders = wait_for_release(pids, launch.id)
    return describe_holders(holders) if holders else None
