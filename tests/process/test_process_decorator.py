"""``@distributed`` in this very process: real ranks, results, failures, output, shared memory."""

from __future__ import annotations

import glob
import os
import re
import sys
import time
from typing import Any, Iterator

import cloudpickle
import pytest
from harness import air_magic_processes, helper_processes, wait_until

import air_magic
from air_magic import (
    DirectCallError,
    LaunchTimeoutError,
    RankCrashedError,
    ResultError,
    distributed,
)
from air_magic.errors import RankTraceback

pytestmark = pytest.mark.process

# The functions below travel by value, as a notebook's do (this module is not
# importable in a rank the way the kernel's __main__ is not).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", autouse=True)
def private_tracking_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    yield
    if old is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = old


def launcher() -> Any:
    from air_magic.kernel.launcher import get_launcher

    return get_launcher()


def launch_dirs() -> list[str]:
    return sorted(n for n in os.listdir(launcher().session_dir) if re.match(r"\d{4}-", n))


@distributed(num_accelerators=2, tracking=False)
def rank_info(x: Any) -> tuple[int, int, Any]:
    import os

    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), x


def assert_next_launch_works() -> None:
    assert rank_info.distributed("again") == [(0, 2, "again"), (1, 2, "again")]


def test_distributed_returns_one_value_per_rank_in_rank_order() -> None:
    assert rank_info.distributed({"lr": 0.1}) == [(0, 2, {"lr": 0.1}), (1, 2, {"lr": 0.1})]
    assert rank_info.distributed(x=[1, 2]) == [(0, 2, [1, 2]), (1, 2, [1, 2])]


def test_wrong_call_signature_is_a_type_error_before_any_process_starts() -> None:
    before = launch_dirs()
    with pytest.raises(TypeError, match="too many positional arguments"):
        rank_info.distributed(1, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'y'"):
        rank_info.distributed(1, y=2)
    with pytest.raises(TypeError, match="missing a required argument: 'x'"):
        rank_info.distributed()
    assert launch_dirs() == before
    assert not launcher().launches


def test_calling_the_decorated_object_directly_names_both_ways() -> None:
    with pytest.raises(DirectCallError) as info:
        rank_info(1)
    message = str(info.value)
    assert "rank_info.distributed(" in message
    assert "rank_info.func(" in message
    assert isinstance(info.value, TypeError)


def test_func_is_the_original_function_and_runs_here() -> None:
    @distributed(num_accelerators=2, tracking=False)
    def add(a: int, b: int = 1) -> int:
        return a + b

    before = launch_dirs()
    assert add.func(2, b=5) == 7
    assert launch_dirs() == before


def test_with_overrides_runs_one_rank() -> None:
    one = rank_info.with_overrides(num_accelerators=1)
    assert one.num_accelerators == 1
    assert rank_info.num_accelerators == 2  # the original is untouched
    assert one.distributed("solo") == [(0, 1, "solo")]


@distributed(num_accelerators=2, tracking=False)
def fail_on_rank_one(rank_to_fail: int) -> int:
    import os
    import time

    rank = int(os.environ["RANK"])
    if rank == rank_to_fail:
        raise ValueError(f"bad batch on rank {rank}")
    time.sleep(60)
    return rank


def test_exception_on_rank_one_reraised_with_its_type_and_rank_zero_stopped_fast() -> None:
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        fail_on_rank_one.distributed(1)
    elapsed = time.monotonic() - start
    assert elapsed < 5, f"rank 0 was not stopped fast: {elapsed:.1f} s"
    exc = info.value
    assert type(exc) is ValueError
    assert str(exc) == "bad batch on rank 1"
    notes = "\n".join(getattr(exc, "__notes__", []))
    assert "[air_magic] raised on rank 1 of 2; rank 0 was stopped by air_magic." in notes
    assert isinstance(exc.__cause__, RankTraceback)
    tb = exc.__cause__.text
    assert 'raise ValueError(f"bad batch on rank {rank}")' in tb
    assert "in fail_on_rank_one" in tb
    assert "ValueError: bad batch on rank 1" in tb
    assert_next_launch_works()


@distributed(num_accelerators=2, tracking=False)
def exit_three() -> None:
    import os
    import time

    if os.environ["RANK"] == "1":
        os._exit(3)
    time.sleep(60)


def test_os_exit_is_a_rank_crash_with_its_code() -> None:
    start = time.monotonic()
    with pytest.raises(RankCrashedError) as info:
        exit_three.distributed()
    assert time.monotonic() - start < 5
    exc = info.value
    assert "rank 1 of 2 exited with code 3" in str(exc)
    assert (exc.rank, exc.world_size, exc.returncode) == (1, 2, 3)
    assert_next_launch_works()


@distributed(num_accelerators=2, tracking=False)
def die_by_signal(name: str) -> None:
    import ctypes
    import os
    import signal
    import time

    if os.environ["RANK"] == "1":
        if name == "SIGSEGV":
            ctypes.string_at(0)
        os.kill(os.getpid(), getattr(signal, name))
    time.sleep(60)


def test_sigkill_on_a_rank_says_possibly_out_of_memory() -> None:
    with pytest.raises(RankCrashedError) as info:
        die_by_signal.distributed("SIGKILL")
    message = str(info.value)
    assert "rank 1 of 2 was killed by SIGKILL (exit -9)" in message
    assert "out of memory" in message
    assert info.value.returncode == -9
    assert_next_launch_works()


def test_segfault_on_a_rank_is_named() -> None:
    with pytest.raises(RankCrashedError) as info:
        die_by_signal.distributed("SIGSEGV")
    message = str(info.value)
    assert "rank 1 of 2 was killed by SIGSEGV" in message
    assert "segmentation fault" in message
    assert_next_launch_works()


@distributed(num_accelerators=2, tracking=False)
def hang_in_collective() -> float:
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group()
    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 gave up before the all_reduce")
    t = torch.ones(1)
    dist.all_reduce(t)  # never completes: rank 1 is gone
    return t.item()


def test_hang_in_a_collective_fails_fast_naming_the_failed_rank() -> None:
    # Rank 0's all_reduce often fails too ("Connection reset by peer") and both exits
    # can arrive together: several rounds, so that either order is met.
    for _ in range(8):
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            hang_in_collective.distributed()
        elapsed = time.monotonic() - start
        assert elapsed < 10, elapsed
        assert str(info.value) == "rank 1 gave up before the all_reduce"
        # Rank 1 failed first; rank 0 is described as it really ended: stopped, or failed in
        # the all_reduce that lost its peer.
        assert re.search(
            r"raised on rank 1 of 2(, the first to fail)?; rank 0 (was stopped by air_magic|"
            r"failed too \(RuntimeError: )",
            "\n".join(info.value.__notes__),
        ), info.value.__notes__
    assert_next_launch_works()


def test_timeout_stops_every_rank_and_says_how_to_change_it() -> None:
    sleepy = fail_on_rank_one.with_overrides(timeout=2)
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:
        sleepy.distributed(-1)  # no rank fails; both sleep 60 s
    elapsed = time.monotonic() - start
    assert 2 <= elapsed < 8, elapsed
    message = str(info.value)
    assert "ran past its timeout of 2 s" in message
    assert "timeout=None" in message
    assert isinstance(info.value, TimeoutError)
    assert_next_launch_works()


@distributed(num_accelerators=2, tracking=False)
def return_a_lock() -> Any:
    import os
    import threading

    return threading.Lock() if os.environ["RANK"] == "1" else 0


def test_unpicklable_return_value_names_rank_and_type() -> None:
    with pytest.raises(ResultError) as info:
        return_a_lock.distributed()
    message = str(info.value)
    assert "rank 1 of 2 returned a _thread.lock" in message
    assert "cannot pickle '_thread.lock' object" in message
    assert info.value.rank == 1
    assert_next_launch_works()


@distributed(num_accelerators=2, tracking=False)
def return_a_rank_only_class() -> Any:
    # The value pickles on the rank, but its class lives in a module only the rank can import.
    import os
    import sys
    import tempfile

    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "air_magic_rank_only_mod.py"), "w") as handle:
        handle.write("class Thing:\n    pass\n")
    sys.path.insert(0, folder)
    import air_magic_rank_only_mod

    return air_magic_rank_only_mod.Thing() if os.environ["RANK"] == "1" else 0


def test_return_value_the_kernel_cannot_load_names_the_rank() -> None:
    launch = return_a_rank_only_class.submit()
    with pytest.raises(ResultError) as info:
        launch.result(timeout=60)
    message = str(info.value)
    assert "rank 1 of 2" in message
    assert "No module named 'air_magic_rank_only_mod'" in message
    assert info.value.rank == 1
    assert launch.status == "failed"
    assert_next_launch_works()


@distributed(num_accelerators=2, tracking=False)
def big_tensor(numel: int) -> Any:
    import os

    import torch

    return torch.full((numel,), float(os.environ["RANK"]) + 0.5)


def shm_entries() -> list[str]:
    return sorted(glob.glob(f"/dev/shm/air_magic-{os.getpid()}-*/*"))


def test_large_tensors_come_back_through_shared_memory_and_leave_nothing() -> None:
    import torch

    numel = 16 * 1024 * 1024  # 64 MB of float32 per rank
    values = big_tensor.distributed(numel)
    assert [tuple(v.shape) for v in values] == [(numel,), (numel,)]
    assert [v.dtype for v in values] == [torch.float32, torch.float32]
    assert torch.equal(values[0], torch.full((numel,), 0.5))
    assert torch.equal(values[1], torch.full((numel,), 1.5))
    shm_root = launcher().shm_root
    assert shm_root is not None and shm_root.startswith("/dev/shm/air_magic-")
    # while the result is still held: the launch's folder and its files are gone already
    assert shm_entries() == []
    del values
    assert shm_entries() == []
    assert os.listdir(shm_root) == []
    assert_next_launch_works()


@distributed(num_accelerators=2, tracking=False)
def chatty(lines: int) -> int:
    import os

    rank = int(os.environ["RANK"])
    for i in range(lines):
        print(f"rank{rank} line {i}")
    return rank


def test_rank_zero_output_is_streamed_and_rank_one_output_is_in_its_log(capfd: pytest.CaptureFixture[str]) -> None:
    assert chatty.distributed(5) == [0, 1]
    out = capfd.readouterr().out
    printed = [line for line in out.splitlines() if not line.startswith("[air_magic]")]
    assert printed == [f"rank0 line {i}" for i in range(5)]
    assert "rank1" not in out


def test_submit_returns_a_launch_handle() -> None:
    launch = chatty.submit(3)
    assert launch.result(timeout=60) == [0, 1]
    assert launch.done() is True
    assert launch.status == "finished"
    assert len(launch.log_paths) == 2
    with open(launch.log_paths[1]) as handle:
        assert handle.read().splitlines() == [f"rank1 line {i}" for i in range(3)]
    with open(launch.log_paths[0]) as handle:
        assert handle.read().splitlines() == [f"rank0 line {i}" for i in range(3)]


@distributed(num_accelerators=2, tracking=False)
def payload_size(blob: bytes) -> int:
    return len(blob)


def test_large_argument_warns_naming_it_at_the_callers_line() -> None:
    from air_magic import capture

    old = capture.settings.warn_mb
    capture.settings.warn_mb = 1
    try:
        with pytest.warns(capture.CaptureWarning) as record:
            assert payload_size.distributed(b"x" * 5_000_000) == [5_000_000, 5_000_000]
    finally:
        capture.settings.warn_mb = old
    assert len(record) == 1
    message = str(record[0].message)
    assert "'argument 0' is 5 MB once pickled and is sent to every rank" in message
    assert "Load or build it inside 'payload_size' instead" in message
    assert record[0].filename == __file__


LOCK_GLOBAL = __import__("threading").Lock()


@distributed(num_accelerators=2, tracking=False)
def uses_a_lock(arg: Any) -> bool:
    return LOCK_GLOBAL.locked()


def test_unpicklable_global_and_argument_are_named_before_launch() -> None:
    import threading

    before = launch_dirs()
    with pytest.raises(air_magic.CaptureError) as info:
        uses_a_lock.distributed(threading.Event())
    message = str(info.value)
    assert "'LOCK_GLOBAL'" in message and "'argument 0'" in message
    assert "- LOCK_GLOBAL (_thread.lock)" in message
    assert "- argument 0 (threading.Event)" in message
    assert "cannot be pickled" in message
    assert launch_dirs() == before


@distributed(num_accelerators=2, tracking=False)
def thread_settings() -> tuple[str | None, int]:
    import os

    import torch

    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def test_omp_num_threads_set_in_the_kernel_is_kept() -> None:
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "3"
    try:
        assert thread_settings.distributed() == [("3", 3), ("3", 3)]
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old
    default = thread_settings.distributed()
    assert default[0][0] is not None and int(default[0][0]) >= 1
    assert default[0][1] == int(default[0][0])


def test_a_launch_handle_is_exported_and_tells_its_error_as_a_future_does() -> None:
    launch = chatty.submit(1)
    assert isinstance(launch, air_magic.Launch)
    assert launch.exception(timeout=60) is None
    running = fail_on_rank_one.submit(-1)  # both ranks sleep 60 s
    with pytest.raises(TimeoutError, match=f"launch {running.id} is still running after 0 s"):
        running.exception(timeout=0)
    running.cancel()
    error = running.exception(timeout=10)
    assert isinstance(error, air_magic.LaunchCancelledError)
    with pytest.raises(air_magic.LaunchCancelledError) as info:
        running.result()
    assert info.value is error


def test_cancel_stops_a_submitted_launch() -> None:
    launch = fail_on_rank_one.submit(-1)  # both ranks sleep 60 s
    assert wait_until(lambda: launch.status == "running", timeout=30)
    start = time.monotonic()
    assert launch.cancel() is True
    with pytest.raises(air_magic.LaunchCancelledError, match="was cancelled; its 2 ranks were stopped"):
        launch.result(timeout=10)
    assert time.monotonic() - start < 3
    assert launch.status == "cancelled"
    assert launch.cancel() is False  # already over
    assert_next_launch_works()


def test_cancel_is_refused_once_the_outcome_is_known_while_observers_are_told_of_the_end() -> None:
    """A front end (the lab's list, the panel) may show the outcome before the launch is
    done: a Stop then does nothing and says so, and the outcome stays."""
    from air_magic.kernel.launcher import Launcher

    seen: dict[str, Any] = {}

    class Late:
        def before_start(self, launch: Any, env: dict[str, str]) -> None:
            pass

        def before_end(self, launch: Any) -> None:
            seen["status"], seen["cancelled"] = launch.status, launch.cancel()

        def after_end(self, launch: Any) -> None:
            pass

    def factory(launch: Any) -> Late:
        return Late()

    Launcher.add_observer(factory)
    try:
        assert chatty.distributed(2) == [0, 1]
    finally:
        Launcher._observer_factories.remove(factory)
    assert seen == {"status": "finished", "cancelled": False}


@distributed(num_accelerators=2, tracking=False)
def raise_unrebuildable() -> None:
    import os
    import time

    class NeedsTwoArgs(Exception):
        def __init__(self, a: Any, b: Any) -> None:
            super().__init__(f"{a}/{b}")

    if os.environ["RANK"] == "1":
        time.sleep(1.0)  # rank 0 returns at once: it has ended (on a loaded machine too)
        raise NeedsTwoArgs("left", "right")


def test_exception_that_cannot_be_rebuilt_is_a_rank_failed_error() -> None:
    with pytest.raises(air_magic.RankFailedError) as info:
        raise_unrebuildable.distributed()
    exc = info.value
    type_name = f"{__name__}.raise_unrebuildable.<locals>.NeedsTwoArgs"
    assert f"rank 1 of 2 raised {type_name}: left/right; rank 0 finished." in str(exc)  # it returned at once
    assert (exc.rank, exc.exc_type, exc.exc_message) == (1, type_name, "left/right")
    assert 'raise NeedsTwoArgs("left", "right")' in exc.traceback_text
    assert_next_launch_works()


@distributed(num_accelerators=2, tracking=False)
def reduce_and_port(value: float) -> tuple[float, str]:
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group()
    time.sleep(0.5)  # both launches are up at the same time
    t = torch.tensor([value * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item(), os.environ["MASTER_PORT"]


def test_concurrent_launches_in_one_process_do_not_collide() -> None:
    first = reduce_and_port.submit(1.0)
    second = reduce_and_port.submit(10.0)
    a, b = first.result(timeout=60), second.result(timeout=60)
    assert [v[0] for v in a] == [3.0, 3.0]
    assert [v[0] for v in b] == [30.0, 30.0]
    assert a[0][1] == a[1][1] and b[0][1] == b[1][1]
    assert a[0][1] != b[0][1]


def test_helper_killed_during_a_launch_fails_it_and_the_next_launch_works() -> None:
    launch = fail_on_rank_one.submit(-1)  # both ranks sleep 60 s
    assert wait_until(lambda: launch.status == "running", timeout=30)
    ranks = [state.pid for state in launch.ranks]
    helper = launcher()._helper.proc.pid
    os.kill(helper, 9)
    with pytest.raises(air_magic.LaunchError, match="the air_magic helper process died"):
        launch.result(timeout=10)

    def ranks_gone() -> bool:
        alive = [p for p in air_magic_processes() if p.pid in ranks]
        return not alive

    assert wait_until(ranks_gone, timeout=5)
    assert_next_launch_works()
    assert launcher()._helper.proc.pid != helper


def _describe_helpers(pids: list[int]) -> str:
    """Each helper, its parent and how long they have been running: whose it was."""
    import time

    import psutil

    rows = []
    for pid in pids:
        try:
            helper = psutil.Process(pid)
            parent = helper.parent()
            owner = f"{parent.pid} {' '.join(parent.cmdline()[:6])}" if parent else "none"
            rows.append(f"{pid} ({time.time() - helper.create_time():.0f} s old, {helper.status()}), parent: {owner}")
        except psutil.Error as exc:
            rows.append(f"{pid}: {exc}")
    return "; ".join(rows)


def only_current_helper(current: Any) -> list[Any]:
    """The launcher's own helper, alone: a helper of an earlier launcher of this process
    (killed or shut down by an earlier test) may still be on its way out, and must be
    gone within 5 s."""
    own = current._helper.proc.pid
    helpers = helper_processes()
    assert own in [h.pid for h in helpers]
    others = [h.pid for h in helpers if h.pid != own]
    if not wait_until(lambda: not [h for h in helper_processes() if h.pid in others], timeout=5):
        pytest.fail(f"an earlier helper is still there: {_describe_helpers(others)}")
    return [h for h in helper_processes() if h.pid == own]


def test_session_files_are_private_and_the_helper_listens_nowhere_between_launches() -> None:
    launch = chatty.submit(1)
    assert launch.result(timeout=60) == [0, 1]
    current = launcher()
    for folder in (current.session_dir, current.shm_root, launch.log_dir, os.path.dirname(launch.log_dir)):
        assert folder is not None
        assert os.stat(folder).st_mode & 0o777 == 0o700, folder
    assert not os.path.exists(launch.work_dir)  # the logs are kept elsewhere: nothing else stays
    for path in launch.log_paths:
        assert os.stat(path).st_mode & 0o077 == 0, path
    helpers = only_current_helper(current)
    sockets = helpers[0].net_connections(kind="all")
    assert [c for c in sockets if c.status == "LISTEN"] == []


def test_launcher_shutdown_takes_the_helper_and_its_files() -> None:
    assert rank_info.distributed(0) == [(0, 2, 0), (1, 2, 0)]
    current = launcher()
    only_current_helper(current)
    session_dir, shm_root = current.session_dir, current.shm_root
    assert os.path.isdir(session_dir)
    current.shutdown()
    assert wait_until(lambda: not air_magic_processes(), timeout=5), [p.pid for p in air_magic_processes()]
    assert not os.path.exists(session_dir)
    assert shm_root is None or not os.path.exists(shm_root)
    # a new launcher (and helper) comes up for the next launch
    assert rank_info.distributed(1) == [(0, 2, 1), (1, 2, 1)]
    air_magic.kernel.launcher.get_launcher().shutdown()
    assert wait_until(lambda: not air_magic_processes(), timeout=5)


def test_a_cancelled_launch_s_ranks_log_that_they_were_stopped() -> None:
    launch = fail_on_rank_one.submit(-1)  # both ranks sleep 60 s
    assert wait_until(lambda: launch.status == "running", timeout=30)
    time.sleep(0.5)
    launch.cancel()
    with pytest.raises(air_magic.LaunchCancelledError):
        launch.result(timeout=10)
    for path in launch.log_paths:
        with open(path, encoding="utf-8") as handle:
            log = handle.read()
        assert "[air_magic] this rank was stopped by air_magic" in log, log
        assert "this rank failed" not in log, log


@distributed(num_accelerators=1, tracking=False, panel=False)
def progress_bar(steps: int) -> int:
    for step in range(steps + 1):
        print(f"\rstep {step}/{steps} " + "#" * (step * 40 // steps), end="", flush=True)
    print(flush=True)
    print("after the bar", flush=True)
    return steps


def test_carriage_return_progress_is_kept_at_its_last_state(capsys: pytest.CaptureFixture[str]) -> None:
    assert progress_bar.distributed(3000) == [3000]
    out = capsys.readouterr().out
    # The cell (here stdout) gets a few states of the bar, not 3000, and its last one once.
    assert out.count("step ") < 10, out[:2000]
    assert out.count("step 3000/3000") == 1, out[-2000:]
    assert "after the bar" in out
    # The saved log (MLflow's logs/rank-0.log artifact) holds the bar's last state only.
    launch = progress_bar.last_launch
    assert launch is not None
    with open(launch.log_paths[0], encoding="utf-8") as handle:
        log = handle.read()
    assert "\r" not in log
    assert log.splitlines()[:2] == ["step 3000/3000 " + "#" * 40, "after the bar"], log[:500]
