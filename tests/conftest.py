"""Fixtures of the kernel-level and process-level tests (helpers live in harness.py)."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from typing import Any, Iterator

import psutil
import pytest
from harness import LIVE_KERNEL_PIDS, Kernel, describe, stray_processes, wait_until


@pytest.fixture(autouse=True)
def no_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every kernel/process test: no rank, no rank child and no orphaned helper
    survives it (5 s grace)."""
    yield
    if not (request.node.get_closest_marker("kernel") or request.node.get_closest_marker("process")):
        return
    if not wait_until(lambda: not stray_processes(), timeout=5.0):
        leftovers = stray_processes()
        report = describe(leftovers)
        _kill_and_clean(leftovers)  # do not poison the next tests
        pytest.fail("air_magic processes survived the test:\n" + report)


def _kill_and_clean(procs: list[psutil.Process]) -> None:
    """SIGKILL leftovers and delete the session folders their command lines name."""
    folders = set()
    for proc in procs:
        try:
            folders.update(a for a in proc.cmdline() if os.path.basename(a).startswith("air_magic-"))
            proc.kill()
        except psutil.Error:
            pass
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


#: What the project's code, its tests, notebooks and benchmarks name their temporary files and
#: folders (in the temp folder and in ``/dev/shm``): a test run leaves none behind.
_OURS = re.compile(r"^(air[_-]magic|am-|amray-|airbench-|bench-|tracking-bench-|fsdp2-|tiny-gpt2-|kept-)")
_TEMP_PLACES = (tempfile.gettempdir(), "/dev/shm")


def _our_temp_files() -> set[str]:
    found = set()
    for place in _TEMP_PLACES:
        try:
            with os.scandir(place) as entries:
                for entry in entries:
                    try:
                        if _OURS.match(entry.name) and entry.stat(follow_symlinks=False).st_uid == os.getuid():
                            found.add(entry.path)
                    except OSError:  # gone meanwhile
                        continue
        except OSError:
            continue
    return found


#: The machine's list of launches (GPU claims, air-magic ps) of this run's own: the machine's real
#: one (another notebook's launches) is not the tests' to see, nor theirs to fill.  Inherited by
#: every kernel, helper and command the tests start; removed at the session's end.
_LAUNCH_LIST = tempfile.mkdtemp(prefix="am-launches-")
os.environ.setdefault("AIR_MAGIC_REGISTRY", os.path.join(_LAUNCH_LIST, "launches"))

_TEMP_AT_START = _our_temp_files()  # (another run's, or the user's: not this run's to judge)
#: The test after which each of this run's temporary files was first seen: a report of what
#: was left behind names where to look.
_FIRST_SEEN: dict[str, str] = {}


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    for path in _our_temp_files() - _TEMP_AT_START:
        _FIRST_SEEN.setdefault(path, item.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Every kernel fixture has shut down by now: no rank and no helper of a kernel may
    # remain (a helper of this pytest process itself goes at its exit).
    LIVE_KERNEL_PIDS.clear()
    # This process's own launcher (tests that launch in-process) ends here rather than at the
    # interpreter's exit, after this check: its helper and session folders go now.
    own = sys.modules.get("air_magic.kernel.launcher")
    if own is not None and own._launcher is not None:
        own._launcher.shutdown()
    if not wait_until(lambda: not stray_processes(), timeout=5.0):
        leftovers = stray_processes()
        sys.stderr.write("\nair_magic processes left after the test session:\n" + describe(leftovers) + "\n")
        _kill_and_clean(leftovers)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(_LAUNCH_LIST, ignore_errors=True)
    # Nor a file or folder of this run in the temp folder or /dev/shm (10 s for the last
    # processes' own clean-up).  One a live process works in (its current folder, a file it
    # holds open) is not a leftover: another program's at work.  Nothing is removed: it may
    # be someone's.  AIR_MAGIC_TEMP_CHECK=warn says so without failing the run.
    if not wait_until(lambda: not _left_behind(), timeout=10.0):
        left = _left_behind()
        named = [f"{path}  (first seen after {_FIRST_SEEN.get(path, 'the last test')})" for path in left]
        sys.stderr.write("\nthe test session left these behind:\n  " + "\n  ".join(named) + "\n")
        if os.environ.get("AIR_MAGIC_TEMP_CHECK") != "warn":
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _left_behind() -> list[str]:
    new = _our_temp_files() - _TEMP_AT_START
    if not new:
        return []
    in_use: set[str] = set()
    for proc in psutil.process_iter():
        try:
            places = [proc.cwd()] + [f.path for f in proc.open_files()]
        except (psutil.Error, OSError):
            continue
        for path in new:
            if any(place == path or place.startswith(path + os.sep) for place in places):
                in_use.add(path)
    return sorted(new - in_use)


@pytest.fixture(scope="session", autouse=True)
def private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``AIR_MAGIC_STATE_DIR`` for this session (kernels started here inherit it): the MLflow
    spools of one suite never reach another suite's kernels, nor the user's own folder."""
    folder = tmp_path_factory.mktemp("air-magic-state")
    folder.chmod(0o700)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIR_MAGIC_STATE_DIR", str(folder))
        yield str(folder)


@pytest.fixture(scope="session", autouse=True)
def private_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``AIR_MAGIC_LOG_DIR`` for this session (kernels started here inherit it): the launches'
    logs, kept after a kernel exits, go here instead of the user's own cache folder."""
    folder = tmp_path_factory.mktemp("air-magic-logs")
    folder.chmod(0o700)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIR_MAGIC_LOG_DIR", str(folder))
        yield str(folder)


@pytest.fixture(scope="session")
def kernel_factory() -> Iterator[Any]:
    """``kernel_factory(extra_env=None) -> Kernel``; every kernel is shut down at the end."""
    kernels: list[Kernel] = []
    root = tempfile.mkdtemp(prefix="air-magic-tests-")

    def make(extra_env: dict[str, str] | None = None, load: bool = True, tracking: bool = False) -> Kernel:
        workdir = tempfile.mkdtemp(dir=root)
        kernel = Kernel(workdir, extra_env)
        kernels.append(kernel)
        if load:
            kernel.ok("%load_ext air_magic")
            if not tracking:  # MLflow has tests of its own; keep these launches lean
                kernel.ok("%config DistributedMagics.tracking = False")
        return kernel

    yield make
    for kernel in kernels:
        kernel.shutdown()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def kernel(kernel_factory: Any) -> Iterator[Kernel]:
    """One kernel per test module, with ``%load_ext air_magic`` done."""
    k = kernel_factory()
    yield k
    k.shutdown()
