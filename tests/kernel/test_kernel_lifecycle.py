"""The fault matrix at the kernel level: interrupts, kernel kill, restart and shutdown."""

from __future__ import annotations

import glob
import os
import re
import signal
import tempfile
import time
from typing import Any, Callable

import psutil
import pytest
from harness import Kernel, air_magic_processes, describe, helper_processes, rank_processes, wait_until

pytestmark = pytest.mark.kernel

SLEEPER = '%%distributed -n 2\nimport time\nprint("started", flush=True)\ntime.sleep(60)\n'


def kernel_helpers(k: Kernel) -> list[psutil.Process]:
    return [p for p in helper_processes() if p.ppid() == k.pid]


def start_sleeper(k: Kernel, code: str = SLEEPER) -> tuple[str, list[int]]:
    """Start a blocking launch and wait until both ranks run; returns (msg_id, rank pids)."""
    msg_id = k.execute(code)
    k.collect(msg_id, timeout=60, until=lambda r: "started" in r.stdout)
    assert wait_until(lambda: len(ranks_of(k)) >= 2, timeout=10), describe(air_magic_processes())
    return msg_id, [p.pid for p in ranks_of(k)]


def ranks_of(k: Kernel) -> list[psutil.Process]:
    helpers = {p.pid for p in kernel_helpers(k)}
    return [p for p in rank_processes() if p.ppid() in helpers]


def session_paths(kernel_pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"air_magic-{kernel_pid}-*")) + glob.glob(
        f"/dev/shm/air_magic-{kernel_pid}-*"
    )


def all_gone(pids: list[int]) -> Callable[[], bool]:
    def check() -> bool:
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                pass
        return True

    return check


def assert_launch_works(k: Kernel) -> None:
    res = k.run('%%distributed -n 2\nimport os\nint(os.environ["RANK"])')
    assert res.error is None, res.error_text
    assert res.result == "[0, 1]"


@pytest.mark.parametrize("how", ["interrupt_kernel", "sigint_to_kernel_pid"])
def test_interrupt_stops_the_ranks_and_keeps_the_helper(kernel: Kernel, how: str) -> None:
    assert_launch_works(kernel)  # helper up and warm
    helpers_before = [p.pid for p in kernel_helpers(kernel)]
    assert len(helpers_before) == 1
    msg_id, ranks = start_sleeper(kernel)
    assert len(ranks) == 2
    start = time.monotonic()
    if how == "interrupt_kernel":
        kernel.km.interrupt_kernel()  # SIGINT to the kernel's process group, as Jupyter does
    else:
        os.kill(kernel.pid, signal.SIGINT)
    res = kernel.collect(msg_id, timeout=30)
    elapsed = time.monotonic() - start
    assert res.error is not None and res.error["ename"] == "KeyboardInterrupt"
    assert re.fullmatch(
        r"Cell In\[\d+\] was cancelled: you interrupted it after \d+\.\d s; its 2 ranks were stopped\.",
        res.error["evalue"],
    )
    assert elapsed < 2.5, elapsed
    assert wait_until(all_gone(ranks), timeout=1), describe(rank_processes())
    assert not ranks_of(kernel)
    assert [p.pid for p in kernel_helpers(kernel)] == helpers_before
    assert_launch_works(kernel)


def test_interrupt_stops_ranks_that_ignore_sigint_and_sigterm(kernel: Kernel) -> None:
    code = (
        "%%distributed -n 2\n"
        "import signal, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        'print("started", flush=True)\n'
        "time.sleep(60)\n"
    )
    msg_id, ranks = start_sleeper(kernel, code)
    start = time.monotonic()
    kernel.km.interrupt_kernel()
    res = kernel.collect(msg_id, timeout=30)
    elapsed = time.monotonic() - start
    assert res.error is not None and res.error["ename"] == "KeyboardInterrupt"
    assert elapsed < 5, elapsed  # SIGINT, then SIGTERM, then SIGKILL
    assert wait_until(all_gone(ranks), timeout=1), describe(rank_processes())
    assert_launch_works(kernel)


def test_dataloader_workers_die_with_their_rank_on_interrupt(kernel: Kernel) -> None:
    code = (
        "%%distributed -n 2\n"
        "import time\n"
        "from torch.utils.data import DataLoader, Dataset\n"
        "class Slow(Dataset):\n"
        "    def __len__(self):\n"
        "        return 100_000\n"
        "    def __getitem__(self, i):\n"
        "        time.sleep(0.05)\n"
        "        return i\n"
        "for n, batch in enumerate(DataLoader(Slow(), batch_size=1, num_workers=2)):\n"
        "    if n == 0:\n"
        '        print("started", flush=True)\n'
    )
    msg_id, _ = start_sleeper(kernel, code)
    # 2 ranks, each with 2 workers
    assert wait_until(lambda: len(ranks_of_tree(kernel)) >= 6, timeout=20), describe(rank_processes())
    tree = [p.pid for p in ranks_of_tree(kernel)]
    kernel.km.interrupt_kernel()
    res = kernel.collect(msg_id, timeout=30)
    assert res.error is not None and res.error["ename"] == "KeyboardInterrupt"
    assert wait_until(all_gone(tree), timeout=3), describe(rank_processes())
    assert_launch_works(kernel)


def ranks_of_tree(k: Kernel) -> list[psutil.Process]:
    """Ranks of this kernel and everything below them."""
    found = []
    for helper in kernel_helpers(k):
        try:
            found.extend(helper.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return found


def test_kernel_killed_with_sigkill_takes_ranks_and_helper(kernel_factory: Any) -> None:
    k = kernel_factory()
    assert_launch_works(k)
    _, ranks = start_sleeper(k)
    helpers = [p.pid for p in kernel_helpers(k)]
    assert len(helpers) == 1
    kernel_pid = k.pid
    os.kill(kernel_pid, signal.SIGKILL)
    k.forget()
    start = time.monotonic()
    assert wait_until(all_gone(ranks + helpers), timeout=5), describe(air_magic_processes())
    elapsed = time.monotonic() - start
    assert elapsed < 5
    # and the helper took the session's private folders with it
    assert wait_until(lambda: not session_paths(kernel_pid), timeout=3), session_paths(kernel_pid)
    k.shutdown()


def test_kernel_killed_while_the_helper_is_still_preloading(kernel_factory: Any, tmp_path: Any) -> None:
    # A heavy AIR_MAGIC_PRELOAD (here: a module that takes 30 s to import) must not keep
    # the helper alive after its kernel is gone.
    (tmp_path / "air_magic_slow_preload.py").write_text("import time\ntime.sleep(30)\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    k = kernel_factory(extra_env={"AIR_MAGIC_PRELOAD": "air_magic_slow_preload", "PYTHONPATH": path}, load=False)
    k.ok("%load_ext air_magic")
    assert wait_until(lambda: len(kernel_helpers(k)) == 1, timeout=5)
    helpers = [p.pid for p in kernel_helpers(k)]
    kernel_pid = k.pid
    time.sleep(0.5)  # the helper is inside the import now
    os.kill(kernel_pid, signal.SIGKILL)
    k.forget()
    assert wait_until(all_gone(helpers), timeout=5), describe(air_magic_processes())
    assert wait_until(lambda: not session_paths(kernel_pid), timeout=3), session_paths(kernel_pid)
    k.shutdown()


@pytest.mark.parametrize("now", [False, True], ids=["graceful-restart", "immediate-restart"])
def test_kernel_restart_during_a_launch(kernel_factory: Any, now: bool) -> None:
    k = kernel_factory()
    _, ranks = start_sleeper(k)
    helpers = [p.pid for p in kernel_helpers(k)]
    old_pid = k.pid
    requested = time.monotonic()
    k.km.restart_kernel(now=now)
    k.refresh_pid()
    assert k.pid != old_pid
    assert wait_until(all_gone(ranks + helpers), timeout=5), describe(air_magic_processes())
    assert time.monotonic() - requested < 5  # counted from the restart request
    assert wait_until(lambda: not session_paths(old_pid), timeout=3), session_paths(old_pid)
    k.kc.wait_for_ready(timeout=60)
    k.ok("%load_ext air_magic")
    k.ok("%config DistributedMagics.tracking = False")
    assert_launch_works(k)
    k.shutdown()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "during-launch"])
def test_graceful_shutdown_removes_helper_ranks_and_session_folder(kernel_factory: Any, busy: bool) -> None:
    k = kernel_factory()
    assert_launch_works(k)
    kernel_pid = k.pid
    paths = session_paths(kernel_pid)
    assert len(paths) == 2, paths  # /tmp/air_magic-<pid>-* and /dev/shm/air_magic-<pid>-*
    pids = [p.pid for p in kernel_helpers(k)]
    assert len(pids) == 1
    if busy:
        _, ranks = start_sleeper(k)
        pids += ranks
    requested = time.monotonic()
    k.shutdown()
    assert wait_until(all_gone(pids), timeout=5), describe(air_magic_processes())
    assert time.monotonic() - requested < 5  # counted from the shutdown request
    assert wait_until(lambda: not session_paths(kernel_pid), timeout=3), session_paths(kernel_pid)
