#!/usr/bin/env python3
"""What the live panel costs: rank slowdown, traffic to the front end, kernel memory.

    python benchmarks/panel/run.py [--repeats 7] [--steps 1500] [--size 256] [--lines 400000]

Three kernels are started with jupyter_client, one per panel mode, and driven like a
notebook front end (every iopub message is read and counted):

    off      AIR_MAGIC_PANEL=0       no panel
    widget   AIR_MAGIC_PANEL=widget  the ipywidgets panel (what JupyterLab / VS Code get)
    text     AIR_MAGIC_PANEL=text    periodic text lines (terminal, nbclient, papermill)

Two workloads, ``%%distributed -n 2`` cells on CPU ranks, MLflow tracking on (so the
panel has metrics to chart):

    training   STEPS steps of torch matmuls (SIZE x SIZE, 6 a step) per rank, a tqdm bar, an
               mlflow.log_metric per step, a print every 100 steps; each rank times its
               own loop (perf_counter) and returns it.  The modes take turns, REPEATS
               launches each.  Reported: slowdown = median over rounds of (loop time
               with the panel / without it, same round) - 1; each rank's CPU time
               and its waiting for a core (wall - CPU), the only time a panel in
               another process can add; and the kernel's extra CPU time with the
               panel, as a share of the ranks' two cores.
    flood      each rank prints LINES lines as fast as it can (rank 0's output is also
               streamed into the cell, bounded by AIR_MAGIC_OUTPUT_LIMIT, 1 MiB).

For each launch: every iopub message of the cell (count and bytes of its JSON content
plus binary buffers, by kind), and the kernel's RSS before, at its peak (sampled every
50 ms) and after.  Writes ``benchmarks/panel/results.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from jupyter_client import KernelManager

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODES = ("off", "widget", "text")
ENV = {"off": "0", "widget": "widget", "text": "text"}

TRAINING = """%%distributed -n 2
import os, sys, time, torch, mlflow
from tqdm import tqdm
torch.manual_seed(0)
rank = int(os.environ["RANK"])
a = torch.randn({size}, {size}) / {size} ** 0.5
start, cpu = time.perf_counter(), time.process_time()
for step in tqdm(range({steps}), desc="train"):
    b = a
    for _ in range(6):
        b = torch.tanh(b @ a) * 0.5
    loss = float(b.abs().mean())
    mlflow.log_metric("loss", loss, step=step)
    if step % 100 == 0:
        print(f"step {{step}} loss {{loss:.4f}}", flush=True)
(time.perf_counter() - start, time.process_time() - cpu)
"""

FLOOD = """%%distributed -n 2
import os, sys, time
start = time.perf_counter()
rank = os.environ["RANK"]
for i in range({lines}):
    print(f"rank {{rank}} line {{i:07d}} the quick brown fox jumps over the lazy dog")
sys.stdout.flush()
time.perf_counter() - start
"""


class Kernel:
    """A kernel driven like a notebook: every iopub message read, counted and sized."""

    def __init__(self, mode: str, workdir: Path) -> None:
        env = dict(os.environ)
        env.update(
            AIR_MAGIC_PANEL=ENV[mode],
            MLFLOW_TRACKING_URI=f"sqlite:///{workdir / 'mlflow.db'}",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        )
        for name in ("JPY_SESSION_NAME", "VSCODE_PID"):
            env.pop(name, None)
        self.mode = mode
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, cwd=str(workdir))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.proc = psutil.Process(self.km.provisioner.process.pid)  # type: ignore[union-attr]

    def run(self, code: str, timeout: float = 600) -> dict[str, Any]:
        rss_before = self.proc.memory_info().rss
        peak = [rss_before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.05):
                try:
                    peak[0] = max(peak[0], self.proc.memory_info().rss)
                except psutil.Error:
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        cpu_before = self.proc.cpu_times()
        sampler.start()
        msg_id = self.kc.execute(code)
        start = time.perf_counter()
        counts: dict[str, int] = {}
        sizes: dict[str, int] = {}
        result = error = None
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(code[:60])
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "status":
                if msg["content"]["execution_state"] == "idle":
                    break
                continue
            size = len(json.dumps(msg["content"])) + sum(len(b) for b in msg.get("buffers") or [])
            group = {
                "stream": "stream",
                "comm_open": "widget setup",
                "comm_close": "widget setup",
                "comm_msg": "widget updates",
                "display_data": "display",
                "update_display_data": "display",
            }.get(kind, "other")
            counts[group] = counts.get(group, 0) + 1
            sizes[group] = sizes.get(group, 0) + size
            if kind == "execute_result":
                result = msg["content"]["data"]["text/plain"]
            elif kind == "error":
                error = f"{msg['content']['ename']}: {msg['content']['evalue']}"
        wall = time.perf_counter() - start
        cpu_after = self.proc.cpu_times()
        stop.set()
        sampler.join()
        if error:
            raise RuntimeError(error)
        return {
            "wall_s": wall,
            "result": ast.literal_eval(result) if result else None,
            "messages": counts,
            "bytes": sizes,
            # the kernel process's own CPU time (all its threads; not its children)
            "kernel_cpu_s": (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system),
            "rss_before_mb": rss_before / 1e6,
            "rss_peak_mb": peak[0] / 1e6,
            "rss_after_mb": self.proc.memory_info().rss / 1e6,
        }

    def ok(self, code: str) -> None:
        self.run(code)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--lines", type=int, default=400_000)
    parser.add_argument("--out", default=str(HERE / "results.json"))
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="air-magic-panel-bench-"))
    kernels: dict[str, Kernel] = {}
    try:
        for mode in MODES:
            workdir = tmp / mode
            workdir.mkdir()
            kernels[mode] = Kernel(mode, workdir)
            kernels[mode].ok("%load_ext air_magic")
            # Untimed: the helper's torch import, MLflow's store creation, tqdm's import.
            kernels[mode].ok(TRAINING.format(steps=20, size=args.size))
        training: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:  # take turns, both orders
                run = kernels[mode].run(TRAINING.format(steps=args.steps, size=args.size))
                training[mode].append(run)
                print(
                    f"training {mode:6s} #{repeat}: ranks {[[round(x, 2) for x in v] for v in run['result']]} s, "
                    f"{sum(run['messages'].values())} messages",
                    file=sys.stderr,
                )
        flood: dict[str, dict[str, Any]] = {}
        for mode in MODES:
            flood[mode] = kernels[mode].run(FLOOD.format(lines=args.lines))
            print(
                f"flood {mode:6s}: {flood[mode]['wall_s']:.1f} s, {sum(flood[mode]['bytes'].values())} B",
                file=sys.stderr,
            )
    finally:
        for kernel in kernels.values():
            kernel.close()

    # Each rank returns (wall, CPU) seconds of its loop. On a shared machine the CPU time
    # of the same work varies too (other work on the same cores makes each step slower);
    # what the panel could add is time spent waiting for a core: wall - CPU.
    def wall(run: dict[str, Any]) -> float:
        return statistics.mean(w for w, _ in run["result"])

    def waiting(run: dict[str, Any]) -> float:
        return statistics.mean(w - c for w, c in run["result"])

    def loop_time(runs: list[dict[str, Any]]) -> float:
        return statistics.median(wall(run) for run in runs)

    base = loop_time(training["off"])
    base_cpu = statistics.median(r["kernel_cpu_s"] for r in training["off"])
    summary: dict[str, Any] = {"training": {}, "flood": {}}
    for mode in MODES:
        runs = training[mode]
        cell = statistics.median(run["wall_s"] for run in runs)
        # The machine's load drifts: each launch is compared with the "off" launch of the
        # same round (they ran one after the other), and the median of those ratios is kept.
        paired = [wall(run) / wall(off) - 1 for run, off in zip(runs, training["off"])]
        off_wait = statistics.median(waiting(r) for r in training["off"])
        extra_wait = statistics.median(waiting(r) for r in runs) - off_wait
        extra_cpu = statistics.median(r["kernel_cpu_s"] for r in runs) - base_cpu
        summary["training"][mode] = {
            "rank_loop_s": loop_time(runs),
            "slowdown": statistics.median(paired),
            "slowdown_of_medians": loop_time(runs) / base - 1,
            "rank_cpu_s": statistics.median(statistics.mean(c for _, c in r["result"]) for r in runs),
            "rank_wait_s": statistics.median(waiting(r) for r in runs),
            # extra waiting for a core, over the loop time without the panel
            "wait_slowdown": extra_wait / base,
            # what the panel took of the 2 cores the ranks share, while they ran
            "panel_cpu_share": max(0.0, extra_cpu) / (2 * loop_time(runs)),
            "cell_s": cell,
            "messages": statistics.median(sum(r["messages"].values()) for r in runs),
            "widget_updates": statistics.median(r["messages"].get("widget updates", 0) for r in runs),
            "widget_updates_per_s": statistics.median(
                r["messages"].get("widget updates", 0) / r["wall_s"] for r in runs
            ),
            "bytes": statistics.median(sum(r["bytes"].values()) for r in runs),
            "widget_bytes": statistics.median(
                r["bytes"].get("widget updates", 0) + r["bytes"].get("widget setup", 0) for r in runs
            ),
            "kernel_cpu_s": statistics.median(r["kernel_cpu_s"] for r in runs),
            "rss_peak_growth_mb": max(r["rss_peak_mb"] - r["rss_before_mb"] for r in runs),
            "rss_after_growth_mb": training[mode][-1]["rss_after_mb"] - training[mode][0]["rss_before_mb"],
        }
        f = flood[mode]
        summary["flood"][mode] = {
            "rank_print_s": statistics.mean(f["result"]),
            "cell_s": f["wall_s"],
            "messages": sum(f["messages"].values()),
            "bytes": sum(f["bytes"].values()),
            "by_kind": {k: [f["messages"][k], f["bytes"][k]] for k in f["messages"]},
            "kernel_cpu_s": f["kernel_cpu_s"],
            "rss_peak_growth_mb": f["rss_peak_mb"] - f["rss_before_mb"],
            "rss_after_growth_mb": f["rss_after_mb"] - f["rss_before_mb"],
        }
    payload = {
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": vars(args),
        "summary": summary,
        "runs": {"training": training, "flood": flood},
    }
    Path(args.out).write_text(json.dumps(payload, indent=2))
    print(table(summary, args))
    return 0


def table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"### Training loop (2 CPU ranks, {args.steps} steps, tqdm + log_metric per step; median of {args.repeats})",
        "",
        "| panel | rank loop wall (s) | rank CPU (s) | rank waiting (s) | slowdown: wall, paired | slowdown: waiting "
        "| kernel CPU (s) | panel's share of 2 cores | cell (s) | messages to front end | widget updates/s | bytes "
        "| widget bytes | kernel RSS peak growth (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, row in summary["training"].items():
        lines.append(
            f"| {mode} | {row['rank_loop_s']:.2f} | {row['rank_cpu_s']:.2f} | {row['rank_wait_s']:.3f} | "
            f"{row['slowdown'] * 100:+.1f}% | {row['wait_slowdown'] * 100:+.1f}% | {row['kernel_cpu_s']:.2f} | "
            f"{row['panel_cpu_share'] * 100:.1f}% | {row['cell_s']:.2f} | "
            f"{row['messages']:.0f} | {row['widget_updates_per_s']:.1f} | "
            f"{row['bytes'] / 1e3:.0f} kB | {row['widget_bytes'] / 1e3:.0f} kB | {row['rss_peak_growth_mb']:.1f} |"
        )
    lines += [
        "",
        f"### Flood ({args.lines:,} printed lines per rank, 2 CPU ranks)",
        "",
        "| panel | rank print loop (s) | cell (s) | kernel CPU (s) | messages to front end | bytes to front end "
        "| of which widget updates | kernel RSS peak growth (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, row in summary["flood"].items():
        widgets = row["by_kind"].get("widget updates", [0, 0])
        lines.append(
            f"| {mode} | {row['rank_print_s']:.2f} | {row['cell_s']:.2f} | {row['kernel_cpu_s']:.2f} | "
            f"{row['messages']} | {row['bytes'] / 1e6:.2f} MB | {widgets[0]} msgs, {widgets[1] / 1e3:.0f} kB | "
            f"{row['rss_peak_growth_mb']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
