"""The notebooks in notebooks/ are documentation that runs: execute each in a real kernel."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

pytestmark = pytest.mark.kernel


def _text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type == "execute_result":
            parts.append(output.data.get("text/plain", ""))
        elif output.output_type == "display_data":  # a launch's panel, as it ended: its summary
            parts.append(output.data.get("text/plain", "") + "\n")
    return "".join(parts)


def test_quickstart_runs_on_cpu_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUICKSTART_EPOCHS", "1")
    monkeypatch.setenv("QUICKSTART_BATCH_SIZE", "8")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    notebook = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [_text(cell) for cell in notebook.cells if cell.cell_type == "code"]
    everything = "\n".join(outputs)
    assert "2 ranks on CPU" in everything
    # Rank 0's prints stream into the cell: one line per epoch.
    assert "Total loss for epoch 0:" in everything
    assert re.search(r"^\[air_magic\] +MLflow run ", everything, re.M), everything
    # One value per rank: the documentation's function returns nothing.
    assert "returned per rank: [None, None]" in everything
    # Each rank's total loss over its half of the data, in MLflow: one epoch, two ranks.
    line = next(text for text in everything.splitlines() if text.startswith("'total_loss' of every epoch on every rank:"))
    losses = ast.literal_eval(line.split(":", 1)[1].strip())
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert "FINISHED" in everything
    # 5000 samples / 2 ranks / batch 8 = 313 steps per rank, every point from both ranks stored.
    assert "points of 'loss' logged by all ranks: 626" in everything
    assert "rank logs: ['logs/rank-0.log', 'logs/rank-1.log']" in everything
    assert everything.rstrip().endswith("[(0, 1.0), (1, 1.0)]")


def _execute(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    """Run ``notebooks/<name>.ipynb`` in a real kernel on CPU ranks; everything its code cells showed."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebooks' checkpoint and model folders
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    return "\n".join(_text(cell) for cell in notebook.cells if cell.cell_type == "code")


def _losses(text: str, prefix: str) -> list[tuple[float, float]]:
    """``(first, last)`` from each line ``<prefix>... loss A -> B`` (one per rank)."""
    found = re.findall(re.escape(prefix) + r".*?loss ([0-9.]+) -> ([0-9.]+)", text)
    return [(float(a), float(b)) for a, b in found]


def test_fsdp2_shards_are_split_and_the_checkpoint_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    everything = _execute("fsdp2", tmp_path, monkeypatch, FSDP2_STEPS="100")
    assert "2 ranks on CPU" in everything
    # Every weight matrix is split in two halves by rows; sizes add up to the full parameter.
    shards = {
        name: (int(full), [int(n) for n in parts.split(" + ")])
        for name, full, parts in re.findall(r"^(\S+)\s+(\d+) elements = ([\d +]+)$", everything, re.M)
    }
    assert set(shards) == {f"blocks.{i}.0.{kind}" for i in range(3) for kind in ("weight", "bias")} | {"head.weight", "head.bias"}
    for name, (full, local) in shards.items():
        assert len(local) == 2 and sum(local) == full, name
    for name in ("blocks.0.0.weight", "blocks.1.0.weight", "blocks.2.0.weight"):
        full, local = shards[name]
        assert local == [full // 2, full // 2], (name, local)
    assert shards["blocks.1.0.weight"] == (65536, [32768, 32768])
    assert shards["head.weight"] == (256, [256, 0])  # one row: FSDP2 shards along dim 0
    # Both ranks trained, and the sharded checkpoint came back exactly (weights and optimizer).
    losses = _losses(everything, "rank ")
    assert len(losses) == 2 and all(last < first for first, last in losses), losses
    assert everything.count("checkpoint reloaded equal: True, resumed step equal: True") == 2
    assert "checkpoint files: ['.metadata', '__0_0.distcp', '__1_0.distcp']" in everything
    assert "plain model loaded from the sharded checkpoint gives the same outputs: True" in everything


def _deepspeed_segments() -> set[str]:
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)} if os.path.isdir("/dev/shm") else set()


def test_deepspeed_zero1_and_zero3_run_on_cpu_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _deepspeed_segments()
    everything = _execute("deepspeed", tmp_path, monkeypatch, DEEPSPEED_STEPS="60")
    # DeepSpeed's CPU all-reduce maps ~66 MB of /dev/shm per rank and never unlinks it:
    # the helper removes each launch's segments when its ranks are gone.
    assert _deepspeed_segments() - before == set()
    assert "2 ranks on CPU" in everything
    rows = re.findall(
        r"^rank (\d): ZeRO stage (\d) \((\w+), (\w+)/(\w+)\), loss ([0-9.]+) -> ([0-9.]+), "
        r"holds (\d+) of (\d+) parameters and Adam moments for (\d+)$",
        everything, re.M,
    )
    assert len(rows) == 4, everything[-3000:]
    by_stage: dict[int, list[tuple[str, ...]]] = {1: [], 3: []}
    for rank, stage, optimizer, accelerator, backend, first, last, held, full, moments in rows:
        # What DeepSpeed itself reports: its ZeRO stage, its CPU accelerator, gloo underneath.
        assert (accelerator, backend) == ("cpu", "gloo")
        assert optimizer == {"1": "DeepSpeedZeroOptimizer", "3": "DeepSpeedZeroOptimizer_Stage3"}[stage]
        assert float(last) < float(first)
        by_stage[int(stage)].append((rank, held, full, moments))
    for stage, ranks in by_stage.items():
        assert [r[0] for r in ranks] == ["0", "1"]
        for _, held, full, moments in ranks:
            # Adam's moments: about half of the model on each of the 2 ranks (plus alignment).
            assert int(full) // 2 <= int(moments) < int(full) // 2 + 64, (stage, moments, full)
            if stage == 1:
                assert held == full  # ZeRO-1 keeps every parameter
            else:
                assert int(full) // 2 <= int(held) < int(full) // 2 + 64  # ZeRO-3 partitions them
    assert "ZeRO-1 and ZeRO-3 trained" in everything


def test_transformers_trainer_fine_tunes_with_ddp_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    everything = _execute("transformers", tmp_path, monkeypatch, TRANSFORMERS_STEPS="60")
    assert "2 ranks on CPU" in everything
    rows = re.findall(
        r"^rank (\d) of (\d) \((\w+), (\S+)\): (\d+) steps, loss ([0-9.]+) -> ([0-9.]+), weight sum (\S+)$",
        everything, re.M,
    )
    assert len(rows) == 2, everything[-3000:]
    # The Trainer joined both CPU ranks (DDP over gloo) with no use_cpu in the code.
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [("0", "2", "distributed", "60"), ("1", "2", "distributed", "60")]
    assert all(float(r[6]) < float(r[5]) for r in rows)
    assert rows[0][7] == rows[1][7]  # replicas identical after training
    # The model rank 0 saved learned the pattern: it keeps counting.
    assert "prompt [10, 11, 12, 13] -> [14, 15, 16, 17, 18, 19, 20, 21]" in everything
    assert "'model.safetensors'" in everything


def test_the_quickstart_s_runner_talks_to_its_kernel_over_private_unix_sockets(tmp_path: Path) -> None:
    """scripts/run_notebook.py (what quickstart.sh runs): each cell's output as it comes, and
    no warning from ipykernel about plain TCP (the kernel's sockets are IPC, in a 0700 folder)."""
    import subprocess
    import sys

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("import os\nprint('hello from', os.getpid() != 0)"),
        nbformat.v4.new_code_cell("%load_ext air_magic\n%config DistributedMagics.tracking = False"),
    ]
    path = tmp_path / "tiny.ipynb"
    nbformat.write(notebook, path)
    script = Path(__file__).resolve().parents[2] / "scripts" / "run_notebook.py"
    done = subprocess.run(
        [sys.executable, str(script), str(path), "--output", str(tmp_path / "out.ipynb")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "--- cell 0 ---" in done.stdout and "hello from True\n" in done.stdout
    assert "without encryption" not in done.stdout + done.stderr, done.stderr
    # The runner ends its kernel (whose exit hooks delete its folders): the kernel never finds
    # its parent gone and leaves without them.
    assert "Parent appears to have exited" not in done.stdout + done.stderr, done.stderr
    assert nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[0].outputs
    assert not list(tmp_path.glob("kernel-*"))  # no socket files left where it ran
