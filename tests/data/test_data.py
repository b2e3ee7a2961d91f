"""air_magic.data in real ranks: even shards, deterministic shuffles, resume, DCP checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from air_magic import distributed
from air_magic.data import DataError, StreamingDataset, UCVolumeDataset

pytestmark = pytest.mark.process


def make_files(folder: Path, count: int) -> list[str]:
    (folder / "nested").mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        path = folder / ("nested" if i % 3 == 0 else "") / f"item{i:03d}.txt"
        path.write_text(str(i))
        names.append(str(i))
    return names


@distributed(num_accelerators=2, tracking=False, timeout=120)
def read_epochs(url: str, epochs: list[int], workers: int, seed: int = 7) -> list[list[str]]:
    from air_magic.data import DataLoader, StreamingDataset

    dataset = StreamingDataset(url, seed=seed, output="bytes")
    seen = []
    for epoch in epochs:
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=None, num_workers=workers)
        seen.append([item.decode() for item in loader])
    return seen


@pytest.mark.parametrize(("files", "workers"), [(7, 2), (5, 0), (1, 2), (12, 2)])
def test_every_rank_gets_the_same_number_of_items(tmp_path: Path, files: int, workers: int) -> None:
    names = make_files(tmp_path, files)
    rank0, rank1 = (epochs[0] for epochs in read_epochs.distributed(str(tmp_path), [0], workers))
    assert len(rank0) == len(rank1) == -(-files // 2)
    assert set(rank0) | set(rank1) == set(names)  # padding repeats files, nothing is lost


def test_shuffles_are_deterministic_per_seed_and_epoch(tmp_path: Path) -> None:
    make_files(tmp_path, 20)
    first = read_epochs.distributed(str(tmp_path), [0, 1], 0)
    again = read_epochs.distributed(str(tmp_path), [0, 1], 0)
    assert first == again
    assert first[0][0] != first[0][1]  # a new order in epoch 1
    other_seed = read_epochs.distributed(str(tmp_path), [0], 0, 8)
    assert other_seed[0][0] != first[0][0]


@distributed(num_accelerators=2, tracking=False, timeout=120)
def interrupted_then_resumed(url: str, stop_after: int) -> tuple[list[str], list[str], list[str]]:
    from air_magic.data import DataLoader, StreamingDataset

    dataset = StreamingDataset(url, seed=3, output="bytes")
    dataset.set_epoch(2)
    full = [x.decode() for x in DataLoader(dataset, batch_size=None, num_workers=2)]
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    first = []
    for item in loader:
        first.append(item.decode())
        if len(first) == stop_after:
            break
    state = loader.state_dict()
    # A fresh process would build these again: the same dataset, a new loader.
    resumed_dataset = StreamingDataset(url, seed=3, output="bytes")
    resumed = DataLoader(resumed_dataset, batch_size=None, num_workers=2)
    resumed.load_state_dict(state)
    rest = [x.decode() for x in resumed]
    return full, first, rest


def test_resume_after_an_interrupted_epoch_gives_exactly_the_rest(tmp_path: Path) -> None:
    make_files(tmp_path, 23)
    for full, first, rest in interrupted_then_resumed.distributed(str(tmp_path), 5):
        assert len(first) == 5
        assert sorted(first + rest) == sorted(full)
        assert len(first) + len(rest) == len(full) == 12


@distributed(num_accelerators=2, tracking=False, timeout=120)
def memory_bucket(limit: int) -> tuple[list[bytes], int]:
    import fsspec

    from air_magic.data import StreamingDataset

    fs = fsspec.filesystem("memory")
    for i in range(6):
        fs.pipe(f"/bucket/shard{i}", bytes([i]) * 1000)  # each rank has its own memory store
    dataset = StreamingDataset("memory://bucket", shuffle=False, output="bytes", cache_limit_bytes=2500)
    items = [item[:1] for item in dataset]
    cache_files = [p for p in os.listdir(dataset._cache_root())]
    return items, len(cache_files)


def test_remote_files_go_through_a_bounded_cache() -> None:
    (items0, cached0), (items1, cached1) = memory_bucket.distributed(2500)
    assert items0 == [b"\x00", b"\x02", b"\x04"] and items1 == [b"\x01", b"\x03", b"\x05"]
    assert cached0 <= 3 and cached1 <= 3  # 1000-byte files, 2500 bytes allowed (+ the current one)


@distributed(num_accelerators=2, tracking=False, timeout=180)
def fsdp_save(url: str) -> list[int]:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from air_magic.data import save_checkpoint

    dist.init_process_group()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    fully_shard(model)
    local = [p.to_local().numel() for p in model.parameters()]
    save_checkpoint({"model": get_model_state_dict(model)}, url)
    dist.destroy_process_group()
    return local


@distributed(num_accelerators=2, tracking=False, timeout=180)
def fsdp_load(url: str) -> list[float]:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from air_magic.data import load_checkpoint

    dist.init_process_group()
    torch.manual_seed(1)  # other weights than the saved ones
    model = torch.nn.Linear(16, 8)
    fully_shard(model)
    state = {"model": get_model_state_dict(model)}
    load_checkpoint(state, url)
    set_model_state_dict(model, state["model"])
    full = model.weight.full_tensor()
    dist.destroy_process_group()
    return full.flatten().tolist()


def test_dcp_checkpoint_saved_by_2_loads_on_2_and_reshards_to_1(tmp_path: Path) -> None:
    import torch

    from air_magic.data import load_checkpoint

    url = str(tmp_path / "ckpt")
    shards = fsdp_save.distributed(url)
    assert shards == [[64, 4], [64, 4]]  # the 8x16 weight and the bias really are split
    torch.manual_seed(0)
    expected = torch.nn.Linear(16, 8).weight.detach().flatten().tolist()
    loaded = fsdp_load.distributed(url)
    assert loaded[0] == pytest.approx(expected) and loaded[1] == pytest.approx(expected)
    # One process, no process group: DCP reshards into a plain module.
    single = torch.nn.Linear(16, 8)
    state = {"model": single.state_dict()}
    load_checkpoint(state, url)
    single.load_state_dict(state["model"])
    assert single.weight.detach().flatten().tolist() == pytest.approx(expected)


def test_async_save_and_training_state_round_trip(tmp_path: Path) -> None:
    import torch

    from air_magic.data import async_save_checkpoint, load_checkpoint, load_training_state, save_training_state

    future = async_save_checkpoint({"w": torch.arange(6.0)}, str(tmp_path / "async"))
    future.result()
    state = {"w": torch.zeros(6)}
    load_checkpoint(state, str(tmp_path / "async"))
    assert state["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save_training_state(str(tmp_path / "train"), model, optimizer)
    other = torch.nn.Linear(3, 2)
    other_opt = torch.optim.Adam(other.parameters())
    load_training_state(str(tmp_path / "train"), other, other_opt)
    assert torch.equal(other.weight, model.weight)
    assert other_opt.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]


def test_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="the folder '.*missing' does not exist"):
        StreamingDataset(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no files under .*: the dataset would be empty"):
        StreamingDataset(str(tmp_path / "empty"))
    (tmp_path / "one.txt").write_text("x")
    with pytest.raises(DataError, match="is a file; pass the folder"):
        StreamingDataset(str(tmp_path / "one.txt"))
    with pytest.raises(DataError, match="cannot open 'nosuchproto://bucket/x'"):
        StreamingDataset("nosuchproto://bucket/x")
    from air_magic.data import checkpoint_reader

    with pytest.raises(DataError, match="no checkpoint at .*its .metadata file is missing"):
        checkpoint_reader(str(tmp_path))


def test_resume_with_another_world_size_explains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_files(tmp_path, 4)
    dataset = StreamingDataset(str(tmp_path))
    state: dict[str, Any] = dataset.state_dict()
    state["streams"] = 4  # saved by 2 ranks x 2 workers
    with pytest.raises(DataError, match="saved with 4 streams .* loaded with 1. Resume with the same number"):
        dataset.load_state_dict(state)


def test_reference_names_still_work_with_a_warning(tmp_path: Path) -> None:
    make_files(tmp_path, 3)
    with pytest.warns(FutureWarning, match="use air_magic.data.StreamingDataset instead"):
        dataset = UCVolumeDataset(str(tmp_path))
    assert len(list(dataset)) == 3
