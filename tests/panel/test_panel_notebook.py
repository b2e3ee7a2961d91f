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


def _saved(notebook: nbformat.NotebookNode, folder: Path) -> nbformat.NotebookNode:
    path = folder / "executed.ipynb"
    nbformat.write(notebook, path)
    return nbformat.read(path, as_version=4)


def _execute(cells: list[str], folder: Path) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    ).execute()
    return _saved(notebook, folder)


def test_headless_run_prints_status_lines_and_saves_a_summary(tmp_path: Path) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    saved = _saved(notebook, tmp_path)

    outputs = [output for cell in saved.cells for output in cell.get("outputs", [])]
    assert not [o for o in outputs if WIDGET_MIME in o.get("data", {})]  # no one renders widgets here
    assert "widgets" not in saved.metadata

    launch = saved.cells[1].outputs
    # In time order: the start line, the status lines and what rank 0 printed, then the
    # summary, then the value.
    assert launch[0].output_type == "display_data"
    assert launch[0].data["text/plain"].startswith("[air_magic] Cell In[2] on 2 CPU ranks")
    summary = launch[-2]
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


def test_progress_is_saved_at_its_last_state_and_the_summary_last(tmp_path: Path) -> None:
    saved = _execute(
        [
            CELLS[0],
            "%%distributed -n 2\n"
            "import os, time\n"
            "from tqdm.auto import tqdm\n"
            "for i in tqdm(range(200), desc='steps', mininterval=0.01):\n"
            "    time.sleep(0.02)\n"
            "print('rank', os.environ['RANK'], 'done')\n",
        ],
        tmp_path,
    )
    outputs = saved.cells[1].outputs
    streams = [o for o in outputs if o.output_type == "stream"]
    # Not one output per step (papermill keeps every stream message): a few states.
    assert len(streams) <= 10, [o.text for o in streams]
    text = "".join(o.text for o in streams)
    final = re.findall(r"steps: 100%\S* 200/200", text)
    assert len(final) == 1, text  # the last state once
    assert "rank 0 done" in text
    # Status lines while it ran, in time order, and the summary after them, last.
    status = [i for i, o in enumerate(outputs) if o.output_type == "stream" and " running · r0 " in o.text]
    assert status, text
    assert outputs[-1].output_type == "execute_result"  # [None, None]: print's value
    assert outputs[-2].output_type == "display_data"
    assert status_of(outputs[-2].data["text/html"]) == "finished"
    assert max(status) < len(outputs) - 2


@pytest.mark.parametrize("panel", ["text", "widget"])
def test_a_background_launch_saves_its_outcome_in_its_cell(
    tmp_path: Path, panel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIR_MAGIC_PANEL", panel)  # the kernel's environment: widgets or text lines
    saved = _execute(
        [
            CELLS[0],
            "from air_magic import distributed\n"
            "@distributed(num_accelerators=2, tracking=False)\n"
            "def bg_train(seconds):\n"
            "    import time\n"
            "    time.sleep(seconds)\n"
            "    return 1\n"
            "handle = bg_train.submit(2)",
            "handle.result(timeout=60)",
        ],
        tmp_path,
    )
    first = saved.cells[1].outputs
    shown = [o for o in first if o.output_type == "display_data"]
    assert len(shown) == 1, first
    assert ("widgets" in saved.metadata) == (panel == "widget")  # the panel was live there
    # After a restart a widget would read "model not found": none is left in the file.
    assert WIDGET_MIME not in shown[0].data
    # Its display gave way to the static summary: the outcome, not "starting".
    assert shown[0].data["text/plain"].startswith("[air_magic] bg_train on 2 CPU ranks"), shown[0].data
    assert "finished in" in shown[0].data["text/plain"]
    assert status_of(shown[0].data["text/html"]) == "finished"
    assert saved.cells[2].outputs[-1].data["text/plain"] == "[1, 1]"
