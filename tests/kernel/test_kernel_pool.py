"""A pool of ranks that stays across cells, in a real kernel: ``%%distributed --pool``,
``%distributed_pool`` and ``air_magic.Pool``.  State, the process group, output, errors,
Ctrl-C, faults (a killed rank, one rank failing while the other waits in a collective),
the timeout, and the kernel's end taking the pool along."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any, Iterator

import psutil
import pytest
from harness import (
    Kernel,
    gone,
    helper_processes,
    kernel_with_a_pool,
    pool_pids,
    the_pool_stays,
    user_lines,
    values,
    wait_until,
)

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def k(kernel_factory: Any) -> Iterator[Kernel]:
    yield from kernel_with_a_pool(kernel_factory, "%load_ext air_magic")


@pytest.fixture(autouse=True)
def the_pool_may_stay(k: Kernel) -> Iterator[None]:
    """The module's pool outlives each test (its ranks are not leftovers); nothing else may."""
    yield from the_pool_stays(k)


def test_names_a_cell_assigns_stay_on_the_ranks_for_the_next_cell(k: Kernel) -> None:
    k.ok("%%distributed --pool\nimport os\nmine = int(os.environ['RANK']) * 10")
    assert values(k.run("%%distributed --pool\nmine + 1")) == [1, 11]


def test_the_process_group_stays_and_pasted_init_and_destroy_leave_it_alive(k: Kernel) -> None:
    cell = (
        "%%distributed --pool\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group()  # as a script does: a no-op on a pool\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "dist.destroy_process_group()  # leaves the pool's group alive\n"
        "t.item()"
    )
    assert values(k.run(cell)) == [3.0, 3.0]
    assert values(k.run("%%distributed --pool\n(dist.is_initialized(), dist.get_world_size())")) == [
        (True, 2),
        (True, 2),
    ]


def test_a_notebook_name_the_ranks_lack_is_sent_and_a_rank_name_wins_said_once(k: Kernel) -> None:
    k.ok("from_kernel = 7\nshadow = 'kernel'")
    assert values(k.run("%%distributed --pool\nfrom_kernel * 2")) == [14, 14]
    k.ok("%%distributed --pool\nshadow = 'rank'")
    first = k.run("%%distributed --pool\nshadow")
    assert values(first) == ["rank", "rank"]
    said = [line for line in first.stderr.splitlines() if "shadow" in line]
    assert said == [
        "[air_magic] shadow: the pool's ranks have their own (a pool cell or pool.push set it), so the "
        "notebook's shadow is not sent; pool.push(shadow=...) sends it."
    ]
    again = k.run("%%distributed --pool\nshadow")
    assert values(again) == ["rank", "rank"] and "shadow" not in again.stderr


def test_a_notebook_value_changed_since_the_last_cell_reaches_the_ranks(k: Kernel) -> None:
    k.ok("learning_rate = 0.1")
    assert values(k.run("%%distributed --pool\nlearning_rate")) == [0.1, 0.1]
    k.ok("learning_rate = 0.2")  # a captured name, not one the ranks assigned: sent again
    res = k.run("%%distributed --pool\nlearning_rate")
    assert values(res) == [0.2, 0.2] and "learning_rate" not in res.stderr


def test_push_and_pull_set_and_read_every_rank_s_names(k: Kernel) -> None:
    k.ok("import air_magic\npool = air_magic.Pool.current()\npool.push(pushed=[1, 2])")
    assert values(k.run("%%distributed --pool\npushed + [3]")) == [[1, 2, 3], [1, 2, 3]]
    k.ok("%%distributed --pool\nimport os\npulled = os.environ['RANK']")
    assert k.value("pool.pull('pulled')") == ["0", "1"]
    assert k.value("pool.run(lambda: 5)") == [5, 5]


def test_script_arguments_after_the_double_dash_are_each_cell_s_own(k: Kernel) -> None:
    cell = (
        "%%distributed --pool{}\n"
        "import argparse, sys\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--epochs', type=int, default=2)\n"
        "(parser.parse_args().epochs, sys.argv[0].startswith('Cell In['))"
    )
    assert values(k.run(cell.format(" -- --epochs 5"))) == [(5, True), (5, True)]
    assert values(k.run(cell.format(""))) == [(2, True), (2, True)]


def test_rank_zero_s_output_streams_into_the_cell(k: Kernel) -> None:
    res = k.run("%%distributed --pool\nimport os\nprint('hello from', os.environ['RANK'])")
    assert res.error is None, res.error_text
    assert "hello from 0" in res.stdout and "hello from 1" not in res.stdout


def test_a_rank_s_exception_is_raised_with_its_type_and_the_pool_stays(k: Kernel) -> None:
    k.ok("%%distributed --pool\nkept = 'still here'")
    res = k.run("%%distributed --pool\nimport os\nraise ValueError('bad value on ' + os.environ['RANK'])")
    assert res.error is not None and res.error["ename"] == "ValueError"
    assert res.error["evalue"] == "bad value on 0"
    assert "Cell In[" in res.error_text and "raise ValueError" in res.error_text
    assert values(k.run("%%distributed --pool\nkept")) == ["still here", "still here"]


def test_a_different_n_names_the_pool_and_how_to_stop_it(k: Kernel) -> None:
    res = k.run("%%distributed --pool -n 3\n1")
    assert res.stderr.strip() == (
        "UsageError: %%distributed --pool -n 3: the kernel's pool has 2 ranks (and their state). Leave out -n to "
        "use it, or stop it first with %distributed_pool --stop (its state is lost) and start a new one."
    )
    assert res.result is None


def pool_status(k: Kernel) -> dict[str, str]:
    """What ``%distributed_pool`` displays: its one display, as text and as HTML."""
    res = k.ok("%distributed_pool")
    [(kind, data, _)] = res.displays
    assert kind == "display_data" and res.stdout == ""
    return data


def test_the_line_magic_shows_the_pool(k: Kernel) -> None:
    shown = pool_status(k)
    text = shown["text/plain"]
    [line] = [x for x in text.splitlines() if x.startswith("[air_magic] pool of")]
    assert line.startswith("[air_magic] pool of 2 CPU ranks: idle, ")
    assert "memory per rank: " in line and line.count(" MB") == 2  # the panel's units
    ranks = [x.strip() for x in text.splitlines() if x.startswith("  rank ")]
    assert [x.split(",")[0] for x in ranks] == ["rank 0: idle", "rank 1: idle"]
    # The same status as Pool.current() draws, in a notebook and in a terminal (one model)
    # (up to the pool's age, which may tick between the two cells)
    assert text.split(", up ")[0] == k.value("repr(air_magic.Pool.current())").split(", up ")[0]
    markup = shown["text/html"]
    assert markup.split("up ")[0] == k.value("air_magic.Pool.current()._repr_html_()").split("up ")[0]
    assert "<b>[air_magic] pool of 2 CPU ranks</b>" in markup and "● idle</span>" in markup
    assert ">running<" not in markup  # no column that would be empty: no rank runs a call


def test_the_pool_s_status_names_the_call_a_rank_still_runs(k: Kernel) -> None:
    k.ok(
        "import os, time, air_magic\ndef rank_one_sleeps():\n    if os.environ['RANK'] == '1':\n        time.sleep(4)\n\n"
        "call = air_magic.Pool.current().submit(rank_one_sleeps)\ntime.sleep(1.5)"
    )
    shown = pool_status(k)
    ranks = [x.strip() for x in shown["text/plain"].splitlines() if x.startswith("  rank ")]
    # rank 0 came back from the call: "done" (issue 33, item 10: not "idle" while the call still runs)
    assert [x.split(",")[0] for x in ranks] == ["rank 0: done", "rank 1: running rank_one_sleeps"]
    assert ">running</th>" in shown["text/html"] and ">rank_one_sleeps</td>" in shown["text/html"]
    assert "✔ done</span>" in shown["text/html"] and "● running</span>" in shown["text/html"]
    k.ok("call.result(timeout=30)")
    html = k.value("air_magic.Pool.current()._repr_html_()")
    assert ">state</th>" in html and html.count("● idle</span>") == 3  # the pool's, and each rank's


LONG_CELL = """\
%%distributed --pool
import os, sys, time
from tqdm import tqdm
for step in tqdm(range(6), desc="steps", file=sys.stdout, mininterval=0):
    time.sleep(0.5 if os.environ["RANK"] == "0" else 0.7)
print("rank", os.environ["RANK"], "trained", flush=True)
"""


EARLY_PRINT = """\
%%distributed --pool
import time
print("at once", flush=True)
time.sleep(1.6)
print("later", flush=True)
"""


def test_a_pool_cell_s_panel_is_above_what_it_prints_even_in_its_first_second(k: Kernel) -> None:
    for _ in range(2):  # the first pool cell of the pool and the next alike
        res = k.ok(EARLY_PRINT, timeout=60)
        assert user_lines(res.stdout) == ["at once", "later"]
        first_print = next(i for i, text in enumerate(res.streams) if "at once" in text[1])
        stream_places = [i for i, where in enumerate(res.order) if where in ("stdout", "stderr")]
        # the panel's place comes before the stream message that holds the first print
        assert res.order.index("display_data") < stream_places[first_print], res.order
    quick = k.ok('%%distributed --pool\nprint("quick")')
    assert quick.displays == [] and user_lines(quick.stdout) == ["quick"]  # held until the end, not lost


def test_a_pool_cell_that_runs_long_shows_each_rank_live_and_how_it_ended(k: Kernel) -> None:
    quick = k.ok("%%distributed --pool\n0")
    assert quick.displays == []  # a quick cell shows no panel: nothing between the user and the value
    res = k.ok(LONG_CELL, timeout=60)
    # A launch's panel, as text lines (this front end shows no widgets): its start line, then
    # its summary as the cell's last display, after rank 0's output.
    [(kind, start, start_id), (end_kind, end, end_id)] = res.displays
    assert kind == end_kind == "display_data" and end_id == f"{start_id}-end"
    assert re.fullmatch(
        r"\[air_magic\] Cell In\[\d+\] on 2 CPU ranks \(pool call [0-9a-f-]+\): running", start["text/plain"]
    )
    lines = end["text/plain"].splitlines()
    assert re.fullmatch(
        r"\[air_magic\] Cell In\[\d+\] on 2 CPU ranks \(pool call [0-9a-f-]+\): finished in \d+\.\d s", lines[0]
    )
    # The pool itself on the line under it: its ranks, the call's number, its age.
    assert re.fullmatch(r"\[air_magic\]  pool of 2 CPU ranks \(launch [0-9a-f-]+\) · call \d+ · up \d+:\d\d", lines[1])
    # Each rank says what it did of the call (not "idle"), with its own bar and last line.
    rank_lines = [line for line in lines if line.startswith("[air_magic]  rank ")]
    assert [line.split(": ")[1].split(" · ")[0] for line in rank_lines] == ["finished", "finished"]
    assert all(" · steps · 100% 6/6 · " in line for line in rank_lines), rank_lines
    assert rank_lines[1].endswith("'rank 1 trained'")
    html = end["text/html"]
    assert 'data-air-magic-status="finished"' in html and html.count('data-state="finished"') == 2
    assert "MiB" not in html and "MiB" not in end["text/plain"]


def _shape(summary: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """What a summary is made of, whatever it is of: its text's lines with the label, the
    noun, the ids and the numbers taken out, its HTML's tags and its data's fields."""
    text = [
        re.sub(r"\d+(\.\d+)?", "N", re.sub(r"\((launch|pool call) [0-9a-f-]+\)|logs: .*", "(ID)", line))
        for line in summary["text/plain"].splitlines()
        if not line.startswith("[air_magic]  pool of ")  # the pool's own line: only a pool call has it
    ]
    tags = re.findall(r"<(\w+)", re.sub(r'<div data-air-magic-context="1"[^>]*>[^<]*</div>', "", summary["text/html"]))
    data = sorted(summary["application/vnd.air-magic.summary+json"])
    return text, tags, data


def test_a_pool_call_and_a_launch_end_in_summaries_of_one_model(k: Kernel) -> None:
    launched = k.ok(LONG_CELL.replace("%%distributed --pool", "%%distributed -n 2"), timeout=120)
    pooled = k.ok(LONG_CELL, timeout=60)
    [launch_summary] = [data for _, data, did in launched.displays if did and did.endswith("-end")]
    [pool_summary] = [data for _, data, did in pooled.displays if did and did.endswith("-end")]
    assert _shape(pool_summary) == _shape(launch_summary)
    assert "(launch " in launch_summary["text/plain"].splitlines()[0]
    assert "(pool call " in pool_summary["text/plain"].splitlines()[0]
    data = pool_summary["application/vnd.air-magic.summary+json"]
    assert data["noun"] == "pool call" and data["context"].startswith("pool of 2 CPU ranks")
    assert [r["state"] for r in data["ranks"]] == ["finished", "finished"]


def _in_the_cell(name: str) -> str:
    """A pool cell's first lines: each rank says it is in the cell (a file in the kernel's folder)."""
    return f"%%distributed --pool\nimport os, time\nopen(f'in-{name}-{{os.environ[\"RANK\"]}}', 'w').close()\n"


def _wait_in_the_cell(k: Kernel, name: str) -> None:
    """Until every rank runs the cell (not a fixed sleep: a loaded machine starts it late)."""
    marks = [os.path.join(k.workdir, f"in-{name}-{rank}") for rank in (0, 1)]
    assert wait_until(lambda: all(os.path.exists(m) for m in marks), timeout=30)
    for mark in marks:
        os.unlink(mark)


def test_ctrl_c_stops_every_rank_s_cell_and_keeps_the_state(k: Kernel) -> None:
    k.ok("%%distributed --pool\nbefore = 'kept'")
    msg_id = k.execute(_in_the_cell("ctrl-c") + "time.sleep(60)")
    _wait_in_the_cell(k, "ctrl-c")
    begin = time.monotonic()
    k.km.interrupt_kernel()
    res = k.collect(msg_id, timeout=30)
    assert time.monotonic() - begin < 5
    assert res.error is not None and res.error["ename"] == "KeyboardInterrupt", res.error_text
    assert res.error["evalue"] == (
        "you interrupted the pool's cell; every rank stopped it, and the pool and its state are intact."
    )
    assert values(k.run("%%distributed --pool\nbefore")) == ["kept", "kept"]


def test_an_idle_pool_costs_no_cpu(k: Kernel) -> None:
    pids = pool_pids(k)
    procs = [psutil.Process(pid) for pid in pids]
    before = [p.cpu_times() for p in procs]
    time.sleep(5)
    after = [p.cpu_times() for p in procs]
    used = [(a.user + a.system) - (b.user + b.system) for a, b in zip(after, before)]
    assert all(u < 0.05 for u in used), used  # < 1 % of one core over 5 s


def test_a_killed_rank_breaks_the_pool_and_the_next_cell_restarts_it_saying_so(k: Kernel) -> None:
    k.ok("%%distributed --pool\nold = 1")
    pids = pool_pids(k)
    msg_id = k.execute(_in_the_cell("kill") + "time.sleep(30)")
    _wait_in_the_cell(k, "kill")
    begin = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    res = k.collect(msg_id, timeout=30)
    assert time.monotonic() - begin < 5
    assert res.error is not None, res.stdout
    assert "the pool is broken (rank 1 ended (exit -9))" in res.error["evalue"], res.error_text
    assert wait_until(lambda: all(gone(p) for p in pids), timeout=10)
    begin = time.monotonic()
    res = k.run("%%distributed --pool\n'old' in globals()", timeout=60)
    assert time.monotonic() - begin < 10
    assert values(res) == [False, False]
    assert res.stderr.splitlines()[0] == (
        "[air_magic] the pool was broken (rank 1 ended (exit -9)); starting 2 fresh ranks: the state of the old "
        "ones (their names, models, data) is lost."
    )


def test_one_rank_failing_while_the_other_waits_in_all_reduce_ends_in_seconds(k: Kernel) -> None:
    cell = (
        "%%distributed --pool\n"
        "import os, torch, torch.distributed as dist\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise RuntimeError('rank 1 gave up')\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)  # rank 0 waits here for rank 1\n"
    )
    begin = time.monotonic()
    res = k.run(cell, timeout=60)
    assert time.monotonic() - begin < 5 + 2
    assert res.error is not None and res.error["ename"] == "RuntimeError", res.error_text
    assert res.error["evalue"] == "rank 1 gave up"
    assert "the pool is broken (rank 1 failed while the others did not come back)" in res.error_text
    assert "rank 0: in all_reduce" in res.error_text
    assert values(k.run("%%distributed --pool\n1", timeout=60)) == [1, 1]


def test_the_cell_s_timeout_breaks_the_pool_with_where_each_rank_was(k: Kernel) -> None:
    res = k.run("%%distributed --pool --timeout 2\nimport time\ntime.sleep(30)", timeout=60)
    assert res.error is not None and res.error["ename"] == "LaunchTimeoutError", res.error_text
    assert res.error["evalue"].startswith("Cell In[")
    assert "ran past its timeout of 2 s on the pool" in res.error["evalue"]
    assert "where each rank was" in res.error_text
    assert values(k.run("%%distributed --pool\n2", timeout=60)) == [2, 2]


def test_stop_leaves_no_rank_and_a_new_pool_starts(kernel_factory: Any) -> None:
    kernel = kernel_factory()
    try:
        kernel.ok("%load_ext air_magic")
        kernel.ok("%%distributed --pool -n 2 --no-tracking\nx = 1", timeout=180)
        pids = pool_pids(kernel)
        res = kernel.ok("%distributed_pool --stop")
        assert res.stdout.strip() == "[air_magic] the pool was stopped."
        assert wait_until(lambda: all(gone(p) for p in pids), timeout=10)
        assert values(kernel.run("%%distributed --pool -n 1 --no-tracking\n'x' in globals()", timeout=180)) == [False]
        kernel.ok("%unload_ext air_magic")  # the magics go; the pool stays, for air_magic.Pool
        unloaded = kernel.run("%distributed_pool")
        assert "Line magic function `%distributed_pool` not found" in unloaded.stderr + unloaded.error_text
        assert kernel.value("__import__('air_magic').Pool.current().run(int)") == [0]
    finally:
        kernel.shutdown()


@pytest.mark.parametrize("how", ["sigkill", "restart", "shutdown"])
def test_the_kernel_s_end_takes_the_pool_along(kernel_factory: Any, how: str) -> None:
    kernel = kernel_factory()
    try:
        kernel.ok("%load_ext air_magic")
        kernel.ok("%%distributed --pool -n 2 --no-tracking\nx = 2", timeout=180)
        pids = pool_pids(kernel)
        helpers = [p.pid for p in helper_processes() if p.ppid() == kernel.pid]
        assert len(helpers) == 1
        if how == "sigkill":
            os.kill(kernel.pid, signal.SIGKILL)
            kernel.forget()
        elif how == "restart":
            kernel.km.restart_kernel(now=True)
            kernel.refresh_pid()
        else:
            kernel.km.shutdown_kernel(now=True)
            kernel.forget()
        assert wait_until(lambda: all(gone(p) for p in pids + helpers), timeout=10), how
    finally:
        kernel.shutdown()
