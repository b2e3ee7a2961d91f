"""MLflow's own log lines from air_magic's threads go to a file, never into a cell.

MLflow logs through the ``mlflow`` logger (and alembic's, while it creates or migrates a
sqlite store) to handlers that write to the kernel's ``stderr``: a first launch in a new
folder showed ``INFO mlflow.store.db.utils: Creating initial MLflow database tables...``
in red in the cell.  :func:`divert` puts a filter on those handlers that takes the records
made in air_magic's own threads (their names start with ``air_magic-``) out of the
handler and appends them to the file that thread named with :func:`log_to`.  Records of
the user's own MLflow calls, in any thread of theirs, are untouched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Iterator

_local = threading.local()
_lock = threading.Lock()
_PREFIX = "air_magic-"
_LOGGERS = ("mlflow", "alembic", "")  # "" is the root logger: alembic's records end there


class _OursToFile(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not record.threadName or not record.threadName.startswith(_PREFIX):
            return True
        path = getattr(_local, "path", None)
        if path:
            try:
                line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {record.levelname} {record.name}: {record.getMessage()}\n"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, line.encode("utf-8", "replace"))
                finally:
                    os.close(fd)
            except (OSError, ValueError, TypeError):
                pass  # a log line is never a reason to fail
        return False


_FILTER = _OursToFile()


def divert() -> None:
    """Put the filter on every handler of MLflow's, alembic's and the root logger (again
    after an import that added handlers; a handler gets it once)."""
    with _lock:
        for name in _LOGGERS:
            for handler in logging.getLogger(name or None).handlers:
                if _FILTER not in handler.filters:
                    handler.addFilter(_FILTER)


@contextlib.contextmanager
def log_to(path: str | None) -> Iterator[None]:
    """MLflow's records made by this thread inside the block go to ``path`` (nowhere: None)."""
    previous = getattr(_local, "path", None)
    _local.path = path
    try:
        yield
    finally:
        _local.path = previous
