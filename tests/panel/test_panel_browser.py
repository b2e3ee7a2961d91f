"""The panel in a real JupyterLab, in headless Chromium, offline.

The test starts JupyterLab on 127.0.0.1 (a token, a temp folder as its root and config),
starts Debian's Chromium headless with a DevTools port, and drives the page over the
Chrome DevTools Protocol (``websockets``): it runs a notebook whose ``%%distributed -n 2``
cell shows a tqdm bar, watches the panel update while the cell runs and end as a
success, then clicks Stop on a blocking launch (JupyterLab sends the click on a kernel
subshell, so it is handled while the cell runs). Every request the page makes must go
to the local server: the panel needs no CDN.  The page is 1280 px wide: the panel, live
and as a summary, must fit its output area (no horizontal overflow); a PNG of the live
panel goes to ``AIR_MAGIC_UI_SCREENSHOT`` when set (else into the test's temp folder).

``test_panel_browser_pages`` uses the same helpers (``serve_jupyter``, ``open_chromium``) for
the kernel status during a blocking launch, a saved notebook reopened with a new kernel,
and the panel in Notebook 7.

Needs ``chromium`` (``apt-get install chromium``; ``scripts/setup_env.sh`` does it) and
``jupyterlab``; skipped without them, unless ``AIR_MAGIC_UI_REQUIRED=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import json
import os
import re
import shutil
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

CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-quic",
    "--disable-extensions",
    "--disable-default-apps",
    "--mute-audio",
    "--window-size=1280,1600",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
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
  const found = {page: document.documentElement.clientWidth, status: root.dataset.airMagicStatus};
  for (const [name, box] of Object.entries(boxes)) {
    if (box) found[name] = {scroll: box.scrollWidth, client: box.clientWidth, right: box.getBoundingClientRect().right};
  }
  return JSON.stringify(found);
})
"""


def _check_widths(tools: "DevTools", index: int) -> dict[str, Any]:
    """No horizontal overflow: neither the output area nor the panel (nor its table) is wider than its box."""
    found = json.loads(tools.evaluate(f"{WIDTHS}({index})"))
    assert found is not None, "no panel in the cell"
    assert found["page"] == 1280, found
    for name in ("area", "output", "widget", "panel"):
        if name in found:
            assert found[name]["scroll"] <= found[name]["client"], (name, found)
    if "table" in found and "panel" in found:
        assert found["table"]["right"] <= found["panel"]["right"] + 1, found
    return found


def _screenshot(tools: "DevTools", index: int, path: Path) -> None:
    """A PNG of the cell's output (the panel), for a person to look at."""
    box = json.loads(
        tools.evaluate(
            "(() => { const cell = document.querySelectorAll('.jp-Notebook .jp-CodeCell')[%d];"
            " const out = cell.querySelector('.jp-OutputArea'); out.scrollIntoView({block: 'start'});"
            " const r = out.getBoundingClientRect();"
            " return JSON.stringify({x: r.left, y: r.top, width: r.width, height: r.height}); })()" % index
        )
    )
    box["width"] = min(box["width"], 1280 - box["x"])
    shot = tools.call("Page.captureScreenshot", format="png", clip={**box, "scale": 1}, captureBeyondViewport=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _chromium() -> str | None:
    for candidate in (
        os.environ.get("CHROMIUM_PATH"),
        "/usr/bin/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
    ):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def _missing(what: str) -> None:
    if os.environ.get("AIR_MAGIC_UI_REQUIRED") == "1":
        pytest.fail(f"the UI test needs {what} (AIR_MAGIC_UI_REQUIRED=1)")
    pytest.skip(f"the UI test needs {what}")


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page's websocket."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        ident = self.next_id
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error: {result['exceptionDetails']}")
        return result["result"].get("value")


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
            _missing(f"{app} (pip install -e '.[test]')")
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


@contextlib.contextmanager
def open_chromium(tmp_path: Path) -> Iterator[DevTools]:
    """Headless Chromium (its profile in ``tmp_path``) and a DevTools client on its page."""
    chromium = _chromium()
    if chromium is None:
        _missing("Chromium (apt-get install chromium)")
    profile = tmp_path / "chromium"
    with open(tmp_path / "chromium.log", "wb") as log:
        proc = subprocess.Popen(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("Chromium did not start: " + (tmp_path / "chromium.log").read_text()[-2000:])
            time.sleep(0.1)
        devtools_port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{devtools_port}/json/list", timeout=10) as reply:
            pages = [t for t in json.load(reply) if t.get("type") == "page"]
        from websockets.sync.client import connect

        with connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=20) as ws:
            yield DevTools(ws)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """JupyterLab on 127.0.0.1 with a token; its root, config and state in ``tmp_path``."""
    with serve_jupyter(tmp_path, {"panel.ipynb": NOTEBOOK_CELLS}) as server:
        yield server


@pytest.fixture
def browser(lab: dict[str, Any]) -> Iterator[DevTools]:
    with open_chromium(lab["tmp"]) as tools:
        yield tools


def _poll(tools: DevTools, seen: list[dict[str, Any]], until: Any, timeout: float, what: str) -> dict[str, Any]:
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


def test_panel_updates_live_and_ends_in_success(lab: dict[str, Any], browser: DevTools) -> None:
    tools = browser
    tools.call("Network.enable")
    tools.call("Page.enable")
    tools.call("Emulation.setDeviceMetricsOverride", width=1280, height=1600, deviceScaleFactor=1, mobile=False)
    tools.call("Page.navigate", url=f"{lab['base']}/lab/tree/panel.ipynb?token={lab['token']}")
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
    clicked = tools.evaluate(
        f"(() => {{ const p = document.querySelector('[data-air-magic-launch=\"{launch}\"]');"
        " const b = p.closest('.widget-vbox').querySelector('button'); b.click(); return b.textContent; })()"
    )
    assert "Stop" in clicked
    start = time.monotonic()

    def cancelled(state: dict[str, Any]) -> bool:
        panels = cell(state, 2).get("panels", [])
        return bool(panels) and panels[0]["status"] == "cancelled" and "LaunchCancelledError" in cell(state, 2)["text"]

    _poll(tools, seen, cancelled, 30, "Stop to cancel the blocking launch")
    assert time.monotonic() - start < 20

    # Offline: every request went to the local server.
    urls = [e["params"]["request"]["url"] for e in tools.events if e.get("method") == "Network.requestWillBeSent"]
    foreign = [u for u in urls if not u.startswith((lab["base"], "data:", "blob:", "about:", "ws://127.0.0.1"))]
    assert urls and not foreign, foreign[:10]


def _running_progress(cell: dict[str, Any]) -> list[int]:
    """Rank 0's progress (percent) as a running widget panel shows it, if it shows one."""
    found = []
    for panel in cell.get("panels", []):
        if panel["status"] == "running" and panel["widget"] and panel["rows"]:
            match = re.search(r"(\d+)% \d+/50", panel["rows"][0])
            if match:
                found.append(int(match.group(1)))
    return found
