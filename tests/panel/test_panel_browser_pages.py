"""The panel's pages beyond one live run: the kernel status, a saved notebook reopened, Notebook 7.

One JupyterLab server, one Notebook 7 server (only for its test) and one headless
Chromium page serve the whole module (the helpers of ``test_panel_browser``: loopback, a
token, temp folders; Debian's Chromium driven with Playwright, ``tests/playwright_page.py``);
after each test its kernels are shut down.

* While a blocking ``%%distributed -n 2`` cell with its widget panel runs (the panel
  shown, then a click on Where?, which JupyterLab sends on a kernel subshell), the
  kernel status the page shows (the notebook toolbar's indicator, ``data-status``, and
  the status bar's "Python 3 (ipykernel) | ..." item) never reads Idle; it does once
  the cell has ended.
* A notebook with a blocking launch and a background one (``h = f.submit()``, then
  ``h.result()`` in a later cell), saved, its kernel shut down and the page reloaded
  (a new kernel): both cells show their static summary ("finished") and the page shows
  no "Error displaying widget" / "model not found"; in the saved ``.ipynb`` both
  cells' outputs hold the summary (text/plain and text/html).
* Notebook 7 (``/notebooks/<path>``) at 1280 px: a short tqdm cell's panel renders as
  widgets, ends in success, and neither it nor the output area overflows sideways.

Skipped without Chromium, Playwright, JupyterLab or Notebook 7, unless ``AIR_MAGIC_UI_REQUIRED=1``.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import nbformat
import pytest
from panel_support import WIDGET_MIME, status_of
from playwright_page import Page, chromium_page
from test_panel_browser import PROBE, _check_widths, _panel_box, _poll, _running_progress, serve_jupyter

pytestmark = [pytest.mark.ui, pytest.mark.kernel]

SETUP = "%load_ext air_magic\n%config DistributedMagics.tracking = False"

BUSY_CELLS = [SETUP, "%%distributed -n 2\nimport time\ntime.sleep(8)\n'slept'"]

SAVED_CELLS = [
    SETUP,
    "%%distributed -n 2\nimport os, time\ntime.sleep(1)\nint(os.environ['RANK'])",
    "from air_magic import distributed\n"
    "@distributed(num_accelerators=2)\n"
    "def f():\n"
    "    import os, time\n"
    "    time.sleep(2)\n"
    "    return int(os.environ['RANK'])\n"
    "h = f.submit()",
    "h.result(timeout=60)",
]

# Tracking on (a SQLite store in the server's folder): the headline names the MLflow run, the
# summary adds the ``mlflow ui`` line, and the rows their metrics, beside a long last line.
TRACKED_CELLS = [
    "import os\nos.environ['MLFLOW_TRACKING_URI'] = 'sqlite:///' + os.path.abspath('mlflow.db')\n%load_ext air_magic",
    "%%distributed -n 2\n"
    "import mlflow, os, time\n"
    "from tqdm.auto import tqdm\n"
    "print('epoch 1: ' + 'a long line of log output that must not widen the panel ' * 6)\n"
    "for i in tqdm(range(40), desc='train'):\n"
    "    mlflow.log_metric('train_loss_of_the_long_named_kind', 1.0 / (i + 1), step=i)\n"
    "    time.sleep(0.25)\n"
    "int(os.environ['RANK'])",
]

NOTEBOOK7_CELLS = [
    SETUP,
    "%%distributed -n 2\n"
    "import os, time\n"
    "from tqdm.auto import tqdm\n"
    "print('epoch 1: ' + 'a long line of log output that must not widen the panel ' * 6)\n"
    "for i in tqdm(range(50), desc='train'):\n"
    "    time.sleep(0.1)\n"
    "int(os.environ['RANK'])",
]

# The kernel's state as the page shows it: the toolbar's indicator and the status bar's item.
KERNEL_SHOWN = r"""
(() => {
  const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
  const item = document.querySelector('#jp-main-statusbar [title^="Change kernel for"]');
  const shown = item && !item.closest('.lm-mod-hidden');
  return JSON.stringify({indicator: indicator ? indicator.dataset.status : null, bar: shown ? item.textContent : null});
})()
"""

# Every part of the cell's air_magic output that a person cannot read whole: a box outside the
# output area (left or right), or one whose own text is cut (wider than its box) without the
# whole of it on hover (a title).
OUTSIDE = r"""
((index) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-CodeCell')[index];
  const area = cell && cell.querySelector('.jp-OutputArea');
  if (!area) return JSON.stringify(null);
  const bounds = area.getBoundingClientRect();
  const roots = [...area.querySelectorAll('.air-magic-panel')].map(p => p.closest('.widget-vbox') || p);
  const found = {page: document.documentElement.clientWidth, area: [bounds.left, bounds.right], parts: 0, out: []};
  for (const root of roots) {
    for (const part of [root, ...root.querySelectorAll('*')]) {
      const box = part.getBoundingClientRect();
      const style = getComputedStyle(part);
      if (!box.width || !box.height || style.visibility === 'hidden') continue;
      found.parts += 1;
      const own = [...part.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
      const name = `${part.tagName.toLowerCase()}.${[...part.classList].join('.')}: ${(part.innerText || '').slice(0, 60)}`;
      if (box.left < bounds.left - 1 || box.right > bounds.right + 1) {
        found.out.push(`${name} at ${Math.round(box.left)}..${Math.round(box.right)}`);
      } else if (own && part.scrollWidth > part.clientWidth + 1 && !part.closest('[title]')) {
        found.out.push(`${name} cut: ${part.scrollWidth} px of text in ${part.clientWidth}`);
      }
    }
  }
  return JSON.stringify(found);
})
"""

RUN_ALL = (
    "(() => { const app = window.jupyterapp;"
    " const widget = [...app.shell.widgets('main')].find(w => w.sessionContext);"
    " if (app.shell.activateById) app.shell.activateById(widget.id);"
    " app.commands.execute('notebook:run-all-cells'); return true; })()"
)


def _api(server: dict[str, Any], path: str, method: str = "GET") -> Any:
    request = urllib.request.Request(f"{server['base']}{path}?token={server['token']}", method=method)
    with urllib.request.urlopen(request, timeout=20) as reply:
        body = reply.read()
    return json.loads(body) if body else None


def _shut_kernels_down(server: dict[str, Any]) -> None:
    """End every session and kernel of the server, and wait until none is left."""
    for session in _api(server, "/api/sessions"):
        _api(server, f"/api/sessions/{session['id']}", "DELETE")
    for kernel in _api(server, "/api/kernels"):
        _api(server, f"/api/kernels/{kernel['id']}", "DELETE")
    deadline = time.monotonic() + 30
    while _api(server, "/api/kernels") and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    notebooks = {"busy.ipynb": BUSY_CELLS, "saved.ipynb": SAVED_CELLS, "tracked.ipynb": TRACKED_CELLS}
    with serve_jupyter(tmp_path_factory.mktemp("lab"), notebooks) as server:
        yield server


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    # (Playwright emulates focus on its pages: the status bar follows the focused notebook.)
    with chromium_page(tmp_path_factory.mktemp("browser"), width=1280, height=1600) as tools:
        yield tools


@pytest.fixture
def lab(lab_server: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The module's JupyterLab; the test's kernels are shut down after it."""
    try:
        yield lab_server
    finally:
        _shut_kernels_down(lab_server)


def _open(tools: Page, url: str, seen: list[dict[str, Any]]) -> dict[str, Any]:
    tools.goto(url)
    state = _poll(tools, seen, lambda s: s["ready"] and s.get("kernel") == "idle", 120, "the notebook and its kernel")
    tools.evaluate(
        "(() => { const app = window.jupyterapp; const w = [...app.shell.widgets('main')].find(w => w.sessionContext);"
        " if (app.shell.activateById) app.shell.activateById(w.id); return true; })()"
    )
    return state


def _cell(state: dict[str, Any], index: int) -> dict[str, Any]:
    return state["cells"][index] if state.get("ready") and len(state["cells"]) > index else {}


def _panel(state: dict[str, Any], index: int) -> dict[str, Any]:
    panels = _cell(state, index).get("panels", [])
    return panels[0] if panels else {}


def test_the_kernel_reads_busy_while_a_blocking_launch_runs(lab: dict[str, Any], page: Page) -> None:
    tools = page
    seen: list[dict[str, Any]] = []
    _open(tools, f"{lab['base']}/lab/tree/busy.ipynb?reset&token={lab['token']}", seen)
    deadline = time.monotonic() + 10
    while json.loads(tools.evaluate(KERNEL_SHOWN)) != {"indicator": "idle", "bar": "Python 3 (ipykernel) | Idle"}:
        assert time.monotonic() < deadline, tools.evaluate(KERNEL_SHOWN)
        time.sleep(0.2)
    tools.evaluate(RUN_ALL)

    def where_enabled(state: dict[str, Any]) -> bool:
        panel = _panel(state, 1)
        return panel.get("status") == "running" and panel.get("widget") and panel.get("stop") is True

    running = _poll(tools, seen, where_enabled, 60, "the blocking launch's panel, its buttons enabled")
    launch = _panel(running, 1)["launch"]
    button = _panel_box(tools, launch).locator("button", has_text=re.compile("Where")).first
    clicked = button.text_content() or ""
    button.click()
    assert "Where" in clicked

    # While the launch runs, the page never shows the kernel idle.
    samples = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = json.loads(tools.evaluate(PROBE))
        shown = json.loads(tools.evaluate(KERNEL_SHOWN))
        panel = _panel(state, 1)
        if panel.get("status") != "running":
            break
        samples.append({**shown, "kernel": state.get("kernel"), "prompt": _cell(state, 1).get("prompt")})
        time.sleep(0.3)
    assert len(samples) >= 5, samples
    assert all(s["bar"] for s in samples), samples
    idle = [s for s in samples if s["indicator"] == "idle" or "idle" in (s["bar"] or "").lower()]
    assert not idle, samples

    # The cell ends: the summary, then the kernel reads idle.
    def ended(state: dict[str, Any]) -> bool:
        return _panel(state, 1).get("status") == "finished" and _cell(state, 1)["prompt"].strip() == "[2]:"

    _poll(tools, seen, ended, 60, "the cell to end")
    deadline = time.monotonic() + 10
    while True:
        shown = json.loads(tools.evaluate(KERNEL_SHOWN))
        if shown["indicator"] == "idle" and "Idle" in shown["bar"]:
            break
        assert time.monotonic() < deadline, shown
        time.sleep(0.25)


def test_every_part_of_a_tracked_panel_lies_inside_its_output_area_at_1024_with_the_sidebar_open(
    lab: dict[str, Any], page: Page
) -> None:
    """At 1024x768 with the file browser open (as wide as JupyterLab opens it), the running
    panel of a tracked launch (its MLflow run in the headline, a metric and a long last line in
    its rows) and then its summary (with the ``mlflow ui`` line): every part lies inside the
    cell's output area, and no text is cut without the whole of it on hover."""
    tools = page
    seen: list[dict[str, Any]] = []
    tools.page.set_viewport_size({"width": 1024, "height": 768})
    try:
        _open(tools, f"{lab['base']}/lab/tree/tracked.ipynb?reset&token={lab['token']}", seen)
        tools.evaluate("(() => { window.jupyterapp.shell.activateById('filebrowser'); return true; })()")
        tools.evaluate(RUN_ALL)
        shots = lab["tmp"] / "shots"
        shots.mkdir(exist_ok=True)

        def metric_shown(state: dict[str, Any]) -> bool:  # and the MLflow run, once it exists
            text = _cell(state, 1).get("text", "")
            return _panel(state, 1).get("status") == "running" and "train_loss" in text and "mlflow ui" in text

        _poll(tools, seen, metric_shown, 120, "the running panel with its metric")
        running = _inside_with_each_sidebar(tools, shots, "tracked-running")
        assert all(found["parts"] > 20 for found in running.values()), running

        def summary(state: dict[str, Any]) -> bool:
            return _panel(state, 1).get("status") == "finished" and "mlflow ui" in _cell(state, 1).get("text", "")

        _poll(tools, seen, summary, 120, "the summary with its mlflow ui line")
        ended = _inside_with_each_sidebar(tools, shots, "tracked-finished")
        assert all(found["parts"] > 10 for found in ended.values()), ended
    finally:
        tools.evaluate("(() => { window.jupyterapp.shell.collapseLeft(); return true; })()")
        tools.page.set_viewport_size({"width": 1280, "height": 1600})


def _inside_with_each_sidebar(tools: Page, shots: Path, name: str) -> dict[str, Any]:
    """With the file browser's sidebar open, then air_magic's: nothing of the panel outside its
    output area (a screenshot of each, ``NAME-1024x768-SIDEBAR.png``)."""
    found = {}
    for sidebar in ("filebrowser", "air-magic-launches"):
        tools.evaluate(f"(() => {{ window.jupyterapp.shell.activateById('{sidebar}'); return true; }})()")
        time.sleep(0.5)
        found[sidebar] = json.loads(tools.evaluate(f"{OUTSIDE}(1)"))
        tools.page.screenshot(path=str(shots / f"{name}-1024x768-{sidebar}.png"))
        assert found[sidebar]["page"] == 1024 and found[sidebar]["out"] == [], (sidebar, found[sidebar])
    return found


def test_a_saved_notebook_reopens_with_its_summaries(lab: dict[str, Any], page: Page) -> None:
    tools = page
    seen: list[dict[str, Any]] = []
    url = f"{lab['base']}/lab/tree/saved.ipynb?reset&token={lab['token']}"
    _open(tools, url, seen)
    tools.evaluate(RUN_ALL)

    def done(state: dict[str, Any]) -> bool:
        return (
            _cell(state, 3).get("prompt", "").strip() == "[4]:"
            and "[0, 1]" in _cell(state, 3)["text"]
            and all(_panel(state, i).get("status") == "finished" and not _panel(state, i)["widget"] for i in (1, 2))
        )

    _poll(tools, seen, done, 120, "both launches to end in their summaries")
    saved_at = (lab["root"] / "saved.ipynb").stat().st_mtime_ns
    tools.evaluate(
        "(async () => { const app = window.jupyterapp;"
        " app.shell.activateById([...app.shell.widgets('main')].find(w => w.sessionContext).id);"
        " await app.commands.execute('docmanager:save'); return true; })()"
    )
    deadline = time.monotonic() + 20
    while (lab["root"] / "saved.ipynb").stat().st_mtime_ns == saved_at:
        assert time.monotonic() < deadline, "the notebook was not saved"
        time.sleep(0.2)

    # The file: each launch's cell holds its summary, and no widget view.
    saved = nbformat.read(lab["root"] / "saved.ipynb", as_version=4)
    for index in (1, 2):
        outputs = saved.cells[index].outputs
        bundles = [o.data for o in outputs if o.output_type in ("display_data", "execute_result")]
        assert bundles and not any(WIDGET_MIME in b for b in bundles), outputs
        summaries = [b for b in bundles if "text/html" in b and status_of(b["text/html"]) is not None]
        assert len(summaries) == 1, outputs
        assert status_of(summaries[0]["text/html"]) == "finished", summaries
        assert "finished" in summaries[0]["text/plain"], summaries
    assert saved.cells[3].outputs[-1].data["text/plain"] == "[0, 1]"

    # A new kernel, the page reloaded: the summaries stay, no widget is missed.
    _shut_kernels_down(lab)
    state = _open(tools, url, seen)
    time.sleep(2)  # outputs and any widget views render
    state = json.loads(tools.evaluate(PROBE))
    for index in (1, 2):
        panel = _panel(state, index)
        assert panel.get("status") == "finished" and not panel["widget"], _cell(state, index)
        assert "finished" in _cell(state, index)["text"], _cell(state, index)
    text = tools.evaluate("document.body.innerText")
    for error in ("Error displaying widget", "model not found"):
        assert error not in text, text[-3000:]


@pytest.fixture(scope="module")
def notebook7_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with serve_jupyter(tmp_path_factory.mktemp("notebook7"), {"nb7.ipynb": NOTEBOOK7_CELLS}, app="notebook") as server:
        yield server


@pytest.fixture
def notebook7(notebook7_server: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The module's Notebook 7; the test's kernels are shut down after it."""
    try:
        yield notebook7_server
    finally:
        _shut_kernels_down(notebook7_server)


def test_the_panel_in_notebook_7(notebook7: dict[str, Any], page: Page) -> None:
    tools = page
    seen: list[dict[str, Any]] = []
    _open(tools, f"{notebook7['base']}/notebooks/nb7.ipynb?token={notebook7['token']}", seen)
    tools.evaluate(RUN_ALL)

    def progressed(state: dict[str, Any]) -> bool:
        return len({p for s in seen for p in _running_progress(_cell(s, 1))}) >= 2

    _poll(tools, seen, progressed, 120, "the panel to show the bar moving while the cell runs")
    live = [s for s in seen if _running_progress(_cell(s, 1))]
    assert all(p["widget"] for s in live for p in _cell(s, 1)["panels"])
    first = _cell(live[0], 1)["panels"][0]
    assert len(first["rows"]) == 2
    widths = _check_widths(tools, 1)
    assert widths["status"] in ("running", "finished"), widths

    def finished(state: dict[str, Any]) -> bool:
        return _panel(state, 1).get("status") == "finished" and "[0, 1]" in _cell(state, 1)["text"]

    done = _poll(tools, seen, finished, 120, "the launch to end in success")
    summary = _panel(done, 1)
    assert summary["launch"] == first["launch"] and not summary["widget"]
    assert [row.split()[0] for row in summary["rows"]] == ["finished", "finished"]
    assert "100% 50/50" in " ".join(summary["rows"])
    _check_widths(tools, 1)
