#!/usr/bin/env python3
"""One GPU box, many notebooks: what the machine's list and the GPU claims cost, and whether two
launches ever get one GPU.  NVML's answer is replaced (8 GPUs this CPU machine does not have).

    .venv/bin/python benchmarks/claims/run.py [--pairs 1000] [--crowd 100] [--only-ps]

* ``ps``: ``air-magic ps`` (a fresh process, as a user types it) and ``machine.rows()`` in
  process, with 64 live records;
* ``refusal``: a launch's claim refused (``wait=False``, every GPU held): the
  observer's ``before_start`` until it raises;
* ``overlap``: ``--pairs`` pairs of processes claiming 4 of the 8 GPUs at the same moment, and
  ``--crowd`` processes claiming 1 GPU each at once, each holding its claim until every one has
  tried: GPUs claimed twice (the goal: none; the crowd: 8 claimed, the rest refused);
* ``dead holder``: a holder of every GPU killed with SIGKILL while a launch waits for them: the
  seconds from the kill to the waiter's claim;
* ``added``: the observer's hooks on a warm CPU launch and on a (faked) GPU launch, per launch.

Writes ``results/claims.json`` and ``results/claims.md``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
GPUS = 8


def fake_nvml() -> None:
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nv.NVMLError = NVMLError  # type: ignore[attr-defined]
    nv.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nv.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: GPUS  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    nv.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: []  # type: ignore[attr-defined]
    sys.modules["pynvml"] = nv
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)


class FakeLaunch:
    """What the claims observer reads of a launch."""

    def __init__(self, launch_id: str, ranks: int | None, device: str = "cuda") -> None:
        self.id = launch_id
        self.kind = "launch"
        self.label = "bench"
        self.world_size = ranks or GPUS
        self.local_processes = True
        self.placement = types.SimpleNamespace(device=device)
        self.spec = types.SimpleNamespace(num_accelerators=ranks, wait=True)
        self.ranks: list[Any] = []

    def notify(self, line: str, stream: str = "stdout") -> None:
        pass


def _claim_and_hold(launch_id: str, ranks: int, ready: Any, go: Any, out: Any, release: Any) -> None:
    fake_nvml()
    from air_magic.kernel.machine.claims import ClaimObserver

    observer = ClaimObserver(FakeLaunch(launch_id, ranks))  # type: ignore[arg-type]
    observer.launch.spec.wait = False  # type: ignore[attr-defined]
    env: dict[str, str] = {}
    ready.set()
    go.wait()
    try:
        observer.before_start(observer.launch, env)  # type: ignore[arg-type]
        out.put(env["CUDA_VISIBLE_DEVICES"].split(","))
    except Exception:
        out.put([])
    release.wait()  # held until every claimant has tried: any GPU claimed twice overlapped
    observer.after_end(observer.launch)  # type: ignore[arg-type]


def overlap(pairs: int, crowd: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    twice = 0
    refused_pairs = 0
    for i in range(pairs):
        go, out, release = ctx.Event(), ctx.Queue(), ctx.Event()
        readies = [ctx.Event() for _ in range(2)]
        procs = [
            ctx.Process(target=_claim_and_hold, args=(f"p{i}-{j}", 4, readies[j], go, out, release)) for j in range(2)
        ]
        for proc in procs:
            proc.start()
        for ready in readies:
            ready.wait()
        go.set()
        got = [out.get(timeout=30) for _ in procs]
        release.set()
        for proc in procs:
            proc.join()
        flat = [g for gpus in got for g in gpus]
        twice += len(flat) - len(set(flat))
        refused_pairs += sum(1 for gpus in got if not gpus)
    go, out, release = ctx.Event(), ctx.Queue(), ctx.Event()
    readies = [ctx.Event() for _ in range(crowd)]
    procs = [ctx.Process(target=_claim_and_hold, args=(f"c{j}", 1, readies[j], go, out, release)) for j in range(crowd)]
    for proc in procs:
        proc.start()
    for ready in readies:
        ready.wait()
    go.set()
    got = [out.get(timeout=60) for _ in procs]
    release.set()
    for proc in procs:
        proc.join()
    flat = [g for gpus in got for g in gpus]
    result = {
        "pairs": pairs,
        "gpus_claimed_twice_in_pairs": twice,
        "pairs_where_one_was_refused": refused_pairs,
        "crowd": crowd,
        "crowd_claimed": len(flat),
        "crowd_claimed_twice": len(flat) - len(set(flat)),
    }
    print(f"  overlap: {result}", flush=True)
    return result


def ps_time(records: int) -> dict[str, Any]:
    from air_magic.kernel.machine import ps as machine
    from air_magic.protocol import registry

    me = os.getpid()
    holders = [
        registry.publish(
            registry.Record(
                id=f"{i:04d}-benchmark", uid=os.getuid(), user="bench", holder_pid=me,
                holder_start=registry.process_start(me), kind="pool", ranks=2, pids=[me, me],
                pid_starts=[registry.process_start(me)] * 2,
            )
        )
        for i in range(records)
    ]  # fmt: skip
    try:
        inproc = []
        for _ in range(20):
            began = time.perf_counter()
            found, skipped = machine.rows()
            machine.table(found, machine.orphans(), skipped)
            inproc.append(time.perf_counter() - began)
        cli = []
        for _ in range(10):
            began = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "air_magic.cli", "ps"], capture_output=True, text=True)
            cli.append(time.perf_counter() - began)
            assert done.returncode == 0 and done.stdout.count("benchmark") == records, done.stderr
    finally:
        for holder in holders:
            holder.close()
    result = {
        "records": records,
        "in_process_ms": statistics.median(inproc) * 1000,
        "cli_ms": statistics.median(cli) * 1000,
    }
    print(
        f"  ps with {records} records: {result['cli_ms']:.0f} ms (air-magic ps), {result['in_process_ms']:.1f} ms in process",
        flush=True,
    )
    return result


def refusal() -> dict[str, Any]:
    from air_magic.kernel.machine.claims import ClaimObserver, GPUsBusyError

    holder = ClaimObserver(FakeLaunch("hold-all", GPUS))  # type: ignore[arg-type]
    holder.before_start(holder.launch, {})  # type: ignore[arg-type]
    took = []
    for i in range(50):
        observer = ClaimObserver(FakeLaunch(f"refused-{i}", 2))  # type: ignore[arg-type]
        observer.launch.spec.wait = False  # type: ignore[attr-defined]
        began = time.perf_counter()
        try:
            observer.before_start(observer.launch, {})  # type: ignore[arg-type]
        except GPUsBusyError:
            took.append(time.perf_counter() - began)
    holder.after_end(holder.launch)  # type: ignore[arg-type]
    result = {"median_ms": statistics.median(took) * 1000, "max_ms": max(took) * 1000}
    print(f"  --no-wait refusal: {result['median_ms']:.1f} ms (max {result['max_ms']:.1f})", flush=True)
    return result


def _hold_everything(ready: Any) -> None:
    fake_nvml()
    from air_magic.kernel.machine.claims import ClaimObserver

    observer = ClaimObserver(FakeLaunch("doomed", GPUS))  # type: ignore[arg-type]
    observer.before_start(observer.launch, {})  # type: ignore[arg-type]
    ready.set()
    time.sleep(120)


def dead_holder(rounds: int) -> dict[str, Any]:
    from air_magic.kernel.machine.claims import ClaimObserver

    ctx = multiprocessing.get_context("fork")
    delays = []
    for i in range(rounds):
        ready = ctx.Event()
        proc = ctx.Process(target=_hold_everything, args=(ready,))
        proc.start()
        ready.wait()
        got: list[float] = []
        waiter = ClaimObserver(FakeLaunch(f"waiter-{i}", 2))  # type: ignore[arg-type]

        def wait_for_it(waiter: Any, got: list[float]) -> None:
            waiter.before_start(waiter.launch, {})
            got.append(time.perf_counter())

        thread = threading.Thread(target=wait_for_it, args=(waiter, got))
        thread.start()
        time.sleep(0.5)
        killed = time.perf_counter()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        thread.join(timeout=30)
        delays.append(got[0] - killed)
        waiter.after_end(waiter.launch)  # type: ignore[arg-type]
    result = {"rounds": rounds, "median_s": statistics.median(delays), "max_s": max(delays)}
    print(f"  dead holder to waiter's claim: {result['median_s']:.2f} s (max {result['max_s']:.2f})", flush=True)
    return result


def added() -> dict[str, Any]:
    from air_magic.kernel.machine.claims import ClaimObserver

    out = {}
    for device in ("cpu", "cuda"):
        took = []
        for i in range(200):
            launch = FakeLaunch(f"added-{device}-{i}", 2, device)
            launch.ranks = [types.SimpleNamespace(pid=os.getpid()), types.SimpleNamespace(pid=os.getpid())]
            began = time.perf_counter()
            observer = ClaimObserver(launch)  # type: ignore[arg-type]
            observer.before_start(launch, {})  # type: ignore[arg-type]
            observer.after_start(launch)  # type: ignore[arg-type]
            observer.after_end(launch)  # type: ignore[arg-type]
            took.append(time.perf_counter() - began)
        out[device] = statistics.median(took) * 1000
    print(f"  added per launch: CPU {out['cpu']:.2f} ms, GPU {out['cuda']:.2f} ms", flush=True)
    return out


def machine_text() -> str:
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--crowd", type=int, default=100)
    parser.add_argument("--only-ps", action="store_true", help="measure air-magic ps alone (results/claims-ps.json)")
    args = parser.parse_args()
    where = tempfile.mkdtemp(prefix="air-magic-claims-")
    os.environ["AIR_MAGIC_REGISTRY"] = os.path.join(where, "launches")
    fake_nvml()
    if args.only_ps:
        try:
            found = {"machine": machine_text(), "ps": ps_time(64)}
        finally:
            shutil.rmtree(where, ignore_errors=True)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "claims-ps.json").write_text(json.dumps(found, indent=1))
        return
    try:
        results = {
            "machine": machine_text(),
            "ps": ps_time(64),
            "refusal": refusal(),
            "overlap": overlap(args.pairs, args.crowd),
            "dead_holder": dead_holder(10),
            "added_ms": added(),
        }
    finally:
        shutil.rmtree(where, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "claims.json").write_text(json.dumps(results, indent=1))
    o, d = results["overlap"], results["dead_holder"]
    lines = [
        f"Machine: {results['machine']}",
        "",
        "| what | measured | goal |",
        "|---|---|---|",
        f"| `air-magic ps`, 64 live records (a fresh process) | {results['ps']['cli_ms']:.0f} ms | ≤ 200 ms |",
        f"| the same in the kernel (`%distributed_ps`) | {results['ps']['in_process_ms']:.1f} ms | |",
        f"| a refusal (`--no-wait`) | {results['refusal']['median_ms']:.1f} ms (max {results['refusal']['max_ms']:.1f}) | ≤ 100 ms |",
        f"| GPUs claimed twice, {o['pairs']} pairs at once (4 of 8 each) | {o['gpus_claimed_twice_in_pairs']} | 0 |",
        f"| GPUs claimed twice, {o['crowd']} at once (1 of 8 each) | {o['crowd_claimed_twice']} ({o['crowd_claimed']} claimed) | 0 |",
        f"| a holder killed to the waiter's claim | {d['median_s']:.2f} s (max {d['max_s']:.2f}, {d['rounds']} rounds) | ≤ 1 s |",
        f"| the claims' cost per launch, CPU / GPU | {results['added_ms']['cpu']:.2f} / {results['added_ms']['cuda']:.2f} ms | ≤ 2 ms |",
    ]
    (RESULTS / "claims.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
