"""The notebooks in notebooks/ are documentation that runs: execute each in a real kernel."""

from __future__ import annotations

import ast
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
    assert "[air_magic] MLflow run " in everything
    # One value per rank: each rank's total loss over its half of the data.
    line = next(l for l in everything.splitlines() if l.startswith("final total loss per rank:"))
    losses = ast.literal_eval(line.split(":", 1)[1].strip())
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert "FINISHED" in everything
    # 5000 samples / 2 ranks / batch 8 = 313 steps per rank, every point from both ranks stored.
    assert "points of 'loss' logged by all ranks: 626" in everything
    assert "rank logs: ['logs/rank-0.log', 'logs/rank-1.log']" in everything
    assert everything.rstrip().endswith("[(0, 1.0), (1, 1.0)]")
