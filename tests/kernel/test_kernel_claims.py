"""One GPU box, many notebooks, in real kernels: GPU claims (NVML's answer replaced: 4 GPUs that
this CPU machine does not have), ``air-magic ps`` and ``stop`` from a terminal and
``%distributed_ps`` from a notebook, and what another user sees and may do."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
from harness import wait_until

from air_magic.protocol import gpu_locks, registry

pytestmark = pytest.mark.kernel

HOLD = """\
import air_magic
@air_magic.distributed(2)
def hold(gate):
    import os, time
    while not os.path.exists(gate):
        time.sleep(0.05)
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")
"""


@pytest.fixture
def machine_list(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A list of the machine's launches of this test's own (another user can reach it), and 8
    files standing in for the GPUs' device nodes (as NVML's answer stands in for the GPUs):
    ``<base>/dev/nvidia0``... read-write for every user, as the driver makes them."""
    base = tempfile.mkdtemp(prefix="air-magic-list-")
    os.chmod(base, 0o755)
    where = os.path.join(base, "launches")
    nodes = os.path.join(base, "dev")
    os.mkdir(nodes, 0o755)
    for minor in range(8):
        path = os.path.join(nodes, f"nvidia{minor}")
        open(path, "w").close()
        os.chmod(path, 0o666)
    monkeypatch.setenv(registry.REGISTRY_ENV, where)
    monkeypatch.setenv(gpu_locks.NODES_ENV, nodes)
    yield where
    shutil.rmtree(base, ignore_errors=True)


def _nodes(machine_list: str) -> str:
    return os.path.join(os.path.dirname(machine_list), "dev")


def _cli(*args: str, user: int | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "air_magic.cli", *args]
    if user is not None:
        command = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=dict(os.environ))


def _without_ages(message: str) -> str:
    """The message with each claim's age (``· 3 s``, ``· 12 min``, ``· 1.5 h``) left out."""
    return re.sub(r"· [0-9.]+ (s|min|h)\b", "· AGE", message)


def _uuid(index: int) -> str:
    return f"GPU-00000000-0000-0000-0000-{index:012d}"


def test_notebooks_get_disjoint_gpus_wait_for_held_ones_and_a_dead_kernel_frees_its_own(
    kernel_factory: Any, machine_list: str, tmp_path: Path
) -> None:
    def kernel(notebook: str) -> Any:
        env = {
            "AIR_MAGIC_TEST_FAKE_GPUS": "4",
            registry.REGISTRY_ENV: machine_list,
            gpu_locks.NODES_ENV: _nodes(machine_list),
            "JPY_SESSION_NAME": notebook,
        }
        k = kernel_factory(env)
        k.ok(HOLD)
        return k

    gates = [str(tmp_path / f"gate{i}") for i in range(3)]
    first, second, third = kernel("first.ipynb"), kernel("second.ipynb"), kernel("third.ipynb")
    try:
        _disjoint_waiting_and_freed(first, second, third, gates)
    finally:
        for k in (first, second, third):  # their helpers and ranks go now, not at the session's end
            k.shutdown()


def _disjoint_waiting_and_freed(first: Any, second: Any, third: Any, gates: list[str]) -> None:
    first.ok(f"held = hold.submit({gates[0]!r})")
    second.ok(f"held = hold.submit({gates[1]!r})")
    assert wait_until(lambda: sum(bool(r.pids) for r in registry.records()[0]) == 2, timeout=60)
    live = registry.records()[0]
    mine = {r.notebook: [g["index"] for g in r.gpus] for r in live}
    assert sorted(mine) == ["first.ipynb", "second.ipynb"]
    assert sorted(mine["first.ipynb"] + mine["second.ipynb"]) == [0, 1, 2, 3]  # disjoint, all four

    # Refused at once when asked not to wait, naming who holds them; --no-wait on a cell too.
    refused = third.run(f"hold.with_overrides(wait=False).distributed({gates[2]!r})")
    assert refused.error is not None and refused.error["ename"] == "GPUsBusyError"
    user = registry.user_name(os.getuid())
    assert f"held by {user} · first.ipynb · launch" in refused.error["evalue"]
    assert f"held by {user} · second.ipynb · launch" in refused.error["evalue"]
    cell = third.run("%%distributed -n 2 --no-wait\n1")
    assert cell.error is not None and cell.error["ename"] == "GPUsBusyError"
    assert _without_ages(refused.error["evalue"]).count("launch · AGE") == 2
    assert _without_ages(cell.error["evalue"]) == _without_ages(refused.error["evalue"])  # a second apart
    # By default it waits, says so once, and starts when the GPUs it waits for are free.
    Path(gates[2]).touch()
    waiting = third.execute(f"got = hold.distributed({gates[2]!r})")
    seen = third.collect(waiting, timeout=60, until=lambda r: "waiting (Interrupt to stop waiting)" in r.stderr)
    assert seen.stderr.count("waiting (Interrupt to stop waiting)") == 1
    Path(gates[0]).touch()  # the first notebook's launch ends: its GPUs are free
    done = third.collect(waiting, timeout=60)
    assert done.error is None, done.error_text
    first_gpus = first.value("held.result(timeout=30)")
    assert first_gpus == [",".join(_uuid(i) for i in mine["first.ipynb"])] * 2
    assert third.value("got") == first_gpus  # the GPUs that were freed, exactly
    # A kernel killed without a word: its claim is free on the next look (its ranks go too).
    (ranks,) = [r.pids for r in registry.records()[0] if r.notebook == "second.ipynb"]
    os.kill(second.pid, signal.SIGKILL)
    second.forget()
    assert wait_until(lambda: all(r.notebook != "second.ipynb" for r in registry.records()[0]), timeout=1)
    assert wait_until(lambda: not any(psutil.pid_exists(pid) for pid in ranks), timeout=10)
    Path(gates[1]).touch()


def test_ps_and_stop_from_a_terminal_and_a_notebook(kernel_factory: Any, machine_list: str) -> None:
    env = {registry.REGISTRY_ENV: machine_list, "JPY_SESSION_NAME": "ps.ipynb"}
    k = kernel_factory(env)
    try:
        _ps_and_stop(k)
    finally:
        k.shutdown()


def _ps_and_stop(k: Any) -> None:
    k.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
    done = _cli("ps", "--json")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert (row["owner"], row["kind"], row["ranks"], row["notebook"], row["state"]) == (
        registry.user_name(os.getuid()),
        "pool",
        2,
        "ps.ipynb",
        "idle",  # a pool between cells: as the notebook's own item says
    )
    assert len(row["pids"]) == 2 and row["kernel"] and row["gpus"] == []
    assert all(isinstance(v, int) and v > 0 for v in row["host_memory"])
    table = _cli("ps").stdout
    assert row["id"] in table and "ps.ipynb" in table and "pool" in table
    shown = k.ok("%distributed_ps").stdout
    assert row["id"] in shown and "ps.ipynb" in shown

    # Stopped from outside while a cell runs: the cell raises, saying who stopped it.
    cell = k.execute("%%distributed --pool\nimport time\nprint('began', flush=True)\ntime.sleep(60)")
    began = k.collect(cell, timeout=60, until=lambda r: "began" in r.stdout)
    assert began.error is None
    (during,) = json.loads(_cli("ps", "--json").stdout)
    assert re.fullmatch(r"running Cell In\[\d+\]", during["state"]), during
    stopped = _cli("stop", row["id"])
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == f"pool {row['id']} of {row['owner']}: 2 ranks stopped"
    res = k.collect(cell, timeout=60)
    assert res.error is not None and res.error["ename"] == "PoolBrokenError", res.error_text
    assert re.fullmatch(
        rf"the pool was stopped from outside while Cell In\[\d+\] ran on it: air-magic stop by {row['owner']} "
        r"\(pid \d+ on \S+\) at \d\d:\d\d:\d\d; its 2 ranks were stopped, so this call has no values, and the "
        r"next pool cell starts fresh ones \(the state of these is lost\)\.",
        res.error["evalue"],
    ), res.error["evalue"]
    assert json.loads(_cli("ps", "--json").stdout) == []
    unknown = _cli("stop", "0042-nothere")
    assert unknown.returncode == 1
    assert unknown.stderr.strip() == (
        "air-magic stop: error: no air_magic launch or pool '0042-nothere' is running on this machine "
        "(air-magic ps lists them)"
    )
    res = k.run("%distributed_ps --stop 0042-nothere")  # a magic's usage error: IPython prints it
    assert "UsageError: %distributed_ps --stop: no air_magic launch or pool '0042-nothere'" in res.stderr


@pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv for a second user"
)
def test_another_user_sees_owner_gpus_and_age_only_and_cannot_stop_it(kernel_factory: Any, machine_list: str) -> None:
    k = kernel_factory({registry.REGISTRY_ENV: machine_list, "JPY_SESSION_NAME": "secret-project.ipynb"})
    try:
        _another_user(k, machine_list)
    finally:
        k.shutdown()


def _another_user(k: Any, machine_list: str) -> None:
    k.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
    done = _cli("ps", "--json", user=65534)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert row["owner"] == "root" and row["kind"] == "pool" and row["ranks"] == 2
    assert (row["pids"], row["notebook"], row["kernel"], row["label"], row["state"]) == ([], "", "", "", "")
    assert "host_memory" not in row and "secret-project" not in done.stdout
    refused = _cli("stop", row["id"], user=65534)
    assert refused.returncode == 1
    assert refused.stderr.strip() == f"air-magic stop: error: {row['id']} is root's (uid 0): only root can stop it"
    assert k.value("__import__('air_magic').Pool.current().state") == "idle"  # untouched
    # Nor can it forge a record of root's (the file is its own).
    forged = (
        "import json, os, sys\n"
        "rec = dict(id='0099-forged', uid=0, user='root', holder_pid=1, holder_start=None, kind='pool', ranks=8,\n"
        "    pids=[1], gpus=[{'index': 0, 'uuid': 'GPU-x'}], notebook='', kernel='', label='', state='running',\n"
        "    started=0, host='h')\n"
        "open(os.path.join(sys.argv[1], '0099-forged.json'), 'w').write(json.dumps(rec))\n"
    )
    subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", forged, machine_list],
        check=True,
        timeout=30,
    )
    found, skipped = registry.records()
    assert [r.id for r in found] == [row["id"]]
    assert skipped == ["0099-forged.json: forged (it names uid 0; the file is uid 65534's)"]
    k.ok("%distributed_pool --stop")


def test_a_cuda_visible_devices_of_uuids_narrows_the_claim_in_its_order(kernel_factory: Any, machine_list: str) -> None:
    """As a container runtime or a scheduler sets it (UUIDs): a launch claims those GPUs only, in
    that order, and its default count is theirs."""
    visible = f"{_uuid(3)},{_uuid(1)}"
    env = {
        "AIR_MAGIC_TEST_FAKE_GPUS": "4",
        registry.REGISTRY_ENV: machine_list,
        gpu_locks.NODES_ENV: _nodes(machine_list),
        "CUDA_VISIBLE_DEVICES": visible,
    }
    k = kernel_factory(env)
    try:
        k.ok(
            "import air_magic, os\n@air_magic.distributed()\ndef where():\n    return os.environ['CUDA_VISIBLE_DEVICES']"
        )
        got = k.value("where.distributed()", timeout=120)
        assert got == [f"{_uuid(3)},{_uuid(1)}"] * 2  # two ranks: the two GPUs it may use, in its order
        assert registry.records()[0] == []  # the claim ended with the launch
    finally:
        k.shutdown()


def _mig(slot: int) -> str:
    return f"MIG-11111111-0000-0000-0000-{slot:012d}"


def test_each_mig_instance_is_a_gpu_of_its_own_and_each_rank_gets_its_own(
    kernel_factory: Any, machine_list: str, tmp_path: Path
) -> None:
    """GPU 0 in MIG mode with 3 instances, GPU 1 whole (NVML's answer replaced): a 2-rank launch
    claims two instances, each rank seeing only its own (CUDA shows a process one MIG instance),
    and says so once; another notebook's launch gets what is left, disjoint; ``ps`` names them."""
    env = {
        "AIR_MAGIC_TEST_FAKE_GPUS": "2",
        "AIR_MAGIC_TEST_FAKE_MIG": "3",
        registry.REGISTRY_ENV: machine_list,
        gpu_locks.NODES_ENV: _nodes(machine_list),
    }
    first, second = kernel_factory(env), kernel_factory(env)
    gate = str(tmp_path / "go")
    try:
        for k in (first, second):
            k.ok(HOLD)
        started = first.ok(f"held = hold.submit({gate!r})")
        said = "2 MIG instances claimed, one per rank: each rank sees its own as cuda:0"
        assert started.stderr.count(said) == 1, started.stderr
        assert wait_until(lambda: any(r.gpus for r in registry.records()[0]), 60)
        (record,) = registry.records()[0]
        assert [g["uuid"] for g in record.gpus] == [_mig(0), _mig(1)]
        listed = _cli("ps")
        assert listed.returncode == 0 and "0:MIG-11111111,0:MIG-11111111" in listed.stdout, listed.stdout
        # Another notebook: two GPUs asked for, two left (the third instance and GPU 1).
        second.ok(f"other = hold.submit({gate!r})")
        assert wait_until(lambda: len(registry.records()[0]) == 2 and all(r.gpus for r in registry.records()[0]), 60)
        Path(gate).touch()
        assert first.value("held.result()", timeout=120) == [_mig(0), _mig(1)]  # each rank its own instance
        assert second.value("other.result()", timeout=120) == [_mig(2), _uuid(1)]
    finally:
        Path(gate).touch()
        first.shutdown()
        second.shutdown()
