#!/usr/bin/env python3
"""The model back: air_magic's paths beside the torch-only paths a user has, in one run.

    .venv/bin/python benchmarks/model_back/run.py [--ranks 2,4] [--repeat 3]

Each measurement runs in a fresh process of its own (the kernel side: ``air_magic.Pool``, as
a notebook's kernel runs it), which starts a pool of CPU ranks, builds the model there, then
times one path ``--repeat`` times (the median is reported) while a thread samples its own RSS
and the ranks' every 5 ms:

* ``pull``: a 954 MiB state dict (250 tensors of 1000×1000 float32) on 2 ranks, rank 0's
  value: ``pool.pull(name, rank=0)`` beside ``torch.save`` on rank 0 + ``torch.load`` here.
* ``fsdp2``: a 1 GiB float32 model (16 ``Linear(4096, 4096)``, FSDP2 per layer) on 2 and on 4
  ranks: ``pool.state_dict`` beside ``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)`` on the ranks and ``pool.pull(rank=0)`` of rank 0's, and beside DCP
  ``save`` + ``dcp_to_torch_save`` + ``torch.load``.
* ``safetensors``: that 1 GiB state dict written to the local disk by
  ``air_magic.save_safetensors`` and by ``safetensors.torch.save_file``; read back with
  ``safetensors.torch.load_file`` and compared bit for bit.

Writes ``results/model_back.json`` and ``results/model_back.md``.
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
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
GIB = 1 << 30

PULL_SETUP = """
global sd
import torch
torch.manual_seed(0)
sd = {f"w{i}": torch.randn(1000, 1000) for i in range(250)}
"""

FSDP_SETUP = """
global model
import torch, torch.nn as nn
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(16)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
import gc; gc.collect()
"""


class Sampler:
    """Peak RSS of this process and of each rank, above what each had when it started."""

    def __init__(self, pids: list[int]) -> None:
        import psutil

        self._me = psutil.Process()
        self._ranks = [psutil.Process(pid) for pid in pids]
        self.base = self._me.memory_info().rss
        self.rank_base = [p.memory_info().rss for p in self._ranks]
        self.peak = 0
        self.rank_peak = [0] * len(pids)
        self._on = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._on:
            self._look()
            time.sleep(0.005)

    def _look(self) -> None:
        self.peak = max(self.peak, self._me.memory_info().rss - self.base)
        for i, proc in enumerate(self._ranks):
            try:
                self.rank_peak[i] = max(self.rank_peak[i], proc.memory_info().rss - self.rank_base[i])
            except Exception:
                pass

    def stop(self) -> None:
        self._on = False
        self._thread.join()
        self._look()


def _touch(state: dict[str, Any]) -> None:
    """Read every page of every tensor (a mapped tensor costs nothing until it is read)."""
    for value in state.values():
        float(value.reshape(-1)[:: max(1, 4096 // value.element_size())].sum())


def one(case: str, path: str, ranks: int, repeat: int, workdir: str) -> dict[str, Any]:
    """One path of one case, measured here (a fresh process)."""
    import torch

    import air_magic

    pool = air_magic.Pool(ranks, tracking=False)
    try:
        setup = PULL_SETUP if case == "pull" else FSDP_SETUP
        pool.run(lambda: exec(setup, globals()))
        nbytes = 250 * 10**6 * 4 if case == "pull" else 16 * 4096 * 4096 * 4
        times, peaks, rank_peaks, equal = [], [], [], True
        reference = None
        for attempt in range(repeat):
            out = Path(tempfile.mkdtemp(dir=workdir))
            sampler = Sampler(pool._engine.pids)
            began = time.perf_counter()
            state = _path(pool, case, path, out)
            _touch(state)
            took = time.perf_counter() - began
            sampler.stop()
            times.append(took)
            peaks.append(sampler.peak)
            rank_peaks.append(max(sampler.rank_peak))
            if attempt == 0:
                reference = _reference(pool, case)
                equal = sorted(state) == sorted(reference) and all(torch.equal(state[k], reference[k]) for k in state)
            del state
            shutil.rmtree(out, ignore_errors=True)
        del reference
        took = statistics.median(times)
        return {
            "case": case,
            "path": path,
            "ranks": ranks,
            "bytes": nbytes,
            "seconds": times,
            "median_s": took,
            "gb_per_s": nbytes / took / 1e9,
            "kernel_peak_over_bytes": max(peaks) / nbytes,
            "rank_peak_extra_mib": max(rank_peaks) / 2**20,
            "shard_mib": nbytes / ranks / 2**20,
            "equal": equal,
        }
    finally:
        pool.close()


def _reference(pool: Any, case: str) -> dict[str, Any]:
    """What the ranks hold, for the equality check (not timed)."""
    if case == "pull":
        return pool.pull("sd", rank=1)
    return pool.state_dict("model")


def _path(pool: Any, case: str, path: str, out: Path) -> dict[str, Any]:
    import torch

    if case == "pull" and path == "pool.pull(rank=0)":
        return pool.pull("sd", rank=0)
    if case == "pull" and path == "torch.save on rank 0 + torch.load":
        file = str(out / "sd.pt")
        pool.run(lambda file: __import__("torch").save(sd, file) if os.environ["RANK"] == "0" else None, file)  # noqa: F821
        return torch.load(file)
    if path == "pool.state_dict":
        return pool.state_dict("model")
    if path == "get_model_state_dict(full, cpu_offload) + pool.pull(rank=0)":

        def gather() -> None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            globals()["gathered"] = get_model_state_dict(globals()["model"], options=options)

        pool.run(gather)
        state = pool.pull("gathered", rank=0)
        pool.run(lambda: globals().pop("gathered", None) and None)
        return state
    if path == "DCP save + dcp_to_torch_save + torch.load":
        folder, file = str(out / "dcp"), str(out / "full.pt")

        def save(folder: str) -> None:
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": globals()["model"].state_dict()}, checkpoint_id=folder)

        pool.run(save, folder)
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(folder, file)
        return torch.load(file)["model"]
    raise ValueError(path)


PATHS = {
    "pull": ["pool.pull(rank=0)", "torch.save on rank 0 + torch.load"],
    "fsdp2": [
        "pool.state_dict",
        "get_model_state_dict(full, cpu_offload) + pool.pull(rank=0)",
        "DCP save + dcp_to_torch_save + torch.load",
    ],
}


def safetensors_case(workdir: str, repeat: int) -> list[dict[str, Any]]:
    import torch
    from safetensors.torch import load_file, save_file

    import air_magic

    torch.manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(4096, 4096) for i in range(16)}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    rows = []
    for name, write in (
        ("air_magic.save_safetensors", lambda folder: air_magic.save_safetensors(state, folder)),
        ("safetensors.torch.save_file", lambda folder: save_file(state, os.path.join(folder, "model.safetensors"))),
    ):
        times = []
        equal = True
        for attempt in range(repeat):
            folder = tempfile.mkdtemp(dir=workdir)
            began = time.perf_counter()
            write(folder)
            fd = os.open(os.path.join(folder, "model.safetensors"), os.O_RDONLY)
            os.fsync(fd)  # on the disk, not only in the page cache
            os.close(fd)
            times.append(time.perf_counter() - began)
            if attempt == 0:
                back = load_file(os.path.join(folder, "model.safetensors"))
                equal = sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
                del back
            shutil.rmtree(folder)
        took = statistics.median(times)
        rows.append(
            {
                "case": "safetensors",
                "path": name,
                "bytes": nbytes,
                "seconds": times,
                "median_s": took,
                "gb_per_s": nbytes / took / 1e9,
                "equal": equal,
            }
        )
        print(f"  {name}: {took:.2f} s, {nbytes / took / 1e9:.2f} GB/s, bit for bit {equal}", flush=True)
    return rows


def machine() -> str:
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import psutil
    import torch

    disk = shutil.disk_usage(tempfile.gettempdir())
    return (
        f"{cpu}, {os.cpu_count()} cores, {psutil.virtual_memory().total / GIB:.0f} GiB, /dev/shm "
        f"{shutil.disk_usage('/dev/shm').total / GIB:.0f} GiB, temp disk {disk.total / GIB:.0f} GiB; Python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="rank counts of the FSDP2 case")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--one", nargs=3, metavar=("CASE", "PATH", "RANKS"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        case, path, ranks = args.one
        print("RESULT " + json.dumps(one(case, path, int(ranks), args.repeat, args.workdir)), flush=True)
        return
    workdir = tempfile.mkdtemp(prefix="air-magic-model-back-")
    try:
        run_all(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_all(args: argparse.Namespace, workdir: str) -> None:
    rows: list[dict[str, Any]] = []
    plan = [("pull", path, 2) for path in PATHS["pull"]]
    plan += [("fsdp2", path, int(n)) for n in args.ranks.split(",") for path in PATHS["fsdp2"]]
    for case, path, ranks in plan:
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                case,
                path,
                str(ranks),
                "--repeat",
                str(args.repeat),
                "--workdir",
                workdir,
            ],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{case} / {path} / {ranks} ranks failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        row = json.loads(line[len("RESULT ") :])
        rows.append(row)
        print(
            f"  {case}, {ranks} ranks, {path}: {row['median_s']:.2f} s, {row['gb_per_s']:.2f} GB/s, kernel peak "
            f"{row['kernel_peak_over_bytes']:.2f}x, rank extra {row['rank_peak_extra_mib']:.0f} MiB, equal {row['equal']}",
            flush=True,
        )
    rows += safetensors_case(workdir, args.repeat)
    results = {"machine": machine(), "repeat": args.repeat, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "model_back.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"Machine: {results['machine']}",
        "",
        "| case | ranks | path | median s | GB/s | vs air_magic | kernel peak / bytes | rank extra MiB (shard MiB) | equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ours = next(
            r
            for r in rows
            if r["case"] == row["case"]
            and r.get("ranks") == row.get("ranks")
            and r["path"] in ("pool.pull(rank=0)", "pool.state_dict", "air_magic.save_safetensors")
        )
        lines.append(
            f"| {row['case']} | {row.get('ranks', '')} | {row['path']} | {row['median_s']:.2f} | {row['gb_per_s']:.2f} | "
            f"{row['median_s'] / ours['median_s']:.1f}x | "
            + (
                f"{row['kernel_peak_over_bytes']:.2f} | {row['rank_peak_extra_mib']:.0f} ({row['shard_mib']:.0f}) | "
                if "kernel_peak_over_bytes" in row
                else "| | "
            )
            + f"{row['equal']} |"
        )
    (RESULTS / "model_back.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
