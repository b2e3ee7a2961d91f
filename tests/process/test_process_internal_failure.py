"""A failure of air_magic's own (not of the user's code) ends the launch it happened in:
its ranks are stopped, the error says that air_magic failed and where its traceback is,
and the next launch works.  A setting changed while a launch runs is for the next one."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import cloudpickle
import pytest

from air_magic import ConfigurationError, LaunchError, distributed
from air_magic.kernel.launcher import Launcher

pytestmark = pytest.mark.process

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@distributed(num_accelerators=2, accelerator_type="CPU", tracking=False)
def pair() -> int:
    return int(os.environ["RANK"])


class _BrokenAtTheEnd:
    """An observer whose end hook raises what the observers' guards do not catch."""

    def before_start(self, launch: Any, env: dict[str, str]) -> None:
        pass

    def before_end(self, launch: Any) -> None:
        raise SystemExit("observer gave up")

    def after_end(self, launch: Any) -> None:
        pass


def test_a_failure_while_a_launch_ends_is_its_error_and_the_next_launch_works() -> None:
    def factory(launch: Any) -> _BrokenAtTheEnd:
        return _BrokenAtTheEnd()

    Launcher.add_observer(factory)
    try:
        with pytest.raises(LaunchError) as info:
            pair.distributed()
    finally:
        Launcher._observer_factories.remove(factory)
    message = str(info.value)
    assert message.startswith(f"air_magic failed while ending the launch of {pair.func.__qualname__} ")
    assert "(SystemExit: observer gave up); its ranks were stopped. This is a bug of air_magic" in message
    found = re.search(r"Its traceback is in (\S+)\.$", message)
    assert found, message
    with open(found.group(1)) as handle:
        kept = handle.read()
    assert "while ending the launch" in kept and "SystemExit: observer gave up" in kept
    assert pair.last_launch.done() and pair.last_launch.status == "failed"
    assert pair.distributed() == [0, 1]


def test_a_bad_setting_made_while_a_launch_runs_is_for_the_next_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    @distributed(num_accelerators=2, accelerator_type="CPU", tracking=False)
    def slow() -> str:
        import time

        time.sleep(1.0)
        return "done"

    launch = slow.submit()
    monkeypatch.setenv("AIR_MAGIC_LOG_LIMIT", "16MB")  # read at the start, never again
    monkeypatch.setenv("AIR_MAGIC_OUTPUT_LIMIT", "lots")
    assert launch.result(timeout=60) == ["done", "done"]
    with pytest.raises(ConfigurationError, match="^AIR_MAGIC_OUTPUT_LIMIT must be a whole number of bytes"):
        slow.submit()
