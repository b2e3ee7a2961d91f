"""Verified teardown on GPUs, with NVML faked (the one edge not owned here): a process of
the launch that still holds GPU memory is named; others' processes are not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from types import SimpleNamespace
from typing import Any

import pytest

from air_magic.kernel import teardown as _teardown


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[Any]]:
    """A fake pynvml: GPU index -> its compute processes."""
    devices: dict[int, list[Any]] = {0: [], 1: []}
    nv = types.ModuleType("pynvml")
    nv.NVMLError = type("NVMLError", (Exception,), {})  # type: ignore[attr-defined]
    nv.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nv.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: len(devices)  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: devices[h]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    return devices


def _sleeper(launch_id: str) -> subprocess.Popen[bytes]:
    """``sleep 30`` carrying ``launch_id``, returned once its environment is readable.

    ``Popen`` returns when ``exec`` has begun, but the kernel sets the new program's
    environment a moment later; until then ``/proc/PID/environ`` reads empty (seen in CI
    on a loaded 2-core machine)."""
    process = subprocess.Popen(["sleep", "30"], env={**os.environ, "AIR_MAGIC_LAUNCH_ID": launch_id})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{process.pid}/environ", "rb") as handle:
            if f"AIR_MAGIC_LAUNCH_ID={launch_id}".encode() in handle.read().split(b"\0"):
                return process
        time.sleep(0.01)
    process.kill(), process.wait()
    raise AssertionError(f"sleep 30 (pid {process.pid}) never showed its environment")


def test_a_process_of_the_launch_that_holds_gpu_memory_is_named(nvml: dict[int, list[Any]]) -> None:
    ours = _sleeper("0007-abc")
    theirs = _sleeper("0008-def")
    try:
        nvml[1] = [
            SimpleNamespace(pid=ours.pid, usedGpuMemory=3 << 30),
            SimpleNamespace(pid=theirs.pid, usedGpuMemory=1 << 30),
            SimpleNamespace(pid=4242424, usedGpuMemory=1 << 30),
        ]  # a rank's pid
        holders = _teardown.gpu_holders({4242424}, "0007-abc")
        assert holders == [(ours.pid, 1, 3 << 30), (4242424, 1, 1 << 30)]
        text = _teardown.describe_holders(holders[:1])
        assert text == (
            f"[air_magic] GPU memory is still held after the launch: pid {ours.pid} (sleep 30) 3.0 GiB on GPU 1. "
            "A process the launched code started outlived it; stop it (kill PID) to give the memory back."
        )
    finally:
        ours.kill(), theirs.kill(), ours.wait(), theirs.wait()


def test_memory_given_back_a_moment_late_is_not_reported(
    nvml: dict[int, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml[0] = [SimpleNamespace(pid=4242424, usedGpuMemory=1 << 30)]
    calls = {"n": 0}
    real = _teardown.gpu_holders

    def releasing(pids: set[int], launch_id: str) -> list[tuple[int, int, int]]:
        calls["n"] += 1
        if calls["n"] == 3:
            nvml[0] = []  # the driver gave it back
        return real(pids, launch_id)

    monkeypatch.setattr(_teardown, "gpu_holders", releasing)
    assert _teardown.wait_for_release({4242424}, "x", grace=2.0) == []


def test_without_nvml_nothing_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert _teardown.gpu_holders({1}, "x") == []
    launch = SimpleNamespace(placement=SimpleNamespace(device="cpu"), ranks=[], id="x")
    assert _teardown.check(launch) is None
