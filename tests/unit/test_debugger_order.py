"""Ranks stopped at a breakpoint ask in rank order, also when rank 1 reaches the line first
(a loaded machine): the desk waits a moment for the lower ranks."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from air_magic.kernel.inspect.debugger import HOLD, BreakpointDesk
from air_magic.protocol.debugging import encode_event, events_path


def _stop(work_dir: Path, rank: int) -> None:
    with open(events_path(str(work_dir), rank), "ab") as handle:
        handle.write(encode_event("stop", where="Cell In[2], line 3", text="", first=True))


def test_rank_0_stopping_a_moment_after_rank_1_is_served_first(tmp_path: Path) -> None:
    desk = BreakpointDesk(str(tmp_path), 2)
    try:
        _stop(tmp_path, 1)
        desk._read()
        later = threading.Timer(0.1, _stop, (tmp_path, 0))
        later.start()
        desk._hold_for_lower_ranks()
        later.join()
        assert sorted(desk.stopped) == [0, 1]  # min(): rank 0's prompt comes first
    finally:
        desk.close()


def test_a_rank_that_stops_alone_waits_no_longer_than_the_hold(tmp_path: Path) -> None:
    desk = BreakpointDesk(str(tmp_path), 2)
    try:
        _stop(tmp_path, 1)
        desk._read()
        began = time.monotonic()
        desk._hold_for_lower_ranks()
        assert sorted(desk.stopped) == [1]
        assert time.monotonic() - began <= HOLD + 0.2
        began = time.monotonic()
        desk._hold_for_lower_ranks()  # its stop is older than the hold now: served at once
        assert time.monotonic() - began < 0.05
    finally:
        desk.close()
