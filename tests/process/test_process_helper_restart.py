"""A launch sent to a helper that goes away before reading it is not lost: it goes to a new
helper (once), as no rank of it can be running (a rank dies with its helper)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from harness import wait_until

import air_magic
from air_magic import distributed

pytestmark = pytest.mark.process


@distributed(num_accelerators=2, tracking=False)
def ranks_and_pid() -> tuple[int, int]:
    return int(os.environ["RANK"]), os.getppid()


def launcher() -> Any:
    from air_magic.kernel.launcher import get_launcher

    return get_launcher()


def test_a_request_the_helper_never_read_goes_to_a_new_helper() -> None:
    assert [r for r, _ in ranks_and_pid.distributed()] == [0, 1]  # a helper that has torch
    old = launcher()._helper
    os.kill(old.proc.pid, signal.SIGSTOP)  # it reads nothing more
    try:
        launch = ranks_and_pid.submit()
        assert launch.helper is old
    finally:
        os.kill(old.proc.pid, signal.SIGKILL)
    values = launch.result(timeout=120)
    assert [r for r, _ in values] == [0, 1]
    new = launcher()._helper
    assert new is not old and {pid for _, pid in values} == {new.proc.pid}
    assert launch.sent_again is True


def test_a_helper_that_dies_again_on_the_same_request_fails_the_launch() -> None:
    assert [r for r, _ in ranks_and_pid.distributed()] == [0, 1]
    launch = None
    for attempt in range(2):  # the first helper and the one the launch is sent to next
        helper = launcher()._helper
        os.kill(helper.proc.pid, signal.SIGSTOP)
        if launch is None:
            launch = ranks_and_pid.submit()
        else:
            assert wait_until(lambda sent=launch, h=helper: sent.helper is h, timeout=30)
        os.kill(helper.proc.pid, signal.SIGKILL)
        if attempt == 0:  # the launch goes to a new helper (the launcher holds none for a moment)
            assert wait_until(lambda h=helper: launcher()._helper not in (h, None), timeout=30)
        else:  # it failed: no helper until the next launch
            assert wait_until(lambda h=helper: launcher()._helper is not h, timeout=30)
    assert launch is not None
    with pytest.raises(air_magic.LaunchError, match="the air_magic helper process died"):
        launch.result(timeout=60)
    assert [r for r, _ in ranks_and_pid.distributed()] == [0, 1]
