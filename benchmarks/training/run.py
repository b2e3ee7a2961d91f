"""Steady-state training throughput: the same script under ``torchrun`` and under air_magic.

    python benchmarks/training/run.py                   # 3 repeats, DDP and FSDP2, 2 CPU ranks
    python benchmarks/training/run.py --device cuda     # on GPUs, NCCL
    python benchmarks/training/run.py --quick --out /tmp/r.json   # a smoke run (the tests use it)

:func:`train.train` runs (1) under ``torchrun --standalone --nproc-per-node N`` from a
subprocess and (2) as ``@distributed(num_accelerators=N)`` launched from a real Jupyter
kernel (jupyter_client), with air_magic's defaults (MLflow tracking on) and once more with
``tracking=False``. Both get the same ``OMP_NUM_THREADS`` (torchrun would set 1 and
air_magic cores / ranks). The ranks time their own steps after the warm-up; a run's
number is the mean over its ranks, a configuration's the median over the repeats, which
alternate their order so that a drift of the machine hits every launcher alike.

Writes ``results.json`` next to this file (or ``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LAUNCHERS = ("torchrun", "air_magic", "air_magic (tracking off)")
# About 20 s of steady-state training per run on the 2-core development machine: short runs
# (a few seconds) leave the number at the mercy of whatever else the machine does meanwhile.
DEFAULT_STEPS = {"cpu": {"ddp": 3000, "fsdp2": 600}, "cuda": {"ddp": 3000, "fsdp2": 3000}}


def run_torchrun(kind: str, args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-torchrun-") as out:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            str(HERE / "train.py"),
            "--kind",
            kind,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--device",
            args.device,
            "--out",
            out,
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return [json.loads((Path(out) / f"rank-{r}.json").read_text()) for r in range(args.nproc)]


class Kernel:
    """A real IPython kernel that launches :func:`train.train` with ``@distributed``."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str]) -> None:
        from jupyter_client.manager import KernelManager

        self.timeout = args.timeout
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(HERE), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        accelerator = '"CPU"' if args.device == "cpu" else "None"
        self.execute(
            "import json, sys\n"
            f"sys.path.insert(0, {str(HERE)!r})\n"
            "from air_magic import distributed\n"
            "from train import train\n"
            f"bench = distributed(num_accelerators={args.nproc}, accelerator_type={accelerator})(train)\n"
            "bench_untracked = bench.with_overrides(tracking=False)\n"
        )

    def execute(self, code: str) -> str:
        """Run a cell; its stdout. Raises with the traceback if the cell failed."""
        msg_id = self.kc.execute(code)
        out: list[str] = []
        error: list[str] = []
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cell did not finish in {self.timeout} s") from None
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream" and content["name"] == "stdout":
                out.append(content["text"])
            elif kind == "error":
                error = content["traceback"]
            elif kind == "status" and content["execution_state"] == "idle":
                break
        if error:
            raise RuntimeError("cell failed:\n" + "\n".join(error))
        return "".join(out)

    def launch(
        self, kind: str, args: argparse.Namespace, tracking: bool
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """The ranks' reports, and how much CPU the kernel and the helper used meanwhile
        (percent of one core over the launch)."""
        name = "bench" if tracking else "bench_untracked"
        before, started = self._cpu_seconds(), time.monotonic()
        text = self.execute(
            f"_r = {name}.distributed(kind={kind!r}, steps={args.steps}, warmup={args.warmup}, device={args.device!r})\n"
            "print('RESULT ' + json.dumps(_r))\n"
        )
        after, wall = self._cpu_seconds(), time.monotonic() - started
        line = next(line for line in text.splitlines() if line.startswith("RESULT "))
        usage = {key: 100 * (after.get(key, 0.0) - before.get(key, 0.0)) / wall for key in after}
        return json.loads(line[len("RESULT ") :]), usage

    def _cpu_seconds(self) -> dict[str, float]:
        import psutil

        kernel = psutil.Process(self.km.provisioner.process.pid)  # type: ignore[union-attr]
        seconds = {"kernel": sum(kernel.cpu_times()[:2]), "helper": 0.0}
        for child in kernel.children():
            try:
                if "air_magic.rank.zygote" in " ".join(child.cmdline()):
                    seconds["helper"] += sum(child.cpu_times()[:2])
            except psutil.Error:
                pass
        return seconds

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def _spread(values: list[float]) -> float:
    """Half the range between the quartiles, relative to the median: how much one run of a
    launcher differs from the next on this machine."""
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return (quartiles[2] - quartiles[0]) / 2 / statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--kinds", nargs="+", choices=("ddp", "fsdp2"), default=["ddp", "fsdp2"])
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per run (default: about 20 s of training each: ddp 3000, fsdp2 600 on CPU)",
    )
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--quick", action="store_true", help="40 steps, 1 repeat: checks that everything runs")
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 40, 10, 1
    steps = {kind: args.steps or DEFAULT_STEPS[args.device][kind] for kind in args.kinds}

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    store = tempfile.mkdtemp(prefix="bench-mlflow-")
    env.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{store}/mlflow.db")
    env["PYTHONWARNINGS"] = "ignore"  # torchrun's OMP_NUM_THREADS notice and the like

    kernel = Kernel(args, env)
    runs: list[dict[str, Any]] = []
    try:
        # The kernel's first launch starts MLflow's store and system-metrics monitor: not timed.
        kernel.launch(args.kinds[0], argparse.Namespace(**{**vars(args), "steps": 20, "warmup": 5}), tracking=True)
        per_kind = {kind: argparse.Namespace(**{**vars(args), "steps": steps[kind]}) for kind in args.kinds}
        for repeat in range(args.repeats):
            order = LAUNCHERS if repeat % 2 == 0 else tuple(reversed(LAUNCHERS))
            for kind in args.kinds:
                for launcher in order:
                    usage: dict[str, float] = {}
                    if launcher == "torchrun":
                        ranks = run_torchrun(kind, per_kind[kind], env)
                    else:
                        ranks, usage = kernel.launch(kind, per_kind[kind], tracking=launcher == "air_magic")
                    value = statistics.fmean(r["steps_per_s"] for r in ranks)
                    runs.append(
                        {
                            "repeat": repeat,
                            "kind": kind,
                            "launcher": launcher,
                            "steps_per_s": value,
                            "threads": sorted({r["threads"] for r in ranks}),
                            "cpu_percent_of_a_core": usage,
                            "ranks": ranks,
                        }
                    )
                    extra = "".join(f", {key} {pct:.1f}% of a core" for key, pct in usage.items())
                    print(f"[bench] repeat {repeat} {kind:5s} {launcher:24s} {value:8.2f} steps/s{extra}", flush=True)
    finally:
        kernel.shutdown()
        shutil.rmtree(store, ignore_errors=True)  # the MLflow store of the timed runs

    table = []
    for kind in args.kinds:
        medians = {
            launcher: statistics.median(
                r["steps_per_s"] for r in runs if r["kind"] == kind and r["launcher"] == launcher
            )
            for launcher in LAUNCHERS
        }
        reference = {r["repeat"]: r["steps_per_s"] for r in runs if r["kind"] == kind and r["launcher"] == "torchrun"}
        for launcher in LAUNCHERS:
            # Each repeat's run against the torchrun run of the same repeat (they ran minutes apart
            # at most): the spread of these ratios is the noise the comparison has to beat.
            paired = sorted(
                r["steps_per_s"] / reference[r["repeat"]]
                for r in runs
                if r["kind"] == kind and r["launcher"] == launcher
            )
            kernel_cpu = [
                r["cpu_percent_of_a_core"].get("kernel", 0.0) + r["cpu_percent_of_a_core"].get("helper", 0.0)
                for r in runs
                if r["kind"] == kind and r["launcher"] == launcher
            ]
            table.append(
                {
                    "kind": kind,
                    "launcher": launcher,
                    "median_steps_per_s": medians[launcher],
                    "ratio_to_torchrun": medians[launcher] / medians["torchrun"],
                    "paired_ratio_median": statistics.median(paired),
                    "paired_ratio_range": [paired[0], paired[-1]],
                    "spread_of_own_runs": _spread(
                        [r["steps_per_s"] for r in runs if r["kind"] == kind and r["launcher"] == launcher]
                    ),
                    "kernel_and_helper_cpu_percent": statistics.median(kernel_cpu),
                }
            )
    import torch

    results = {
        "what": "steps/s of the same training script after warm-up, measured inside the ranks",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average_at_end": os.getloadavg(),
        },
        "config": {
            "nproc": args.nproc,
            "device": args.device,
            "steps": steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "omp_num_threads": env["OMP_NUM_THREADS"],
            "model": "MLP 4 x (Linear(256, 256) + ReLU) + Linear(256, 1), batch 64 per rank, AdamW",
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "summary": table,
        "runs": runs,
    }
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    shown = ", ".join(f"{kind} {n}" for kind, n in steps.items())
    print(
        f"\n{args.nproc} ranks on {args.device}, steps timed: {shown} ({args.warmup} warm-up first), "
        f"median of {args.repeats}, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}\n"
    )
    print(
        "| script | launcher | steps/s (median) | vs torchrun (medians) | vs torchrun, paired by repeat: median [min, max] "
        "| own runs' spread | kernel + helper CPU |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in table:
        cpu = "" if row["launcher"] == "torchrun" else f"{row['kernel_and_helper_cpu_percent']:.1f}% of a core"
        low, high = row["paired_ratio_range"]
        paired = (
            ""
            if row["launcher"] == "torchrun"
            else (f"{(row['paired_ratio_median'] - 1) * 100:+.1f}% [{(low - 1) * 100:+.1f}%, {(high - 1) * 100:+.1f}%]")
        )
        print(
            f"| {row['kind']} | {row['launcher']} | {row['median_steps_per_s']:.2f} | "
            f"{(row['ratio_to_torchrun'] - 1) * 100:+.1f}% | {paired} | ±{row['spread_of_own_runs'] * 100:.1f}% | {cpu} |"
        )
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
