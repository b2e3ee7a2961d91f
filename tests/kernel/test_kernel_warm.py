"""``%load_ext air_magic`` pays a first launch's one-time costs in the background while
the helper imports torch: the panel's modules, NVML, and the linter whose findings the
panel shows (its first run imports libcst: the end of a short first launch waited up to
0.3 s for it)."""

from __future__ import annotations

from typing import Any

import pytest
from harness import wait_until

pytestmark = pytest.mark.kernel

WARMED = "sorted(m for m in ('air_magic.panel', 'air_magic.lint.engine', 'libcst') if m in sys.modules)"


def test_load_ext_warms_the_panel_and_the_linter_in_the_background(kernel_factory: Any) -> None:
    k = kernel_factory(load=False)
    try:
        k.ok("import sys")
        assert k.value(WARMED) == []
        k.ok("%load_ext air_magic")
        assert wait_until(lambda: len(k.value(WARMED)) == 3, timeout=60, interval=0.2), k.value(WARMED)
    finally:
        k.shutdown()  # the factory's kernels live until the session ends: its helper with it


def test_no_warm_up_with_air_magic_warm_0(kernel_factory: Any) -> None:
    k = kernel_factory(extra_env={"AIR_MAGIC_WARM": "0"}, load=False)
    try:
        k.ok("import sys\n%load_ext air_magic")
        k.ok("import time; time.sleep(2)")
        assert k.value(WARMED) == []
    finally:
        k.shutdown()
