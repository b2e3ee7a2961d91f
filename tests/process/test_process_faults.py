"""Faults around a launch: nothing lost, nothing stuck, nobody in.

A timeout no selector can hold, a helper that went away, a deleted session folder, a
shared-memory folder smaller than the results, a rank that leaves without returning,
processes a rank hides in sessions of their own, a working directory that no longer
exists, a rank log of many megabytes, a thread count no machine can run, and another
user of the machine.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import cloudpickle
import pytest
from harness import helper_processes, wait_until

from air_magic import LaunchError, LaunchTimeoutError, RankCrashedError, distributed

pytestmark = pytest.mark.process

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROOT = os.geteuid() == 0


def launcher() -> Any:
    from air_magic.kernel.launcher import get_launcher

    return get_launcher()


@distributed(num_accelerators=2, tracking=False)
def all_reduce() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group()
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def assert_next_launch_works() -> None:
    assert all_reduce.distributed() == [2.0, 2.0]


# -- timeouts no clock can hold -----------------------------------------------------------------


def test_a_timeout_of_thirty_days_is_held_and_other_launches_go_on() -> None:
    long = all_reduce.with_overrides(timeout=30 * 86400.0)  # past what a selector can wait at once
    handle = long.submit()
    assert handle.result(timeout=1e12) == [2.0, 2.0]  # a wait no lock can hold, too
    assert_next_launch_works()
    assert launcher()._helper is not None and launcher()._helper.alive


# -- the helper and the session folder --------------------------------------------------------


def test_a_helper_stopped_with_sigterm_is_replaced_by_the_next_launch() -> None:
    assert_next_launch_works()
    [helper] = [p for p in helper_processes() if p.ppid() == os.getpid()]
    helper.send_signal(signal.SIGTERM)
    helper.wait(10)
    assert not os.path.isdir(launcher().session_dir)  # it took the session folder along
    assert_next_launch_works()


def test_a_deleted_session_folder_is_made_again() -> None:
    assert_next_launch_works()
    shutil.rmtree(launcher().session_dir)  # a temp cleaner
    assert_next_launch_works()
    assert oct(os.stat(launcher().session_dir).st_mode & 0o777) == "0o700"


# -- results bigger than /dev/shm --------------------------------------------------------------


@pytest.fixture
def small_shm(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A launcher whose shared-memory folder is an 8 MB tmpfs (Docker gives 64 MB)."""
    if not ROOT:
        pytest.skip("mounting a small tmpfs needs root")
    import air_magic.kernel.launcher as launcher_module

    mount = str(tmp_path / "shm")
    os.mkdir(mount)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mount], check=True)
    monkeypatch.setenv("AIR_MAGIC_SHM_DIR", mount)
    small = launcher_module.Launcher()
    monkeypatch.setattr(launcher_module, "_launcher", small)
    try:
        yield mount
    finally:
        small.shutdown()
        subprocess.run(["umount", "--lazy", mount], check=True)  # tensors of a failed test may map it


@distributed(num_accelerators=2, tracking=False)
def big_tensors(mb: int) -> Any:
    import os

    import torch

    return torch.full((mb << 18,), float(os.environ["RANK"]))  # mb MB of float32


def test_results_larger_than_shared_memory_arrive_through_the_private_folder(small_shm: str) -> None:
    values = big_tensors.distributed(6)  # 12 MB in all, for an 8 MB /dev/shm
    assert [v.numel() for v in values] == [6 << 18] * 2
    assert [float(v[0]) for v in values] == [0.0, 1.0] and [float(v[-1]) for v in values] == [0.0, 1.0]
    # nothing left in either place
    shm_root = launcher().shm_root
    assert shm_root.startswith(small_shm)
    assert all(not files for _, _, files in os.walk(small_shm))
    leftovers = [n for _, _, files in os.walk(launcher().session_dir) for n in files if re.fullmatch(r"r\d+-\d+", n)]
    assert not leftovers, leftovers


@distributed(num_accelerators=1, tracking=False)
def bus_error() -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGBUS)


def test_a_bus_error_names_dev_shm_and_dockers_shm_size() -> None:
    with pytest.raises(RankCrashedError) as info:
        bus_error.distributed()
    assert "rank 0 of 1 was killed by SIGBUS (exit -7): a bus error: most often /dev/shm is full" in str(info.value)
    assert "--shm-size=8g or --ipc=host" in str(info.value)


# -- a rank that leaves ------------------------------------------------------------------------


@distributed(num_accelerators=2, tracking=False)
def leave_before_the_rendezvous() -> float:
    import os

    import torch
    import torch.distributed as dist

    if os.environ["RANK"] == "1":
        os._exit(0)  # gone, without returning: rank 0 would wait for it in the rendezvous
    dist.init_process_group()
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_a_rank_that_exits_0_without_returning_fails_the_launch_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(RankCrashedError) as info:
        leave_before_the_rendezvous.distributed()
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert message.startswith(
        "rank 1 of 2 exited (code 0) without returning: something ended the process early (os._exit(0), "
        "or a library that exits), so the other ranks would have waited for it; rank 0 was stopped by air_magic."
    ), message
    assert info.value.rank == 1
    assert_next_launch_works()


# -- processes a rank hides from its group ----------------------------------------------------


@distributed(num_accelerators=1, tracking=False)
def start_detached(report: str) -> int:
    import subprocess

    child = subprocess.Popen(["sleep", "120"], start_new_session=True)  # its own session and group
    with open(report, "w") as handle:
        handle.write(str(child.pid))
    return child.pid


def test_a_child_in_a_session_of_its_own_goes_with_its_rank(tmp_path: Any) -> None:
    report = str(tmp_path / "pid")
    [pid] = start_detached.distributed(report)
    assert wait_until(lambda: not _alive(pid), timeout=5), f"pid {pid} outlived its rank"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


# -- the working directory, logs, thread counts -----------------------------------------------


def test_a_deleted_working_directory_is_said_and_nothing_starts(tmp_path: Any) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    here = os.getcwd()
    os.chdir(gone)
    try:
        os.rmdir(gone)
        before = set(os.listdir(launcher().session_dir)) if os.path.isdir(launcher().session_dir) else set()
        with pytest.raises(LaunchError) as info:
            all_reduce.distributed()
        after = set(os.listdir(launcher().session_dir)) if os.path.isdir(launcher().session_dir) else set()
    finally:
        os.chdir(here)
    assert str(info.value) == (
        "the notebook's working directory no longer exists (it was deleted or moved), and the ranks start "
        "in it. Change to a folder that exists first, e.g. %cd ~ (or os.chdir(...))."
    )
    assert after == before
    assert_next_launch_works()


def test_one_rank_stopped_is_said_in_the_singular() -> None:
    @distributed(num_accelerators=1, tracking=False, timeout=1)
    def sleeps() -> None:
        import time

        time.sleep(30)

    with pytest.raises(LaunchTimeoutError) as info:
        sleeps.distributed()
    assert "ran past its timeout of 1 s; its rank was stopped." in str(info.value)


@pytest.mark.parametrize("n", [1, 2])
def test_a_timeout_that_passes_before_the_ranks_return_is_a_timeout(n: int) -> None:
    # The limit passes before the helper has even seen the ranks' exits: whatever the ranks
    # do after it, the outcome is the timeout.
    @distributed(num_accelerators=n, accelerator_type="CPU", timeout=1e-9, tracking=False)
    def quick() -> int:
        return 1

    with pytest.raises(LaunchTimeoutError) as info:
        quick.distributed()
    assert str(info.value).startswith(f"{quick.func.__qualname__} ran past its timeout of 1e-09 s; ")


@distributed(num_accelerators=1, tracking=False)
def chatty(megabytes: int) -> int:
    line = "x" * 1023 + "\n"
    for _ in range(megabytes * 1024):
        print(line, end="")
    return megabytes


def test_a_rank_log_is_kept_bounded_with_its_beginning_and_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_MAGIC_LOG_LIMIT", str(1 << 20))
    monkeypatch.setenv("AIR_MAGIC_OUTPUT_LIMIT", str(1 << 10))
    handle = chatty.submit(4)
    assert handle.result(timeout=60) == [4]
    size = os.path.getsize(handle.ranks[0].log_path)
    assert (1 << 20) <= size < (1 << 20) + 512
    text = open(handle.ranks[0].log_path).read()
    assert (
        f"[air_magic] {3 << 20} bytes of this rank's output were cut here: its log keeps the first 64 KiB and "
        "the last 960 KiB (AIR_MAGIC_LOG_LIMIT)." in text
    )
    assert text.startswith("x" * 1023 + "\n") and text.endswith("x" * 1023 + "\n")


def test_an_absurd_omp_num_threads_is_bounded_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1000000")

    @distributed(num_accelerators=1, tracking=False)
    def threads() -> int:
        import torch

        return torch.get_num_threads()

    [count] = threads.distributed()
    assert count == 4 * (os.cpu_count() or 1)


# -- another user of the machine ---------------------------------------------------------------


@distributed(num_accelerators=2, tracking=False)
def rendezvous_then_wait(report: str) -> float:
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group()
    if os.environ["RANK"] == "0":
        with open(report + ".tmp", "w") as handle:
            handle.write(f"{os.environ['MASTER_PORT']} {os.environ['TORCHELASTIC_ERROR_FILE']}")
        os.replace(report + ".tmp", report)
    deadline = time.time() + 30
    while not os.path.exists(report + ".done") and time.time() < deadline:
        time.sleep(0.05)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.skipif(not ROOT or shutil.which("setpriv") is None, reason="needs root and setpriv for a second user")
def test_another_user_can_neither_reach_nor_read_the_rendezvous(tmp_path: Any) -> None:
    os.chmod(tmp_path, 0o777)
    report = str(tmp_path / "where")
    handle = rendezvous_then_wait.submit(report)
    try:
        assert wait_until(lambda: os.path.exists(report), timeout=20)
        port, error_file = open(report).read().split()
        work_dir = os.path.dirname(error_file)
        attack = (
            "import os, socket, sys\n"
            "port, work = int(sys.argv[1]), sys.argv[2]\n"
            "out = []\n"
            "try:\n"
            "    socket.create_connection(('127.0.0.1', port), timeout=2); out.append('connected')\n"
            "except OSError as e:\n"
            "    out.append(type(e).__name__)\n"
            "for path in (work, os.path.join(work, 'rendezvous.store')):\n"
            "    try:\n"
            "        os.listdir(path) if os.path.isdir(path) else open(path, 'rb').read(); out.append('read')\n"
            "    except OSError as e:\n"
            "        out.append(type(e).__name__)\n"
            "print(' '.join(out))\n"
        )
        done = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                sys.executable,
                "-c",
                attack,
                port,
                work_dir,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.stdout.split() == ["ConnectionRefusedError", "PermissionError", "PermissionError"], done
    finally:
        open(report + ".done", "w").close()
    assert handle.result(timeout=60) == [2.0, 2.0]


# -- where is each rank ------------------------------------------------------------------------


@distributed(num_accelerators=2, tracking=False)
def one_rank_lags() -> float:
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group()
    if os.environ["RANK"] == "1":
        time.sleep(60)  # the straggler
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for rank 1
    return t.item()


def _line_of(marker: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(one_rank_lags.func)
    return first + next(i for i, line in enumerate(lines) if marker in line)


def _running(handle: Any) -> bool:
    return all(state.pid for state in handle.ranks) and os.path.exists(handle.ranks[1].log_path)


def test_stacks_on_demand_show_every_rank_and_name_the_one_behind() -> None:
    handle = one_rank_lags.submit()
    try:
        assert wait_until(lambda: _running(handle), timeout=20)
        time.sleep(0.5)  # into the sleep and the all_reduce
        stacks = handle.stacks()
        assert sorted(stacks) == [0, 1]
        assert "in one_rank_lags" in stacks[0] and "all_reduce" in stacks[0]
        assert "time.sleep" not in stacks[1] and "in one_rank_lags" in stacks[1]
        where = handle.where(stacks).splitlines()
        assert where[0] == "[air_magic] where each rank was:"
        assert where[1].startswith("  rank 0: in all_reduce (torch.distributed), called at ")
        assert where[1].endswith(f"test_process_faults.py, line {_line_of('# rank 0 waits here')} in one_rank_lags")
        assert where[2].endswith(
            f"test_process_faults.py, line {_line_of('# the straggler')} in one_rank_lags  <- behind: rank 0 waits for it"
        )
    finally:
        handle.cancel()
    with pytest.raises(Exception):  # noqa: B017 - ended by the cancel: only that it ends is asserted
        handle.result(timeout=30)


@distributed(num_accelerators=2, accelerator_type="CPU", tracking=False)
def in_c_sleep(library: str) -> tuple[int, float]:
    import ctypes

    begin = time.monotonic()
    left = getattr(ctypes, library)(None).sleep(3)  # libc: the seconds left if a signal cut it short
    while library == "PyDLL" and time.monotonic() - begin < 3:
        ctypes.PyDLL(None).sleep(1)  # holds the GIL (a signal may have cut the first one short)
    return left, time.monotonic() - begin


def _stacks_while_in_c(library: str) -> tuple[dict[int, str], list[tuple[int, float]]]:
    handle = in_c_sleep.submit(library)
    try:
        assert wait_until(lambda: _running(handle), timeout=20)
        time.sleep(1.0)  # into the sleep
        stacks = handle.stacks()
        return stacks, handle.result(timeout=30)
    finally:
        handle.cancel()


def test_asking_where_the_ranks_are_does_not_change_what_a_c_call_computes() -> None:
    # The ranks' answering thread writes the stacks: libc's sleep() (which gives up on a
    # signal and returns the seconds left) sleeps its 3 s and returns 0.
    stacks, results = _stacks_while_in_c("CDLL")
    assert sorted(stacks) == [0, 1]
    assert all("in in_c_sleep" in text for text in stacks.values()), stacks
    assert [left for left, _ in results] == [0, 0]
    assert all(took >= 2.9 for _, took in results), results


def test_stacks_of_a_rank_whose_c_call_holds_the_gil_still_come() -> None:
    # No thread can run while a C call holds the GIL: the request comes again by signal.
    stacks, results = _stacks_while_in_c("PyDLL")
    assert sorted(stacks) == [0, 1]
    assert all("in in_c_sleep" in text for text in stacks.values()), stacks
    assert len(results) == 2


@distributed(num_accelerators=2, accelerator_type="CPU", tracking=False)
def imports_in_a_thread(folder: str) -> str:
    import importlib
    import sys
    import threading
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group()
    rank = dist.get_rank()
    sys.path.insert(0, folder)

    def import_all() -> None:  # fresh modules, one after another: frames made and dropped
        for i in range(400):
            importlib.import_module(f"mod_{rank}_{i}")

    thread = threading.Thread(target=import_all)
    thread.start()
    open(f"{folder}/started-{rank}", "w").close()
    while thread.is_alive():
        time.sleep(0.01)
    dist.all_reduce(torch.ones(1))
    return "survived"


def test_a_rank_asked_for_its_stacks_by_signal_while_a_thread_imports_survives(tmp_path: Any) -> None:
    # faulthandler reads other threads' frames without their lock: dumping every thread from
    # the signal handler while one imports crashed the rank (SIGSEGV).  The main thread's only.
    from air_magic.protocol import ask_for_stacks, stack_path

    for rank in range(2):
        for i in range(400):
            (tmp_path / f"mod_{rank}_{i}.py").write_text(
                "".join(f"def f{j}(x):\n    return x + {j}\n" for j in range(50)) + "VALUE = f1(1)\n"
            )
    handle = imports_in_a_thread.submit(str(tmp_path))
    try:
        assert wait_until(lambda: _running(handle) and os.path.exists(tmp_path / "started-1"), timeout=30)
        asked, seen = 0, ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not handle.done():
            for rank in range(2):
                asked += ask_for_stacks(handle.work_dir, rank, handle.ranks[rank].pid, by_signal=True)
            time.sleep(0.01)
            if asked == 20:
                seen = open(stack_path(handle.work_dir, 0), encoding="utf-8", errors="replace").read()
        assert handle.result(timeout=60) == ["survived", "survived"]
        assert asked >= 20, asked  # the signals came while the threads imported
        assert "in imports_in_a_thread" in seen and "in import_all" not in seen, seen  # the main thread's
    finally:
        handle.cancel()


def test_a_timeout_says_where_each_rank_was() -> None:
    with pytest.raises(LaunchTimeoutError) as info:
        one_rank_lags.with_overrides(timeout=4).distributed()
    [where] = info.value.__notes__
    lines = where.splitlines()
    assert lines[0] == "[air_magic] where each rank was:"
    assert lines[1].startswith("  rank 0: in all_reduce (torch.distributed), called at ")
    assert lines[2].endswith("in one_rank_lags  <- behind: rank 0 waits for it")


def test_a_straggler_is_named_when_every_rank_has_been_quiet_a_while(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIR_MAGIC_STALL_SECONDS", "1.5")
    with pytest.raises(LaunchTimeoutError):
        one_rank_lags.with_overrides(timeout=6).distributed()
    err = capsys.readouterr().err
    report = err[err.index("[air_magic] no rank has written anything for 1.5 s.") :].splitlines()
    assert report[1] == "[air_magic] where each rank was:"
    assert report[2].startswith("  rank 0: in all_reduce (torch.distributed), called at ")
    assert report[3].endswith("in one_rank_lags  <- behind: rank 0 waits for it")


@distributed(num_accelerators=2, tracking=False)
def return_before_the_rendezvous(late: bool) -> str:
    import os
    import time

    import torch.distributed as dist

    if os.environ["RANK"] == "1":
        if not late:
            time.sleep(1.0)  # rank 0 waits in init_process_group() by now
        return "done early"  # never calls init_process_group(): the group cannot form
    if late:
        time.sleep(1.0)  # joins after rank 1 has gone
    dist.init_process_group()
    return "never here"


def test_a_rank_that_returns_without_joining_the_others_in_the_rendezvous_fails_the_launch() -> None:
    start = time.monotonic()
    with pytest.raises(RankCrashedError) as info:  # rank 0 already waits in init_process_group
        return_before_the_rendezvous.distributed(False)
    assert time.monotonic() - start < 5
    assert str(info.value).startswith(
        "rank 1 of 2 returned without joining the process group that the other ranks wait for it in "
        "(every rank must call init_process_group()); rank 0 was stopped by air_magic."
    ), str(info.value)
    with pytest.raises(RuntimeError) as late:  # rank 0 comes to init_process_group after rank 1 left
        return_before_the_rendezvous.distributed(True)
    assert str(late.value) == (
        "init_process_group() cannot complete: rank 1 of 2 ended without joining the process group "
        "(every rank must call init_process_group())"
    )
    assert_next_launch_works()


def test_an_interrupt_while_a_launch_starts_leaves_none_of_its_files() -> None:
    from air_magic.kernel.launcher import Launcher

    assert_next_launch_works()
    before = set(os.listdir(launcher().session_dir))

    def interrupted(launch: Any) -> None:
        raise KeyboardInterrupt  # the user's Ctrl-C while the payload is written and sent

    Launcher.add_observer(interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            all_reduce.distributed()
    finally:
        Launcher._observer_factories.remove(interrupted)
    assert set(os.listdir(launcher().session_dir)) == before  # no payload, no folder
    assert not launcher().launches
    assert_next_launch_works()


PIDS_CGROUPS = "/sys/fs/cgroup/pids"


@pytest.mark.skipif(not os.access(PIDS_CGROUPS, os.W_OK), reason="no writable cgroup v1 pids controller here")
def test_a_process_limit_names_the_limit_and_how_many_ranks_could_start() -> None:
    @distributed(num_accelerators=4, accelerator_type="CPU", tracking=False)
    def four() -> int:
        return 1

    assert four.distributed() == [1] * 4  # the helper runs
    helper = launcher()._helper.proc.pid
    group = os.path.join(PIDS_CGROUPS, f"air-magic-test-{os.getpid()}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "cgroup.procs"), "w") as handle:
            handle.write(str(helper))
        with open(os.path.join(group, "pids.max"), "w") as handle:
            # The helper and two more tasks: rank 0 and either rank 1 or rank 0's stack thread
            # (started as the helper forks on), so rank 1 or rank 2 is refused.
            handle.write("3")
        with pytest.raises(LaunchError) as info:
            four.distributed()
        message = str(info.value)
        refused = re.match(
            f"could not run {re.escape(four.func.__qualname__)}: the system refused to start rank (\\d) \\(BlockingIOError: ",
            message,
        )
        assert refused is not None and refused.group(1) in ("1", "2"), message
        assert "the cgroup limit pids.max is 3 (" in message and f"{group})" in message
        assert message.endswith(
            f"{refused.group(1)} of its 4 ranks could start. Ask for fewer ranks, or raise the limit."
        )
        assert "Traceback" not in message
    finally:
        with open(os.path.join(PIDS_CGROUPS, "cgroup.procs"), "w") as handle:
            handle.write(str(helper))
        os.rmdir(group)
    assert four.distributed() == [1] * 4
