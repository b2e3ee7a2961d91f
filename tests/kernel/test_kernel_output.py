"""What a ``%%distributed`` cell shows: rank 0 streams live, every rank logs, output is bounded."""

from __future__ import annotations

import re
import time
from typing import Any, Iterator

import pytest
from harness import Kernel, user_lines

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def k(kernel_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    # A log folder of its own: the last launch's logs are its newest folder there.
    logs = tmp_path_factory.mktemp("output-logs") / "logs"
    kernel = kernel_factory(extra_env={"AIR_MAGIC_LOG_DIR": str(logs)})
    kernel.ok(
        "def _last_log(rank):\n"
        "    import os, re\n"
        "    from air_magic.settings import settings\n"
        "    d = settings.log_dir\n"
        "    last = sorted(n for n in os.listdir(d) if re.match(r'\\d{8}-\\d{6}-\\d{4}-', n))[-1]\n"
        "    with open(os.path.join(d, last, f'rank-{rank}.log')) as f:\n"
        "        return f.read()\n"
    )
    yield kernel
    kernel.shutdown()


def test_rank_zero_prints_stream_into_the_cell_in_order(k: Kernel) -> None:
    res = k.run(
        "%%distributed -n 2\n"
        "import os, time\n"
        'rank = int(os.environ["RANK"])\n'
        "for i in range(20):\n"
        '    print(f"rank{rank} step {i}", flush=True)\n'
        "    time.sleep(0.01)\n"
        "rank"
    )
    assert res.error is None, res.error_text
    assert res.result == "[0, 1]"
    assert user_lines(res.stdout) == [f"rank0 step {i}" for i in range(20)]
    assert all(name == "stdout" for name, text in res.streams if "step" in text)
    assert "rank1" not in res.stdout and "rank1" not in res.stderr
    # rank 1 printed just as much: into its log file
    log = k.value("_last_log(1)")
    assert log.splitlines() == [f"rank1 step {i}" for i in range(20)]


def _as_shown(stream: str) -> list[str]:
    """The lines a notebook shows of a stream: a ``\r`` takes the line back to its start."""
    return [([part for part in line.split("\r") if part] or [""])[-1] for line in stream.split("\n")][:-1]


def test_a_print_inside_a_progress_bar_s_loop_keeps_a_line_of_its_own(k: Kernel) -> None:
    """tqdm on rank 0's stdout with a print at each step: the prints on lines of their own and
    the bar one line, at its last state (a terminal would show a snapshot of the bar per print)."""
    res = k.run(
        "%%distributed -n 2\n"
        "import sys, time\n"
        "from tqdm import tqdm\n"
        "for step in tqdm(range(4), desc='steps', file=sys.stdout, mininterval=0):\n"
        "    print('loss', step, flush=True)\n"
        "    time.sleep(0.05)\n"
        "print('done')\n"
    )
    assert res.error is None, res.error_text
    shown = [line for line in _as_shown(res.stdout) if not line.startswith("[air_magic]")]
    assert shown[:4] == ["loss 0", "loss 1", "loss 2", "loss 3"]
    [bar] = [line for line in shown if line.startswith("steps")]
    assert "100%" in bar and "4/4" in bar
    assert shown[-1] == "done"
    # the log as it is kept: the same lines
    log = [line for line in k.value("_last_log(0)").splitlines() if line]
    assert log[:4] == ["loss 0", "loss 1", "loss 2", "loss 3"] and log[-1] == "done"


def test_output_arrives_while_the_cell_is_still_running(k: Kernel) -> None:
    msg_id = k.execute(
        '%%distributed -n 2\nimport time\nprint("first", flush=True)\ntime.sleep(1.5)\nprint("second", flush=True)\n'
    )
    start = time.monotonic()
    early = k.collect(msg_id, timeout=30, until=lambda r: "first" in r.stdout)
    assert "second" not in early.stdout
    rest = k.collect(msg_id, timeout=30)
    assert rest.error is None, rest.error_text
    assert "second" in rest.stdout
    assert time.monotonic() - start >= 1.0  # "first" came well before the end


def test_async_launch_handle_and_rank_one_log(k: Kernel) -> None:
    res = k.run(
        "%%distributed -n 2 --async\n"
        "import os\n"
        "print(f\"hello from rank {os.environ['RANK']}\")\n"
        'int(os.environ["RANK"])'
    )
    assert res.error is None, res.error_text
    # The handle shows as its panel (its first line, above): no `Out[n]: <Launch ... starting>`
    # under it; the value is kept in Out[n] all the same.
    assert res.result is None
    n = res.reply["execution_count"]
    summary = k.value(
        f"handle = Out[{n}]\n"
        "values = handle.result(timeout=60)\n"
        "(values, handle.done(), handle.status, len(handle.log_paths),\n"
        " open(handle.log_paths[0]).read(), open(handle.log_paths[1]).read())"
    )
    assert summary == ([0, 1], True, "finished", 2, "hello from rank 0\n", "hello from rank 1\n")


def test_failure_traceback_is_shown_once_not_in_the_stream(k: Kernel) -> None:
    res = k.run(
        "%%distributed -n 2\n"
        "import os\n"
        'print("before the failure", flush=True)\n'
        'if os.environ["RANK"] == "0":\n'
        '    raise RuntimeError("rank zero broke")\n'
    )
    assert res.error is not None and res.error["ename"] == "RuntimeError"
    assert user_lines(res.stdout) == ["before the failure"]
    for stream in (res.stdout, res.stderr):
        assert "Traceback" not in stream
        assert "rank zero broke" not in stream
        assert "this rank failed" not in stream
    assert res.error_text.count("Traceback (most recent call last)") == 1
    assert 'raise RuntimeError("rank zero broke")' in res.error_text
    # the log keeps everything, the traceback included
    log = k.value("_last_log(0)")
    assert log.startswith("before the failure\n")
    assert "RuntimeError: rank zero broke" in log


def test_output_is_bounded(kernel_factory: Any) -> None:
    limit = 20_000
    big = kernel_factory(load=False)
    try:
        # read when air_magic.kernel.launcher is imported: set before %load_ext
        big.ok(f'import os\nos.environ["AIR_MAGIC_OUTPUT_LIMIT"] = "{limit}"')
        big.ok("%load_ext air_magic")
        big.ok("%config DistributedMagics.tracking = False")
        start = time.monotonic()
        res = big.run(
            "%%distributed -n 2\n"
            "import os\n"
            'if os.environ["RANK"] == "0":\n'
            "    for i in range(200_000):\n"
            '        print(f"line {i:06d}")\n'
            '"done"',
            timeout=120,
        )
        elapsed = time.monotonic() - start
        assert res.error is None, res.error_text
        assert res.result == "['done', 'done']"
        shown = [line for line in user_lines(res.stdout) if line]
        assert shown[:3] == ["line 000000", "line 000001", "line 000002"]
        assert sum(len(line) + 1 for line in shown) <= limit
        assert len(res.stdout) < limit + 1000
        notice = re.search(
            r"\[air_magic\] rank 0 printed more than 19 KiB; the rest is not shown here\. Full log: (\S+)",
            res.stdout,
        )
        assert notice is not None, res.stdout[-500:]
        assert elapsed < 60, elapsed
        # the full output is in the log
        log_lines = big.value(f"sum(1 for _ in open({notice.group(1)!r}))")
        assert log_lines == 200_000
    finally:
        big.shutdown()
