"""Why is it stuck: the hang report in a real kernel, for launches and pool cells.

Each verdict a CPU machine can produce for real (a rank behind, ranks that disagree, a pool
rank that finished the call while its peer waits: a launch's rank that exits closes its
gloo connections, and its peers fail at once), shown in the cell while the hang lasts and in what
Ctrl-C prints; no report for a long compute pause or a rank paused in the debugger; and
the pool's way out: Ctrl-C on ranks stuck in collectives keeps the pool and its names (a
DDP model included), and the user's ``init_process_group(timeout=...)`` is the pool
group's timeout.  (``every rank in one collective`` needs a stalled network or device:
``test_kernel_hang_network.py`` stalls one, in a network namespace of its own.)  ``AIR_MAGIC_HANG_SECONDS=2``
keeps each test short; the default's timing is ``benchmarks/hang``'s."""

from __future__ import annotations

import re
import time
from typing import Any, Iterator

import pytest
from harness import CellResult, Kernel, kernel_with_a_pool, rank_processes, reports, the_pool_stays, wait_until

pytestmark = pytest.mark.kernel

FAST = {"AIR_MAGIC_HANG_SECONDS": "2"}


def until_reported(res: CellResult) -> bool:
    return bool(reports(res))


def stuck_then_interrupted(kernel: Kernel, code: str) -> tuple[CellResult, CellResult, float]:
    """Run ``code``, wait for its hang report, then interrupt it as the stop button does."""
    began = time.monotonic()
    msg_id = kernel.execute(code)
    shown = kernel.collect(msg_id, timeout=60, until=until_reported)
    took = time.monotonic() - began
    assert reports(shown), f"no hang report: {shown.stdout[-2000:]}"
    kernel.km.interrupt_kernel()
    rest = kernel.collect(msg_id, timeout=90)
    return shown, rest, took


@pytest.fixture(scope="module")
def kernel(kernel_factory: Any) -> Iterator[Kernel]:
    k = kernel_factory(FAST)
    yield k
    k.shutdown()


SKIP = """%%distributed -n 2
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(8)
for _ in range(3):
    dist.all_reduce(t)
if dist.get_rank() == 0:
    dist.all_reduce(t)
else:
    time.sleep(120)"""


def test_a_launch_whose_rank_skips_an_all_reduce_names_it_behind(kernel: Kernel) -> None:
    shown, rest, took = stuck_then_interrupted(kernel, SKIP)
    report = reports(shown)[-1]
    verdict = report.splitlines()[0]
    assert re.fullmatch(
        r"\[air_magic\] hang report: rank 1 is behind, blocked \(neither in a collective nor computing\): its last "
        r"collective is #3 \(Cell In\[\d+\]:6 in <module>\); "
        r"it is at Cell In\[\d+\]:10 in <module>; rank 0 waits in all_reduce #4 \(Cell In\[\d+\]:8 in <module>\)",
        verdict,
    ), report
    rows = [line.split() for line in report.splitlines()[2:]]
    assert rows[0][:8] == ["0", "in", "collective", "default", "#4", "all_reduce", "[8]", "float32"], report
    assert rows[1][:5] == ["1", "blocked", "default", "#3", "all_reduce"], report  # asleep: a system call
    assert took < 20, took
    # Ctrl-C prints where each rank was, and the same report.
    assert rest.error is not None and rest.error["ename"] == "KeyboardInterrupt", rest.error_text
    assert verdict in rest.stderr, rest.stderr
    # It is kept with the launch's logs (an MLflow run's artifacts).
    logs = re.search(r"logs: (\S+)", rest.stdout + "".join(str(d.get("text/plain", "")) for _, d, _ in rest.displays))
    assert logs, rest.stdout
    with open(f"{logs.group(1)}/hang-report.txt", encoding="utf-8") as handle:
        assert handle.read().splitlines()[0] == verdict
    assert wait_until(lambda: not rank_processes(), timeout=15)


def test_a_long_compute_pause_between_collectives_is_not_a_hang(kernel: Kernel) -> None:
    code = (
        "%%distributed -n 2\nimport time, torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "t = torch.ones(4)\ndist.all_reduce(t)\ntime.sleep(7)\ndist.all_reduce(t)\nt.tolist()"
    )
    res = kernel.run(code, timeout=60)
    assert res.error is None, res.error_text
    assert res.result == "[[4.0, 4.0, 4.0, 4.0], [4.0, 4.0, 4.0, 4.0]]"
    assert not reports(res) and "hang report" not in res.stderr


def test_a_rank_paused_in_the_debugger_while_its_peer_waits_is_not_a_hang(kernel: Kernel) -> None:
    code = (
        "%%distributed -n 2\nimport torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "t = torch.ones(4)\nif dist.get_rank() == 1:\n    breakpoint()\ndist.all_reduce(t)\nt.tolist()"
    )

    def answer(prompt: str, res: CellResult) -> str:
        time.sleep(6)  # three times AIR_MAGIC_HANG_SECONDS, rank 0 waiting in its all_reduce meanwhile
        return "c"

    res = kernel.run_with_stdin(code, answer, timeout=90)
    assert res.error is None, res.error_text
    assert res.result == "[[2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]]"
    assert [p for p, _ in res.prompts] == ["(Pdb rank 1) "]
    assert not reports(res)


# -- a pool ---------------------------------------------------------------------------------------

SETUP = """%%distributed --pool
import torch, torch.distributed as dist
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def step():
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    return round(float(model.module.bias), 4)
first = step()"""

NEXT = """%%distributed --pool
t = torch.ones(2) * (dist.get_rank() + 1)
dist.all_reduce(t)
(first, step(), t.tolist())"""


@pytest.fixture(scope="module")
def pool(kernel_factory: Any) -> Iterator[Kernel]:
    for k in kernel_with_a_pool(kernel_factory, "import os\nos.environ['AIR_MAGIC_HANG_SECONDS'] = '2'"):
        k.ok(SETUP, timeout=120)
        yield k


@pytest.fixture(autouse=True)
def _pool_stays(request: pytest.FixtureRequest) -> Iterator[None]:
    if "pool" not in request.fixturenames:
        yield
        return
    pool = request.getfixturevalue("pool")
    yield from the_pool_stays(pool)


def next_cell_works(pool: Kernel) -> None:
    res = pool.run(NEXT, timeout=60)
    assert res.error is None, res.error_text
    values = eval(res.result or "None")  # noqa: S307 - the kernel's repr of our own values
    assert values[0] == values[1], values
    first, stepped, total = values[0]
    assert stepped != first and total == [3.0, 3.0], values  # the same model trained on; a collective works


def test_a_pool_cell_whose_ranks_disagree_is_reported_and_ctrl_c_keeps_the_names(pool: Kernel) -> None:
    code = (
        "%%distributed --pool\nif dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(4))\n"
        "else:\n    dist.broadcast(torch.ones(7), src=1)"
    )
    shown, rest, took = stuck_then_interrupted(pool, code)
    verdict = reports(shown)[-1].splitlines()[0]
    assert re.fullmatch(
        r"\[air_magic\] hang report: ranks disagree at #\d+: rank 0 all_reduce \[4\] float32, "
        r"rank 1 broadcast \[7\] float32",
        verdict,
    ), verdict
    assert took < 20, took
    assert rest.error is not None and rest.error["ename"] == "KeyboardInterrupt", rest.error_text
    assert rest.error["evalue"] == (
        "you interrupted the pool's cell; ranks 0, 1 waited in collectives that no peer would complete (a hang), "
        "so they were stopped there: the process group was rebuilt; your names are kept, and their state is intact."
    ), rest.error_text
    next_cell_works(pool)


def test_a_pool_rank_that_finished_the_call_while_its_peer_waits_is_named(pool: Kernel) -> None:
    code = "%%distributed --pool\nif dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(4))"
    shown, rest, _ = stuck_then_interrupted(pool, code)
    report = reports(shown)[-1]
    assert re.search(r"\n  1 +ended +default +finished the call +its reply\n?", report), report
    verdict = report.splitlines()[0]
    assert re.fullmatch(
        r"\[air_magic\] hang report: rank 1 has ended \(finished the call\) while rank 0 waits in all_reduce #\d+ "
        r"\(Cell In\[\d+\]:3 in <module>\)",
        verdict,
    ), verdict
    assert rest.error is not None and rest.error["ename"] == "KeyboardInterrupt", rest.error_text
    assert "the pool and its state are intact" in rest.error["evalue"] or "your names are kept" in rest.error["evalue"]
    next_cell_works(pool)


def test_ctrl_c_on_a_rank_asleep_while_its_peer_waits_for_it_keeps_the_pool(pool: Kernel) -> None:
    code = (
        "%%distributed --pool\nimport time\nt = torch.ones(4)\nif dist.get_rank() == 1:\n    time.sleep(300)\n"
        "dist.all_reduce(t)"
    )
    shown, rest, _ = stuck_then_interrupted(pool, code)
    assert "rank 1 is behind" in reports(shown)[-1], reports(shown)[-1]
    assert rest.error is not None and rest.error["ename"] == "KeyboardInterrupt", rest.error_text
    # Told again, the sleeping rank stops where it is; its peer, left in an all_reduce that no rank
    # will join, is stopped there (the collective never completes), and the group is rebuilt.
    assert rest.error["evalue"] == (
        "you interrupted the pool's cell; rank 0 waited in a collective that rank 1 had stopped before, so it was "
        "stopped there: the process group was rebuilt; your names are kept, and their state is intact."
    ), rest.error_text
    next_cell_works(pool)


def test_distributed_pool_shows_the_hang_of_a_call_submitted_in_the_background(pool: Kernel) -> None:
    pool.ok(
        "import time\nfrom air_magic import Pool\n"
        "def lonely():\n    import torch, torch.distributed as dist\n"
        "    if dist.get_rank() == 0:\n        dist.all_reduce(torch.ones(4))\n    return 1\n"
        "call = Pool.current().submit(lonely)"
    )
    found: list[str] = []

    def shown() -> bool:
        res = pool.ok("%distributed_pool")
        found[:] = [str(d.get("text/plain", "")) for _, d, _ in res.displays]
        return any(text.startswith("[air_magic] hang report:") for text in found)

    assert wait_until(shown, timeout=30, interval=1.0), found
    report = next(text for text in found if text.startswith("[air_magic] hang report:"))
    assert "rank 1 has ended (finished the call) while rank 0 waits in all_reduce" in report, report
    res = pool.run("call.cancel()\ntype(call.exception(timeout=60)).__name__", timeout=90)
    assert res.error is None and res.result == "'KeyboardInterrupt'", res.error_text
    next_cell_works(pool)


def test_the_user_s_init_timeout_is_the_pool_group_s_and_the_group_is_rebuilt_after_it(pool: Kernel) -> None:
    code = (
        "%%distributed --pool\nfrom datetime import timedelta\n"
        "dist.init_process_group('nccl', timeout=timedelta(seconds=3))\n"
        "if dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(4))"
    )
    began = time.monotonic()
    res = pool.run(code, timeout=60)
    took = time.monotonic() - began
    assert res.error is not None and res.error["ename"] == "RuntimeError", res.error_text
    assert "Timed out waiting 3000ms" in res.error_text, res.error_text
    assert re.search(r"Cell In\[\d+\], line 5", res.error_text), res.error_text  # the collective's line
    assert took < 15, took  # as a fresh launch fails: in about the timeout, not 30 minutes
    assert (
        "[air_magic] the collective's failure closed the process group's connections: the process group was "
        "rebuilt; your names are kept."
    ) in res.error_text
    said = "[air_magic] init_process_group(backend='nccl') is not taken on a pool"
    assert res.stderr.count(said) == 1, res.stderr
    next_cell_works(pool)
    again = pool.run("%%distributed --pool\ndist.init_process_group('nccl')\n1", timeout=60)
    assert again.error is None and said not in again.stderr  # said once
    # The module's pool goes on with torch's default timeout (a later test computes for 6 s).
    pool.ok("%%distributed --pool\ndist.init_process_group('gloo', timeout=timedelta(minutes=30))", timeout=60)


# -- hangs that hooks make, and ranks that are only slow ---------------------------------------------

DDP_SKIP = """%%distributed --pool
for i in range(4):
    if dist.get_rank() == 1 and i == 2:
        continue  # a step skipped: rank 0 waits in its backward's gradient all-reduce
    step()"""


def test_a_ddp_step_one_rank_skipped_is_reported_at_the_user_s_line_and_ctrl_c_keeps_the_model(pool: Kernel) -> None:
    shown, rest, took = stuck_then_interrupted(pool, DDP_SKIP)
    report = reports(shown)[-1]
    verdict = report.splitlines()[0]
    assert re.fullmatch(
        r"\[air_magic\] hang report: rank 1 has ended \(finished the call\) while rank 0 waits in all_reduce #\d+ "
        r"\(Cell In\[\d+\]:8 in step, DDP's gradient all-reduce\)",
        verdict,
    ), report
    assert re.search(r"\n  0 +in collective .*Cell In\[\d+\]:8 in step \(DDP's gradient all-reduce\)", report), report
    assert took < 12, took  # AIR_MAGIC_HANG_SECONDS=2 here; benchmarks/hang times the default's 5 s
    assert rest.error is not None and rest.error["evalue"] == (
        "you interrupted the pool's cell; rank 0 waited in a collective that rank 1 never made (it had finished "
        "the call), so it was stopped there: the process group was rebuilt; your names are kept, and their state "
        "is intact."
    ), rest.error_text
    assert (
        "[air_magic] put back: model: DDP's reducer reset and the interrupted step's gradients cleared (every rank)."
    ) in rest.error_text
    next_cell_works(pool)


def test_a_rank_that_computes_while_its_peer_waits_is_a_notice_then_one_line_when_it_arrives(pool: Kernel) -> None:
    code = (
        "%%distributed --pool\nimport time\nt = torch.ones(4)\ndist.all_reduce(t)\nif dist.get_rank() == 1:\n"
        "    began, a = time.time(), torch.rand(128, 128)\n    while time.time() - began < 6:\n"
        "        a = torch.tanh(a @ a)\ndist.all_reduce(t)\nt.tolist()"
    )
    res = pool.run(code, timeout=60)
    assert res.error is None, res.error_text
    shown = [str(d.get("text/plain", "")) for _, d, _ in res.displays]
    assert not reports(res), shown  # no "hang report": nothing is stuck
    notices = [s for s in shown if "is computing" in s]
    assert notices, shown
    assert re.fullmatch(
        r"\[air_magic\] rank 1 is computing at Cell In\[\d+\]:8 in <module> for \d+ s; rank 0 waits in "
        r"all_reduce #\d+ \(Cell In\[\d+\]:9 in <module>\)",
        notices[0],
    ), notices
    # The last word the notebook got is true: the wait is over.
    last = [s for s in shown if s.startswith("[air_magic] rank 1 ")][-1]
    assert re.fullmatch(r"\[air_magic\] rank 1 reached all_reduce #\d+ after \d+ s", last), shown


LAUNCH_DDP = """%%distributed -n 2
import torch, torch.nn as nn, torch.distributed as dist
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(10, 5))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(4):
    if dist.get_rank() == 1 and i == 2:
        continue
    opt.zero_grad()
    model(torch.randn(4, 10)).sum().backward()
    opt.step()
dist.barrier()"""


def test_a_launch_whose_rank_skipped_a_ddp_step_is_named_where_each_rank_really_waits(kernel: Kernel) -> None:
    shown, rest, took = stuck_then_interrupted(kernel, LAUNCH_DDP)
    verdict = reports(shown)[-1].splitlines()[0]
    assert re.fullmatch(
        r"\[air_magic\] hang report: ranks disagree at #\d+: rank 0 all_reduce \[55\] float32, rank 1 barrier",
        verdict,
    ), verdict
    assert "Cell In[" in reports(shown)[-1] and "(DDP's gradient all-reduce)" in reports(shown)[-1]
    assert re.search(
        r"rank 0: in all_reduce \(DDP's gradient all-reduce\), called at Cell In\[\d+\], line 10 in <module>\n",
        rest.stderr,
    ), rest.stderr
    assert "behind" not in rest.stderr, rest.stderr
