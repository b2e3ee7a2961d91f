"""The benchmark scripts still run: the GPU check's skip path, and the training benchmark in
its smoke mode (both launchers, DDP and FSDP2, one short run each)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs its checks for real")
def test_gpu_check_says_why_it_skips_without_a_gpu() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("SKIP: no CUDA GPU here (torch.cuda.is_available() is False)."), done.stdout
    assert time.monotonic() - started < 60


@pytest.mark.kernel
def test_training_benchmark_runs_torchrun_and_air_magic_from_a_kernel(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "training" / "run.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    rows = {(row["kind"], row["launcher"]): row for row in results["summary"]}
    assert set(rows) == {
        (kind, launcher)
        for kind in ("ddp", "fsdp2")
        for launcher in ("torchrun", "air_magic", "air_magic (tracking off)")
    }
    assert all(row["median_steps_per_s"] > 0 for row in rows.values())
    for run in results["runs"]:
        # both launchers trained 2 ranks with the same number of threads
        assert [rank["rank"] for rank in run["ranks"]] == [0, 1]
        assert run["threads"] == [int(results["config"]["omp_num_threads"])]
    assert "| ddp | air_magic |" in done.stdout and "| fsdp2 | torchrun |" in done.stdout
