"""The lock beside a local MLflow store is never followed to somewhere else: another user
who plants a symlink at ``<store>.air_magic.lock`` cannot make the kernel create or touch
a file of their choosing."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from air_magic._mlflow_upload import _first_use_lock


def test_a_symlink_planted_at_the_lock_path_is_not_followed(tmp_path: Path) -> None:
    store = tmp_path / "mlflow.db"
    victim = tmp_path / "elsewhere" / "created-by-the-kernel"
    victim.parent.mkdir()
    os.symlink(victim, f"{store}.air_magic.lock")
    with pytest.raises(OSError) as info:
        with _first_use_lock(f"sqlite:///{store}"):
            pass
    assert info.value.errno == errno.ELOOP
    assert not victim.exists()


def test_the_lock_is_a_private_file(tmp_path: Path) -> None:
    store = tmp_path / "mlflow.db"
    with _first_use_lock(f"sqlite:///{store}"):
        pass
    st = os.lstat(f"{store}.air_magic.lock")
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
