"""The panel in a real JupyterLab, in headless Chromium, offline.

The test starts JupyterLab on 127.0.0.1 (a token, a temp folder as its root and config)
and Debian's headless Chromium driven with Playwright (``tests/playwright_page.py``; none
of Playwright's own browsers): it runs a notebook whose ``%%distributed -n 2`` cell shows
a tqdm bar, watches the panel update while the cell runs and end as a success, then
clicks Stop on a blocking launch (JupyterLab sends the click on a kernel subshell, so it
is handled while the cell runs). Every request the page makes must go to the local
server: the panel needs no CDN.  The page is 1280 px wide: the panel, live and as a
summary, must fit its output area (no horizontal overflow); a PNG of the live panel goes
to ``AIR_MAGIC_UI_SCREENSHOT`` when set (else into the test's temp folder).

``test_panel_browser_pages`` (and ``tests/lab/test_lab_browser.py``) use the same helpers
(``serve_jupyter``, ``PROBE``, ``_poll``) for the kernel status during a blocking launch, a
saved notebook reopened with a new kernel, and the panel in Notebook 7.

Needs ``chromium`` (``apt-get install chromium``; ``scripts/setup_env.sh`` does it),
Playwright and ``jupyterlab``; skipped without them, unless ``AIR_MAGIC_UI_REQUIRED=1``
(CI) makes that a failure.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from playwright_page import Page, chromium_page, missing

pytestmark = [pytest.mark.ui, pytest.mark.kernel]

NOTEBOOK_CELLS = [
    "%load_ext air_magic\n%config DistributedMagics.tracking = False",
    "%%distributed -n 2\n"
    "import os, time\n"
    "from tqdm.auto import tqdm\n"
    "print('epoch 1: ' + 'a long line of log output that must not widen the panel ' * 6)\n"
    "for i in tqdm(range(50), desc='train'):\n"
    "    time.sleep(0.2)\n"
    "int(os.environ['RANK'])",
    "%%distributed -n 2\nimport time\ntime.sleep(120)",
]

# Everything the page shows of the panels, once per poll.
PROBE = r"""
(() => {
  const nb = document.querySelector('.jp-Notebook');
  if (!nb) return JSON.stringify({ready: false});
  const cells = [...nb.querySelectorAll('.jp-CodeCell')].map(cell => ({
    prompt: (cell.querySelector('.jp-InputArea-prompt') || {}).textContent || '',
    text: (cell.querySelector('.jp-OutputArea') || {}).innerText || '',
    panels: [...cell.querySelectorAll('[data-air-magic-status]')].map(p => {
      const box = p.closest('.widget-vbox');
      const button = box ? box.querySelector('button') : null;
      return {
        launch: p.dataset.airMagicLaunch, status: p.dataset.airMagicStatus, widget: !!box,
        rows: [...p.querySelectorAll('tr[data-rank]')].map(r => r.dataset.state + ' ' + r.innerText),
        stop: button ? !button.disabled : null,
      };
    }),
  }));
  const app = window.jupyterapp;
  const widget = app && [...app.shell.widgets('main')].find(w => w.sessionContext);
  const kernel = widget && widget.sessionContext.session && widget.sessionContext.session.kernel;
  return JSON.stringify({ready: true, kernel: kernel ? kernel.status : null, cells});
})()
"""


# The widths of a cell's output area and of the panel in it (the page is 1280 px wide).
WIDTHS = r"""
((index) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-CodeCell')[index];
  const root = cell && cell.querySelector('.air-magic-panel');
  if (!root) return JSON.stringify(null);
  const boxes = {
    area: cell.querySelector('.jp-OutputArea'),
    output: root.closest('.jp-OutputArea-output'),
    widget: root.closest('.widget-vbox'),
    panel: root,
    table: root.querySelector('table'),
  };
  const found = {page: document.documentElement.clientWidth, status: root.dataset.airMagicStatus,
                 columns: [...root.querySelectorAll('th')].map(th => [th.innerText, th.getBoundingClientRect().width])};
  for (const [name, box] of Object.entries(boxes)) {
    if (box) found[name] = {scroll: box.scrollWidth, client: box.clientWidth, right: box.getBoundingClientRect().right};
  }
  return JSON.stringify(found);
})
"""


def _check_widths(tools: Page, index: int, page: int = 1280) -> dict[str, Any]:
    """No horizontal overflow: neither the output area nor the panel (nor its table) is wider than its box."""
    found = json.loads(tools.evaluate(f"{WIDTHS}({index})"))
    assert found is not None, "no panel in the cell"
    assert found["page"] == page, found
    for name in ("area", "output", "widget", "panel"):
        if name in found:
            assert found[name]["scroll"] <= found[name]["client"], (name, found)
    if "table" in found and "panel" in found:
        assert found["table"]["right"] <= found["panel"]["right"] + 1, found
    # Every column of the rank table is there to read (none squeezed to nothing by the others).
    assert all(width >= 40 for _, width in found["columns"]), found["columns"]
    return found


def _screenshot(tools: Page, index: int, path: Path) -> None:
    """A PNG of the cell's output (the panel), for a person to look at."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tools.shot(f".jp-Notebook .jp-CodeCell >> nth={index} >> .jp-OutputArea", path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def notebook_json(cells: list[str]) -> str:
    """An nbformat 4 notebook of these code cells (no outputs), on the python3 kernel."""
    notebook = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": f"c{i}",
                "metadata": {},
                "outputs": [],
                "source": source,
            }
            for i, source in enumerate(cells)
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    return json.dumps(notebook)


@contextlib.contextmanager
def serve_jupyter(tmp_path: Path, notebooks: dict[str, list[str]], app: str = "jupyterlab") -> Iterator[dict[str, Any]]:
    """JupyterLab (``app="jupyterlab"``) or Notebook 7 (``app="notebook"``) on 127.0.0.1 with
    a token; its root (holding ``notebooks``), config and state in ``tmp_path``.

    The server is this Python's, or that of ``AIR_MAGIC_UI_SERVER_PYTHON`` (another
    environment's JupyterLab, e.g. an older one: ``scripts/check_lab_versions.sh``); its
    notebooks' kernels are this Python's either way (``python3`` in its data folder)."""
    python = os.environ.get("AIR_MAGIC_UI_SERVER_PYTHON") or sys.executable
    if python == sys.executable:
        try:
            importlib.import_module(app)
        except ImportError:
            missing(f"{app} (pip install -e '.[test]')")
    elif subprocess.run([python, "-c", f"import {app}"], capture_output=True).returncode != 0:
        pytest.fail(f"AIR_MAGIC_UI_SERVER_PYTHON={python} has no {app}")
    root = tmp_path / "root"
    root.mkdir()
    for name, cells in notebooks.items():
        (root / name).write_text(notebook_json(cells))
    port, token = _free_port(), uuid.uuid4().hex
    config = tmp_path / "jupyter_config.py"
    config.write_text(
        f"c.ServerApp.ip = '127.0.0.1'\nc.ServerApp.port = {port}\nc.ServerApp.port_retries = 0\n"
        f"c.ServerApp.open_browser = False\nc.IdentityProvider.token = '{token}'\n"
        f"c.ServerApp.root_dir = {str(root)!r}\nc.ServerApp.allow_root = True\n"
        "c.LabApp.expose_app_in_browser = True\nc.LabApp.news_url = None\n"
        "c.LabApp.check_for_updates_class = 'jupyterlab.NeverCheckForUpdate'\n"
        "c.LabApp.extension_manager = 'readonly'\n"
        f"c.LabApp.workspaces_dir = {str(tmp_path / 'workspaces')!r}\n"
        f"c.LabApp.user_settings_dir = {str(tmp_path / 'settings')!r}\n"
        # Notebook 7's pages (/tree, /notebooks/...): the same, for its own app
        "c.JupyterNotebookApp.expose_app_in_browser = True\n"
        f"c.JupyterNotebookApp.workspaces_dir = {str(tmp_path / 'workspaces')!r}\n"
        f"c.JupyterNotebookApp.user_settings_dir = {str(tmp_path / 'settings')!r}\n"
    )
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    if python != sys.executable:
        spec = tmp_path / "data" / "kernels" / "python3"
        spec.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        kernel: dict[str, Any] = {"argv": argv, "display_name": "Python 3", "language": "python"}
        if os.environ.get("PYTHONPATH"):  # the kernel's, not the server's
            kernel["env"] = {"PYTHONPATH": os.environ["PYTHONPATH"]}
        (spec / "kernel.json").write_text(json.dumps(kernel))
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        JUPYTER_DATA_DIR=str(tmp_path / "data"),
        # These folders before the environment's (in a virtual environment jupyter_core puts
        # the environment's first): what a test puts there is what the server uses.
        JUPYTER_PREFER_ENV_PATH="0",
    )
    env.pop("AIR_MAGIC_PANEL", None)  # the page is a widget front end: found by itself
    if python != sys.executable:
        env.pop("PYTHONPATH", None)  # the server runs its own environment's packages
    log_path = tmp_path / f"{app}.log"
    with open(log_path, "wb") as log:  # the server keeps its own descriptor
        server = subprocess.Popen(
            [python, "-m", app, f"--config={config}"],
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{app} did not start:\n" + log_path.read_text()[-3000:])
            time.sleep(0.3)
        version = subprocess.run(
            [python, "-c", f"import {app}; print({app}.__version__)"], capture_output=True, text=True, check=True
        ).stdout.strip()
        yield {"base": base, "token": token, "log": log_path, "tmp": tmp_path, "root": root, "version": version}
    finally:
        try:  # a clean stop shuts its kernels down (and their ranks with them)
            request = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(request, timeout=5).close()
            server.wait(20)
        except Exception:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """JupyterLab on 127.0.0.1 with a token; its root, config and state in ``tmp_path``."""
    with serve_jupyter(tmp_path, {"panel.ipynb": NOTEBOOK_CELLS}) as server:
        yield server


@pytest.fixture
def browser(lab: dict[str, Any]) -> Iterator[Page]:
    with chromium_page(lab["tmp"], width=1280, height=1600) as tools:
        yield tools


def _poll(tools: Page, seen: list[dict[str, Any]], until: Any, timeout: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state = json.loads(tools.evaluate(PROBE))
        seen.append(state)
        if until(state):
            return state
        if time.monotonic() > deadline:
            cells = state.get("cells", [])
            shown = "\n".join(json.dumps(cell)[:2000] for cell in cells)
            raise AssertionError(f"timed out waiting for {what}; kernel {state.get('kernel')}, cells:\n{shown}")
        time.sleep(0.25)


def test_panel_updates_live_and_ends_in_success(lab: dict[str, Any], browser: Page) -> None:
    tools = browser
    # Every request of the browser (its pages, workers, service workers) and every websocket.
    urls: list[str] = []
    tools.page.context.on("request", lambda request: urls.append(request.url))
    tools.page.on("websocket", lambda socket: urls.append(socket.url))
    tools.goto(f"{lab['base']}/lab/tree/panel.ipynb?token={lab['token']}")
    seen: list[dict[str, Any]] = []
    _poll(tools, seen, lambda s: s["ready"] and s.get("kernel") == "idle", 120, "the notebook and its kernel")
    tools.evaluate(  # not awaited: the promise settles when the last cell ends
        "(() => { const app = window.jupyterapp;"
        " app.shell.activateById([...app.shell.widgets('main')].find(w => w.sessionContext).id);"
        " app.commands.execute('notebook:run-all-cells'); return true; })()"
    )

    def cell(state: dict[str, Any], index: int) -> dict[str, Any]:
        return state["cells"][index] if state.get("ready") and len(state["cells"]) > index else {}

    # The training cell: a live widget panel while the cell runs ...
    def progressed(state: dict[str, Any]) -> bool:
        return len({p for s in seen for p in _running_progress(cell(s, 1))}) >= 2

    _poll(tools, seen, progressed, 120, "the panel to show the bar moving while the cell runs")
    live = [s for s in seen if _running_progress(cell(s, 1))]
    assert all(cell(s, 1)["prompt"].strip() == "[*]:" for s in live), [cell(s, 1)["prompt"] for s in live]
    assert all(p["widget"] for s in live for p in cell(s, 1)["panels"])
    first = cell(live[0], 1)["panels"][0]
    assert first["stop"] is True  # JupyterLab 4.6 + ipykernel 7: clicks arrive on a subshell
    assert len(first["rows"]) == 2

    # At 1280 px the live panel fits its output area: the long last line is cut, not scrolled.
    widths = _check_widths(tools, 1)
    if widths["status"] == "running":
        _screenshot(tools, 1, Path(os.environ.get("AIR_MAGIC_UI_SCREENSHOT") or lab["tmp"] / "panel-1280.png"))
    # So it does at 1024x768 with a sidebar open (the file browser's, as wide as JupyterLab opens it).
    tools.page.set_viewport_size({"width": 1024, "height": 768})
    tools.evaluate("(() => { window.jupyterapp.shell.activateById('filebrowser'); return true; })()")
    time.sleep(1.0)
    narrow = _check_widths(tools, 1, page=1024)
    if narrow["status"] == "running":
        folder = Path(os.environ.get("AIR_MAGIC_UI_ARTIFACTS") or lab["tmp"])
        folder.mkdir(parents=True, exist_ok=True)
        tools.page.screenshot(path=str(folder / "panel-1024x768-sidebar.png"))
    tools.evaluate("(() => { window.jupyterapp.shell.collapseLeft(); return true; })()")
    tools.page.set_viewport_size({"width": 1280, "height": 1600})

    # ... and a success at the end: the static summary in place of the widgets.
    def finished(state: dict[str, Any]) -> bool:
        panels = cell(state, 1).get("panels", [])
        return bool(panels) and panels[0]["status"] == "finished" and "[0, 1]" in cell(state, 1)["text"]

    done = _poll(tools, seen, finished, 120, "the launch to end in success")
    summary = cell(done, 1)["panels"][0]
    assert summary["launch"] == first["launch"] and not summary["widget"]
    assert [row.split()[0] for row in summary["rows"]] == ["finished", "finished"]
    assert "100% 50/50" in " ".join(summary["rows"])
    _check_widths(tools, 1)  # and so does the summary

    # A blocking launch stopped with the panel's button while its cell runs.
    def stoppable(state: dict[str, Any]) -> bool:
        panels = cell(state, 2).get("panels", [])
        return bool(panels) and panels[0]["status"] == "running" and panels[0]["stop"] is True

    running = _poll(tools, seen, stoppable, 60, "the second launch to run with Stop enabled")
    launch = cell(running, 2)["panels"][0]["launch"]
    button = _panel_box(tools, launch).locator("button").first
    clicked = button.text_content() or ""
    button.click()
    assert "Stop" in clicked
    start = time.monotonic()

    def cancelled(state: dict[str, Any]) -> bool:
        panels = cell(state, 2).get("panels", [])
        return bool(panels) and panels[0]["status"] == "cancelled" and "LaunchCancelledError" in cell(state, 2)["text"]

    _poll(tools, seen, cancelled, 30, "Stop to cancel the blocking launch")
    assert time.monotonic() - start < 20

    # Offline: every request went to the local server.
    foreign = [u for u in urls if not u.startswith((lab["base"], "data:", "blob:", "about:", "ws://127.0.0.1"))]
    assert urls and not foreign, foreign[:10]


def _panel_box(tools: Page, launch: str) -> Any:
    """The widget box (a Playwright locator) of the live panel of ``launch``: its buttons."""
    panel = tools.page.locator(f'[data-air-magic-launch="{launch}"]').first
    return panel.locator("xpath=ancestor::div[contains(concat(' ', @class, ' '), ' widget-vbox ')][1]")


def _running_progress(cell: dict[str, Any]) -> list[int]:
    """Rank 0's progress (percent) as a running widget panel shows it, if it shows one."""
    found = []
    for panel in cell.get("panels", []):
        if panel["status"] == "running" and panel["widget"] and panel["rows"]:
            match = re.search(r"(\d+)% \d+/50", panel["rows"][0])
            if match:
                found.append(int(match.group(1)))
    return found
