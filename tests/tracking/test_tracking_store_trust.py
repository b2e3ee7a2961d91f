"""A local MLflow store is opened as MLflow opens it, and never trusted blindly.

* a new sqlite store is made whole, in a temp file beside it that is linked into place:
  no lock or state file of air_magic's in the notebook's folder, two makers at once share
  one store, a maker stopped half-way leaves no half-made store;
* a file another user planted beside the store costs a launch nothing; a store file of
  another user is never written to, and the launch says so at once, naming the owner;
* a store left half-made (by a process stopped while MLflow made it) is told in one line
  that names it and the fix, once for all kernels; the points wait on disk, and reach the
  store once it is moved away.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from harness import Kernel, wait_until
from tracking_support import stored_run

from air_magic.tracking.store import StoreUnusable, make_client

ROOT = os.geteuid() == 0
NOBODY = 65534
needs_root = pytest.mark.skipif(not ROOT, reason="another user's files are made as root")

pytestmark = pytest.mark.process


def test_a_new_store_is_made_whole_and_nothing_of_air_magic_stays_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "mlflow.db"
    client = make_client(f"sqlite:///{path}")
    assert [e.name for e in client.search_experiments()] == ["Default"]
    assert sorted(os.listdir(tmp_path)) == ["mlflow.db"]  # no lock, no temp file
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # as sqlite makes a file


def test_two_processes_making_one_new_store_at_once_both_use_it(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = (
        "import sys, time\n"
        "from air_magic.tracking.store import make_client\n"
        "while time.time() < float(sys.argv[2]): time.sleep(0.001)\n"
        "client = make_client(sys.argv[1])\n"
        "print(client.create_experiment(sys.argv[3]))\n"
    )
    at = str(time.time() + 8)  # both start making it at the same moment, after MLflow's import
    makers = [
        subprocess.Popen([sys.executable, "-c", code, uri, at, f"maker-{i}"], stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    outs = [maker.communicate(timeout=120)[0] for maker in makers]
    assert [maker.returncode for maker in makers] == [0, 0], outs
    names = sorted(e.name for e in make_client(uri).search_experiments())
    assert names == ["Default", "maker-0", "maker-1"]
    assert sorted(os.listdir(tmp_path)) == ["mlflow.db"]


def test_a_temp_store_left_by_a_stopped_maker_is_removed_by_the_next_one(tmp_path: Path) -> None:
    left = tmp_path / ".mlflow.db.air_magic-abc123.tmp"
    left.write_bytes(b"")
    os.utime(left, (time.time() - 3600, time.time() - 3600))
    make_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert sorted(os.listdir(tmp_path)) == ["mlflow.db"]


@needs_root
def test_a_store_file_of_another_user_is_refused_at_once_naming_its_owner(tmp_path: Path) -> None:
    path = tmp_path / "mlflow.db"
    make_client(f"sqlite:///{path}")
    os.chown(path, NOBODY, NOBODY)
    started = time.monotonic()
    with pytest.raises(StoreUnusable) as info:
        make_client(f"sqlite:///{path}")
    assert time.monotonic() - started < 1
    assert info.value.reason.startswith(f"{path} belongs to user nobody (uid {NOBODY}), not to you: ")


@needs_root
def test_a_link_another_user_planted_at_the_store_path_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "elsewhere.db"
    os.symlink(victim, tmp_path / "mlflow.db")
    os.lchown(tmp_path / "mlflow.db", NOBODY, NOBODY)
    with pytest.raises(StoreUnusable, match="belongs to user nobody"):
        make_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert not victim.exists()


def _half_made(path: Path) -> None:
    """A store as MLflow leaves it when stopped during its first migration."""
    db = sqlite3.connect(path)
    with db:
        db.execute("CREATE TABLE _alembic_tmp_experiments (experiment_id INTEGER)")
    db.close()


CELL = "%%distributed -n 1\nimport mlflow\nmlflow.log_metric('loss', 0.5)\n42"


def _store_path(kernel: Kernel) -> Path:
    return Path(kernel.workdir) / "mlflow.db"


def _runs(kernel: Kernel) -> list[Any]:
    """The runs in the kernel's store (none while it does not exist)."""
    if not _store_path(kernel).exists():
        return []
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{_store_path(kernel)}")
    ids = [e.experiment_id for e in client.search_experiments()]
    return list(client.search_runs(ids))


@needs_root
def test_a_lock_file_another_user_holds_beside_the_store_costs_a_launch_nothing(kernel_factory: Any) -> None:
    kernel = kernel_factory(tracking=True)
    try:
        os.chmod(kernel.workdir, 0o1777)  # a folder others can write, as a shared one is
        # What another user left there: the lock file air_magic once used, theirs, 0666, held.
        planted = _store_path(kernel).with_name("mlflow.db.air_magic.lock")
        fd = os.open(planted, os.O_RDWR | os.O_CREAT, 0o666)
        os.fchmod(fd, 0o666)
        os.fchown(fd, NOBODY, NOBODY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            started = time.monotonic()
            res = kernel.run(CELL, timeout=120)
            took = time.monotonic() - started
            assert res.error is None, res.error_text
            assert res.result == "[42]"
            assert "unreachable" not in res.stderr and "cannot be used" not in res.stderr, res.stderr
            assert took < 30, took  # it waited 30 s and more on the lock before
            assert wait_until(lambda: [r.info.status for r in _runs(kernel)] == ["FINISHED"], timeout=60)
            assert _runs(kernel)[0].data.metrics == {"loss": 0.5}
        finally:
            os.close(fd)
    finally:
        kernel.shutdown()


@needs_root
def test_a_store_file_of_another_user_is_said_at_once_and_the_launch_returns(kernel_factory: Any) -> None:
    kernel = kernel_factory(tracking=True)
    try:
        make_client(f"sqlite:///{_store_path(kernel)}")
        os.chown(_store_path(kernel), NOBODY, NOBODY)
        res = stored_run(kernel, CELL, timeout=120)
        assert res.error is None and res.result == "[42]", res.error_text
        [line] = [line for line in res.stderr.splitlines() if "cannot be used" in line]
        assert line.startswith(
            f"[air_magic] MLflow store sqlite:///{_store_path(kernel)} cannot be used: {_store_path(kernel)} "
            f"belongs to user nobody (uid {NOBODY}), not to you: "
        ), line
    finally:
        kernel.shutdown()
        # Its launch's points wait on disk: given to the store once it is the user's again.
        os.chown(_store_path(kernel), os.getuid(), os.getgid())
        from air_magic.tracking import upload_pending

        assert [r.outcome for r in upload_pending() if r.tracking_uri.endswith(kernel.workdir + "/mlflow.db")] == [
            "sent"
        ]


def test_a_half_made_store_is_told_once_in_one_line_and_its_points_wait_for_the_fix(kernel_factory: Any) -> None:
    first = kernel_factory(tracking=True)
    store = _store_path(first)
    _half_made(store)
    res = stored_run(first, CELL, timeout=120)
    assert res.error is None and res.result == "[42]", res.error_text
    told = [line for line in res.stderr.splitlines() if "half-made" in line]
    assert told == [
        f"[air_magic] MLflow store sqlite:///{store} cannot be used: it was left half-made "
        "((sqlite3.OperationalError) table _alembic_tmp_experiments already exists), by a process stopped "
        f"while it created the store: move it away (mv {store} {store}.broken) and the next launch makes a "
        "new one. This launch's points stay on disk and are sent once it is fixed, at the next launch or "
        "%load_ext, or with air_magic.tracking.upload_pending()."
    ], res.stderr
    first.shutdown()  # its launch's spool is an orphan now, for the next kernels to recover

    def recovery_lines() -> list[str]:
        kernel = kernel_factory(load=False, extra_env={"MLFLOW_TRACKING_URI": f"sqlite:///{store}"})
        out = kernel.run(  # what the kernel's first cell shows, once its look for orphans is done
            "%load_ext air_magic\nimport air_magic.tracking.recovery as r\nr._thread is not None and r._thread.join(60)",
            timeout=90,
        )
        kernel.shutdown()
        return [line for line in out.stderr.splitlines() if "half-made" in line]

    [said] = recovery_lines()  # the first kernel after it: one line for the store
    assert said.startswith(f"[air_magic] MLflow store sqlite:///{store} is still unreachable (it was left half-made")
    assert recovery_lines() == []  # said already: not again in every new kernel
    os.rename(store, f"{store}.broken")  # the fix the line names
    kernel = kernel_factory(tracking=True, extra_env={"MLFLOW_TRACKING_URI": f"sqlite:///{store}"})
    try:
        kernel.ok("import air_magic.tracking\nair_magic.tracking.upload_pending()", timeout=120)
        runs = _runs(first)
        assert [r.data.metrics for r in runs] == [{"loss": 0.5}]
    finally:
        kernel.shutdown()


def test_a_store_another_process_is_making_right_now_is_waited_for_not_called_half_made(tmp_path: Path) -> None:
    from air_magic.tracking.store import Unreachable

    path = tmp_path / "mlflow.db"
    _half_made(path)  # as a plain MLflow client has it mid-way, in its write transaction:
    maker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "db.execute('BEGIN IMMEDIATE')\n"
            "db.execute('CREATE TABLE experiments (experiment_id INTEGER)')\n"
            "print('open', flush=True)\n"
            "time.sleep(60)",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert maker.stdout is not None and maker.stdout.readline() == "open\n"
        with pytest.raises(Unreachable) as info:
            make_client(f"sqlite:///{path}")
        assert not isinstance(info.value, StoreUnusable)
        # sqlite's own word while the maker's transaction holds it, or ours once MLflow saw half of it
        assert info.value.reason in ("database is locked", "it is being made by another process")
    finally:
        maker.kill()
        maker.wait()
