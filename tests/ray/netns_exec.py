"""``python netns_exec.py ARGS...``: in a new network namespace (``unshare -n``), bring the
loopback interface up, check that it is the only one, then become ``python ARGS...``."""

from __future__ import annotations

import os
import sys

from ray_support import bring_loopback_up, interfaces, loopback_only

if __name__ == "__main__":
    bring_loopback_up()
    if not loopback_only():
        sys.exit(f"not a loopback-only network namespace: interfaces {interfaces()}")
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
