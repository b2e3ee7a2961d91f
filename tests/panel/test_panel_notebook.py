"""A notebook executed headless (nbclient, as nbconvert and papermill do): text status lines
while it runs, and a static summary saved in the notebook file."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from panel_support import WIDGET_MIME, status_of

pytestmark = pytest.mark.kernel

CELLS = [
    "%load_ext air_magic\n%config DistributedMagics.tracking = False",
    "%%distributed -n 2\n"
    "import os, time\n"
    "from tqdm.auto import tqdm\n"
    "for i in tqdm(range(80), desc='epoch 1'):\n"
    "    time.sleep(0.05)\n"
    "print('rank', os.environ['RANK'], 'done')\n"
    "int(os.environ['RANK'])",
    "from air_magic import distributed\n"
    "@distributed(num_accelerators=2, tracking=False)\n"
    "def square(x):\n"
    "    return x * x\n"
    "handle = square.submit(3)\n"
    "handle.result(timeout=60)",
    "handle",
]


def test_headless_run_prints_status_lines_and_saves_a_summary(tmp_path: Path) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    path = tmp_path / "executed.ipynb"
    nbformat.write(notebook, path)
    saved = nbformat.read(path, as_version=4)

    outputs = [output for cell in saved.cells for output in cell.get("outputs", [])]
    assert not [o for o in outputs if WIDGET_MIME in o.get("data", {})]  # no one renders widgets here
    assert "widgets" not in saved.metadata

    launch = saved.cells[1].outputs
    # The summary stands where the launch began, above what rank 0 printed.
    summary = launch[0]
    assert summary.output_type == "display_data"
    assert status_of(summary.data["text/html"]) == "finished"
    text = summary.data["text/plain"]
    assert re.match(r"\[air_magic\] Cell In\[2\] on 2 CPU ranks \(launch \S+\): finished in \d+\.\d s", text), text
    assert "rank 0: finished · epoch 1 · 100% 80/80" in text and "'rank 1 done'" in text
    stdout = "".join(o.text for o in launch if o.output_type == "stream")
    lines = [ln for ln in stdout.replace("\r", "\n").splitlines() if ln.startswith("[air_magic] Cell In[2]")]
    assert lines, stdout[-1500:]
    assert any(
        re.search(r"\[air_magic\] Cell In\[2\] 0:\d\d running · r0 epoch 1 \d+% \d+/80 · r1 ", line) for line in lines
    ), lines
    assert "rank 0 done" in stdout
    assert launch[-1].output_type == "execute_result" and launch[-1].data["text/plain"] == "[0, 1]"

    # A background launch's handle, shown after it ended, is its summary.
    shown = saved.cells[3].outputs[0]
    assert shown.output_type == "execute_result"
    assert status_of(shown.data["text/html"]) == "finished"
    assert shown.data["text/plain"].startswith("[air_magic] square on 2 CPU ranks")
