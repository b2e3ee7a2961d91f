"""Result records whose large tensors travel beside the pickle, not in it (air_magic.rank.results),
on one machine and the way a Ray rank's come back: files on its node, raw buffers through
the object store (pickle protocol 5, out of band), files of the kernel (no processes, no Ray)."""

from __future__ import annotations

import errno
import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from air_magic.backends.ray import agent as _ray_agent  # noqa: E402
from air_magic.backends.ray.ray_launch import RayLaunch  # noqa: E402
from air_magic.protocol import UnpicklableRecord, ValueRecord  # noqa: E402
from air_magic.rank import results as _results  # noqa: E402

BIG = _results.SHM_THRESHOLD  # bytes: the smallest tensor that travels beside the record


def _value() -> dict[str, Any]:
    floats = torch.arange(BIG // 4 * 3, dtype=torch.float32).reshape(3, -1)
    halves = torch.linspace(-1, 1, BIG // 2, dtype=torch.bfloat16)
    weights = torch.ones(BIG // 4, requires_grad=True)
    return {"floats": floats, "halves": halves, "weights": weights, "small": torch.ones(3), "n": 7}


def _check(value: dict[str, Any]) -> None:
    expected = _value()
    assert value["n"] == 7 and torch.equal(value["small"], expected["small"])
    for key in ("floats", "halves", "weights"):
        got, want = value[key], expected[key]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got.detach(), want.detach())
        got.detach().add_(1)  # writable, as a tensor made in the kernel
    assert value["weights"].requires_grad and not value["floats"].requires_grad


def _folders(tmp_path: Path, *names: str) -> list[str]:
    made = []
    for name in names:
        (tmp_path / name).mkdir(mode=0o700)
        made.append(str(tmp_path / name))
    return made


def _files(*folders: str) -> list[str]:
    return sorted(name for folder in folders for name in os.listdir(folder))


def test_a_local_ranks_large_tensors_travel_as_files_the_record_names(tmp_path: Path) -> None:
    shm, work = _folders(tmp_path, "shm", "work")
    path = os.path.join(work, "result-0.pkl")
    _results.write_record(path, ValueRecord(_value()), shm, _results.rank_prefix(0), fallback_dir=work)
    # One file holds the record's large tensors, each at its own (64-byte aligned) place.
    assert _files(shm) == ["r0-0"]
    assert os.path.getsize(os.path.join(shm, "r0-0")) >= sum(
        t.numel() * t.element_size() for k, t in _value().items() if k not in ("small", "n")
    )
    assert os.path.getsize(path) < 4096  # names, dtypes and shapes only
    with open(path, "rb") as handle:
        text = handle.read()
    assert shm.encode() not in text and work.encode() not in text  # no path of the rank's machine
    (value,) = _results.read_record(path, (shm, work))
    _check(value)
    assert _files(shm, work) == ["result-0.pkl"]  # each file unlinked once mapped


def test_a_ray_ranks_tensors_come_back_as_raw_buffers_beside_a_small_record(tmp_path: Path) -> None:
    # The rank, on its node: the record in its folder, the tensors in its agent's /dev/shm folder.
    node_shm, node_folder, shm, work = _folders(tmp_path, "node-shm", "node-folder", "shm", "work")
    node_record = os.path.join(node_folder, "result-1.pkl")
    prefix = _results.rank_prefix(1)
    _results.write_record(node_record, ValueRecord(_value()), node_shm, prefix, fallback_dir=node_folder)
    # Its agent's finish(): the record's bytes, each tensor file as an array mapped from it.
    with open(node_record, "rb") as handle:
        record = handle.read()
    tensors = _ray_agent.take_tensor_files((node_shm, node_folder), prefix)
    assert sorted(tensors) == ["r1-0"] and _files(node_shm) == []
    # What Ray does with the reply (protocol 5): each array is a buffer of its own, out of the pickle.
    buffers: list[pickle.PickleBuffer] = []
    reply = pickle.dumps((record, tensors, {}), protocol=5, buffer_callback=buffers.append)
    sizes = [t.numel() * t.element_size() for k, t in _value().items() if k != "small" and k != "n"]
    # One buffer: the tensors' bytes, nothing more than each one's alignment to 64 bytes.
    (buffer,) = buffers
    assert sum(sizes) <= memoryview(buffer).nbytes < sum(sizes) + 64 * len(sizes)
    assert len(reply) < 4096
    del tensors
    # The kernel: ray.get maps them read-only from its object store ...
    record, tensors, _ = pickle.loads(reply, buffers=[memoryview(b).toreadonly() for b in buffers])
    assert all(not array.flags.writeable for array in tensors.values())
    # ... and writes each once into the launch's folders, then the record beside them.
    launch = _fake_launch(shm, work)
    launch._place_tensors(tensors)
    assert tensors == {} and _files(shm) == ["r1-0"]
    path = os.path.join(work, "result-1.pkl")
    with open(path, "wb") as handle:
        handle.write(record)
    (value,) = _results.read_record(path, (shm, work))
    _check(value)
    assert _files(shm, work) == ["result-1.pkl"]


def test_tensors_go_to_the_private_folder_where_shared_memory_has_no_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm, work = _folders(tmp_path, "shm", "work")
    fallocate, pwrite = os.posix_fallocate, os.pwrite

    def no_room_in_shm(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(shm):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_shm(fd: int, offset: int, size: int) -> None:
        no_room_in_shm(fd)
        fallocate(fd, offset, size)

    def full_shm_write(fd: int, data: Any, offset: int) -> int:  # shared memory's pages run out as written
        no_room_in_shm(fd)
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "posix_fallocate", full_shm)
    monkeypatch.setattr(os, "pwrite", full_shm_write)
    path = os.path.join(work, "result-0.pkl")
    _results.write_record(path, ValueRecord(_value()), shm, "r0", fallback_dir=work)  # a rank
    assert _files(shm) == [] and _files(work) == ["r0-0", "result-0.pkl"]
    (value,) = _results.read_record(path, (shm, work))
    _check(value)
    assert _files(shm, work) == ["result-0.pkl"]
    _results.place_tensor_file("r3-0", b"\1" * 64, (shm, work))  # the kernel, for a Ray rank
    assert _files(shm) == [] and "r3-0" in _files(work)


def test_a_full_disk_is_said_as_such_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm, work = _folders(tmp_path, "shm", "work")

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space left on device"):
        _results.place_tensor_file("r0-0", b"\1" * 64, (shm, work))
    launch = _fake_launch(shm, work)
    with pytest.raises(OSError):
        launch._place_tensors({"r0-0": b"\1" * 8, "r0-1": b"\2" * 8})
    assert _files(shm, work) == []


def test_a_ray_rank_whose_tensors_find_no_room_in_the_kernel_returns_an_unpicklable_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm, work = _folders(tmp_path, "shm", "work")
    launch = _fake_launch(shm, work)
    launch.id, launch.stopping, launch.running = "L", None, {0}
    launch.request = type("R", (), {"shm_dir": shm, "work_dir": work, "world_size": 1})()
    launch.spool = None

    class Agent:
        class finish:  # noqa: N801 - an actor method's shape: agent.finish.remote(launch_id)
            @staticmethod
            def remote(launch_id: str) -> tuple[bytes, dict[str, bytes], dict[str, bytes]]:
                assert launch_id == "L"
                return pickle.dumps(ValueRecord(None)), {"r0-0": b"\1" * 64}, {}

    sent: list[Any] = []
    launch.agents = [Agent()]
    launch.ray = type("Ray", (), {"get": staticmethod(lambda ref: ref)})()
    launch.backend = type("B", (), {"emit": staticmethod(sent.append)})()

    def no_room(name: str, data: Any, folders: Any) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_results, "place_tensor_file", no_room)
    launch._rank_ended(0, 0)
    record = _results.read_record(os.path.join(work, "result-0.pkl"), (shm, work))
    assert record == UnpicklableRecord("value with large tensors", "[Errno 28] No space left on device")
    assert [type(m).__name__ for m in sent] == ["Exited"]


def test_a_record_whose_tensor_file_is_missing_names_it(tmp_path: Path) -> None:
    shm, work = _folders(tmp_path, "shm", "work")
    path = os.path.join(work, "result-0.pkl")
    _results.write_record(path, ValueRecord(_value()), shm, "r0", fallback_dir=work)
    os.unlink(os.path.join(shm, "r0-0"))
    with pytest.raises(FileNotFoundError, match=r"the file of a result tensor is missing \(r0-0\)"):
        _results.read_record(path, (shm, work))


def test_the_folders_of_dead_agents_are_removed_and_those_of_live_ones_kept(tmp_path: Path) -> None:
    parent = str(tmp_path)
    live, dead, young, other = (os.path.join(parent, f"{_ray_agent.FOLDER_PREFIX}{n}") for n in "abcd")
    for folder in (live, dead, young):
        os.mkdir(folder)
        Path(folder, "r0-0").write_bytes(b"\0" * 16)
    os.mkdir(other := os.path.join(parent, "not-an-agents"))
    lock = _ray_agent.claim(live)  # the agent of `live` is alive
    try:
        old = time.time() - 3600
        for folder in (live, dead, other):
            os.utime(folder, (old, old))
        assert _ray_agent.sweep(parent) == [dead]  # `young`'s agent may not hold its lock yet
    finally:
        os.close(lock)
    assert sorted(os.listdir(parent)) == sorted(os.path.basename(f) for f in (live, young, other))


def _fake_launch(shm: str, work: str) -> Any:
    launch = RayLaunch.__new__(RayLaunch)  # its thread, Ray and agents are not needed here
    launch.request = type("R", (), {"shm_dir": shm, "work_dir": work})()
    return launch
