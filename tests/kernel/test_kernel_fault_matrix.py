"""The fault matrix: every way a launch can end badly, on 1, 2 and 4 ranks, in a real kernel.

For each fault: the error reaches the cell within seconds and names the right rank; no
rank, launch file, shared-memory entry or listening port is left; the MLflow run has the
right status and the points logged before the fault; the next launch works.  (The
leftover-process guard in conftest.py checks every test for processes as well.)  Faults of
the kernel itself (SIGKILL, restart, shutdown) are at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from typing import Any, Iterator

import psutil
import pytest
from harness import Kernel, alive, helper_processes, rank_processes, wait_until

pytestmark = pytest.mark.kernel

SIZES = [1, 2, 4]
POINTS = 5  # each rank logs this many points before the fault

#: Every rank logs POINTS points; then the last rank meets the fault while the others
#: wait for it in an all_reduce (or in the rendezvous, for a rank that leaves).
#: A double fork into a session of its own that ignores every polite signal; it writes its pid.
DAEMON = (
    "import os, signal, sys, time\n"
    "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGIO): signal.signal(s, signal.SIG_IGN)\n"
    "if os.fork(): os._exit(0)\n"
    "os.setsid()\n"
    "if os.fork(): os._exit(0)\n"
    "open(sys.argv[1], 'a').write(f' {os.getpid()}')\n"
    "time.sleep(120)\n"
)

FAULTY = f"""
from air_magic import distributed
DAEMON = {DAEMON!r}

@distributed(accelerator_type="CPU")
def faulty(fault):
    import ctypes, os, signal, sys, time
    import torch, torch.distributed as dist
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if fault == "escape":  # every rank hides two processes from its group and session, then waits
        import subprocess
        hidden = subprocess.Popen(["sleep", "60"], start_new_session=True)
        subprocess.run([sys.executable, "-c", DAEMON, f"escaped-{{os.environ['AIR_MAGIC_LAUNCH_ID']}}-{{rank}}"])
        with open(f"escaped-{{os.environ['AIR_MAGIC_LAUNCH_ID']}}-{{rank}}", "a") as mark:
            mark.write(f" {{hidden.pid}}")
        time.sleep(120)
    if fault == "csleep":  # every rank in a C call that gives up when a signal comes
        ctypes.CDLL(None).sleep(30)
        return "returned"
    if fault != "timeout":  # importing mlflow takes seconds: not inside a 3 s timeout
        import mlflow
        for step in range({POINTS}):
            # a value of each rank's own: MLflow keeps one row per (key, step, value, time)
            mlflow.log_metric("loss", rank + 1.0 / (step + 1), step=step)
    last = rank == size - 1
    if last and fault != "none":  # when the fault happens, for the test's clock
        with open(f"fault-{{os.environ['AIR_MAGIC_LAUNCH_ID']}}", "w") as mark:
            mark.write(repr(time.time()))
    if fault == "exit0" and last:
        os._exit(0)
    dist.init_process_group()
    if last:
        if fault == "exception":
            raise ValueError(f"bad batch on rank {{rank}}")
        if fault == "exit3":
            sys.exit(3)
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "segfault":
            ctypes.string_at(0)
        if fault in ("hang", "interrupt", "timeout"):
            time.sleep(120)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()

LAST = None

def run(fault, n, **options):
    global LAST
    LAST = faulty.with_overrides(num_accelerators=n, **options)
    return LAST.distributed(fault)

def outcome():
    # The run as it ends: its last points and status are stored behind the launch's values.
    import air_magic.tracking
    assert air_magic.tracking.flush(120)
    from mlflow import MlflowClient
    client = MlflowClient()
    launch = LAST.last_launch
    # every rank's points: rank 0's under "loss", rank r's under "rank<r>/loss"
    keys = ["loss"] + [f"rank{{r}}/loss" for r in range(1, launch.world_size)]
    points = sum(len(client.get_metric_history(launch.run_id, key)) for key in keys)
    return client.get_run(launch.run_id).info.status, points

def ended_at():
    return LAST.last_launch.ended_at

def folders():
    from air_magic.kernel.launcher import get_launcher
    return get_launcher().session_dir, get_launcher().shm_root

def log_folder():
    return LAST.last_launch.log_dir
"""


@pytest.fixture(scope="module")
def k(kernel_factory: Any) -> Iterator[Kernel]:
    kernel = kernel_factory(tracking=True)
    kernel.ok(FAULTY)
    kernel.ok("run('none', 1)", timeout=120)  # warm: the helper has torch, the MLflow store exists
    yield kernel
    kernel.shutdown()


def _helper(k: Kernel) -> psutil.Process:
    assert wait_until(lambda: len([p for p in helper_processes() if p.ppid() == k.pid]) == 1, timeout=10)
    [helper] = [p for p in helper_processes() if p.ppid() == k.pid]
    return helper


def _ranks(helper: psutil.Process) -> list[psutil.Process]:
    return [p for p in rank_processes() if p.ppid() == helper.pid]


def _fault_time(k: Kernel) -> float:
    """When the last rank met its fault (it wrote the time to the kernel's folder)."""
    marks = sorted((f for f in os.listdir(k.workdir) if f.startswith("fault-")), reverse=True)
    with open(os.path.join(k.workdir, marks[0])) as handle:
        return float(handle.read())


def _assert_nothing_left(k: Kernel) -> None:
    helper = _helper(k)
    assert wait_until(lambda: not _ranks(helper), timeout=5)
    session, shm = k.value("folders()")
    # Nothing of a launch stays in the session folder; its bounded logs are kept in its log folder.
    assert [name for name in os.listdir(session) if os.path.isdir(os.path.join(session, name))] == []
    assert "rank-0.log" in os.listdir(k.value("log_folder()"))
    if shm:
        assert os.listdir(shm) == []
    assert not [c for c in helper.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def _assert_next_launch_works(k: Kernel, n: int) -> None:
    assert k.value(f"run('none', {n})", timeout=60) == [float(n)] * n


#: fault -> (exception type in the cell, how its message starts, what else it says)
EXPECTED = {
    "exception": ("ValueError", "bad batch on rank {last}", ""),
    "exit3": ("RankFailedError", "rank {last} of {n}", "raised SystemExit: 3"),
    "exit0": ("RankCrashedError", "rank {last} of {n}", "exited (code 0) without returning"),
    "sigkill": ("RankCrashedError", "rank {last} of {n}", "was killed by SIGKILL (exit -9)"),
    "segfault": ("RankCrashedError", "rank {last} of {n}", "was killed by SIGSEGV (exit -11)"),
    "timeout": ("LaunchTimeoutError", "faulty ran past its timeout of 3 s", ""),
}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fault", list(EXPECTED))
def test_a_rank_fault_is_named_and_leaves_nothing(k: Kernel, fault: str, n: int) -> None:
    last = n - 1
    timeout = ", timeout=3" if fault == "timeout" else ""
    res = k.run(f"run({fault!r}, {n}{timeout})", timeout=60)
    # from the fault to the outcome: every rank stopped and reaped, the error built (MLflow's
    # upload of the run's last points and logs comes after, and is checked below)
    elapsed = k.value("ended_at()") - _fault_time(k)
    name, first, also = EXPECTED[fault]
    assert res.error is not None and res.error["ename"] == name, res.error_text
    assert res.error["evalue"].startswith(first.format(last=last, n=n)), res.error["evalue"]
    assert also in res.error["evalue"]
    if fault == "exception" and n > 1:
        assert f"[air_magic] raised on rank {last} of {n}" in res.error_text
    assert elapsed < (3 if fault == "timeout" else 0) + 5, elapsed
    status, points = k.value("outcome()")
    assert status == ("KILLED" if fault == "timeout" else "FAILED")
    # every point a rank logged before it was stopped or failed is stored: all of them, as the
    # fault comes after every rank has logged -- but a rank that leaves does so before the
    # rendezvous, and the others may be stopped before they log
    if fault == "timeout":
        assert points == 0
    elif fault == "exit0":
        assert POINTS <= points <= POINTS * n
    else:
        assert points == POINTS * n
    _assert_nothing_left(k)
    _assert_next_launch_works(k, n)


@pytest.mark.parametrize("n", SIZES)
def test_a_timeout_while_the_ranks_are_in_a_c_call_is_a_timeout_not_their_value(k: Kernel, n: int) -> None:
    # The stacks a timeout asks for cut libc's sleep() short; the ranks must not return then.
    res = k.run(f"run('csleep', {n}, timeout=2)", timeout=60)
    assert res.error is not None and res.error["ename"] == "LaunchTimeoutError", res.error_text
    assert res.error["evalue"].startswith("faulty ran past its timeout of 2 s; ")
    assert "[air_magic] where each rank was:" in res.error_text
    for rank in range(n):
        assert f"rank {rank}: at " in res.error_text
    assert k.value("LAST.last_launch.status") == "timed out"
    assert k.value("[r.state for r in LAST.last_launch.ranks]") == ["stopped"] * n
    _assert_nothing_left(k)
    _assert_next_launch_works(k, n)


@pytest.mark.parametrize("n", SIZES)
def test_what_the_ranks_hid_in_sessions_of_their_own_ends_when_the_helper_is_killed(k: Kernel, n: int) -> None:
    before = set(os.listdir(k.workdir))
    msg_id = k.execute(f"run('escape', {n}, tracking=False)")

    def hidden() -> list[int]:
        marks = [f for f in set(os.listdir(k.workdir)) - before if f.startswith("escaped-")]
        pids = []
        for mark in marks:
            with open(os.path.join(k.workdir, mark)) as handle:
                pids += [int(p) for p in handle.read().split()]
        return pids if len(marks) == n and len(pids) == 2 * n else []

    assert wait_until(lambda: bool(hidden()), timeout=60)
    pids = hidden()
    _helper(k).send_signal(signal.SIGKILL)
    res = k.collect(msg_id, timeout=30)
    assert res.error is not None and res.error["ename"] == "LaunchError", res.error_text
    assert "the air_magic helper process died: it was killed by SIGKILL (exit -9)" in res.error["evalue"]

    def ended(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    assert wait_until(lambda: all(ended(pid) for pid in pids), timeout=3), [p for p in pids if not ended(p)]
    _assert_next_launch_works(k, n)


@pytest.mark.parametrize("n", SIZES)
def test_an_interrupt_stops_every_rank_and_leaves_nothing(k: Kernel, n: int) -> None:
    marks = set(os.listdir(k.workdir))
    msg_id = k.execute(f"run('interrupt', {n})")
    # every rank has logged and met the others: the last one marks the moment it starts to sleep
    assert wait_until(lambda: any(f.startswith("fault-") for f in set(os.listdir(k.workdir)) - marks), timeout=60)
    time.sleep(0.3)
    start = time.monotonic()
    k.km.interrupt_kernel()
    res = k.collect(msg_id, timeout=30)
    assert time.monotonic() - start < 5
    assert res.error is not None and res.error["ename"] == "KeyboardInterrupt"
    status, points = k.value("outcome()")
    assert status == "KILLED" and points == POINTS * n
    _assert_nothing_left(k)
    _assert_next_launch_works(k, n)


@pytest.mark.parametrize("n", SIZES)
def test_a_stopped_helper_or_a_deleted_session_folder_never_stops_the_next_launch(k: Kernel, n: int) -> None:
    _helper(k).send_signal(signal.SIGTERM)
    assert wait_until(lambda: not [p for p in helper_processes() if p.ppid() == k.pid], timeout=5)
    _assert_next_launch_works(k, n)
    session, _ = k.value("folders()")
    shutil.rmtree(session)  # a temp cleaner
    _assert_next_launch_works(k, n)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("how", ["sigkill", "restart", "shutdown"])
def test_the_kernel_going_away_takes_every_rank_within_seconds(kernel_factory: Any, how: str, n: int) -> None:
    kernel = kernel_factory()
    try:
        kernel.ok(FAULTY)
        kernel.execute(f"run('hang', {n}, tracking=False)")
        helper = _helper(kernel)
        assert wait_until(lambda: len(_ranks(helper)) == n, timeout=20)
        processes = [helper, *_ranks(helper)]
        start = time.monotonic()
        if how == "sigkill":
            os.kill(kernel.pid, signal.SIGKILL)
        elif how == "restart":
            kernel.km.restart_kernel(now=True)
            kernel.refresh_pid()
        else:
            kernel.km.shutdown_kernel(now=True)

        def gone() -> bool:
            return not [p for p in processes if alive(p)]

        assert wait_until(gone, timeout=5), f"{how}: still running after 5 s"
        assert time.monotonic() - start < 5
    finally:
        kernel.shutdown()


#: A launch of many ranks: its start-up alone takes seconds (one fork after the other).
MANY = 600


def _start_many(kernel: Kernel, n: int) -> str:
    kernel.ok(f"import os\nos.environ['AIR_MAGIC_MAX_CPU_RANKS'] = '{n}'")
    return kernel.execute(f"%%distributed -n {n} --no-tracking\nimport time\ntime.sleep(60)")


def _forking(kernel: Kernel) -> list[psutil.Process]:
    """The kernel's helper and its ranks, once the helper is forking them."""
    helper = _helper(kernel)
    assert wait_until(lambda: len(_ranks(helper)) >= 20, timeout=30)
    return [helper, *_ranks(helper)]


def _all_gone(processes: list[psutil.Process]) -> bool:
    return not [p for p in processes if alive(p)]


def test_an_interrupt_while_many_ranks_start_answers_at_once_and_leaves_none(kernel_factory: Any) -> None:
    kernel = kernel_factory()
    try:
        msg_id = _start_many(kernel, MANY)
        started = _forking(kernel)
        helper = started[0]
        begin = time.monotonic()
        kernel.km.interrupt_kernel()
        res = kernel.collect(msg_id, timeout=30)
        answered = time.monotonic() - begin
        assert res.error is not None and res.error["ename"] == "KeyboardInterrupt", res.error_text
        assert answered < 5, answered
        assert wait_until(lambda: not _ranks(helper), timeout=5)
        assert helper.is_running()  # the helper serves on: the next launch works
        assert kernel.value("%%distributed -n 2 --no-tracking\nint(os.environ['RANK'])") == [0, 1]
    finally:
        kernel.shutdown()


@pytest.mark.parametrize("n", [*SIZES, MANY])
def test_the_kernel_killed_while_its_ranks_start_takes_the_helper_and_every_rank(kernel_factory: Any, n: int) -> None:
    kernel = kernel_factory()
    try:
        kernel.ok(FAULTY)
        if n == MANY:
            _start_many(kernel, n)
            processes = _forking(kernel)
        else:
            kernel.ok("run('none', 1, tracking=False)")  # the helper has torch
            helper = _helper(kernel)
            kernel.execute(f"run('hang', {n}, tracking=False)")
            assert wait_until(lambda: len(_ranks(helper)) >= 1, timeout=20)
            processes = [helper, *_ranks(helper)]
        os.kill(kernel.pid, signal.SIGKILL)
        begin = time.monotonic()
        assert wait_until(lambda: _all_gone(processes + [p for p in rank_processes()]), timeout=10)
        assert time.monotonic() - begin < 5
    finally:
        kernel.shutdown()
