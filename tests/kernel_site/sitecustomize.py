"""Imported at start-up by the kernels the test harness starts (it puts this folder on their
``PYTHONPATH``): SIGUSR2 then writes every thread's Python stack to the file named by
``AIR_MAGIC_TEST_KERNEL_STACKS``, so a cell that never finishes shows where the kernel was.
The variable is removed at once: the helper and the ranks a kernel starts register nothing.
"""

import os

_path = os.environ.pop("AIR_MAGIC_TEST_KERNEL_STACKS", None)
if _path:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, file=open(_path, "w"), all_threads=True)

# ``AIR_MAGIC_TEST_SLOW_MLFLOW=S``: the kernel's ``import mlflow`` takes S seconds more (for a
# test of a kernel killed before its MLflow store exists).  Popped too: not the helper's.
_slow = os.environ.pop("AIR_MAGIC_TEST_SLOW_MLFLOW", None)
if _slow:
    import importlib.abc
    import sys
    import time

    class _SlowMlflow(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
            if fullname == "mlflow":
                sys.meta_path.remove(self)
                time.sleep(float(_slow))
            return None

    sys.meta_path.insert(0, _SlowMlflow())
