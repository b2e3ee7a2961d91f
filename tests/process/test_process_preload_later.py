"""The helper imports MLflow once it is idle (after a launch, or 5 s after it is ready), so
that a rank's ``import mlflow`` costs what a preloaded module costs; a launch asked for
while it imports says what it waits for."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from air_magic import distributed
from air_magic.backends.local import Helper

pytestmark = pytest.mark.process


@distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, panel=False)
def mlflow_was_there() -> bool:
    import sys

    return "mlflow" in sys.modules  # before this code imports it


def test_after_a_launch_the_ranks_find_mlflow_imported_already() -> None:
    mlflow_was_there.distributed()  # the helper is idle once it ends: it imports MLflow then
    deadline = time.monotonic() + 120
    seen = mlflow_was_there.distributed()
    while seen != [True, True] and time.monotonic() < deadline:
        time.sleep(0.5)
        seen = mlflow_was_there.distributed()
    assert seen == [True, True]


def test_a_launch_waiting_for_the_helper_s_import_says_so() -> None:
    ready = threading.Event()
    ready.set()
    helper = SimpleNamespace(ready=ready, busy="MLflow")
    assert Helper.waiting_for(helper, 2) == "waiting for the helper process to import MLflow"  # type: ignore[arg-type]
    helper.busy = ""
    assert Helper.waiting_for(helper, 2) == "forking 2 ranks"  # type: ignore[arg-type]
