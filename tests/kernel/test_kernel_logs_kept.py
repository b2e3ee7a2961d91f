"""A launch's logs outlive the kernel: a summary or an error names a file the user can still
open after the kernel has exited (in ``AIR_MAGIC_LOG_DIR``, here the session's own folder)."""

from __future__ import annotations

import os
from typing import Any

import pytest

pytestmark = pytest.mark.kernel


def test_the_logs_named_by_a_failed_launch_are_there_after_the_kernel_exits(
    kernel_factory: Any, private_log_dir: str
) -> None:
    k = kernel_factory()
    res = k.run(
        "%%distributed -n 2\n"
        "import os\n"
        "print('hello from rank', os.environ['RANK'])\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise ValueError('bad batch')\n"
    )
    assert res.error is not None and res.error["ename"] == "ValueError"
    named = [word for word in res.error_text.split() if word.endswith("rank-1.log")]
    assert named, res.error_text
    path = named[0]
    assert path.startswith(private_log_dir + os.sep)
    k.shutdown()
    with open(path) as handle:
        text = handle.read()
    assert "hello from rank 1" in text and "ValueError: bad batch" in text
    with open(os.path.join(os.path.dirname(path), "rank-0.log")) as handle:
        assert "hello from rank 0" in handle.read()


def test_a_log_folder_others_can_open_is_refused_and_the_logs_stay_with_the_session(
    kernel_factory: Any, tmp_path: Any
) -> None:
    shared = tmp_path / "shared-logs"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    k = kernel_factory(extra_env={"AIR_MAGIC_LOG_DIR": str(shared)})
    res = k.run("%%distributed -n 2\nimport os\nint(os.environ['RANK'])")
    assert res.error is None, res.error_text
    assert res.result == "[0, 1]"
    assert (
        f"[air_magic] cannot use {shared} for the launches' logs: others may read or write it (mode 0o755); "
        "chmod 700 it. This kernel's launch logs are kept in its session folder and removed when it exits; "
        "set AIR_MAGIC_LOG_DIR to a folder only you can use."
    ) in res.stderr
    assert os.listdir(shared) == []
    again = k.run("%%distributed -n 2\nimport os\nint(os.environ['RANK'])")
    assert "cannot use" not in again.stderr  # said once per kernel
    k.shutdown()
