"""A pool never lies (issue "trust, round three"), in a real kernel as a notebook meets it: a
reply is always its own call's, a fork's child never answers, a cell runs where the notebook
is, re-made pools leave nothing behind, a restart or close under a running call never touches
the new ranks, a failed restart leaves no pool the magics cannot remove, every reason is the
true one, and the limits are bounded and said."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterator

import pytest
from harness import Kernel, gone, kernel_with_a_pool, pool_pids, the_pool_stays, values, wait_until

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def k(kernel_factory: Any) -> Iterator[Kernel]:
    yield from kernel_with_a_pool(kernel_factory, "import air_magic, os, sys, time")


@pytest.fixture(autouse=True)
def the_pool_may_stay(k: Kernel) -> Iterator[None]:
    """The module's pool outlives each test (its ranks are not leftovers); nothing else may."""
    yield from the_pool_stays(k)


def ensure_pool(k: Kernel) -> None:
    if not k.value("air_magic.Pool.current() is not None and air_magic.Pool.current().state == 'idle'"):
        k.ok("%distributed_pool --stop" if k.value("air_magic.Pool.current() is not None") else "0")
        k.ok("%distributed_pool -n 2 --no-tracking", timeout=180)


# -- 1. a reply is its own call's ------------------------------------------------------------------


def test_a_cell_that_forks_returns_the_rank_s_values_and_the_next_cell_its_own(k: Kernel) -> None:
    ensure_pool(k)
    res = k.run("%%distributed --pool\nimport os\npid = os.fork()\n'child' if pid == 0 else 'parent'")
    assert values(res) == ["parent", "parent"]
    [line] = [x for x in res.stderr.splitlines() if "os.fork()" in x]
    assert line.startswith("[air_magic] Cell In[") and " forked processes " in line and " on ranks 0, 1 " in line
    assert line.endswith(
        "with os.fork(): only the rank itself answers the kernel (these values are its own), and a forked "
        "process that runs on to the end of the cell ends there."
    )
    assert values(k.run("%%distributed --pool\n'next'")) == ["next", "next"]
    assert values(k.run("%%distributed --pool\n'after'")) == ["after", "after"]
    assert k.value("air_magic.Pool.current().state") == "idle"


def test_a_frame_the_rank_s_code_writes_on_its_connection_breaks_the_pool_and_says_why(k: Kernel) -> None:
    ensure_pool(k)
    cell = (
        "%%distributed --pool\n"
        "import gc, os\n"
        "from multiprocessing.connection import Connection\n"
        "if os.environ['RANK'] == '1':\n"
        "    [c for c in gc.get_objects() if isinstance(c, Connection)][0].send_bytes(b'x')\n"
        "'sent'"
    )
    res = k.run(cell)
    assert res.error is not None and res.error["ename"] == "PoolBrokenError", res.stdout
    assert (
        "rank 1 sent the kernel something that is not a reply (UnpicklingError: invalid load key, 'x'."
        in (res.error["evalue"])
    )
    assert res.error["evalue"].endswith(
        "Its values cannot be trusted, so the pool is broken: the next pool cell starts 2 fresh ranks (the state "
        "of these is lost)."
    )
    assert k.value("air_magic.Pool.current().state") == "broken"
    assert values(k.run("%%distributed --pool\n'fresh'", timeout=120)) == ["fresh", "fresh"]


def test_a_reply_to_another_call_breaks_the_pool_instead_of_giving_its_values(k: Kernel) -> None:
    ensure_pool(k)
    cell = (
        "%%distributed --pool\n"
        "import gc, os, cloudpickle\n"
        "from multiprocessing.connection import Connection\n"
        "from air_magic.protocol import ValueRecord\n"
        "from air_magic.protocol.pool import CallDone\n"
        "if os.environ['RANK'] == '0':  # a well-formed reply, to a call that is not this one\n"
        "    conn = [c for c in gc.get_objects() if isinstance(c, Connection)][0]\n"
        "    conn.send(CallDone(10**6, cloudpickle.dumps(ValueRecord('stale')), [], []))\n"
        "'mine'"
    )
    res = k.run(cell)
    assert res.error is not None and res.error["ename"] == "PoolBrokenError", res.result
    assert "rank 0 answered call #1000000 while call #" in res.error["evalue"]
    assert "'stale'" not in (res.result or "")
    assert values(k.run("%%distributed --pool\n'fresh'", timeout=120)) == ["fresh", "fresh"]


# -- 5. where the notebook is --------------------------------------------------------------------


def test_a_pool_cell_runs_in_the_notebook_s_folder_path_and_environment_of_now(k: Kernel, tmp_path: Any) -> None:
    ensure_pool(k)
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "checkpoint_helpers.py").write_text("WHERE = 'imported from the new folder'\n")
    k.ok("before = os.getcwd()")
    k.ok(f"%cd {folder}")
    k.ok("os.environ['AIR_MAGIC_TEST_SETTING'] = 'one'\nos.environ['TRAIN_SETTING'] = 'two'")
    res = k.run(
        "%%distributed --pool\nimport os, checkpoint_helpers\n"
        "(os.getcwd(), checkpoint_helpers.WHERE, os.environ.get('TRAIN_SETTING'), os.environ['RANK'])"
    )
    assert values(res) == [
        (str(folder), "imported from the new folder", "two", "0"),
        (str(folder), "imported from the new folder", "two", "1"),
    ]
    k.ok("del os.environ['TRAIN_SETTING']\nos.environ['RANK'] = '7'")  # the rank's own stays its own
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "only_on_sys_path.py").write_text("X = 3\n")
    k.ok(f"sys.path.insert(0, {str(other)!r})")
    res = k.run(
        "%%distributed --pool\nimport os, only_on_sys_path\n(os.environ.get('TRAIN_SETTING'), os.environ['RANK'], "
        "only_on_sys_path.X)"
    )
    assert values(res) == [(None, "0", 3), (None, "1", 3)]
    k.ok("del os.environ['RANK']\nos.chdir(before)\nsys.path.remove(" + repr(str(other)) + ")")


# -- 6, 7, 9. pools made again, restarts and closes under a call, a failed restart -------------------


def test_making_a_pool_again_closes_the_earlier_one_and_says_so(k: Kernel) -> None:
    ensure_pool(k)
    first = pool_pids(k)
    res = k.ok("pool = air_magic.Pool(2, tracking=False)", timeout=180)
    assert res.stderr.splitlines()[-1].startswith("[air_magic] closed the kernel's earlier pool (2 ranks, ")
    assert res.stderr.splitlines()[-1].endswith("a kernel keeps one pool, and its state is gone.")
    second = pool_pids(k)
    assert wait_until(lambda: all(gone(p) for p in first), timeout=10)
    k.ok("pool = air_magic.Pool(2, tracking=False)", timeout=180)
    assert wait_until(lambda: all(gone(p) for p in second), timeout=10)
    assert k.value("len(__import__('air_magic.kernel.pool.engine').kernel.pool.engine.open_pools())") == 1
    third = pool_pids(k)
    k.ok("%distributed_pool --stop")
    assert wait_until(lambda: all(gone(p) for p in third), timeout=10)
    assert k.value("air_magic.Pool.current() is None")
    ensure_pool(k)


@pytest.mark.parametrize("how", ["restart", "close"])
def test_a_restart_or_close_under_a_submitted_call_ends_that_call_and_never_touches_the_new_pool(
    k: Kernel, how: str
) -> None:
    ensure_pool(k)
    k.ok("pool = air_magic.Pool.current()\ndef sleeps():\n    import time\n    time.sleep(30)")
    for _ in range(5 if how == "restart" else 1):
        k.ok("h = pool.submit(sleeps)\ntime.sleep(0.5)")
        k.ok(f"pool.{how}()", timeout=120)
        res = k.run("h.result(timeout=30)")
        assert res.error is not None and res.error["ename"] == "PoolBrokenError", res.result
        verb = "restarted" if how == "restart" else "closed"
        assert res.error["evalue"] == (
            f"the pool was {verb} while sleeps ran on it (pool.{how}() or %distributed_pool "
            f"--{'restart' if how == 'restart' else 'stop'}); its ranks were stopped, so this call has no values."
        )
        if how == "restart":
            assert k.value("pool.state") == "idle"
            assert k.value("pool.run(int)") == [0, 0]
    if how == "close":
        assert k.value("pool.state") == "closed"
        assert k.value("air_magic.Pool.current() is None")


def test_a_restart_that_fails_leaves_no_pool_the_magics_cannot_remove(k: Kernel) -> None:
    ensure_pool(k)
    k.ok("os.environ['AIR_MAGIC_OUTPUT_LIMIT'] = 'a lot'")
    try:
        res = k.run("%distributed_pool --restart")
        assert res.error is not None and res.error["ename"] == "ConfigurationError", res.stdout
        assert "AIR_MAGIC_OUTPUT_LIMIT" in res.error["evalue"]
        assert "the pool's restart failed, so the pool is closed" in res.error_text
    finally:
        k.ok("del os.environ['AIR_MAGIC_OUTPUT_LIMIT']")
    said = k.ok("%distributed_pool").stdout
    assert said.strip() == (
        "[air_magic] this kernel has no pool; start one with %distributed_pool -n N (or a %%distributed --pool cell)."
    )
    k.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
    assert k.value("air_magic.Pool.current().run(int)") == [0, 0]


# -- 10. the true reasons --------------------------------------------------------------------------


def test_a_rank_that_exits_with_code_0_is_said_so_not_out_of_memory(k: Kernel) -> None:
    ensure_pool(k)
    res = k.run("%%distributed --pool\nimport os, time\nif os.environ['RANK'] == '1':\n    os._exit(0)\ntime.sleep(30)")
    assert res.error is not None, res.stdout
    assert res.error["evalue"].startswith(
        "rank 1 of 2 of the pool exited (code 0) without returning: something ended the process early "
        "(os._exit(0), or a library that exits), so the other ranks would have waited for it; the pool is broken "
        "(rank 1 ended (exit 0))"
    ), res.error["evalue"]
    assert "SIGKILL" not in res.error_text and "out of memory" not in res.error_text


def test_a_rank_that_closes_its_connection_is_said_so(k: Kernel) -> None:
    ensure_pool(k)
    cell = (
        "%%distributed --pool\n"
        "import gc, os, time\n"
        "from multiprocessing.connection import Connection\n"
        "if os.environ['RANK'] == '1':\n"
        "    [c for c in gc.get_objects() if isinstance(c, Connection)][0].close()\n"
        "time.sleep(20)"
    )
    begin = time.monotonic()
    res = k.run(cell)
    assert time.monotonic() - begin < 10
    assert res.error is not None, res.stdout
    assert res.error["evalue"].startswith(
        "rank 1 of 2 of the pool closed its connection to the kernel (its process had not ended); the pool is "
        "broken (rank 1 closed its connection to the kernel)"
    ), res.error["evalue"]
    assert "SIGKILL" not in res.error_text


def test_a_rank_that_raised_while_the_other_waits_is_named_as_it_was_and_the_stuck_one_as_stopped(
    k: Kernel,
) -> None:
    ensure_pool(k)
    k.ok(
        "def gives_up():\n"
        "    import os, torch, torch.distributed as dist\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise ValueError('rank 1 gave up')\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "h = air_magic.Pool.current().submit(gives_up)"
    )
    seen = []
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:  # while rank 0 waits: rank 1 is "failed", never a green "idle"
        seen.append(tuple(k.value("air_magic.Pool.current().status()['rank_states']")))
        time.sleep(0.2)
    res = k.run("h.result(timeout=30)")
    assert res.error is not None and res.error["ename"] == "ValueError", res.error_text
    assert "idle" not in {states[1] for states in seen}, seen
    assert ("running", "failed") in seen, seen
    assert "; rank 0 was stopped by air_magic." in res.error_text
    assert "failed too" not in res.error_text
    assert "[air_magic] where each rank was:" in res.error_text, res.error_text
    where = res.error_text[res.error_text.index("[air_magic] where each rank was:") :]
    assert "rank 0: in all_reduce (torch.distributed), called at Cell In[" in where, where
    assert "<air_magic cell" not in where
    assert "rank 1: had raised ValueError (its error is above)" in where
    assert k.value("air_magic.Pool.current().status()['rank_states']") == ["stopped", "failed"]
    ensure_pool(k)


def test_the_last_of_four_ranks_killed_is_named_whatever_its_neighbours_raise(kernel_factory: Any) -> None:
    kernel = kernel_factory()
    try:
        kernel.ok("import air_magic, os, signal, time")
        kernel.ok("%distributed_pool -n 4 --no-tracking", timeout=240)
        for attempt in range(4):
            pids = kernel.value("air_magic.Pool.current().status()['pids']")
            msg_id = kernel.execute(
                "%%distributed --pool\nimport torch, torch.distributed as dist, time\n"
                "for _ in range(100000):\n    dist.all_reduce(torch.ones(8))\n"
            )
            time.sleep(1.0)
            os.kill(pids[3], signal.SIGKILL)
            res = kernel.collect(msg_id, timeout=60)
            assert res.error is not None, res.stdout
            assert res.error["evalue"].startswith(
                "rank 3 of 4 of the pool was killed by SIGKILL (exit -9): possibly out of memory"
            ), (attempt, res.error["evalue"])
            assert "rank 3 was stopped by air_magic" not in res.error_text
            kernel.ok("%distributed_pool --restart", timeout=240)
    finally:
        kernel.shutdown()


def test_a_module_both_sides_have_is_never_said_to_be_the_pool_s_own(k: Kernel) -> None:
    ensure_pool(k)
    k.ok("import torch")
    k.ok("%%distributed --pool\nimport torch")
    res = k.run("%%distributed --pool\ntorch.ones(1).item()")
    assert values(res) == [1.0, 1.0]
    assert "torch: the pool's ranks have their own" not in res.stderr


# -- 11. limits ------------------------------------------------------------------------------------


def test_a_pool_s_logs_stay_bounded_while_it_lives(kernel_factory: Any) -> None:
    kernel = kernel_factory({"AIR_MAGIC_LOG_LIMIT": str(1 << 20)})
    try:
        kernel.ok("import air_magic")
        kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
        chatty = "%%distributed --pool\nimport sys\nfor i in range(30000):\n    print('x' * 60, i)\n"
        for _ in range(3):
            kernel.ok(chatty, timeout=120)
            kernel.ok("%%distributed --pool\n0")
            sizes = kernel.value(
                "[__import__('os').path.getsize(s.log_path) for s in air_magic.Pool.current()._engine.launch.ranks]"
            )
            assert all(size <= (1 << 20) + 1024 for size in sizes), sizes  # the limit, and the line of the cut
        kernel.ok("%%distributed --pool\nprint('still here')")
        res = kernel.ok("%%distributed --pool\nprint('and the next cell shows its own output')")
        assert res.stdout.strip() == "and the next cell shows its own output"
    finally:
        kernel.shutdown()


def test_a_long_temporary_folder_path_still_makes_a_pool(kernel_factory: Any, tmp_path: Any) -> None:
    long = tmp_path / ("a-temporary-folder-with-a-long-name-" + "x" * 40)
    long.mkdir()
    assert len(str(long)) > 78
    before = {n for n in os.listdir("/tmp") if n.startswith("am-")}
    kernel = kernel_factory({"TMPDIR": str(long)})
    try:
        kernel.ok("import air_magic")
        assert kernel.value("air_magic.Pool(2, tracking=False).run(int)", timeout=180) == [0, 0]
        assert {n for n in os.listdir("/tmp") if n.startswith("am-")} == before  # the socket's folder is gone
    finally:
        kernel.shutdown()


PIDS_CGROUPS = "/sys/fs/cgroup/pids"


@pytest.mark.skipif(not os.access(PIDS_CGROUPS, os.W_OK), reason="no writable cgroup v1 pids controller here")
def test_a_pool_larger_than_the_process_limit_is_refused_at_once_naming_the_limit(kernel_factory: Any) -> None:
    kernel = kernel_factory({"AIR_MAGIC_MAX_CPU_RANKS": "1000000"})
    group = os.path.join(PIDS_CGROUPS, f"air-magic-pool-test-{os.getpid()}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "pids.max"), "w") as handle:
            handle.write("500")
        with open(os.path.join(group, "cgroup.procs"), "w") as handle:
            handle.write(str(kernel.pid))
        kernel.ok("import air_magic")
        begin = time.monotonic()
        res = kernel.run("air_magic.Pool(10**6, tracking=False)", timeout=60)
        assert time.monotonic() - begin < 5
        assert res.error is not None and res.error["ename"] == "LaunchError", res.stdout
        assert res.error["evalue"].startswith(
            "could not run pool: it needs 1000000 rank processes, and the system lets "
        )
        assert "the cgroup limit pids.max is 500 (" in res.error["evalue"] and f"{group})" in res.error["evalue"]
        assert res.error["evalue"].endswith("Ask for fewer ranks, or raise the limit.")
        assert kernel.value("air_magic.Pool.current() is None")
    finally:
        kernel.shutdown()
        with open(os.path.join(PIDS_CGROUPS, "cgroup.procs"), "w") as handle:
            for pid in _tasks(group):
                try:
                    handle.write(str(pid))
                    handle.flush()
                except OSError:
                    pass
        wait_until(lambda: not _tasks(group), timeout=10)
        os.rmdir(group)


def _tasks(group: str) -> list[int]:
    try:
        with open(os.path.join(group, "cgroup.procs")) as handle:
            return [int(x) for x in handle.read().split()]
    except OSError:
        return []


# -- 12. clear errors ------------------------------------------------------------------------------


def test_pushing_what_cannot_be_pickled_names_it_as_a_launch_does(k: Kernel) -> None:
    ensure_pool(k)
    res = k.run("import sqlite3\nconn = sqlite3.connect(':memory:')\nair_magic.Pool.current().push(conn=conn)")
    assert res.error is not None and res.error["ename"] == "CaptureError", res.stdout
    assert res.error["evalue"].startswith(
        "cannot send 'conn' to the ranks: it cannot be pickled.\n  - conn (sqlite3.Connection): "
    )
    assert res.error["evalue"].endswith(
        "Create it inside a pool cell (or the function pool.run runs) instead (load data, open files and "
        "connections on each rank)."
    )


def test_pulling_a_ddp_module_says_it_was_pulled_and_what_to_pull_instead(k: Kernel) -> None:
    ensure_pool(k)
    k.ok(
        "%%distributed --pool\nimport torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "net = DDP(torch.nn.Linear(2, 2))"
    )
    res = k.run("air_magic.Pool.current().pull('net')")
    assert res.error is not None and res.error["ename"] == "ResultError", res.stdout
    message = res.error["evalue"]
    assert message.startswith("pull('net'): the value on rank ") and " of 2 cannot be loaded in the kernel (" in message
    assert message.endswith(
        "It holds the ranks' process group (a DistributedDataParallel or FSDP module does): pull what it wraps "
        "(.module), or its state_dict()."
    ), message
    assert "returned" not in message
    assert k.value("air_magic.Pool.current().state") == "idle"  # a pull that cannot come back breaks nothing
