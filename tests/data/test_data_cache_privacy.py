"""The data cache is the user's own: a folder another user planted there, a symlink to
elsewhere, or a folder open to others is refused, never read from nor evicted into."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from air_magic.data import StreamingDataset
from air_magic.protocol.private import PrivateFolderError

ROOT = os.geteuid() == 0


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import fsspec

    memory = fsspec.filesystem("memory")
    for name in ("shards", "linked", "planted", "open"):
        memory.pipe(f"/bucket/{name}/part-0.bin", b"data")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _folder(url: str, home: Path) -> Path:
    return home / "air_magic" / "data" / hashlib.sha1(url.encode()).hexdigest()[:12]


def test_the_cache_is_a_private_folder_of_the_user(cache_home: Path) -> None:
    dataset = StreamingDataset("memory://bucket/shards/")
    root = dataset._cache_root()
    assert root == str(_folder("memory://bucket/shards/", cache_home))
    for folder in (root, os.path.dirname(root)):
        st = os.lstat(folder)
        assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    assert not root.startswith("/tmp/air_magic-cache")  # no predictable shared path


def test_a_symlink_in_place_of_the_cache_is_refused(cache_home: Path, tmp_path: Path) -> None:
    url = "memory://bucket/linked/"
    victim = tmp_path / "checkpoints"
    victim.mkdir(mode=0o700)
    (victim / "step-100.pt").write_bytes(b"weights")
    folder = _folder(url, cache_home)
    folder.parent.mkdir(parents=True, mode=0o700)
    os.chmod(folder.parent.parent, 0o700)
    folder.symlink_to(victim)
    with pytest.raises(PrivateFolderError) as info:
        StreamingDataset(url)._cache_root()
    assert str(info.value) == f"cannot use {folder} for the data cache: it is a symbolic link."
    assert (victim / "step-100.pt").read_bytes() == b"weights"  # nothing evicted there


@pytest.mark.skipif(not ROOT, reason="giving a folder to another user needs root")
def test_a_cache_folder_another_user_made_first_is_refused(cache_home: Path) -> None:
    url = "memory://bucket/planted/"
    folder = _folder(url, cache_home)
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(folder.parent, 0o700), os.chmod(folder.parent.parent, 0o700)
    (folder / "planted.bin").write_bytes(b"attacker's data")
    os.chown(folder, 65534, 65534)
    with pytest.raises(PrivateFolderError) as info:
        StreamingDataset(url)._cache_root()
    assert str(info.value) == f"cannot use {folder} for the data cache: it belongs to uid 65534, not to you (uid 0)."


def test_a_cache_folder_open_to_others_is_refused(cache_home: Path) -> None:
    url = "memory://bucket/open/"
    folder = _folder(url, cache_home)
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(folder.parent, 0o700), os.chmod(folder.parent.parent, 0o700)
    os.chmod(folder, 0o777)
    with pytest.raises(PrivateFolderError) as info:
        StreamingDataset(url)._cache_root()
    assert str(info.value) == (
        f"cannot use {folder} for the data cache: others may read or write it (mode 0o777); chmod 700 it."
    )
