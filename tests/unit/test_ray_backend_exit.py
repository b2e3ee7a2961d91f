"""A Ray launch whose process has left Ray (its exit hook, the user's ``ray.shutdown()``)
makes no more Ray calls: Ray's ``get`` and ``kill`` would join the cluster again, or start a
new local one, from a process on its way out (a fake ``ray``; no Ray needed)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest

from air_magic.backends.ray.ray_launch import RayLaunch
from air_magic.protocol import StartFailed

#: What the launch used of Ray after its process left Ray.
USED: list[str] = []


class _LeftRay:
    """A ``ray`` module this process has left: ``is_initialized()`` is False."""

    def is_initialized(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        USED.append(f"ray.{name}")
        raise RuntimeError(f"ray.{name} was used after this process left Ray")


class _Agent:
    def __getattr__(self, name: str) -> Any:
        USED.append(f"agent.{name}")
        raise RuntimeError(f"the agent's {name}() was called after this process left Ray")


def _launch(sent: list[Any]) -> RayLaunch:
    USED.clear()
    launch = RayLaunch.__new__(RayLaunch)  # no thread, no cluster
    launch.ray = _LeftRay()
    launch.id = "L"
    launch.agents = [_Agent(), _Agent()]
    launch.group = object()
    launch.running = {0, 1}
    launch.lost = []
    launch.stopping = None
    launch._steps = [(time.monotonic() - 1, signal.SIGKILL)]
    launch._lock = threading.Lock()
    launch.finished = threading.Event()
    launch.request = type("R", (), {"timeout": None})()
    launch.spool = None
    launch.run_id = None
    launch.backend = type("B", (), {"emit": staticmethod(sent.append), "forget": staticmethod(lambda launch: None)})()
    return launch


def test_a_launch_whose_process_left_ray_ends_with_no_ray_call() -> None:
    sent: list[Any] = []
    launch = _launch(sent)
    launch._send_due_signals()  # a stop's SIGKILL: the ranks went with the agents already
    assert launch.stacks(1.0) == {}
    launch._remove()
    with pytest.raises(ConnectionError, match=r"this process left the Ray cluster \(ray.shutdown\(\)\)"):
        launch._watch()
    launch._start = lambda: {0: 1, 1: 2}  # type: ignore[method-assign]
    launch._node_names = lambda: {}  # type: ignore[method-assign]
    launch.run()
    assert sent[-1] == StartFailed(
        "L", "the connection to the Ray cluster was lost: this process left the Ray cluster (ray.shutdown())"
    )
    assert launch.finished.is_set()
    assert USED == []
