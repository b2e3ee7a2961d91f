"""Why is it stuck, when the code is not the cause: every rank waits in the same collective and
none completes (a peer's network or device).  A real kernel in a network namespace of its own
(``unshare``), reached over Unix sockets; its ranks' loopback traffic is throttled with a token
bucket (``tc ... tbf``) from inside the cell, so their next all_reduce stalls on every rank with
nothing wrong in the code; the report says so, and when the network is given back the cell ends
normally."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
from harness import Kernel, reports

pytestmark = pytest.mark.kernel

#: The kernel: loopback up with a 1500-byte MTU (a token bucket passes no packet larger than
#: its burst), then ipykernel itself.
NETNS_KERNEL = """\
import os, subprocess, sys
for command in ("ip link set lo mtu 1500", "ip link set lo up"):
    subprocess.run(command.split(), check=True)
os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *sys.argv[1:]])
"""

#: What throttles the ranks' connections: 1 byte a second once the bucket's 1,600 bytes are spent
#: (a local connection spends them), until the test's file (``RELEASE``) appears.
STALL = """%%distributed -n 2
import os, socket, subprocess, threading, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(8)
for _ in range(3):
    dist.all_reduce(t)
if dist.get_rank() == 0:
    subprocess.run("tc qdisc add dev lo root tbf rate 8bit burst 1600 limit 1000000".split(), check=True)
    server = socket.create_server(("127.0.0.1", 0))
    spend = socket.create_connection(server.getsockname())
    spend.settimeout(0.5)
    try:
        spend.sendall(b"x" * 4000)
    except OSError:
        pass
    def give_back():
        while not os.path.exists(RELEASE):
            time.sleep(0.1)
        subprocess.run("tc qdisc del dev lo root".split(), check=True)
    threading.Thread(target=give_back, daemon=True).start()
dist.all_reduce(t)
print("completed", t.tolist())"""


def _unshare_net() -> tuple[list[str] | None, str]:
    """``unshare -n`` (root) or ``unshare -rn`` (a user namespace) where one can throttle its
    loopback with a token bucket; else ``(None, why)``."""
    tool = shutil.which("unshare")
    if tool is None or shutil.which("tc") is None or shutil.which("ip") is None:
        return None, "no unshare (util-linux) or no ip and tc (iproute2) here"
    for prefix in ([tool, "--net"], [tool, "--map-root-user", "--net"]):
        probe = subprocess.run(
            [
                *prefix,
                "sh",
                "-c",
                "ip link set lo mtu 1500 && ip link set lo up && "
                "tc qdisc add dev lo root tbf rate 8bit burst 1600 limit 1000000",
            ],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0:
            return prefix, ""
    return None, "no network namespace whose loopback tc can throttle with a token bucket (tbf) here"


@pytest.fixture
def netns_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Kernel]:
    prefix, why = _unshare_net()
    if prefix is None:
        if os.environ.get("CI") and "iproute2" not in why:  # the tools are here and do not work: a failure
            pytest.fail(why)
        pytest.skip(why)
    spec = tmp_path / "kernels" / "air-magic-netns"
    spec.mkdir(parents=True)
    (tmp_path / "netns_kernel.py").write_text(NETNS_KERNEL)
    argv = [*prefix, sys.executable, str(tmp_path / "netns_kernel.py"), "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "own network", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    sockets = tempfile.mkdtemp(prefix="am-ipc-")  # a short path: a Unix socket's name is at most 107 bytes
    kernel = Kernel(
        tempfile.mkdtemp(dir=tmp_path),
        {"AIR_MAGIC_HANG_SECONDS": "2"},
        kernel_name="air-magic-netns",
        ipc=os.path.join(sockets, "k"),
    )
    try:
        kernel.ok("%load_ext air_magic\n%config DistributedMagics.tracking = False")
        yield kernel
    finally:
        kernel.shutdown()
        shutil.rmtree(sockets, ignore_errors=True)


def test_every_rank_waiting_in_one_collective_is_said_to_be_the_network_or_a_device(
    netns_kernel: Kernel, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    began = time.monotonic()
    msg_id = netns_kernel.execute(STALL.replace("RELEASE", repr(str(release))))
    shown = netns_kernel.collect(msg_id, timeout=90, until=lambda res: bool(reports(res)))
    assert reports(shown), f"no hang report: {shown.stdout[-2000:]}"
    took = time.monotonic() - began
    report = reports(shown)[-1]
    verdict = report.splitlines()[0]
    assert re.fullmatch(
        r"\[air_magic\] hang report: every rank is in all_reduce #\d+ \(Cell In\[\d+\]:21 in <module>\) "
        r"for \d+ s: a peer's network or device, not the code",
        verdict,
    ), report
    for rank in (0, 1):  # a row per rank, each in the collective
        row = rf"\n  {rank} +in collective +default +#\d+ +all_reduce +\[8\] float32 +Cell In\[\d+\]:21 in <module> +Flight Recorder"
        assert re.search(row, report), report
    assert took < 60, took
    # The network back: the collective completes, and the cell ends as it would have.
    release.touch()
    rest = netns_kernel.collect(msg_id, timeout=120)
    assert rest.error is None, rest.error_text
    assert "completed [16.0, 16.0, 16.0, 16.0, 16.0, 16.0, 16.0, 16.0]" in shown.stdout + rest.stdout  # 4 sums
