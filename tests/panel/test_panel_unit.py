"""The panel's parts without a kernel: parsing rank output, bounded state, rendering, modes."""

from __future__ import annotations

import html as html_lib
import re
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
from air_magic.kernel.launcher import RankState
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
    # each rank, then the overall part (rank 0's bar is the only one: it is the slowest)
    assert line == "[air_magic] train 0:12 running · r0 30% 3/10 loss=0.125 · slowest bar 30% eta 00:02 3 it/s", line
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
    code = "import sys, air_magic.kernel.launcher, air_magic.panel; print('ipywidgets' in sys.modules)"
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


# -- stopped rows, the overall line, the MLflow run, the linter's advice, the charts ------------


def _bar(pct: int, total: int = 100, rate: str = "5.00it/s", eta: str = "00:10") -> str:
    return f"\rtrain: {pct:3d}%|##        | {pct * total // 100}/{total} [00:05<{eta}, {rate}]"


def test_a_stopped_or_failed_rank_shows_no_eta(tmp_path: Path) -> None:
    launch = fake_launch(tmp_path, n=3)
    for rank in range(3):
        Path(launch.ranks[rank].log_path).write_text(_bar(40))
    state = LaunchState(launch)
    state.refresh(tick=0)
    assert all("eta 00:10" in row for row in _rows(panel._top_html(state)))  # running: an eta
    launch.status, launch.ended_at = "cancelled", launch.started_at + 12.5
    launch.ranks[0].returncode, launch.ranks[0].stopped = -15, True
    launch.ranks[1].returncode = 1  # failed before the stop
    launch.ranks[2].returncode = None  # its exit code never came: the launch is over all the same
    launch.status = "failed"
    rows = _rows(panel._top_html(state))
    assert [state.rank_state(r) for r in range(3)] == ["stopped", "failed", "stopped"]
    assert all("eta" not in row for row in rows), rows
    assert all("40% 40/100" in row for row in rows), rows  # where each got to stays
    assert "stopped" in rows[0] and "failed (exit 1)" in rows[1] and "stopped" in rows[2]
    summary = LaunchSummary(state).text
    assert "eta" not in summary and "rank 1: failed (exit 1) · train · 40% 40/100" in summary, summary
    assert "data-air-magic-overall" not in panel._top_html(state)  # the overall line only while running


def _rows(html: str) -> list[str]:
    return [row.split("</tr>")[0] for row in html.split("<tr data-rank=")[1:]]


def test_the_overall_line_is_the_slowest_ranks_with_the_rates_summed(tmp_path: Path) -> None:
    launch = fake_launch(tmp_path, n=4)
    for rank, pct in enumerate((76, 75, 40, 74)):
        Path(launch.ranks[rank].log_path).write_text(_bar(pct, eta=f"00:{100 - pct:02d}"))
    state = LaunchState(launch)
    state.refresh(tick=0)
    overall = state.overall()
    assert overall is not None
    assert (overall.slowest, round(overall.fraction, 2), overall.eta) == (2, 0.4, "00:60")
    assert overall.throughput == "20 it/s"  # 4 ranks at 5 it/s
    assert overall.behind == "rank 2 is behind: 40% while the others are at 75%"
    top = panel._top_html(state)
    assert top.index("data-air-magic-overall") < top.index("<table")  # at the top
    # Labelled by what it measures: the slowest rank's current bar (its description), not the run.
    assert "slowest bar train:</span> 40% 40/100 (rank 2) · this bar's eta 00:60 · " in top, top
    assert "20 it/s in all" in top
    assert "rank 2 is behind" in top and "data-air-magic-behind" in top
    line = panel.text_status(state)
    assert line.startswith("[air_magic] train 0:12 running · r0 train 76% 76/100 · r1 train 75% 75/100 · "), line
    assert line.endswith(
        " · slowest train: 40% eta 00:60 20 it/s (rank 2 is behind: 40% while the others are at 75%)"
    ), line


def test_the_overall_part_of_a_text_line_is_never_cut(tmp_path: Path) -> None:
    launch = fake_launch(tmp_path, n=8)
    for rank in range(8):
        pct = 20 if rank == 7 else 80
        Path(launch.ranks[rank].log_path).write_text(("d" * 60) + ": " + _bar(pct).lstrip("\r"))
    state = LaunchState(launch)
    state.refresh(tick=0)
    line = panel.text_status(state)
    assert len(line) <= 220 and line.endswith("(rank 7 is behind: 20% while the others are at 80%)"), line


def test_a_single_rank_has_no_overall_line(tmp_path: Path) -> None:
    launch = fake_launch(tmp_path, n=1)
    Path(launch.ranks[0].log_path).write_text(_bar(40))
    state = LaunchState(launch)
    state.refresh(tick=0)
    assert state.overall() is None and "data-air-magic-overall" not in panel._top_html(state)


@pytest.mark.parametrize(
    ("pcts", "total", "behind"),
    [
        ((50, 45, 52, 48), 100, False),  # a few percent apart: noise
        ((50, 41, 50, 50), 100, False),  # 9 % behind: under the 10 % mark
        ((50, 40, 50, 50), 100, True),  # 10 % and 10 items behind
        ((60, 50, 60), 10, False),  # 10 % but 1 item of a 10-item loop: not clear enough
        ((70, 50, 70), 10, True),  # 2 items and 20 %
        ((5, 100), 100, False),  # the slowest is the only rank left with a running bar
    ],
)
def test_a_straggler_is_called_out_only_when_clearly_behind(
    tmp_path: Path, pcts: tuple[int, ...], total: int, behind: bool
) -> None:
    launch = fake_launch(tmp_path, n=len(pcts))
    for rank, pct in enumerate(pcts):
        Path(launch.ranks[rank].log_path).write_text(_bar(pct, total=total))
        if pct == 100:
            launch.ranks[rank].returncode = 0  # finished: no longer counted
    state = LaunchState(launch)
    state.refresh(tick=0)
    overall = state.overall()
    assert overall is not None
    assert bool(overall.behind) is behind, overall


def test_the_overall_line_without_bars_or_with_unlike_rates(tmp_path: Path) -> None:
    launch = fake_launch(tmp_path, n=2)
    state = LaunchState(launch)
    state.refresh(tick=0)
    assert state.overall() is None and "data-air-magic-overall" not in panel._top_html(state)
    Path(launch.ranks[0].log_path).write_text(_bar(30, rate="2.00s/it"))
    Path(launch.ranks[1].log_path).write_text(_bar(20, rate="3.00kB/s"))
    state.refresh(tick=1)
    overall = state.overall()
    assert overall is not None and overall.slowest == 1 and overall.throughput == ""  # it and B: not added up
    launch.ranks[1].returncode = 0
    overall = state.overall()
    assert overall is not None and overall.slowest == 0 and overall.throughput == "0.5 it/s"


def test_the_mlflow_run_is_shown_with_its_link_or_its_command(tmp_path: Path) -> None:
    launch = fake_launch(tmp_path)
    del launch.run_id, launch.run_url  # an older launch object: no run attributes at all
    state = LaunchState(launch)
    assert "MLflow" not in panel._top_html(state) and "MLflow" not in LaunchSummary(state).text
    launch.run_id, launch.run_name = "0123456789abcdef0123", "train-0007"
    launch.run_url = "http://127.0.0.1:5000/#/experiments/1/runs/0123456789abcdef0123"
    launch.run_command = "mlflow ui --backend-store-uri /tmp/mlruns"
    top = panel._top_html(state)
    assert f'<a href="{launch.run_url}" target="_blank" rel="noopener">train-0007' in top
    assert "0123456789ab" in top and "data-air-magic-run-command" not in top  # a link: no command
    assert "MLflow run train-0007 (0123456789abcdef0123): http://127.0.0.1:5000/" in LaunchSummary(state).text
    launch.run_url = None
    top = panel._top_html(state)
    assert "<a " not in top and "train-0007" in top
    command = top.split("data-air-magic-run-command")[1]
    code = command.split("<code")[1].split("</code>")[0]
    assert "user-select:all" in code and "white-space:pre" in code and "<a" not in code
    assert code.endswith(">mlflow ui --backend-store-uri /tmp/mlruns")
    assert "open it with: mlflow ui --backend-store-uri /tmp/mlruns" in LaunchSummary(state).text


def _lint_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, findings: list[Any]) -> LaunchState:
    fake = types.ModuleType("air_magic.lint")
    fake.lint_cell = lambda source: findings  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "air_magic.lint", fake)
    monkeypatch.setattr("air_magic.lint", fake, raising=False)
    launch = fake_launch(tmp_path)
    launch.sources = {"<cell>": ("Cell In[5]", f"# {len(findings)} {id(findings)}\nimport os")}  # not cached
    state = LaunchState(launch)
    state.start_lint()
    state.join_lint(10)
    return state


def _diagnostic(code: str, applicability: Any, fixed: bool) -> Any:
    from air_magic.lint.diagnostics import Diagnostic, Edit, Fix
    from air_magic.lint.rules import rule

    fix = Fix(applicability, (Edit(0, 1, ""),)) if fixed else None
    r = rule(code)
    return Diagnostic(code, r.message, "<cell>", None, 3, 0, applicability, r.fix_title, fix=fix)


def test_lint_advice_is_per_finding_and_the_fix_command_only_when_it_fixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from air_magic.lint.rules import Applicability, rule

    # AM305 (a hard-coded rendezvous) shown without its rewrite: --fix cannot fix it.
    unfixable = _diagnostic("AM305", Applicability.DISPLAY_ONLY, fixed=False)
    html = panel._lint_html(_lint_state(tmp_path, monkeypatch, [unfixable]))
    assert "AM305" in html and "air-magic lint --fix" not in html, html
    assert panel._format._esc(rule("AM305").fix_title) in html  # its own hint
    assert "fixed by hand" in html

    # Its unsafe rewrite: the command with --unsafe-fixes, and a warning.
    unsafe = _diagnostic("AM305", Applicability.UNSAFE, fixed=True)
    html = panel._lint_html(_lint_state(tmp_path, monkeypatch, [unsafe]))
    assert "<code>air-magic lint --fix --unsafe-fixes</code> fixes it" in html
    assert "<code>air-magic lint --fix</code>" not in html

    # A safe fix with a finding to fix by hand: the plain command, for that one.
    safe = _diagnostic("AM101", Applicability.SAFE, fixed=True)
    state = _lint_state(tmp_path, monkeypatch, [safe, unfixable])
    html = panel._lint_html(state)
    assert "<code>air-magic lint --fix</code> fixes 1 of them" in html and "the other by hand" in html
    assert html.count("[fixable: --fix]") == 1
    assert state.lint is not None and [item.fix for item in state.lint.items] == ["safe", ""]
    assert all(item.hint for item in state.lint.items)


_TEXT = re.compile(r"<text ([^>]*)>([^<]*)")


def _labels(svg: str) -> list[tuple[float, str, str, float]]:
    """Each text of an SVG: (x, anchor, text, font size)."""
    found = []
    for attrs, text in _TEXT.findall(svg):
        fields = dict(re.findall(r'([\w-]+)="([^"]*)"', attrs))
        text = html_lib.unescape(text)
        found.append((float(fields["x"]), fields.get("text-anchor", "start"), text, float(fields["font-size"])))
    return found


@pytest.mark.parametrize(
    "series",
    [
        {0: [(0, 0.004122), (120, 0.08244)], 1: [(0, 0.004122), (120, 0.08244)]},
        {0: [(s, -123456.789 + s) for s in range(50)]},
        {0: [(s, 1e-7 * s) for s in range(1000)], 3: [(s, 2.5e6) for s in range(10)]},
    ],
)
def test_chart_labels_lie_inside_the_svg(series: dict[int, list[tuple[float, float]]]) -> None:
    svg = chart_svg("a_rather_long_metric_name/validation/loss", series)
    width = float(re.search(r'viewBox="0 0 (\d+) \d+"', svg)[1])  # type: ignore[index]
    labels = _labels(svg)
    assert len(labels) == 5
    for x, anchor, text, size in labels:
        estimate = len(text) * size * 0.6  # a digit is about 0.55 em in the usual UI fonts
        start = x - estimate if anchor == "end" else x
        assert start >= 0 and start + estimate <= width, (text, x, anchor)
    low = min(y for points in series.values() for _, y in points)
    assert panel._fmt_value(low) in [text for _, _, text, _ in labels]  # every character of it


def test_overlapping_series_are_drawn_distinguishably() -> None:
    same = [(float(s), 0.5) for s in range(10)]
    svg = chart_svg("loss", {0: same, 1: list(same)})
    lines = re.findall(r"<polyline ([^>]*)/>", svg)
    assert len(lines) == 2
    styles = [dict(re.findall(r'([\w-]+)="([^"]*)"', line)) for line in lines]
    assert styles[0]["points"] == styles[1]["points"]  # the same line ...
    assert styles[0]["stroke"] != styles[1]["stroke"]
    # ... drawn twice so that both show: another dash pattern, the later one thinner
    assert styles[0].get("stroke-dasharray", "") != styles[1].get("stroke-dasharray", "")
    assert float(styles[0]["stroke-width"]) > float(styles[1]["stroke-width"])
    markers = re.findall(r'<(\w+) class="marker" data-rank="(\d)"', svg)
    assert {rank for _, rank in markers} == {"0", "1"} and markers[0][0] != markers[1][0]  # other shapes


def test_chart_captions_and_legend_name_the_ranks(tmp_path: Path) -> None:
    series = {0: [(0.0, 0.5), (120.0, 0.08244)], 1: [(0.0, 0.5), (120.0, 0.08244)]}
    assert panel._svg.chart_caption("loss", series) == "loss — rank 0: 0.08244, rank 1: 0.08244 (step 120)"
    many = {r: [(float(s), 1.0 + r) for s in range(5)] for r in range(8)}
    assert panel._svg.chart_caption("loss", many) == "loss — 1 (rank 0) to 8 (rank 7), 8 ranks (step 4)"
    launch = fake_launch(tmp_path)
    (tmp_path / "tracking-0.tsv").write_text("m\tloss\t0.125\t3\t0\n")
    (tmp_path / "tracking-1.tsv").write_text("m\tloss\t0.125\t3\t0\n")
    state = LaunchState(launch)
    state.refresh(tick=0)
    chart = panel._chart_html(state)
    assert "<figcaption" in chart and "loss — rank 0: 0.125, rank 1: 0.125 (step 3)" in chart
    assert 'data-air-magic-legend="0"' in chart and 'data-air-magic-legend="1"' in chart
    assert "last " not in chart  # the old caption is gone


def test_a_rank_a_timeout_ended_reads_as_a_timeout_not_a_signal_number() -> None:
    from air_magic.panel._render import _exit_note
    from air_magic.protocol import FINAL_STACK_SIGNAL

    assert _exit_note(-FINAL_STACK_SIGNAL) == " (timeout)"
    assert _exit_note(-9) == " (exit -9)"
    assert _exit_note(0) == _exit_note(None) == ""


def test_one_chart_model_for_the_panel_the_summary_and_the_extension(tmp_path: Path) -> None:
    from air_magic.panel._svg import _text_width, chart_model, chart_svg

    # Logged without step= (the documentation's total_loss): every point at step 0.
    series = {0: [(0.0, 1.808e-6), (0.0, 2.5e-6), (0.0, 1.1e-6)], 1: [(0.0, 3.0e-6), (0.0, 2.0e-6), (0.0, 1.5e-6)]}
    model = chart_model("total_loss", series)
    assert model is not None
    assert model["by_index"] is True and model["labels"]["x_right"] == "call 2"  # by the order of the calls
    assert model["title"] == "total_loss"
    xs = sorted({x for points in model["lines"].values() for x, _ in points})
    assert len(xs) == 3 and xs[0] == model["plot"]["left"]  # spread across the plot, not one vertical line
    # The left margin holds the longest y label whole (the extension once cut 1.808e-6 to ..808e-6).
    longest = max(_text_width(model["labels"]["y_top"]), _text_width(model["labels"]["y_bottom"]))
    assert model["plot"]["left"] - 4 >= longest
    svg = chart_svg("total_loss", series)
    assert ">total_loss</text>" in svg and ">call 2</text>" in svg
    for points in model["lines"].values():  # the SVG draws the model's own points
        assert " ".join(f"{x:.1f},{y:.1f}" for x, y in points) in svg
    # With steps: drawn against them.
    stepped = chart_model("loss", {0: [(1.0, 0.5), (2.0, 0.25)]})
    assert stepped is not None and stepped["by_index"] is False and stepped["labels"]["x_right"] == "step 2"


def test_the_summary_data_carries_the_chart_model(tmp_path: Path) -> None:
    from air_magic.panel._mime import summary_data
    from air_magic.panel._svg import chart_model
    from air_magic.protocol import metric_line, spool_file

    launch = fake_launch(tmp_path, n=2)
    for rank in range(2):
        with open(spool_file(launch.work_dir, rank), "w") as handle:
            handle.write("".join(metric_line("loss", 1.0 / (step + 1) + rank, step, 0) for step in range(5)))
    state = LaunchState(launch)
    state.refresh(tick=0, final=True)
    data = summary_data(state)
    assert set(data["chart_models"]) == set(data["charts"]) == {"loss"}
    for key, model in data["chart_models"].items():
        assert model == chart_model(key, state.chart_series()[key])


def test_a_rank_paused_in_its_debugger_reads_paused_with_where_not_running(tmp_path: Path) -> None:
    from air_magic.panel._render import _table_html
    from air_magic.panel._state import rank_state
    from air_magic.protocol.debugging import paused_path

    launch = fake_launch(tmp_path)  # (its ranks have pids and no exit code: running)
    Path(paused_path(str(tmp_path), 1)).write_text("Cell In[3], line 4")
    assert [rank_state(launch, r) for r in (0, 1)] == ["running", "paused"]
    table = _table_html(LaunchState(launch))
    assert 'data-rank="1" data-state="paused"' in table and "‖ paused" in table
    assert "in pdb at Cell In[3], line 4" in table
    Path(paused_path(str(tmp_path), 1)).unlink()  # it runs again
    assert rank_state(launch, 1) == "running"
