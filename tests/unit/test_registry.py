"""The machine's list of launches (``air_magic.protocol.registry``) and the GPU claims made from
it (``air_magic.kernel.claims``): a record lives as long as its holder, a forged or broken one is
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

from air_magic.kernel import claims
from air_magic.protocol import registry


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
    found, skipped = registry.records()
    assert [r.id for r in found] == ["0003-cccc"]
    assert sorted(line.split(":")[0] for line in skipped) == [
        "0004-dddd.json",
        "0005-eeee.json",
        "0006-ffff.json",
        "0007-gggg.json",
    ]
    assert any("forged (it names uid" in line for line in skipped)
    good.close()


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


def test_concurrent_claims_never_share_a_gpu() -> None:
    """Twenty claimants at once for two GPUs each of eight: each GPU is claimed once at most."""
    registry.folder()
    got: list[list[str]] = []
    holders: list[registry.Holder] = []
    start = threading.Barrier(20)

    def claim(n: int) -> None:
        start.wait()
        with registry.claims_lock():
            live, _ = registry.records()
            taken = {g["uuid"] for r in live for g in r.gpus}
            chosen = claims.choose(2, [claims.GPU(i, f"GPU-{i}") for i in range(8)], taken, set())
            if chosen is not None:
                record = _record(f"00{n:02d}-claim")
                record.gpus = [{"index": g.index, "uuid": g.uuid} for g in chosen]
                holders.append(registry.publish(record))
                got.append([g.uuid for g in chosen])

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    flat = [uuid for pair in got for uuid in pair]
    assert len(got) == 4 and len(flat) == len(set(flat)) == 8
    for holder in holders:
        holder.close()
