"""``air-magic run`` stopped from outside (``air-magic stop``, as the sidebar's Stop does it) ends
as stopped, naming who stopped it, and exits 130 (an interrupt, as a shell says it), not as a
rank killed by SIGTERM."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import wait_until
from test_cli_run import environment

pytestmark = pytest.mark.process


def test_a_run_stopped_from_outside_ends_stopped_naming_who_and_exits_130(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("import time\nprint('training', flush=True)\ntime.sleep(300)\n")
    env = environment(tmp_path)
    run = subprocess.Popen(
        [sys.executable, "-m", "air_magic.cli", "run", "train.py", "-n", "2", "--no-tracking"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def listed() -> list[dict]:
            done = subprocess.run(
                [sys.executable, "-m", "air_magic.cli", "ps", "--json"], env=env, capture_output=True, text=True
            )
            return [r for r in json.loads(done.stdout or "[]") if r["kind"] == "run" and r["state"] == "running"]

        assert wait_until(lambda: bool(listed()), timeout=120, interval=0.5), "the run is not in the list"
        (row,) = listed()
        time.sleep(1.0)
        stop = subprocess.run(
            [sys.executable, "-m", "air_magic.cli", "stop", row["id"]], env=env, capture_output=True, text=True
        )
        assert stop.returncode == 0, stop.stderr
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 130, err
    assert re.search(
        r"train\.py on 2 CPU ranks \(launch \S+\): cancelled after [\d.]+ s: LaunchCancelledError: train\.py was "
        r"stopped from outside: air-magic stop by \S+ \(pid \d+ on \S+\) at \d\d:\d\d:\d\d; its 2 ranks were stopped\.",
        err,
    ), err
    assert "rank 0: stopped" in err and "rank 1: stopped" in err, err
    assert "RankCrashedError" not in err and "failed" not in err, err
