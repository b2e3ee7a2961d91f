#!/usr/bin/env python3
"""Why is it stuck: how soon the hang report comes, whether it ever comes when nothing hangs,
and what torch's Flight Recorder costs.

    .venv/bin/python benchmarks/hang/run.py [--samples 10] [--runs 100] [--quick]

* ``detection``: a real kernel (jupyter_client, as a notebook drives it) with a pool of 2 and
  of 4 CPU ranks and the default ``AIR_MAGIC_HANG_SECONDS`` (5); each cell makes two
  all_reduces on every rank, then rank 1 writes ``time.time()`` and skips the third, which
  the others make.  Seconds from that line (the last collective completed) to the front end's
  display of the report (``--samples`` cells each), then Ctrl-C (the pool stays); and ranks
  that disagree (all_reduce against broadcast), the same way.
* ``false reports``: ``--runs`` pool cells, with ``AIR_MAGIC_HANG_SECONDS=1`` and pauses three
  times as long, a third each: a compute pause between collectives on every rank, a rank
  paused in the debugger while its peer waits in an all_reduce (answered ``c`` after 3 s),
  and 400 all_reduces of 65,536 floats that complete (3 s or so); a report in any of them is a false one.
* ``recording``: ``air-magic run`` on 2 ranks, 1,000 all_reduces of 1,024 floats timed on
  rank 0, with the recorder on (``TORCH_FR_BUFFER_SIZE=2000``, air_magic's default) and off
  (``AIR_MAGIC_FLIGHT_RECORDER=0``), alternated, 7 runs each, in one run of this script;
  and ``benchmarks/training/train.py``'s DDP training (2,000 steps), on and off alternated, 5 each.

Writes ``results/hang.json`` and ``results/hang.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(ROOT / "tests"))

from harness import CellResult, Kernel  # noqa: E402  (the test suite's notebook-like kernel driver)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def reported(res: CellResult) -> bool:
    return any(str(d.get("text/plain", "")).startswith("[air_magic] hang report:") for _, d, _ in res.displays)


def verdict(res: CellResult) -> str:
    for _, data, _ in reversed(res.displays):
        text = str(data.get("text/plain", ""))
        if text.startswith("[air_magic] hang report:"):
            return text.splitlines()[0]
    return ""


SKIP = """%%distributed --pool
t = torch.ones(1024)
dist.all_reduce(t)
dist.all_reduce(t)
if dist.get_rank() == 1:
    open({mark!r}, "w").write(repr(time.time()))
    time.sleep(120)
else:
    dist.all_reduce(t)"""

DISAGREE = """%%distributed --pool
t = torch.ones(1024)
dist.all_reduce(t)
if dist.get_rank() == 1:
    open({mark!r}, "w").write(repr(time.time()))
    dist.broadcast(torch.ones(16), src=1)
else:
    dist.all_reduce(t)"""


def detection(n: int, samples: int, workdir: str) -> dict[str, Any]:
    kernel = Kernel(tempfile.mkdtemp(dir=workdir))
    mark = os.path.join(kernel.workdir, "mark")
    out: dict[str, Any] = {}
    try:
        kernel.ok("%load_ext air_magic\n%config DistributedMagics.tracking = False")
        kernel.ok(f"%distributed_pool -n {n} --no-tracking", timeout=300)
        kernel.ok("%%distributed --pool\nimport time, torch, torch.distributed as dist", timeout=120)
        for name, cell, count in (("skip", SKIP, samples), ("disagree", DISAGREE, max(3, samples // 2))):
            seconds, verdicts, outcomes = [], [], []
            for _ in range(count):
                if os.path.exists(mark):
                    os.unlink(mark)
                msg_id = kernel.execute(cell.format(mark=mark))
                res = kernel.collect(msg_id, timeout=120, until=reported)
                seen = time.time()
                seconds.append(seen - float(Path(mark).read_text()))
                verdicts.append(verdict(res))
                kernel.km.interrupt_kernel()
                end = kernel.collect(msg_id, timeout=120)
                outcomes.append(end.error["evalue"] if end.error else "no error")
                kernel.ok("%%distributed --pool\nt = torch.ones(2); dist.all_reduce(t); t.tolist()", timeout=60)
            out[name] = {
                "seconds": seconds,
                "median": statistics.median(seconds),
                "p95": p95(seconds),
                "verdicts": sorted(set(verdicts)),
                "after_ctrl_c": sorted(set(outcomes)),
            }
            print(f"  {n} ranks, {name}: median {out[name]['median']:.2f} s, p95 {out[name]['p95']:.2f} s", flush=True)
    finally:
        kernel.km.shutdown_kernel(now=True)
    return out


PAUSE = """%%distributed --pool
t = torch.ones(64)
dist.all_reduce(t)
time.sleep(3)
dist.all_reduce(t)"""

DEBUG = """%%distributed --pool
t = torch.ones(64)
if dist.get_rank() == 1:
    breakpoint()
dist.all_reduce(t)"""

PROGRESS = """%%distributed --pool
t = torch.ones(1 << 16)
for _ in range(400):
    dist.all_reduce(t)"""


def false_reports(runs: int, workdir: str) -> dict[str, Any]:
    kernel = Kernel(tempfile.mkdtemp(dir=workdir), {"AIR_MAGIC_HANG_SECONDS": "1"})
    counts = {"compute pause": [0, 0], "debugger pause": [0, 0], "collectives that progress": [0, 0]}
    try:
        kernel.ok("%load_ext air_magic\n%config DistributedMagics.tracking = False")
        kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=300)
        kernel.ok("%%distributed --pool\nimport time, torch, torch.distributed as dist", timeout=120)
        for i in range(runs):
            kind = list(counts)[i % 3]
            if kind == "debugger pause":

                def answer(prompt: str, res: Any) -> str:
                    time.sleep(3)
                    return "c"

                res = kernel.run_with_stdin(DEBUG, answer, timeout=120)
            else:
                res = kernel.run(PAUSE if kind == "compute pause" else PROGRESS, timeout=120)
            assert res.error is None, res.error_text
            counts[kind][0] += 1
            counts[kind][1] += reported(res)
    finally:
        kernel.km.shutdown_kernel(now=True)
    for kind, (made, false) in counts.items():
        print(f"  {kind}: {false} false reports in {made} runs", flush=True)
    return {kind: {"runs": made, "false_reports": false} for kind, (made, false) in counts.items()}


RECORD = """import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1024)
for _ in range(50):
    dist.all_reduce(t)
began = time.perf_counter()
for _ in range(1000):
    dist.all_reduce(t)
if dist.get_rank() == 0:
    print("TOOK", time.perf_counter() - began, flush=True)
"""


def recording(runs: int, workdir: str) -> dict[str, Any]:
    script = Path(workdir) / "record.py"
    script.write_text(RECORD)
    took: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * runs):
        mode = "on" if i % 2 == 0 else "off"
        env = dict(os.environ, AIR_MAGIC_FLIGHT_RECORDER="2000" if mode == "on" else "0")
        env.pop("TORCH_FR_BUFFER_SIZE", None)
        done = subprocess.run(
            [sys.executable, "-m", "air_magic.cli", "run", str(script), "-n", "2", "--no-tracking"],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        line = next(line for line in done.stdout.splitlines() if line.startswith("TOOK"))
        took[mode].append(float(line.split()[1]))
    on, off = statistics.median(took["on"]), statistics.median(took["off"])
    print(f"  1,000 all_reduces: on {on * 1000:.0f} ms, off {off * 1000:.0f} ms, ratio {on / off:.3f}", flush=True)
    return {"on_s": took["on"], "off_s": took["off"], "median_on": on, "median_off": off, "ratio": on / off}


def training(runs: int, steps: int, workdir: str) -> dict[str, Any]:
    """``benchmarks/training/train.py`` (DDP on a small MLP, 2 CPU ranks) under ``air-magic run``,
    recorder on and off alternated: steps/s after the warm-up, the mean of the ranks."""
    script = ROOT / "benchmarks" / "training" / "train.py"
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * runs):
        mode = "on" if i % 2 == 0 else "off"
        out = Path(tempfile.mkdtemp(dir=workdir))
        env = dict(os.environ, AIR_MAGIC_FLIGHT_RECORDER="2000" if mode == "on" else "0")
        env.pop("TORCH_FR_BUFFER_SIZE", None)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "air_magic.cli",
                "run",
                str(script),
                "-n",
                "2",
                "--no-tracking",
                "--",
                "--kind",
                "ddp",
                "--steps",
                str(steps),
                "--out",
                str(out),
            ],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        ranks = [json.loads((out / f"rank-{r}.json").read_text())["steps_per_s"] for r in range(2)]
        rates[mode].append(statistics.mean(ranks))
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    print(f"  DDP training: on {on:.1f} steps/s, off {off:.1f} steps/s, cost {1 - on / off:+.1%}", flush=True)
    return {"on": rates["on"], "off": rates["off"], "median_on": on, "median_off": off, "cost": 1 - on / off}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="3 samples, 9 runs, 3 recording runs")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.runs = 3, 9
    workdir = tempfile.mkdtemp(prefix="air-magic-hang-")
    try:
        run_all(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_all(args: argparse.Namespace, workdir: str) -> None:
    results: dict[str, Any] = {"machine": machine(), "samples": args.samples}
    print("detection", flush=True)
    results["detection"] = {str(n): detection(n, args.samples, workdir) for n in (2, 4)}
    print("false reports", flush=True)
    results["false_reports"] = false_reports(args.runs, workdir)
    print("recording", flush=True)
    results["recording"] = recording(3 if args.quick else 7, workdir)
    print("training", flush=True)
    results["training"] = training(2 if args.quick else 5, 600 if args.quick else 2000, workdir)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hang.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"Machine: {results['machine']}",
        "",
        "| ranks | case | median s | p95 s | verdict | after Ctrl-C |",
        "|---|---|---|---|---|---|",
    ]
    for n, cases in results["detection"].items():
        for case, data in cases.items():
            lines.append(
                f"| {n} | {case} | {data['median']:.2f} | {data['p95']:.2f} | {'; '.join(data['verdicts'])} | "
                f"{'; '.join(data['after_ctrl_c'])} |"
            )
    lines += ["", "| no hang | runs | false reports |", "|---|---|---|"]
    lines += [f"| {kind} | {d['runs']} | {d['false_reports']} |" for kind, d in results["false_reports"].items()]
    rec = results["recording"]
    lines += [
        "",
        f"1,000 all_reduces of 1,024 floats on 2 ranks: recorder on {rec['median_on'] * 1000:.0f} ms, off "
        f"{rec['median_off'] * 1000:.0f} ms (medians): ratio {rec['ratio']:.3f}",
    ]
    tr = results["training"]
    lines.append(
        f"DDP training (benchmarks/training/train.py, 2 ranks): recorder on {tr['median_on']:.1f} steps/s, off "
        f"{tr['median_off']:.1f} steps/s (medians): cost {tr['cost']:+.1%}"
    )
    (RESULTS / "hang.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
