"""The real helper (``air_magic.rank.zygote.main``) whose ranks start late, as the scheduler of
a loaded machine may run a freshly forked process: each rank sleeps before it begins
(``python slow_start_helper.py DELAY CTRL_FD ALIVE_FD SESSION_DIR SHM_DIR``).

Only the start is slowed (the OS's scheduling, the one part not owned here); the rank
and the helper are air_magic's own, unchanged."""

from __future__ import annotations

import sys
import time
from typing import Any

from air_magic.rank import main as _rank
from air_magic.rank import zygote as _zygote


def main(argv: list[str]) -> int:
    delay = float(argv[0])
    real = _rank.child_main

    def late(*args: Any) -> None:
        time.sleep(delay)
        real(*args)

    _rank.child_main = late  # type: ignore[assignment]
    return _zygote.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
