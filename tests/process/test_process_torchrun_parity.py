"""A rank is a torchrun worker: one probe, run under ``torchrun`` and under ``@distributed``.

The probe (``parity_probe.py``) records what a program can observe about its process:
environment variable names (and values, where they mean the same), ``sys.argv``,
``__name__``, ``sys.flags``, signal dispositions and mask, umask, stdin, resource limits,
threads, torch's thread pools, the standard streams, random state.  Every difference
that remains is listed in ``ALLOWED`` with its reason; a new difference fails the test,
and so does an allowed one that went away (the list must stay true).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import parity_probe
import pytest

from air_magic import distributed

pytestmark = pytest.mark.process

#: Variables whose value differs by nature (a port, an id, a file): compared by name.
BY_NAME = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
#: Set around torchrun by the terminal handling of some environments (torchrun's workers
#: had COLUMNS=80 under pytest, none from a shell), never by either launcher.
IGNORED = {"COLUMNS", "LINES"}

#: What an air_magic rank shows differently from a torchrun worker, and why.
ALLOWED = {
    "argv": "sys.argv is [<function or cell name>] (plus the arguments after -- on a "
    "%%distributed line), not a script path: there is no script",
    "torch_preloaded": "torch is imported once in the helper the ranks are forked from, so "
    "that a launch starts in milliseconds instead of seconds",
    "str_hash distinct per rank": "str hashes use a secret fixed when the interpreter starts; "
    "forked ranks share the helper's (set PYTHONHASHSEED to make "
    "torchrun's workers agree too)",
    "env MASTER_ADDR": "127.0.0.1 instead of localhost: always the IPv4 loopback the "
    "rendezvous listens on (localhost may resolve to ::1)",
    "env NODE_RANK": "part of the documented environment (multi-node launchers set it)",
    "env LOCAL_SIZE": "DeepSpeed's launcher sets it; its CPU accelerator counts ranks with it",
    "env CROSS_RANK": "DeepSpeed's launcher sets it",
    "env CROSS_SIZE": "DeepSpeed's launcher sets it",
    "env DS_ACCELERATOR": "CPU launches: DeepSpeed would look for a GPU without it",
    "env ACCELERATE_USE_CPU": "CPU launches: the Hugging Face Trainer joins CPU ranks with "
    "gloo only with it (what `accelerate launch --cpu` sets)",
    "env AIR_MAGIC_LAUNCH_ID": "names the launch (logs, MLflow)",
    "env TORCH_FR_BUFFER_SIZE": "torch's Flight Recorder keeps each rank's last collectives, so "
    "that an interrupted pool stops every rank at the same step (AIR_MAGIC_FLIGHT_RECORDER=0 "
    "turns it off; a value of the user's wins)",
    "os_threads": "one more OS thread, blocked in open() on the rank's stack pipe: it answers "
    "'where is each rank?' without a signal that would cut the user's system calls short "
    "(not one of threading's threads: threading.active_count() is the same)",
}


def _torchrun(tmp_path: Any) -> list[dict[str, Any]]:
    """Both workers' probes under ``torchrun --standalone --nproc_per_node=2``.

    On a loaded machine torchrun's own agent can fail to start a worker (it aborted once
    beside another test suite): one more try then, as a user would.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        parity_probe.__file__,
        str(tmp_path),
    ]
    for _attempt in range(2):
        done = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180, cwd=os.getcwd()
        )
        if done.returncode == 0:
            break
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"probe-{rank}.json").read_text()) for rank in (0, 1)]


def _air_magic() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    probe = distributed(num_accelerators=2, accelerator_type="CPU", tracking=False)(parity_probe.probe)
    return probe.distributed(), probe.distributed()


def _differences(ours: dict[str, Any], theirs: dict[str, Any]) -> set[str]:
    found = set()
    skip = {"env", "env_names", "str_hash", "torch_seed", "torch_draw", "numpy_draw", "random_draw"}
    for key in theirs:
        if key not in skip and ours.get(key) != theirs[key]:
            found.add(key)
    for name in (set(ours["env"]) | set(theirs["env"])) - IGNORED:
        if name in BY_NAME:
            if (name in ours["env"]) != (name in theirs["env"]):
                found.add(f"env {name}")
        elif ours["env"].get(name) != theirs["env"].get(name):
            found.add(f"env {name}")
    return found


def _distinct(values: list[Any]) -> bool:
    return len(set(values)) == len(values)


def test_a_rank_shows_what_a_torchrun_worker_shows_but_the_listed_differences(tmp_path: Any) -> None:
    theirs = _torchrun(tmp_path)
    first, second = _air_magic()

    differences: set[str] = set()
    for rank in (0, 1):
        differences |= _differences(first[rank], theirs[rank])
    if _distinct([p["str_hash"] for p in theirs]) != _distinct([p["str_hash"] for p in first]):
        differences.add("str_hash distinct per rank")
    assert differences == set(ALLOWED), (
        f"new differences: {sorted(differences - set(ALLOWED))}; listed but gone: {sorted(set(ALLOWED) - differences)}"
    )
    # The differences are the intended ones.
    assert [p["argv"] for p in first] == [["probe"], ["probe"]]
    assert all(p["env"]["MASTER_ADDR"] == "127.0.0.1" for p in first)
    assert all(p["torchelastic_launched"] for p in first)


def test_random_state_is_fresh_on_every_rank_and_every_launch_as_in_new_processes(tmp_path: Any) -> None:
    theirs = _torchrun(tmp_path)
    first, second = _air_magic()
    for draw in ("torch_seed", "torch_draw", "numpy_draw", "random_draw"):
        assert _distinct([p[draw] for p in theirs]), draw
        assert _distinct([p[draw] for p in first + second]), (draw, [p[draw] for p in first + second])


def test_a_seed_set_in_the_launched_code_still_makes_ranks_reproducible() -> None:
    @distributed(num_accelerators=2, accelerator_type="CPU", tracking=False)
    def seeded() -> list[float]:
        import random

        import numpy
        import torch

        torch.manual_seed(7)
        numpy.random.seed(7)
        random.seed(7)
        return [torch.rand(1).item(), float(numpy.random.random()), random.random()]

    first, second = seeded.distributed(), seeded.distributed()
    assert first[0] == first[1] == second[0] == second[1]


def test_numpy_preloaded_in_the_helper_still_differs_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from air_magic.kernel.launcher import Launcher

    monkeypatch.setenv("AIR_MAGIC_PRELOAD", "torch,numpy")
    launcher = Launcher()  # a helper of its own, started with numpy preloaded
    try:
        from air_magic.capture import function_payload
        from air_magic.spec import make_spec

        def draws() -> tuple[float, float]:
            import random
            import sys

            assert "numpy" in sys.modules  # preloaded, not imported here
            import numpy

            return float(numpy.random.random()), random.random()

        spec = make_spec(2, "CPU", tracking=False)
        values = [launcher.start(spec, function_payload(draws, (), {})).result() for _ in range(2)]
    finally:
        launcher.shutdown()
    flat = [v for launch in values for v in launch]
    assert _distinct([v[0] for v in flat]) and _distinct([v[1] for v in flat]), flat
