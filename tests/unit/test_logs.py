"""Where launch logs are kept and how old ones are pruned (air_magic.kernel.logs), on real folders."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from air_magic.errors import ConfigurationError
from air_magic.kernel import logs as _logs
from air_magic.settings import Settings

DAY = 86400.0


def make_launch(root: Path, name: str, size: int, age_days: float, now: float) -> Path:
    folder = root / name
    folder.mkdir()
    log = folder / "rank-0.log"
    log.write_bytes(b"x" * size)
    when = now - age_days * DAY
    os.utime(log, (when, when))
    os.utime(folder, (when, when))
    return folder


def test_the_log_folder_follows_the_environment_then_the_cache(tmp_path: Path) -> None:
    assert Settings({"AIR_MAGIC_LOG_DIR": str(tmp_path / "mine")}).log_dir == str(tmp_path / "mine")
    assert Settings({"XDG_CACHE_HOME": "/c"}).log_dir == "/c/air_magic/logs"
    assert Settings({}).log_dir == os.path.expanduser("~/.cache/air_magic/logs")
    assert (Settings({}).log_keep_days, Settings({}).log_keep_mb) == (14.0, 1024.0)


def test_a_bad_limit_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="AIR_MAGIC_LOG_KEEP_DAYS must be a number .0 or more., got 'soon'"):
        _ = Settings({"AIR_MAGIC_LOG_KEEP_DAYS": "soon"}).log_keep_days


def test_a_launch_folder_is_named_by_its_start_and_id(tmp_path: Path) -> None:
    started = time.mktime((2026, 11, 30, 23, 45, 12, 0, 0, -1))
    assert _logs.launch_log_dir(str(tmp_path), "0003-1a2b3c4d", started) == str(
        tmp_path / "20261130-234512-0003-1a2b3c4d"
    )


def test_old_folders_go_then_the_oldest_past_the_size_limit_never_a_recent_one(tmp_path: Path) -> None:
    now = time.time()
    make_launch(tmp_path, "a-30-days", 10, 30, now)
    make_launch(tmp_path, "b-5-days", 600, 5, now)
    make_launch(tmp_path, "c-2-days", 600, 2, now)
    make_launch(tmp_path, "d-running", 5000, 0, now)  # written just now: another kernel's launch
    removed = _logs.prune(str(tmp_path), keep_days=14, keep_bytes=1000, now=now)
    assert removed == ["a-30-days", "b-5-days", "c-2-days"]
    assert sorted(os.listdir(tmp_path)) == ["d-running"]


def test_nothing_goes_within_the_limits(tmp_path: Path) -> None:
    now = time.time()
    make_launch(tmp_path, "a", 10, 3, now)
    make_launch(tmp_path, "b", 10, 1, now)
    assert _logs.prune(str(tmp_path), keep_days=14, keep_bytes=1000, now=now) == []
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_the_log_folder_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_MAGIC_LOG_DIR", str(tmp_path / "logs"))
    root = _logs.logs_root()
    assert os.stat(root).st_mode & 0o777 == 0o700
    os.chmod(root, 0o755)
    with pytest.raises(PermissionError, match="others may read or write it"):
        _logs.logs_root()
