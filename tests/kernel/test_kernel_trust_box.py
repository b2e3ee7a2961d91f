"""A shared GPU box where nobody else can take, forge, block or fake-stop your launches: the
outsider is uid 65534 (``setpriv``), the notebooks are root's, the GPUs are NVML's answer
replaced (4 GPUs) and files standing in for their device nodes.  What the outsider tries is what
was seen work before: a FIFO where a stop request goes, a record naming root's processes, the
list's folder made first and root's record deleted, a link in the list's place, a planted stop
request; and two kernels with their own TMPDIRs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
from harness import wait_until

from air_magic.protocol import gpu_locks, registry

pytestmark = [
    pytest.mark.kernel,
    pytest.mark.skipif(
        os.getuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv for a second user"
    ),
]

OUTSIDER = 65534

HOLD = """\
import air_magic
@air_magic.distributed(2)
def hold(gate):
    import os, time
    while not os.path.exists(gate):
        time.sleep(0.05)
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")
"""


def as_outsider(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Python code run as uid 65534 (``args`` are its ``sys.argv[1:]``)."""
    command = ["setpriv", f"--reuid={OUTSIDER}", f"--regid={OUTSIDER}", "--clear-groups", sys.executable, "-c", code]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, check=True)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "air_magic.cli", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.fixture
def box(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A base folder every user can reach: ``launches`` (the list; not made yet), ``dev`` (the
    device nodes, read-write for every user, as the driver makes them), ``gates``."""
    base = tempfile.mkdtemp(prefix="air-magic-box-")
    os.chmod(base, 0o1777)  # as /tmp: every user may make the list's folder there
    nodes = os.path.join(base, "dev")
    os.mkdir(nodes, 0o755)
    for minor in range(4):
        path = os.path.join(nodes, f"nvidia{minor}")
        open(path, "w").close()
        os.chmod(path, 0o666)
    gates = os.path.join(base, "gates")
    os.mkdir(gates)
    where = {"list": os.path.join(base, "launches"), "nodes": nodes, "gates": gates}
    monkeypatch.setenv(registry.REGISTRY_ENV, where["list"])
    monkeypatch.setenv(gpu_locks.NODES_ENV, nodes)
    yield where
    shutil.rmtree(base, ignore_errors=True)


def gpu_kernel(kernel_factory: Any, box: dict[str, str], notebook: str) -> Any:
    env = {
        "AIR_MAGIC_TEST_FAKE_GPUS": "4",
        registry.REGISTRY_ENV: box["list"],
        gpu_locks.NODES_ENV: box["nodes"],
        "JPY_SESSION_NAME": notebook,
    }
    k = kernel_factory(env)
    k.ok(HOLD)
    return k


def one_record(notebook: str) -> registry.Record:
    (record,) = [r for r in registry.records()[0] if r.notebook == notebook]
    return record


def test_a_fifo_or_a_planted_request_neither_hangs_nor_fakes_a_stop_and_a_real_stop_names_who(
    kernel_factory: Any, box: dict[str, str]
) -> None:
    k = gpu_kernel(kernel_factory, box, "mine.ipynb")
    try:
        gate = os.path.join(box["gates"], "go")
        k.ok(f"held = hold.submit({gate!r})")
        assert wait_until(lambda: any(r.pids for r in registry.records()[0]), timeout=60)
        launch_id = one_record("mine.ipynb").id
        planted = (
            "import json, os, sys\n"
            "where, launch = sys.argv[1], sys.argv[2]\n"
            "os.mkfifo(os.path.join(where, launch + '.stopped'))\n"
            "os.mkfifo(os.path.join(where, launch + '.stop.fifo'))\n"
            "os.symlink('/dev/null', os.path.join(where, launch + '.stop.link'))\n"
            "fake = dict(via='air-magic stop', user='root', uid=0, pid=1, host='gpu-box', at='00:00:00')\n"
            "open(os.path.join(where, launch + '.stop.fake'), 'w').write(json.dumps(fake))\n"
        )
        as_outsider(planted, box["list"], launch_id)
        Path(gate).touch()
        values = k.value("held.result(timeout=60)", timeout=90)  # ends: nothing blocked it
        assert len(values) == 2 and all(values)
        res = k.run("print(held.status)\nheld")
        assert res.stdout.strip() == "finished", res.stdout
        assert "stopped from outside" not in res.stdout + res.stderr + str(res.displays)

        # A real stop, through the same planted files, names who asked.
        second = os.path.join(box["gates"], "never")
        k.ok(f"held = hold.submit({second!r})")
        assert wait_until(lambda: any(r.pids for r in registry.records()[0]), timeout=60)
        launch_id = one_record("mine.ipynb").id
        as_outsider(planted, box["list"], launch_id)
        stopped = cli("stop", launch_id)
        assert stopped.returncode == 0, stopped.stderr
        error = k.value("str(held.exception(timeout=60))", timeout=90)
        assert re.fullmatch(
            r"hold was stopped from outside: air-magic stop by root \(pid \d+ on \S+\) at \d\d:\d\d:\d\d; "
            r"its 2 ranks were stopped\.",
            error,
        ), error
    finally:
        k.shutdown()


def test_a_record_naming_root_s_processes_is_skipped_and_stop_signals_nothing(
    kernel_factory: Any, box: dict[str, str]
) -> None:
    k = gpu_kernel(kernel_factory, box, "mine.ipynb")
    try:
        registry.folder()
        victim = k.pid  # the kernel: a process of root's
        forged = asdict(
            registry.Record(
                id="0099-forged",
                uid=OUTSIDER,
                user="nobody",
                holder_pid=victim,
                holder_start=registry.process_start(victim),
                kind="pool",
                ranks=4,
                pids=[victim],
                pid_starts=[registry.process_start(victim)],
                gpus=[{"index": i, "uuid": f"GPU-00000000-0000-0000-0000-{i:012d}"} for i in range(4)],
            )
        )
        write = "import sys\nopen(sys.argv[1], 'w').write(sys.argv[2])\n"
        as_outsider(write, os.path.join(box["list"], "0099-forged.json"), json.dumps(forged))
        found, skipped = registry.records()
        assert found == []
        assert skipped == [
            f"0099-forged.json: forged (it names process {victim}, which is uid 0's; the file is uid {OUTSIDER}'s)"
        ]
        listed = cli("ps")
        assert "no air_magic launch or pool is running on this machine" in listed.stdout, listed.stdout
        assert f"[air_magic] skipped a record: 0099-forged.json: forged (it names process {victim}" in listed.stdout
        refused = cli("stop", "0099-forged")
        assert refused.returncode == 1 and "no air_magic launch or pool '0099-forged'" in refused.stderr
        assert psutil.pid_exists(victim) and k.km.is_alive()  # nothing was signalled
        # And root's own launches get the GPUs the forged record names: it claims nothing.
        gate = os.path.join(box["gates"], "go")
        Path(gate).touch()
        assert (
            k.value(f"hold.with_overrides(wait=False).distributed({gate!r})", timeout=120)
            == ["GPU-00000000-0000-0000-0000-000000000000,GPU-00000000-0000-0000-0000-000000000001"] * 2
        )
    finally:
        k.shutdown()


def test_an_outsider_who_made_the_list_s_folder_and_deleted_a_record_frees_no_gpu(
    kernel_factory: Any, box: dict[str, str]
) -> None:
    as_outsider("import os, sys\nos.mkdir(sys.argv[1])\nos.chmod(sys.argv[1], 0o1777)\n", box["list"])
    first = gpu_kernel(kernel_factory, box, "first.ipynb")
    second = gpu_kernel(kernel_factory, box, "second.ipynb")
    try:
        gate = os.path.join(box["gates"], "go")
        first.ok(f"held = hold.submit({gate!r})")
        assert wait_until(lambda: any(r.pids for r in registry.records()[0]), timeout=60)
        record = one_record("first.ipynb")
        assert [g["index"] for g in record.gpus] == [0, 1]
        # The folder is the outsider's: it may remove any file in it, root's record included.
        as_outsider("import os, sys\nos.unlink(sys.argv[1])\n", os.path.join(box["list"], f"{record.id}.json"))
        assert registry.records()[0] == []
        refused = second.run(f"hold.with_overrides(num_accelerators=4, wait=False).distributed({gate!r})")
        assert refused.error is not None and refused.error["ename"] == "GPUsBusyError", refused.error_text
        assert refused.error["evalue"] == (
            "4 GPUs asked for are not free: GPUs 0, 1 are claimed by a process no record of the machine's list "
            "names. Wait for them (without --no-wait / wait=False), or ask for fewer."
        )
        Path(gate).touch()
        got = second.value(f"hold.with_overrides(wait=False).distributed({gate!r})", timeout=120)
        assert got == ["GPU-00000000-0000-0000-0000-000000000002,GPU-00000000-0000-0000-0000-000000000003"] * 2
        assert (
            first.value("held.result(timeout=60)", timeout=90)
            == ["GPU-00000000-0000-0000-0000-000000000000,GPU-00000000-0000-0000-0000-000000000001"] * 2
        )
    finally:
        first.shutdown()
        second.shutdown()


def test_claims_do_not_fail_open_a_link_in_the_list_s_place_lists_nothing_a_missing_node_refuses(
    kernel_factory: Any, box: dict[str, str]
) -> None:
    os.symlink(box["gates"], box["list"])  # a link planted where the list goes
    k = gpu_kernel(kernel_factory, box, "mine.ipynb")
    try:
        gate = os.path.join(box["gates"], "go")
        started = k.ok(f"held = hold.submit({gate!r})")
        assert (
            started.stderr.count(
                f"[air_magic] the machine's list of launches cannot be written ({box['list']} is not a folder"
            )
            == 1
        ), started.stderr
        # Claimed all the same: the GPUs' locks are held while it runs.
        nodes = [os.path.join(box["nodes"], f"nvidia{i}") for i in range(4)]
        assert wait_until(
            lambda: [gpu_locks.held(n, *gpu_locks.WHOLE) for n in nodes] == [True, True, False, False], 30
        )
        Path(gate).touch()
        assert len(k.value("held.result(timeout=60)", timeout=90)) == 2
        # A GPU whose device node is missing cannot be claimed safely: the launch is refused.
        os.unlink(nodes[3])
        refused = k.run(f"hold.with_overrides(num_accelerators=4).distributed({gate!r})")
        assert refused.error is not None and refused.error["ename"] == "GPUClaimsError", refused.error_text
        assert refused.error["evalue"].startswith(
            f"GPUs cannot be claimed safely here: {nodes[3]}, GPU 3's device node, cannot be locked (No such file "
            "or directory). A launch on GPUs is refused rather than run on GPUs other notebooks may be using"
        ), refused.error["evalue"]
        assert not any(gpu_locks.held(n, *gpu_locks.WHOLE) for n in nodes[:3])  # what it took, let go
    finally:
        k.shutdown()


def test_kernels_with_their_own_tmpdir_share_one_list_a_plain_shell_sees(
    kernel_factory: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(registry.REGISTRY_ENV, raising=False)
    kernels = []
    try:
        for name in ("a", "b"):
            own = tmp_path / f"tmp-{name}"
            own.mkdir()
            k = kernel_factory({"TMPDIR": str(own), "JPY_SESSION_NAME": f"{name}.ipynb"})
            k.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
            kernels.append(k)
        env = {key: value for key, value in os.environ.items() if key not in ("TMPDIR", registry.REGISTRY_ENV)}
        rows = json.loads(cli("ps", "--json", env=env).stdout)
        assert {"a.ipynb", "b.ipynb"} <= {row["notebook"] for row in rows}
    finally:
        for k in kernels:
            k.shutdown()
