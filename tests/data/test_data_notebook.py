"""notebooks/data_and_checkpoints.ipynb runs in a real kernel on CPU ranks."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.kernel

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "data_and_checkpoints.ipynb"


def test_data_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # its data and checkpoint folders go with the test's
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    result_cell = notebook.cells[2]
    shown = next(o for o in result_cell.outputs if o.output_type == "execute_result").data["text/plain"]
    results = ast.literal_eval(shown)
    # 101 files on 2 ranks: 51 items each (one file repeated), 2 workers x 7 batches of 4.
    assert results == [
        {"rank": 0, "items per epoch": 51, "batches per epoch": [14, 14]},
        {"rank": 1, "items per epoch": 51, "batches per epoch": [14, 14]},
    ]
    restored = "".join(o.get("text", "") for o in notebook.cells[4].outputs)
    assert "restored weight: tensor([[" in restored
