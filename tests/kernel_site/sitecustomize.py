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
