#!/usr/bin/env python3
"""A pool on the Ray backend: per-call latency, and a Ray launch on the pool's warm agents
beside a fresh one, on a 2-node cluster simulated on this machine.

    python benchmarks/pool/ray_pool.py [--calls 50] [--launches 5]

It runs in the project's virtual environment (``.venv``, which has Ray) inside a
loopback-only network namespace, on the Ray benchmark's cluster (a head and one more node,
1 CPU each, token authentication: ``benchmarks/ray/run.py`` says how and why).  One driver
process (``ray.init`` once, untimed) measures, with ``time.perf_counter()`` around each call:

* **fresh launch**: ``@distributed(num_accelerators=2, backend="ray")`` whose ranks run
  ``init_process_group`` + ``all_reduce`` + ``destroy_process_group``, no pool open (agents
  placed and started, ranks started, for every launch); the first is not counted;
* **pool start**: ``air_magic.Pool(2, backend="ray")`` until every rank is connected;
* **pool call**: ``pool.run(f)`` with ``f`` returning 0 (``noop``) and ``f`` doing one
  ``all_reduce`` of one element on the pool's group (``all_reduce``), ``--calls`` times each;
* **launch on the pool's agents**: the fresh launch's work again while the pool is open (it
  borrows the pool's agents, whose spare rank processes have imported torch); as the fresh
  launches, 3 s after the previous one (a user between cells), and also back to back (the
  spares started for the next launch are still importing torch);
* **restart**: a rank of the pool SIGKILLed; the time from the kill to the end of the first
  call that succeeds afterwards (the fault seen, the pool restarted on its agents, the call).

Writes ``results/ray_pool.json`` and ``results/ray_pool.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent / "ray"))
import run as R  # noqa: E402  (the Ray benchmark's namespace and cluster)


def payload() -> float:
    """The Ray benchmark's warm-launch work (``run.payload``), defined here so that it travels by
    value as a script's function does (one in ``run`` would be imported by name on the nodes)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    return float(value.item())


def noop() -> int:
    return 0


def reduce_one() -> float:
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return float(value.item())


#: Seconds between two launches (a user between two cells); the spare rank processes a
#: launch on warm agents starts for the next one import torch meanwhile.
PAUSE = 3.0


def paused(fn):
    time.sleep(PAUSE)
    return timed(fn)[0]


def timed(fn, *args):
    began = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - began, value


def driver(calls: int, launches: int) -> dict:
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    import air_magic

    launch = air_magic.distributed(num_accelerators=2, tracking=False, panel=False, backend="ray")(payload)
    out: dict = {}
    launch.distributed()  # untimed: imports, the first connection
    out["fresh_launch_s"] = [paused(launch.distributed) for _ in range(launches)]
    time.sleep(PAUSE)  # as before each fresh launch: Ray has its idle workers up again
    seconds, pool = timed(lambda: air_magic.Pool(2, backend="ray", tracking=False))
    out["pool_start_s"] = seconds
    pool.run(noop)
    out["noop_s"] = [timed(pool.run, noop)[0] for _ in range(calls)]
    out["all_reduce_s"] = [timed(pool.run, reduce_one)[0] for _ in range(calls)]
    launch.distributed()  # untimed: the first borrow (the spares may still import torch)
    out["borrowed_launch_s"] = [paused(launch.distributed) for _ in range(launches)]
    out["borrowed_back_to_back_s"] = [timed(launch.distributed)[0] for _ in range(launches)]
    time.sleep(3)  # the spares of the last borrow are up
    pid = pool.status()["pids"][1]
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    try:
        pool.run(reduce_one)
    except Exception as exc:  # the fault: the pool is broken
        out["fault"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    out["fault_seen_s"] = time.perf_counter() - killed
    assert pool.run(reduce_one) == [2.0, 2.0]
    out["restart_s"] = time.perf_counter() - killed
    pool.close()
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def report(results: dict) -> str:
    r = results["driver"]
    ms = lambda s: f"{s * 1000:.1f} ms"  # noqa: E731
    fresh, borrowed = statistics.median(r["fresh_launch_s"]), statistics.median(r["borrowed_launch_s"])
    m = results["machine"]
    lines = [
        f"# A pool on Ray ({results['date']}; {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
        f"{m.get('memory_gib', '?')} GiB)",
        "",
        "2-node Ray cluster on this machine (1 CPU per node), one rank per node, gloo; one driver process.",
        "",
        "| measurement | median | p99 | n |",
        "|---|---|---|---|",
    ]
    for key, name in (("noop_s", "pool call, noop"), ("all_reduce_s", "pool call, all_reduce of 1 element")):
        values = r[key]
        lines.append(f"| {name} | {ms(statistics.median(values))} | {ms(percentile(values, 0.99))} | {len(values)} |")
    lines += [
        f'| fresh `backend="ray"` launch, no pool | {fresh:.2f} s | {max(r["fresh_launch_s"]):.2f} s (max) | '
        f"{len(r['fresh_launch_s'])} |",
        f"| the same launch on the pool's agents | {borrowed:.2f} s | {max(r['borrowed_launch_s']):.2f} s (max) | "
        f"{len(r['borrowed_launch_s'])} |",
        f"| the same, back to back | {statistics.median(r['borrowed_back_to_back_s']):.2f} s | "
        f"{max(r['borrowed_back_to_back_s']):.2f} s (max) | {len(r['borrowed_back_to_back_s'])} |",
        f"| pool start | {r['pool_start_s']:.2f} s | | 1 |",
        f"| killed rank: fault seen | {r['fault_seen_s']:.2f} s | | 1 |",
        f"| killed rank: restarted and a call done | {r['restart_s']:.2f} s | | 1 |",
        "",
        f"Launch on warm agents / fresh launch: {borrowed / fresh:.2f}. Fault: {r.get('fault', '(none)')}",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        print("RESULT " + json.dumps(driver(args.calls, args.launches)), flush=True)
        return 0
    if not R.in_loopback_namespace():
        return R.reexec_in_namespace(sys.argv[1:], script=__file__)
    folder = tempfile.mkdtemp(prefix="air_magic-pool-ray-")
    try:
        env = R.start_cluster(folder, root=str(ROOT))
        command = [sys.executable, __file__, "--driver", "--calls", str(args.calls), "--launches", str(args.launches)]
        done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=1800)
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if not found:
            sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
            return 1
        results = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": R.machine(),
            "driver": json.loads(found[-1][len("RESULT ") :]),
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ray_pool.json").write_text(json.dumps(results, indent=1))
    text = report(results)
    (out / "ray_pool.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
