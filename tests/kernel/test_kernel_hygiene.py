"""Default settings (MLflow tracking on): no growth over many launches, concurrent kernels,
and a rendezvous that listens on loopback only."""

from __future__ import annotations

import ast
import re
import socket
import time
from collections import Counter
from typing import Any, Iterator

import psutil
import pytest
from harness import Kernel, helper_processes

pytestmark = pytest.mark.kernel

PROBE = (
    "import os, signal, threading\n"
    "def _fd_targets():\n"
    "    found = []\n"
    "    for fd in os.listdir('/proc/self/fd'):\n"
    "        try:\n"
    "            found.append(os.readlink('/proc/self/fd/' + fd))\n"
    "        except OSError:\n"
    "            pass  # the directory listing's own descriptor\n"
    "    return sorted(found)\n"
    "(threading.active_count(), _fd_targets(), dict(os.environ), "
    "repr(signal.getsignal(signal.SIGINT)))"
)


def _split_db(targets: list[str]) -> tuple[list[str], int]:
    """Descriptors of the MLflow sqlite file are MLflow's own connection pool: SQLAlchemy
    opens one per thread that overlaps (kernel, writer, system-metrics monitor), up to its
    pool size, whenever that first happens. IPython's profile folder and history database (and its journal,
    open while its saving thread writes) come and go with the cells themselves.
    Everything else must not change at all."""
    db = [t for t in targets if t.endswith("mlflow.db")]
    ours = [t for t in targets if not t.endswith("mlflow.db") and "/.ipython/profile_default" not in t]
    return ours, len(db)


ALL_REDUCE = (
    "%%distributed -n 2\n"
    "import torch, torch.distributed as dist\n"
    "dist.init_process_group()\n"
    "t = torch.tensor([float(dist.get_rank() + 1)])\n"
    "dist.all_reduce(t)\n"
    "dist.destroy_process_group()\n"
    "t.item()"
)


@pytest.fixture(scope="module")
def k(kernel_factory: Any) -> Iterator[Kernel]:
    kernel = kernel_factory(tracking=True)
    yield kernel
    kernel.shutdown()


def launch_ok(k: Kernel, code: str = ALL_REDUCE, timeout: float = 120) -> Any:
    res = k.run(code, timeout=timeout)
    assert res.error is None, res.error_text
    return ast.literal_eval(res.result)


STORED = "import air_magic.tracking\nassert air_magic.tracking.flush(120)"

# ipykernel gives each thread that writes to the notebook (here the launches' MLflow writer
# threads, which show the stored summary) a ZMQ socket of its own, with an eventfd, and
# closes those of ended threads in its own collection every 10 s: run that collection now,
# on its IO thread, so a probe counts what the launches left and not what ipykernel will
# free on its schedule.
IPYKERNEL_COLLECTED = (
    "import threading, time\n"
    "_deadline = time.monotonic() + 30\n"
    "while any(t.name.startswith(('air_magic-mlflow-writer', 'air_magic-mlflow-monitor')) for t in threading.enumerate()):\n"
    "    assert time.monotonic() < _deadline, [t.name for t in threading.enumerate()]\n"
    "    time.sleep(0.05)\n"
    "_iopub = get_ipython().kernel.iopub_thread\n"
    "_collected = threading.Event()\n"
    "async def _collect():\n"
    "    try:\n"
    "        await _iopub._event_pipe_gc()\n"
    "    finally:\n"
    "        _collected.set()\n"
    "_iopub.io_loop.add_callback(_collect)\n"
    "assert _collected.wait(30)"
)


def test_twenty_five_launches_leave_no_growth_in_the_kernel(k: Kernel) -> None:
    # Each probe once the launches' MLflow storing is over (it goes on behind the values,
    # in a writer thread that ends with it): what is left then is what the launches left.
    assert launch_ok(k) == [3.0, 3.0]
    k.ok(STORED, timeout=180)
    k.ok(IPYKERNEL_COLLECTED, timeout=60)
    threads_1, fds_1, env_1, sigint_1 = k.value(PROBE)
    for _ in range(24):
        assert launch_ok(k) == [3.0, 3.0]
    k.ok(STORED, timeout=180)
    k.ok(IPYKERNEL_COLLECTED, timeout=60)
    threads_25, fds_25, env_25, sigint_25 = k.value(PROBE)
    assert threads_25 <= threads_1, (threads_1, threads_25)
    other_1, db_1 = _split_db(fds_1)
    other_25, db_25 = _split_db(fds_25)
    grown, gone = Counter(other_25) - Counter(other_1), Counter(other_1) - Counter(other_25)
    assert other_25 == other_1, (dict(grown), dict(gone))
    assert db_25 <= 5, db_25  # SQLAlchemy's default pool size
    assert env_25 == env_1
    assert sigint_25 == sigint_1


def test_two_kernels_launching_at_the_same_moment(k: Kernel, kernel_factory: Any) -> None:
    other = kernel_factory(tracking=True)
    try:
        launch_ok(other)  # both helpers warm, both tracking stores created
        port_cell = ALL_REDUCE.replace("t.item()", '(t.item(), os.environ["MASTER_PORT"])').replace(
            "import torch,", "import os, torch,"
        )
        first = k.execute(port_cell)
        second = other.execute(port_cell)
        results = [k.collect(first, timeout=120), other.collect(second, timeout=120)]
        values = []
        for res in results:
            assert res.error is None, res.error_text
            values.append(ast.literal_eval(res.result))
        for value in values:
            assert [v[0] for v in value] == [3.0, 3.0]
            assert value[0][1] == value[1][1]
        assert values[0][0][1] != values[1][0][1]  # each launch its own rendezvous port
    finally:
        other.shutdown()


def test_the_rendezvous_has_no_socket_anyone_could_connect_to(k: Kernel) -> None:
    msg_id = k.execute(
        "%%distributed -n 2\n"
        "import os, time\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group()\n"
        'print("port", os.environ["MASTER_PORT"], flush=True)\n'
        "time.sleep(3)\n"
        "dist.destroy_process_group()\n"
    )
    early = k.collect(msg_id, timeout=60, until=lambda r: re.search(r"port \d+\n", r.stdout) is not None)
    port = int(re.search(r"port (\d+)\n", early.stdout).group(1))  # type: ignore[union-attr]
    try:
        helpers = [p for p in helper_processes() if p.ppid() == k.pid]
        assert len(helpers) == 1
        # The ranks met in a file store in the launch's private folder: MASTER_PORT is
        # reserved (bound on loopback, so no other launch gets it) but nothing listens on it,
        # and the helper listens on nothing at all.
        listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert not [c for c in listening if c.laddr.port == port]
        assert not [c for c in helpers[0].net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        probe = socket.socket()
        with pytest.raises(OSError, match="Address already in use"):  # reserved for this launch
            probe.bind(("127.0.0.1", port))
        probe.close()
    finally:
        res = k.collect(msg_id, timeout=60)
    assert res.error is None, res.error_text
    # the port goes with the launch
    time.sleep(0.2)
    probe = socket.socket()
    probe.bind(("127.0.0.1", port))
    probe.close()
