"""A stop that reaches ranks before they are set up (a peer failed at once, on a loaded
machine): the ranks end as stopped, the user's code never runs, and the launch's files
stay for the kernel to read.

Seen before the fix, 1 launch in 8 with 4 busy loops on 2 cores: a rank that had not yet
installed its own signal handlers ran the helper's SIGTERM handler, which shut the
helper's launches down from inside the rank: it deleted the session folder (the other
rank's result with it) and exited 0; and a stop sent before the rank's ``setsid()`` found
no process group and was lost."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Iterator

import cloudpickle
import pytest

from air_magic.protocol import (
    INTERRUPTED_EXIT,
    STOP_MARK,
    Done,
    Exited,
    LaunchRequest,
    Ready,
    Started,
    StartLaunch,
    Stop,
    decode,
    encode,
    result_path,
)
from air_magic.rank.results import read_record

pytestmark = pytest.mark.process

HELPER = Path(__file__).with_name("slow_start_helper.py")
LATE = 0.25  # seconds each rank sleeps before it begins


class Helper:
    def __init__(self, tmp: Path) -> None:
        self.session = tmp / "session"
        self.session.mkdir(mode=0o700)
        ours, theirs = socket.socketpair()
        alive_r, self.alive_w = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, str(HELPER), str(LATE), str(theirs.fileno()), str(alive_r), str(self.session), ""],
            pass_fds=(theirs.fileno(), alive_r),
        )
        theirs.close()
        os.close(alive_r)
        self.conn = Connection(ours.detach())

    def receive(self, timeout: float = 30) -> Any:
        assert self.conn.poll(timeout), "the helper said nothing"
        return decode(self.conn.recv())

    def launch(self, tmp: Path, world_size: int) -> LaunchRequest:
        work = self.session / "L"
        work.mkdir(mode=0o700)
        payload = work / "payload.pkl"
        code = f"open({str(tmp / 'ran')!r}, 'w').write('the user code ran')"
        payload.write_bytes(cloudpickle.dumps({"kind": "cell", "code": code, "names": {}}))
        request = LaunchRequest(
            launch_id="L",
            world_size=world_size,
            env={**os.environ, "AIR_MAGIC_LAUNCH_ID": "L"},
            cwd=str(tmp),
            sys_path=list(sys.path),
            payload_path=str(payload),
            work_dir=str(work),
            shm_dir=None,
            log_paths=[str(tmp / f"rank-{r}.log") for r in range(world_size)],
            timeout=None,
            sources={},
            argv=None,
            umask=None,
            rlimits={},
        )
        self.conn.send(encode(StartLaunch(request)))
        return request

    def close(self) -> None:
        self.conn.close()
        os.close(self.alive_w)
        self.process.wait(timeout=30)


@pytest.fixture
def helper(tmp_path: Path) -> Iterator[Helper]:
    started = Helper(tmp_path)
    try:
        assert isinstance(started.receive(), Ready)
        yield started
    finally:
        started.close()


def stop_at_once(helper: Helper, reason: str) -> dict[int, int]:
    """Stop the launch as soon as its ranks are forked; their exit codes by rank."""
    started = helper.receive()
    assert isinstance(started, Started), started
    helper.conn.send(encode(Stop("L", reason)))
    exits: dict[int, int] = {}
    while True:
        message = helper.receive()
        if isinstance(message, Exited):
            exits[message.rank] = message.returncode
        elif isinstance(message, Done):
            return exits


def test_a_failure_stop_before_the_ranks_are_set_up_terminates_them(helper: Helper, tmp_path: Path) -> None:
    request = helper.launch(tmp_path, world_size=2)
    assert stop_at_once(helper, "failure") == {0: -signal.SIGTERM, 1: -signal.SIGTERM}
    assert not (tmp_path / "ran").exists()
    assert os.path.isdir(request.work_dir)  # the kernel still reads the launch's files
    assert helper.process.poll() is None  # the helper serves on


def test_an_interrupt_before_the_ranks_are_set_up_stops_them_as_keyboard_interrupt(
    helper: Helper, tmp_path: Path
) -> None:
    request = helper.launch(tmp_path, world_size=2)
    assert stop_at_once(helper, "cancel") == {0: INTERRUPTED_EXIT, 1: INTERRUPTED_EXIT}  # 130, as a shell says it
    assert not (tmp_path / "ran").exists()
    for rank in range(2):
        record = read_record(result_path(request.work_dir, rank))
        assert record.type_name == "KeyboardInterrupt"
        assert STOP_MARK in Path(request.log_paths[rank]).read_text()  # reads as stopped, not failed
