"""The helper's bookkeeping of rank exits, without the kernel around it."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from air_magic.rank import system as _system
from air_magic.rank import zygote as _zygote


class _Conn:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def send(self, message: tuple[Any, ...]) -> None:
        self.sent.append(message)

    def fileno(self) -> int:
        return -1


def _zygote_without_pidfds() -> tuple[_zygote.Zygote, _Conn]:
    conn = _Conn()
    zygote = _zygote.Zygote(conn, alive_fd=-1, session_dir="", shm_dir="")  # type: ignore[arg-type]
    zygote.use_pidfd = False
    return zygote, conn


def _child(code: int) -> int:
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        os._exit(code)
    return pid


def test_polled_exits_are_reported_once_and_reaped() -> None:
    zygote, conn = _zygote_without_pidfds()
    ok, failing = _child(0), _child(3)
    launch = _zygote._Launch("L", running={0: ok, 1: failing})
    zygote.launches["L"] = launch
    deadline = time.monotonic() + 10
    while launch.running and time.monotonic() < deadline:
        zygote._poll_exits()
        time.sleep(0.01)
    exits = sorted(m[2:4] for m in conn.sent if m[0] == "exit")  # (rank, returncode); m[4] is when
    assert exits == [(0, 0), (1, 3)]
    assert ("done", "L") in conn.sent and "L" not in zygote.launches
    for pid in (ok, failing):  # reaped: nothing left to wait for
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_a_launch_that_fails_half_way_through_its_start_leaves_nothing() -> None:
    zygote, conn = _zygote_without_pidfds()
    started = _child_that_waits()
    launch = _zygote._Launch("L", running={0: started})
    zygote.launches["L"] = launch
    zygote._abort(launch)
    assert "L" not in zygote.launches and not launch.running
    with pytest.raises(ChildProcessError):  # killed and reaped
        os.waitpid(started, os.WNOHANG)
    assert conn.sent == []  # the kernel hears of it once, as the launch's error


def _child_that_waits() -> int:
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        signal.pause()
        os._exit(0)
    return pid


def test_a_launchs_peer_segments_go_with_it_and_nothing_else(tmp_path: Any) -> None:
    uid = os.getuid()
    mine = [f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_41234_{rank}" for rank in (0, 1, 12)]
    kept = [
        f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_412345_0",  # another port that starts alike
        f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_41235_0",  # another launch
        f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_41234_0",  # another user's
        f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_41234_x",
        "air_magic-1-abc",
    ]
    for name in mine + kept:
        (tmp_path / name).write_bytes(b"")
    assert sorted(_system.remove_peer_segments(41234, str(tmp_path))) == sorted(mine)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert _system.remove_peer_segments(41234, str(tmp_path / "missing")) == []
