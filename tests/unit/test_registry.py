"""The machine's list of launches (``air_magic.protocol.registry``) and the GPU claims made from
it (``air_magic.kernel.machine.claims``): a record lives as long as its holder, a forged or broken one is
skipped with a line, concurrent claims never share a GPU, and who holds what is said in words."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import pytest

from air_magic.kernel.machine import claims
from air_magic.protocol import gpu_locks, registry


@pytest.fixture(autouse=True)
def own_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    where = tmp_path / "launches"
    monkeypatch.setenv(registry.REGISTRY_ENV, str(where))
    yield where


def _record(launch_id: str, **fields: object) -> registry.Record:
    me = os.getpid()
    base = dict(
        id=launch_id,
        uid=os.getuid(),
        user=registry.user_name(os.getuid()),
        holder_pid=me,
        holder_start=registry.process_start(me),
        kind="launch",
        ranks=2,
    )
    base.update(fields)
    return registry.Record(**base)  # type: ignore[arg-type]


def test_the_folder_is_made_sticky_and_writable_by_every_user(own_list: Path) -> None:
    registry.folder()
    assert oct(own_list.stat().st_mode & 0o7777) == "0o1777"


def test_a_record_lives_as_long_as_its_holder_and_goes_with_it(own_list: Path) -> None:
    holder = registry.publish(_record("0001-aaaa"))
    holder.update(pids=[1234], pid_starts=[5], state="running")
    (found,), skipped = registry.records()
    assert (found.id, found.pids, found.state, skipped) == ("0001-aaaa", [1234], "running", [])
    holder.close()
    assert registry.records() == ([], [])
    # A holder killed without a word: its record is gone on the next look.
    code = (
        "import os, sys, time\n"
        "from air_magic.protocol import registry\n"
        "me = os.getpid()\n"
        "registry.publish(registry.Record(id='0002-bbbb', uid=os.getuid(), user='u', holder_pid=me,\n"
        "    holder_start=registry.process_start(me), kind='pool', ranks=1))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    assert [r.id for r in registry.records()[0]] == ["0002-bbbb"]
    child.kill()
    child.wait()
    began = time.monotonic()
    assert registry.records()[0] == []
    assert time.monotonic() - began < 1
    assert not (own_list / "0002-bbbb.json").exists()  # removed by its owner's look


def test_forged_broken_and_huge_records_are_skipped_with_a_line(own_list: Path) -> None:
    registry.folder()
    good = registry.publish(_record("0003-cccc"))
    forged = asdict(_record("0004-dddd", uid=os.getuid() + 1))  # names another uid
    (own_list / "0004-dddd.json").write_text(json.dumps(forged))
    (own_list / "0005-eeee.json").write_text('{"id": "0005-eeee", "uid"')  # truncated
    (own_list / "0006-ffff.json").write_text(" " * (registry.MAX_BYTES + 1))
    (own_list / "0007-gggg.json").write_text(json.dumps(asdict(_record("0007-gggg")) | {"pids": ["1; rm"]}))
    os.symlink("/etc/passwd", own_list / "0008-hhhh.json")
    (own_list / "0009-iiii.json").write_text(json.dumps(asdict(_record("0010-jjjj"))))  # another id than its name
    found, skipped = registry.records()
    assert [r.id for r in found] == ["0003-cccc"]
    assert sorted(line.split(":")[0] for line in skipped) == [
        "0004-dddd.json",
        "0005-eeee.json",
        "0006-ffff.json",
        "0007-gggg.json",
        "0008-hhhh.json",
        "0009-iiii.json",
    ]
    assert f"0004-dddd.json: forged (it names uid {os.getuid() + 1}; the file is uid {os.getuid()}'s)" in skipped
    assert "0008-hhhh.json: not a record (a link)" in skipped
    assert "0009-iiii.json: not a record (it names the launch '0010-jjjj')" in skipped
    good.close()


def test_the_list_is_one_for_the_machine_whatever_tmpdir_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(registry.REGISTRY_ENV)
    for tmpdir in ("/tmp/a-job-s-own", "/var/tmp"):
        monkeypatch.setenv("TMPDIR", tmpdir)
        assert registry.folder() == "/tmp/air-magic-launches"


def test_a_stop_request_is_believed_only_from_a_regular_file_of_the_owner_and_never_blocks(own_list: Path) -> None:
    registry.folder()
    os.mkfifo(own_list / "0011-kkkk.stop.fifo")  # opened without blocking: nothing to read, skipped
    os.symlink("/etc/hostname", own_list / "0011-kkkk.stop.link")
    (own_list / "0011-kkkk.stop.junk").write_text('{"via": 1}')
    began = time.monotonic()
    assert registry.stop_request("0011-kkkk") is None
    assert time.monotonic() - began < 1
    who = {"via": "air-magic stop", "user": "me", "uid": os.getuid(), "pid": 42, "host": "box", "at": "12:00:01"}
    path = registry.request_stop("0011-kkkk", who)
    assert path is not None and os.path.basename(path).startswith("0011-kkkk.stop.")
    assert registry.stop_request("0011-kkkk") == who
    assert registry.describe_stop(who) == "air-magic stop by me (pid 42 on box) at 12:00:01"
    # Another user's file is not believed (the owner's and root's are).
    assert registry.stop_request("0011-kkkk", owner=os.getuid() + 1) == (who if os.getuid() == 0 else None)


def test_a_folder_in_the_list_s_place_that_cannot_be_trusted_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    link = tmp_path / "elsewhere"
    link.symlink_to(tmp_path)
    monkeypatch.setenv(registry.REGISTRY_ENV, str(link))
    with pytest.raises(OSError, match="is not a folder"):
        registry.folder()
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    monkeypatch.setenv(registry.REGISTRY_ENV, str(open_dir))
    with pytest.raises(OSError, match="without the sticky bit"):
        registry.folder()


GPUS = [claims.GPU(i, f"GPU-{i}") for i in range(4)]


def test_free_gpus_are_chosen_and_who_holds_the_others_is_said() -> None:
    assert claims.choose(2, GPUS, {"GPU-0"}, {"GPU-1"}) == [GPUS[2], GPUS[3]]
    assert claims.choose(3, GPUS, {"GPU-0"}, set()) == GPUS[1:]
    assert claims.choose(4, GPUS, {"GPU-0"}, set()) is None
    assert claims.choose(None, GPUS, {"GPU-0", "GPU-1", "GPU-2", "GPU-3"}, set()) is None
    holder = _record("0009-iiii", kind="pool", notebook="train.ipynb", started=time.time() - 720)
    holder.gpus = [{"index": i, "uuid": f"GPU-{i}"} for i in range(3)]
    words = claims.describe_holders(GPUS, [holder], {"GPU-3"})
    assert words == (
        f"GPUs 0–2 are held by {holder.user} · train.ipynb · pool · 12 min; GPU 3 used by processes outside air_magic"
    )


def test_concurrent_claims_never_share_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty claimants at once for two GPUs each of eight (each a lock on its device node,
    files standing in for them here): each GPU is claimed once at most."""
    nodes = tmp_path / "dev"
    nodes.mkdir()
    for minor in range(8):
        (nodes / f"nvidia{minor}").touch()
    monkeypatch.setenv(gpu_locks.NODES_ENV, str(nodes))
    where = {f"GPU-{i}": (gpu_locks.node_path(i), *gpu_locks.WHOLE) for i in range(8)}
    gpus = [claims.GPU(i, f"GPU-{i}") for i in range(8)]
    got: list[list[str]] = []
    observers: list[claims.ClaimObserver] = []
    start = threading.Barrier(20)

    def claim(n: int) -> None:
        observer = claims.ClaimObserver(None)  # type: ignore[arg-type]
        start.wait()
        chosen, _ = observer._take(2, gpus, where)
        if chosen is not None:
            observers.append(observer)
            got.append([g.uuid for g in chosen])

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    flat = [uuid for pair in got for uuid in pair]
    assert len(flat) == len(set(flat))  # never one GPU twice
    assert 1 <= len(got) <= 4
    for observer in observers:
        observer._release()
    assert not any(gpu_locks.held(*where[g.uuid]) for g in gpus)  # all free again


def test_a_whole_gpu_claim_and_a_mig_instance_s_on_the_same_gpu_exclude_each_other(tmp_path: Path) -> None:
    node = str(tmp_path / "nvidia0")
    open(node, "w").close()
    first = gpu_locks.take(node, *gpu_locks.lock_range(2))  # MIG GPU instance 2
    assert first is not None
    assert gpu_locks.take(node, *gpu_locks.WHOLE) is None  # the whole GPU: held
    second = gpu_locks.take(node, *gpu_locks.lock_range(3))  # another instance: free
    assert second is not None and gpu_locks.held(node, *gpu_locks.lock_range(3))
    gpu_locks.release(first)
    gpu_locks.release(second)
    whole = gpu_locks.take(node, *gpu_locks.WHOLE)
    assert whole is not None
    gpu_locks.release(whole)
    with pytest.raises(FileNotFoundError):
        gpu_locks.take(str(tmp_path / "nvidia9"), *gpu_locks.WHOLE)  # no node: the launch is refused
