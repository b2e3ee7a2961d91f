"""``air_magic.save_safetensors`` on a file system that fills up: an ``OSError`` (ENOSPC) that
names the file, no part of a file left behind, and an earlier good file of the same name
untouched (written beside it, every write's count checked, fsync'ed, renamed into place)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import load_file

from air_magic import save_safetensors


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (mounting one needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_full_disk_raises_naming_the_file_and_leaves_the_earlier_file_whole(tiny_disk: Path) -> None:
    good = {"w": torch.arange(1000, dtype=torch.float32)}
    save_safetensors(good, tiny_disk)
    before = (tiny_disk / "model.safetensors").read_bytes()
    big = {"w": torch.randn(512 * 1024)}  # 2 MiB on a 1 MiB disk
    with pytest.raises(OSError) as info:
        save_safetensors(big, tiny_disk)
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == (
        f"[Errno 28] No space left on device: writing {tiny_disk / 'model.safetensors'} (the earlier file of that "
        f"name, if any, is untouched): '{tiny_disk / 'model.safetensors'}'"
    )
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["model.safetensors"]  # no part of a file left
    assert (tiny_disk / "model.safetensors").read_bytes() == before
    assert torch.equal(load_file(str(tiny_disk / "model.safetensors"))["w"], good["w"])


def test_shards_and_their_index_appear_together_once_written_whole(tmp_path: Path) -> None:
    sd = {f"layer{i}": torch.full((256,), float(i)) for i in range(4)}
    paths = save_safetensors(sd, tmp_path, max_shard_size=2048)
    assert [Path(p).name for p in paths] == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(p).name for p in paths] + ["model.safetensors.index.json"]
    )
    back = {k: v for p in paths for k, v in load_file(p).items()}
    assert all(torch.equal(back[k], sd[k]) for k in sd)
