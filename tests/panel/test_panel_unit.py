"""The panel's parts without a kernel: parsing rank output, bounded state, rendering, modes."""

from __future__ import annotations

import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from harness import wait_until

from air_magic import panel
from air_magic.launcher import RankState
from air_magic.panel import LaunchState, LaunchSummary, LogTail, MetricsReader, Series, chart_svg, parse_tqdm
from air_magic.settings import settings


def fake_launch(tmp_path: Path, n: int = 2, status: str = "running", tracking: bool = True) -> Any:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    ranks = [RankState(r, str(logs / f"rank-{r}.log"), pid=4_000_000 + r) for r in range(n)]
    launch = SimpleNamespace(
        id="0007-abcdef12",
        label="train",
        kind="function",
        world_size=n,
        ranks=ranks,
        work_dir=str(tmp_path),
        log_paths=[r.log_path for r in ranks],
        status=status,
        spec=SimpleNamespace(tracking=tracking),
        placement=SimpleNamespace(device="cpu"),
        run_id=None,
        run_url=None,
        started_at=time.time() - 12.5,
        ended_at=None,
        _outcome=None,
        sources={},
        launcher=SimpleNamespace(is_active=lambda launch: False),
    )
    launch.done = lambda: launch.ended_at is not None

    def exception(timeout: float | None = None) -> BaseException | None:  # as Launch.exception
        if launch._outcome is None:
            raise TimeoutError(f"launch {launch.id} is still running after {timeout} s")
        ok, value = launch._outcome
        return None if ok else value

    launch.exception = exception
    return launch


# -- tqdm and logs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "pct", "n", "total", "desc"),
    [
        ("  0%|          | 0/100 [00:00<?, ?it/s]", 0.0, "0", "100", ""),
        ("train:  45%|####5     | 450/1000 [00:01<00:02, 299.91it/s, loss=0.32]", 45.0, "450", "1000", "train"),
        ("epoch 3: 100%|██████████| 313/313 [00:03<00:00, 95.25batch/s]", 100.0, "313", "313", "epoch 3"),
        (" 45%|████▌     | 4.50k/10.0k [00:01<00:02, 3.00kit/s]", 45.0, "4.50k", "10.0k", ""),
        ("100%|██████████| 3/3 [01:02:03<00:00, 1.23s/it]", 100.0, "3", "3", ""),
        ("epoch 1: 450it [00:01, 299.91it/s]", None, "450it", None, "epoch 1"),
        ("0it [00:00, ?it/s]", None, "0it", None, ""),
    ],
)
def test_tqdm_lines_are_read(line: str, pct: float | None, n: str, total: str | None, desc: str) -> None:
    found = parse_tqdm(line)
    assert found is not None
    assert (found["pct"], found["n"], found["total"], found["desc"]) == (pct, n, total, desc)


@pytest.mark.parametrize("line", ["", "loss 0.3 [ok]", "step 5 [00:01, fast]", "Epoch 3/10 done", "x" * 1000])
def test_ordinary_lines_are_not_progress(line: str) -> None:
    assert parse_tqdm(line) is None


def test_log_tail_reads_progress_and_last_line(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.log"
    bar = "".join(f"\rtrain: {p:3d}%|#         | {p}/100 [00:01<00:02, 50.00it/s]" for p in range(0, 60, 10))
    path.write_text("hello\n\x1b[32mcolored\x1b[0m line\n" + bar)
    tail = LogTail(str(path))
    assert tail.refresh() is True
    assert tail.progress is not None and tail.progress["pct"] == 50.0
    assert tail.last_line == "colored line"
    assert tail.lines[-1].startswith("train:  50%")  # what a terminal shows of the bar's line
    assert tail.refresh() is False  # unchanged file: no read
    with path.open("a") as handle:
        handle.write("\nepoch done\n")
    assert tail.refresh() is True
    assert tail.last_line == "epoch done" and tail.progress["pct"] == 50.0
    # A print while a bar is open lands on the bar's line: the bar is not the "last line".
    with path.open("a") as handle:
        handle.write("\rtrain:  60%|######    | 60/100 [00:01<00:01, 50.00it/s]step 60\n")
    tail.refresh()
    assert tail.last_line == "step 60" and tail.progress["pct"] == 60.0


def test_log_tail_is_bounded_on_a_flood(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.log"
    with path.open("w") as handle:
        handle.write("train: 7%|#  | 7/100 [00:01<00:02, 5.00it/s]\n")
        for i in range(400_000):
            handle.write(f"line {i:06d} {'x' * 20}\n")
    tail = LogTail(str(path))
    start = time.perf_counter()
    tail.refresh()
    took = time.perf_counter() - start
    assert took < 0.2, took
    assert tail.last_line.startswith("line 399999")
    assert len(tail.lines) <= 100 and sum(len(line) + 1 for line in tail.lines) <= 8 * 1024
    assert tail.progress is None  # the bar is far above the tail that was read


def test_series_keeps_at_most_its_limit_and_the_latest_point() -> None:
    series = Series(limit=500)
    for step in range(100_000):
        series.add(step, float(step))
    assert len(series.points) <= 500
    points = series.all()
    assert points[0] == (0, 0.0) and points[-1] == (99_999, 99_999.0)
    steps = [s for s, _ in points[:-1]]
    assert steps == sorted(steps) and len({b - a for a, b in zip(steps, steps[1:])}) == 1  # evenly spaced


def test_metrics_reader_reads_whole_lines_and_skips_a_backlog(tmp_path: Path) -> None:
    path = tmp_path / "tracking-0.tsv"
    path.write_text("m\tloss\t0.5\t1\t100\np\tlr\t0.1\nm\tloss\t0.25\t2\t101\nm\tacc\t0.")
    reader = MetricsReader(str(path))
    assert reader.refresh() is True
    assert reader.latest == {"loss": (2, 0.25)} and reader.max_step == 2
    with path.open("a") as handle:
        handle.write("9\t2\t102\n")
    reader.refresh()
    assert reader.latest["acc"] == (2, 0.9)
    with path.open("a") as handle:  # ~3 MB behind: read only the last MiB
        for step in range(3, 100_000):
            handle.write(f"m\tloss\t{1 / step}\t{step}\t0\n")
    start = time.perf_counter()
    reader.refresh()
    assert time.perf_counter() - start < 0.5
    assert reader.latest["loss"] == (99_999, 1 / 99_999)
    assert len(reader.series["loss"].points) <= 500


# -- rendering ------------------------------------------------------------------------------


def test_chart_is_inline_svg_with_a_line_per_rank() -> None:
    svg = chart_svg("loss", {0: [(s, 1 / (s + 1)) for s in range(1000)], 1: [(s, 2.0) for s in range(10)]})
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert svg.count("<polyline") == 2 and 'data-metric="loss"' in svg
    assert "<script" not in svg and "href" not in svg
    first = svg.split('points="')[1].split('"')[0]
    assert len(first.split()) <= 150  # drawn points are bounded too
    assert chart_svg("x", {0: [(0, float("nan"))]}) == ""
    assert "<polyline" in chart_svg("x", {0: [(0, 1.0), (0, 2.0), (0, 3.0)]})  # no steps: call order


def test_summary_and_status_line(tmp_path: Path) -> None:
    launch = fake_launch(tmp_path)
    Path(launch.ranks[0].log_path).write_text("warming up\r 30%|###  | 3/10 [00:01<00:02, 3.00it/s]")
    Path(launch.ranks[1].log_path).write_text("rank one says hi\n")
    (tmp_path / "tracking-0.tsv").write_text("m\tloss\t0.125\t3\t0\n")
    state = LaunchState(launch)
    state.refresh(tick=0)
    line = panel.text_status(state)
    assert line == "[air_magic] train 0:12 running · r0 30% 3/10 loss=0.125", line
    launch.status, launch.ended_at = "failed", launch.started_at + 12.5
    launch.ranks[1].returncode = 1
    launch._outcome = (False, RuntimeError("boom\nsecond line"))
    summary = LaunchSummary(state)
    assert summary.text.splitlines()[0] == (
        "[air_magic] train on 2 CPU ranks (launch 0007-abcdef12): failed after 12.5 s: RuntimeError: boom"
    )
    assert "  rank 1: failed (exit 1) · 'rank one says hi'" in summary.text
    html = summary._repr_html_()
    assert 'data-air-magic-status="failed"' in html and "<details><summary>rank 1 log" in html
    assert "boom" in html and "<svg" in html  # the chart of rank 0's loss
    printer = SimpleNamespace(out=[], text=lambda s: printer.out.append(s))
    summary._repr_pretty_(printer, False)
    assert printer.out == [summary.text]


def test_lint_findings_are_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from air_magic.lint.diagnostics import Applicability, Diagnostic

    fake = types.ModuleType("air_magic.lint")
    seen: list[str] = []

    def finding(code: str, message: str, line: int) -> Diagnostic:
        return Diagnostic(code, message, "<cell>", None, line, 0, Applicability.DISPLAY_ONLY)

    def lint_cell(source: str) -> list[Diagnostic]:
        seen.append(source)
        return [finding("AM101", "use air_magic instead of serverless_gpu", 2), finding("AM001", "syntax error", 1)]

    fake.lint_cell = lint_cell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "air_magic.lint", fake)
    monkeypatch.setattr("air_magic.lint", fake, raising=False)
    launch = fake_launch(tmp_path)
    launch.sources = {"<cell>": ("Cell In[4]", "%%distributed -n 2\n%time x = 1\nimport serverless_gpu")}
    state = LaunchState(launch)
    state.start_lint()
    state.join_lint(10)
    state.refresh(tick=0)
    assert seen == ["%%distributed -n 2\n%time x = 1\nimport serverless_gpu"]  # the cell as it is
    assert state.lint is not None
    assert state.lint.findings == ["Cell In[4]: AM101 line 2: use air_magic instead of serverless_gpu"]
    assert "lint: 1 finding" in panel._top_html(state)


def test_the_real_linter_is_shown(tmp_path: Path) -> None:
    pytest.importorskip("air_magic.lint")
    from air_magic import lint

    if not hasattr(lint, "lint_cell"):
        pytest.skip("this linter has no lint_cell")
    launch = fake_launch(tmp_path)
    source = "%%distributed -n 2\nfrom serverless_gpu import distributed\nimport time\ntime.sleep(1)"
    launch.sources = {"<cell 9>": ("Cell In[9]", source)}
    state = LaunchState(launch)
    state.start_lint()
    state.join_lint(30)
    assert state.lint is not None and state.lint.findings, state.lint
    assert state.lint.findings[0].startswith("Cell In[9]: AM1"), state.lint.findings
    assert " line 2: " in state.lint.findings[0] and "serverless_gpu" in state.lint.findings[0]


def test_no_linter_no_findings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "air_magic.lint", None)  # an import of it fails
    state = LaunchState(fake_launch(tmp_path))
    state.start_lint()
    state.join_lint(10)
    assert state.lint is not None and state.lint.findings == []


# -- where it shows -----------------------------------------------------------------------------


class FakeShell:
    def __init__(self, kernel: bool = True, panel_setting: bool = True) -> None:
        self.kernel = object() if kernel else None
        self.user_ns: dict[str, Any] = {}
        self.panel_setting = panel_setting  # what %config DistributedMagics.panel set


@pytest.mark.parametrize(
    ("env", "shell", "expected"),
    [
        ({}, None, "text"),  # plain Python
        ({}, FakeShell(kernel=False), "text"),  # terminal IPython
        ({}, FakeShell(), "text"),  # a kernel started by nbclient / jupyter_client
        ({"JPY_SESSION_NAME": "/home/me/train.ipynb"}, FakeShell(), "widget"),  # JupyterLab, Notebook 7
        ({"VSCODE_PID": "1"}, FakeShell(), "widget"),
        ({"JPY_SESSION_NAME": "x.ipynb"}, FakeShell(kernel=False), "text"),
        ({"AIR_MAGIC_PANEL": "widget"}, FakeShell(), "widget"),
        ({"AIR_MAGIC_PANEL": "widget"}, FakeShell(kernel=False), "text"),
        ({"AIR_MAGIC_PANEL": "text", "JPY_SESSION_NAME": "x"}, FakeShell(), "text"),
        ({"AIR_MAGIC_PANEL": "0", "JPY_SESSION_NAME": "x"}, FakeShell(), None),
        ({"AIR_MAGIC_PANEL": "off"}, None, None),
        ({"JPY_SESSION_NAME": "x"}, FakeShell(panel_setting=False), None),
    ],
)
def test_panel_mode(env: dict[str, str], shell: Any, expected: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AIR_MAGIC_PANEL", "JPY_SESSION_NAME", "VSCODE_PID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(settings, "_panel", shell.panel_setting if shell is not None else None)
    assert panel.panel_mode(shell if shell is not None else False) == expected


@pytest.mark.parametrize(
    ("env", "kernel_setting", "wanted", "expected"),
    [
        ({}, False, True, "widget"),  # @distributed(panel=True) in a kernel whose %config turned it off
        ({}, True, False, None),  # @distributed(panel=False)
        ({}, True, None, "widget"),  # the kernel's setting
        ({"AIR_MAGIC_PANEL": "0"}, True, True, None),  # the environment turns it off whatever is asked
        ({"AIR_MAGIC_PANEL": "text"}, True, True, "text"),
    ],
)
def test_a_launchs_own_panel_setting_wins_over_the_kernels(
    env: dict[str, str],
    kernel_setting: bool,
    wanted: bool | None,
    expected: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("AIR_MAGIC_PANEL", "VSCODE_PID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/train.ipynb")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(settings, "_panel", kernel_setting)
    assert panel.panel_mode(FakeShell(), wanted=wanted) == expected


def test_vscode_is_recognised_by_its_notebook_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AIR_MAGIC_PANEL", "JPY_SESSION_NAME", "VSCODE_PID"):
        monkeypatch.delenv(name, raising=False)
    shell = FakeShell()
    shell.user_ns["__vsc_ipynb_file__"] = "/w/train.ipynb"
    assert panel.panel_mode(shell) == "widget"


def test_importing_the_panel_imports_no_widgets() -> None:
    code = "import sys, air_magic.launcher, air_magic.panel; print('ipywidgets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- device numbers ---------------------------------------------------------------------------


def test_cpu_usage_of_a_process_and_its_children(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(30)']); t = time.time()\nwhile time.time() - t < 30: pass",
        ],
    )
    try:
        psutil = __import__("psutil")
        assert wait_until(lambda: psutil.Process(proc.pid).children(), 10)
        sampler = panel.UsageSampler("cpu")
        rank = RankState(0, "", pid=proc.pid)
        sampler.sample([rank])
        time.sleep(0.5)
        sampler.sample([rank])
        text = sampler.text[0]
        cpu = float(text.split("%")[0].split()[-1])
        assert text.startswith("CPU ") and cpu > 20, text
        assert len(sampler.family[0]) == 2  # the rank and its child
    finally:
        for child in __import__("psutil").Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()


def test_gpu_numbers_come_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML's answers for two GPUs; each rank is found on its device by its pid."""
    nv = types.ModuleType("pynvml")
    calls: list[str] = []

    class NVMLError(Exception):
        pass

    devices = {
        0: {"util": 91, "used": 30e9, "total": 80e9, "procs": [SimpleNamespace(pid=1000, usedGpuMemory=12e9)]},
        1: {"util": 45, "used": 20e9, "total": 80e9, "procs": [SimpleNamespace(pid=2001, usedGpuMemory=5e9)]},
    }
    nv.NVMLError = NVMLError  # type: ignore[attr-defined]
    nv.nvmlInit = lambda: calls.append("init")  # type: ignore[attr-defined]
    nv.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    nv.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=devices[h]["util"])  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=devices[h]["used"], total=devices[h]["total"])  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: devices[h]["procs"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = panel.NvmlDevices()
    # rank 1's memory is held by its child (a DataLoader worker, pid 2001)
    found = gpus.sample({0: [1000], 1: [2000, 2001], 2: [3000]})
    assert found[0] == (0, 91, 12e9, 80e9)
    assert found[1] == (1, 45, 5e9, 80e9)
    assert found[2] == (None, None, None, None)  # not on any GPU, no device 2
    gpus.close()
    assert calls == ["init", "shutdown"]
