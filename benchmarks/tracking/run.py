#!/usr/bin/env python3
"""What MLflow tracking costs a training loop: air_magic's single writer vs. ranks writing sqlite.

    python benchmarks/tracking/run.py [--epochs 3] [--samples 5000] [--modes a,b,c]

The training function of the quickstart example (SimpleMLP, DDP over gloo on CPU,
``batch_size=1``, ``mlflow.log_metric("loss", loss.item(), step=step)`` on every step
of every rank) runs on 2 CPU ranks three ways, one after the other in this process:

    (a) tracking off       ``tracking=False``; the ranks' mlflow calls do nothing
    (b) air_magic          tracking on: ranks append lines, the launching process writes batches
    (c) direct sqlite      ``tracking=False``, but MLFLOW_TRACKING_URI and MLFLOW_RUN_ID (a run
                           made beforehand) in the environment, and each rank calls
                           ``MlflowClient().log_metric(run_id, ...)``: every rank writes the
                           sqlite store itself, the way MLflow's own fluent call does

Each rank times its own log calls (``time.perf_counter`` around each one) and returns
the median.  Writes ``benchmarks/tracking/results.json`` and prints a markdown table.
See README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn as nn

from air_magic import distributed

HERE = Path(__file__).resolve().parent

# The functions below travel to the ranks by value, as a notebook's do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- the example, as written (CPU: gloo instead of nccl, no device ids) --------------------------


def setup() -> None:
    dist.init_process_group("gloo")


def cleanup() -> None:
    dist.destroy_process_group()


class SimpleMLP(nn.Module):
    def __init__(self, input_dim: int = 10, hidden_dim: int = 64, output_dim: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden_dim, output_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def run_train(num_epochs: int, batch_size: int, samples: int, direct: bool) -> dict[str, Any]:
    """The example's training function; ``direct`` switches its log call to MLflow's client."""
    import os
    import statistics
    import time

    import mlflow
    import torch.optim as optim
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    started = time.perf_counter()
    if direct:
        run_id = os.environ["MLFLOW_RUN_ID"]

        def log_metric(key: str, value: float, step: int | None = None) -> None:
            # What mlflow.log_metric does once it has the run: a new client, one write.
            mlflow.tracking.MlflowClient().log_metric(run_id, key, value, step=step)
    else:
        log_metric = mlflow.log_metric

    # 1. Set up the multi-process environment
    setup()
    device = torch.device("cpu")

    # 2. Apply DDP
    model = SimpleMLP().to(device)
    model = DDP(model)

    # 3. Create and load the dataset
    x = torch.randn(samples, 10)
    y = torch.randn(samples, 1)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset)
    dataloader = DataLoader(dataset, sampler=sampler, batch_size=batch_size)

    # 4. The training loop
    optimizer = optim.Adam(model.parameters(), lr=0.001)
    loss_fn = nn.MSELoss()
    log_costs: list[float] = []
    steps = 0
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        model.train()
        total_loss = 0.0
        for step, (xb, yb) in enumerate(dataloader):
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            # Log loss to MLflow metric
            value = loss.item()
            t0 = time.perf_counter()
            log_metric("loss", value, step=step)
            log_costs.append(time.perf_counter() - t0)

            loss.backward()
            optimizer.step()
            total_loss += loss.item() * xb.size(0)
            steps += 1

        log_metric("total_loss", total_loss)
        print(f"Total loss for epoch {epoch}: {total_loss}")

    cleanup()
    ordered = sorted(log_costs)
    return {
        "rank": int(os.environ["RANK"]),
        "steps": steps,
        "log_calls": len(log_costs),
        "log_median_s": statistics.median(log_costs),
        "log_p90_s": ordered[int(0.9 * (len(ordered) - 1))],
        "log_total_s": sum(log_costs),
        "function_s": time.perf_counter() - started,
    }


# -- the three ways ------------------------------------------------------------------------------


def sqlite_uri(folder: Path) -> str:
    return f"sqlite:///{folder / 'mlflow.db'}"


def prepare_store(uri: str) -> Any:
    """Create the store's tables now, so that no launch pays for them."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    client.search_experiments()
    return client


def count_points(client: Any, run_id: str, key: str, ranks: int) -> int:
    """Every rank's points of ``key``: air_magic stores rank 0's under ``key`` and rank r's
    under ``rank<r>/<key>``; ranks that log to MLflow directly put them all under ``key``."""
    keys = [key] + [f"rank{rank}/{key}" for rank in range(1, ranks)]
    return sum(len(client.get_metric_history(run_id, name)) for name in keys)


def launch(mode: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    folder = root / mode
    folder.mkdir()
    os.chdir(folder)  # the ranks' working directory; mlruns/ goes here
    train = distributed(num_accelerators=2, timeout=None, tracking=(mode == "b"))(run_train)
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID")}
    client = None
    run_id = None
    if mode in ("b", "c"):
        uri = sqlite_uri(folder)
        client = prepare_store(uri)
        os.environ["MLFLOW_TRACKING_URI"] = uri
    if mode == "c":
        experiment_id = client.create_experiment("direct-sqlite")
        run_id = client.create_run(experiment_id, run_name="direct-sqlite").info.run_id
        os.environ["MLFLOW_RUN_ID"] = run_id
    try:
        started = time.perf_counter()
        ranks = train.distributed(args.epochs, 1, args.samples, mode == "c")
        wall = time.perf_counter() - started
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.chdir(root)
    if mode == "b":
        run_id = train.last_launch.run_id
    if mode == "c":
        client.set_terminated(run_id)
    result: dict[str, Any] = {
        "wall_s": wall,
        "log_median_us": statistics.median(r["log_median_s"] for r in ranks) * 1e6,
        "log_p90_us": max(r["log_p90_s"] for r in ranks) * 1e6,
        "log_calls_per_rank": ranks[0]["log_calls"],
        "ranks": ranks,
    }
    if client is not None and run_id is not None:
        result["run_id"] = run_id
        result["loss_points_stored"] = count_points(client, run_id, "loss", len(ranks))
        result["loss_points_logged"] = sum(r["steps"] for r in ranks)
    return result


LABELS = {
    "a": "(a) tracking off",
    "b": "(b) air_magic tracking",
    "c": "(c) ranks write sqlite directly",
}


def table(results: dict[str, Any]) -> str:
    modes = results["modes"]
    base = modes.get("a", {}).get("wall_s")
    lines = [
        "| way | wall time (s) | × (a) | log_metric median in a rank (µs) | p90 (µs) "
        "| in log calls per rank (s) | loss points stored / logged |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, row in modes.items():
        ratio = f"{row['wall_s'] / base:.2f}" if base else "–"
        stored = f"{row['loss_points_stored']} / {row['loss_points_logged']}" if "loss_points_stored" in row else "–"
        lines.append(
            f"| {LABELS[mode]} | {row['wall_s']:.1f} | {ratio} | {row['log_median_us']:.1f} | "
            f"{row['log_p90_us']:.1f} | {max(r['log_total_s'] for r in row['ranks']):.2f} | {stored} |"
        )
    cfg = results["config"]
    lines.append("")
    lines.append(
        f"2 CPU ranks (gloo), {cfg['samples']} samples, batch_size 1, {cfg['epochs']} epoch(s): "
        f"{cfg['steps_per_rank']} steps and log calls per rank. {results['machine']['cpus']} cores, "
        f"load average {results['machine']['loadavg_start']} at the start."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--modes", default="a,b,c", help="any of a,b,c (default all, in that order)")
    parser.add_argument("--out", default=str(HERE / "results.json"))
    parser.add_argument("--keep", action="store_true", help="keep the stores (their folder is printed)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(LABELS):
        parser.error(f"--modes takes a, b, c; got {args.modes!r}")

    import mlflow

    root = Path(tempfile.mkdtemp(prefix="tracking-bench-"))
    cwd = os.getcwd()
    for key in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        os.environ.pop(key, None)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "mlflow": mlflow.__version__,
            "loadavg_start": [round(v, 2) for v in os.getloadavg()],
        },
        "config": {
            "epochs": args.epochs,
            "samples": args.samples,
            "batch_size": 1,
            "ranks": 2,
            "steps_per_rank": args.epochs * (args.samples // 2),
        },
        "modes": {},
    }
    try:
        os.chdir(root)
        # Untimed: start the helper (it imports torch) so that (a) is not the one paying for it.
        warm = distributed(num_accelerators=2, timeout=None, tracking=False)(run_train)
        warm.distributed(1, 1, 64, False)
        for mode in modes:
            print(f"[{time.strftime('%H:%M:%S')}] {LABELS[mode]} ...", flush=True)
            results["modes"][mode] = launch(mode, root, args)
            print(f"[{time.strftime('%H:%M:%S')}] {LABELS[mode]}: {results['modes'][mode]['wall_s']:.1f} s", flush=True)
    finally:
        os.chdir(cwd)
        if args.keep:
            print(f"stores kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    rows = results["modes"]
    results["machine"]["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    ratios = {}
    if "a" in rows:
        for mode in ("b", "c"):
            if mode in rows:
                ratios[f"{mode}/a wall"] = rows[mode]["wall_s"] / rows["a"]["wall_s"]
    if "b" in rows and "c" in rows:
        ratios["c/b log_metric median"] = rows["c"]["log_median_us"] / rows["b"]["log_median_us"]
    results["ratios"] = ratios
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(table(results))
    print()
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
