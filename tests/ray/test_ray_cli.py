"""``air-magic run --backend ray`` on the 2-node test cluster: a script with arguments, a
module's function and a notebook's function, one rank on each node."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from ray_support import RayCluster

import air_magic

pytestmark = pytest.mark.process

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(air_magic.__file__)))
_LOGS_LINE = re.compile(r"^\[air_magic\]\s+logs: (.+)$", re.M)


def run(tmp_path: Path, cluster: RayCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "AIR_MAGIC_WARM")}
    env.update(cluster.env)
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the namespace's only interface (see test_ray_backend)
    env["AIR_MAGIC_LOG_DIR"] = str(tmp_path / "logs")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_CHECKOUT, env.get("PYTHONPATH")]))
    address = env.pop("RAY_ADDRESS")
    target, options = args[0], list(args[1:])
    command = [sys.executable, "-m", "air_magic.cli", "run", target, "--backend", "ray", "--address", address, *options]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def rank_log(done: subprocess.CompletedProcess[str], rank: int) -> str:
    (folder,) = _LOGS_LINE.findall(done.stderr)
    return Path(folder, f"rank-{rank}.log").read_text()


def test_a_script_with_arguments_runs_one_rank_on_each_node(tmp_path: Path, ray_cluster: RayCluster) -> None:
    (tmp_path / "train.py").write_text(
        textwrap.dedent(
            """\
            import argparse, os
            import torch, torch.distributed as dist
            parser = argparse.ArgumentParser()
            parser.add_argument("--lr", type=float)
            args = parser.parse_args()
            dist.init_process_group("gloo")
            t = torch.ones(1)
            dist.all_reduce(t)
            print(f"rank {os.environ['RANK']} node {os.environ['NODE_RANK']} lr={args.lr} sum={t.item()}", flush=True)
            dist.destroy_process_group()
            """
        )
    )
    done = run(tmp_path, ray_cluster, "train.py", "-n", "2", "--no-tracking", "--", "--lr", "0.5")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 node 0 lr=0.5 sum=2.0" in done.stdout  # rank 0's output reaches the terminal
    assert "rank 1 node 1 lr=0.5 sum=2.0" in rank_log(done, 1)


def test_a_module_function_returns_each_ranks_value(tmp_path: Path, ray_cluster: RayCluster) -> None:
    (tmp_path / "jobs.py").write_text(
        "import os\n\ndef where():\n    return (int(os.environ['RANK']), int(os.environ['NODE_RANK']))\n"
    )
    done = run(tmp_path, ray_cluster, "jobs:where", "-n", "2", "--no-tracking")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0: (0, 0)" in done.stdout and "rank 1: (1, 1)" in done.stdout


def test_a_notebook_function_that_fails_on_one_rank_exits_1(tmp_path: Path, ray_cluster: RayCluster) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("import os\nLIMIT = 1"),
        nbformat.v4.new_code_cell(
            "def check():\n    if int(os.environ['RANK']) >= LIMIT:\n        raise RuntimeError('over the limit')\n"
            "    return 'fine'"
        ),
    ]
    nbformat.write(notebook, tmp_path / "nb.ipynb")
    done = run(tmp_path, ray_cluster, "nb.ipynb:check", "-n", "2", "--no-tracking")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "RuntimeError: over the limit" in done.stderr and "rank 1" in done.stderr
