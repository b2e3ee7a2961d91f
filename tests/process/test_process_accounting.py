"""The tests' own accounting of air_magic processes: by what a process is, not by path text."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from harness import TEST_MARK, air_magic_processes, stray_processes, wait_until

from air_magic import distributed

pytestmark = pytest.mark.process


def test_a_process_started_from_a_folder_named_air_magic_is_not_taken_for_a_rank(
    tmp_path: pytest.TempPathFactory,
) -> None:
    # A clone in a folder named air_magic puts the name in every command line (an MLflow
    # server started from the clone's virtual environment, with the tests' environment).
    folder = os.path.join(str(tmp_path), "air_magic", ".venv", "bin")
    os.makedirs(folder)
    server = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", os.path.join(folder, "mlflow"), "server"],
        env={**os.environ, "AIR_MAGIC_TEST_MARK": TEST_MARK},
    )
    try:
        assert wait_until(lambda: server.pid in _pids_with_marker(), timeout=5)
        assert server.pid not in {p.pid for p in air_magic_processes()}
        assert server.pid not in {p.pid for p in stray_processes()}
    finally:
        server.kill()
        server.wait()


def _pids_with_marker() -> set[int]:
    import psutil

    found = set()
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("AIR_MAGIC_TEST_MARK") == TEST_MARK:
                found.add(proc.pid)
        except psutil.Error:
            pass
    return found


@distributed(num_accelerators=1, tracking=False)
def start_a_program_and_wait(report: str) -> None:
    import os
    import subprocess
    import time

    program = subprocess.Popen(["sleep", "60"])
    with open(report + ".tmp", "w") as handle:
        handle.write(f"{os.getpid()} {program.pid}")
    os.replace(report + ".tmp", report)
    time.sleep(60)


def test_ranks_and_the_programs_they_execute_are_recognised_and_go_with_the_launch(
    tmp_path: pytest.TempPathFactory,
) -> None:
    report = os.path.join(str(tmp_path), "pids")
    launch = start_a_program_and_wait.submit(report)
    assert wait_until(lambda: os.path.exists(report), timeout=20)
    rank_pid, program_pid = map(int, open(report).read().split())
    ours = {p.pid for p in air_magic_processes()}
    assert {rank_pid, program_pid} <= ours  # forked from the helper / carrying the rank's environment
    launch.cancel()
    assert wait_until(lambda: not {rank_pid, program_pid} & {p.pid for p in air_magic_processes()}, timeout=10)
