"""The tracking spool: the ranks' MLflow calls wait on disk until the kernel has sent them.

Both sides read this module: a rank appends lines (:mod:`air_magic.rank.tracking_shim`), the
kernel sends them (:mod:`air_magic.tracking`), and a later kernel sends what a dead one
left (:mod:`air_magic.tracking.recovery`).  It imports only the standard library and
:mod:`air_magic.protocol.private`, so a rank pays nothing for it.

Where the files live (per user, private, outliving the kernel)::

    $AIR_MAGIC_STATE_DIR  (else $XDG_STATE_HOME/air_magic, else ~/.local/state/air_magic)  0700
      tracking/                                                                         0700
        <launch id>/            one launch; renamed into place once locked and journaled   0700
          lock                  flock(LOCK_EX) by the kernel that owns the launch
          journal.json          where the points go and how far each file was sent
          tracking-<rank>.tsv   the rank's calls, a line each; flock(LOCK_SH) by the rank
          run                   the run's id once the kernel made it ("!" and a reason when it
                                cannot): read by a rank whose MLflow call needs the id
          artifacts-<rank>/     copies of the files the rank passed to mlflow.log_artifact
          logs/rank-<rank>.log  copied in when a launch ended before its logs were sent

A free ``lock`` means the kernel is gone (or its launch ended without reaching the store):
whoever takes the lock may send the rest and delete the folder.  Files are created 0600
with ``O_NOFOLLOW`` and every folder is checked (not a symlink, owned by this user, no
group or other access; :mod:`air_magic.protocol.private`) before use.

The line format of ``tracking-<rank>.tsv`` (its ``format``/``parse``) lives in
:mod:`air_magic.protocol`, with the file's name: ranks write it, the panel reads it too.

Journal (``journal.json``, rewritten whole with ``os.replace``)::

    {"format": 1, "launch_id": "0003-1a2b3c4d", "kernel_pid": 4242, "created_at": 1.7e9,
     "tracking_uri": "sqlite:////home/me/mlflow.db",           # absolute
     "experiment_id": "1" | null, "experiment_name": "train" | null,
     "run_name": null, "tags": {...}, "params": {...},           # to create the run
     "run_id": "5e6f..." | null,                                 # null: not created yet
                                                  # (then run_name is the name the run got)
     "params_logged": true,
     "sent": {"0": 18342, "1": 18290},      # per rank: bytes of tracking-<rank>.tsv sent
     "names": {"p": {"lr": [0, "0.1"], "rank2/lr": [2, "0.2"]}, "t": {...}},
                                            # the ranks' params and tags sent: name -> [rank
                                            # whose value it holds, value] (_mlflow_upload)
     "status": null | "FINISHED" | "FAILED" | "KILLED",          # null: the kernel died first
     "logs_copied": false, "logs_sent": false}
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import threading
import time
from typing import Any, Iterator

from air_magic.protocol import METRIC, TailReader, parse_line, spool_file, spool_file_rank, text_field
from air_magic.protocol.private import PrivateFolderError, check_private, private_dir

__all__ = ["SPOOL_DIR_ENV", "STATE_DIR_ENV", "Spool", "PrivateFolderError", "spool_file", "artifact_dir"]
__all__ += ["parse_line", "text_field", "iter_lines"]  # the line format, from _protocol

#: Set by the kernel for the ranks: the launch's spool folder.
SPOOL_DIR_ENV = "AIR_MAGIC_TRACKING_DIR"
#: Where air_magic keeps state that outlives a kernel (overrides the XDG default).
STATE_DIR_ENV = "AIR_MAGIC_STATE_DIR"

JOURNAL = "journal.json"
LOCK = "lock"
LOGS = "logs"
_FORMAT = 1
_NEW = ".new-"  # a folder still being set up: never recovered
_WHAT = "MLflow points"  # in PrivateFolderError's message: "cannot use <path> for MLflow points: ..."


def artifact_dir(folder: str, rank: int) -> str:
    return os.path.join(folder, f"artifacts-{rank}")


RUN = "run"


def publish_run(folder: str, text: str) -> None:
    """Tell the ranks the run's id (or ``"!" + why there is none``), atomically."""
    path = os.path.join(folder, RUN)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def run_text(run_id: str, details: dict[str, object] | None = None) -> str:
    """What :func:`publish_run` writes for a made run: its id, then (a line of JSON) what a
    rank's ``mlflow.active_run().info`` tells besides it (experiment id, artifact URI...)."""
    return run_id + ("\n" + json.dumps(details) if details else "")


def run_fields(text: str) -> tuple[str, dict[str, object]]:
    """The run's id and its details, from :func:`read_run`'s text (details ``{}`` if none)."""
    run_id, _, rest = text.partition("\n")
    try:
        details = json.loads(rest) if rest.strip() else {}
    except ValueError:
        details = {}
    return run_id, details if isinstance(details, dict) else {}


def read_run(folder: str) -> str | None:
    """What :func:`publish_run` wrote, or None while the kernel has not made the run yet."""
    try:
        fd = os.open(os.path.join(folder, RUN), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, 4096).decode()
    finally:
        os.close(fd)


# -- private folders -------------------------------------------------------------------------------


def state_dir() -> str:
    """``$AIR_MAGIC_STATE_DIR``, else ``$XDG_STATE_HOME/air_magic``, else ``~/.local/state/air_magic``."""
    chosen = os.environ.get(STATE_DIR_ENV)  # (settings.state_dir reads the same variable)
    if chosen:
        return os.path.abspath(os.path.expanduser(chosen))
    xdg = os.environ.get("XDG_STATE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "air_magic")


def spool_root(create: bool) -> str | None:
    """The folder of every launch's spool; None when it does not exist and ``create`` is false."""
    root = os.path.join(state_dir(), "tracking")
    if not create:
        if not os.path.lexists(root):
            return None
        check_private(os.path.dirname(root), _WHAT)
        check_private(root, _WHAT)
        return root
    private_dir(state_dir(), _WHAT)
    return private_dir(root, _WHAT)


def _open(path: str, flags: int, mode: int = 0o600) -> int:
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PrivateFolderError(f"refusing {path}: not a file of yours")
    return fd


def _open_to_read(path: str) -> int:
    return _open(path, os.O_RDONLY)


def _write_json(folder: str, data: dict[str, Any]) -> None:
    path = os.path.join(folder, JOURNAL)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, json.dumps(data, sort_keys=True).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _read_json(folder: str) -> dict[str, Any]:
    fd = _open(os.path.join(folder, JOURNAL), os.O_RDONLY)
    with os.fdopen(fd, "rb") as handle:
        data = json.loads(handle.read().decode())
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError("not a journal of this air_magic version")
    return data


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


# -- one launch's spool ------------------------------------------------------------------------------


class Spool:
    """One launch's spool folder, held (locked) by this process.

    The kernel makes one per launch with :meth:`create`; recovery takes a dead kernel's
    with :meth:`claim`.  ``journal`` is the in-memory copy; :meth:`update` writes it.
    """

    def __init__(self, folder: str, lock_fd: int | None, journal: dict[str, Any], durable: bool) -> None:
        self.folder = folder
        self.lock_fd = lock_fd
        self.journal = journal
        self.durable = durable  # False: a folder of the kernel's session, no journal, no recovery
        self._mutex = threading.Lock()

    @classmethod
    def create(cls, launch_id: str, journal: dict[str, Any]) -> "Spool":
        """A new, locked, journaled folder for ``launch_id`` (raises :class:`PrivateFolderError`)."""
        root = spool_root(create=True)
        assert root is not None
        journal = _new_journal(launch_id, journal)
        building = os.path.join(root, f"{_NEW}{launch_id}")
        os.mkdir(building, 0o700)
        lock_fd = None
        try:
            lock_fd = _open(os.path.join(building, LOCK), os.O_RDWR | os.O_CREAT | os.O_EXCL)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            _write_json(building, journal)
            folder = os.path.join(root, launch_id)
            os.rename(building, folder)  # recovery only ever sees locked, journaled folders
        except BaseException:  # clean up whatever stopped it (an interrupt too), then re-raise
            if lock_fd is not None:
                os.close(lock_fd)
            shutil.rmtree(building, ignore_errors=True)
            raise
        return cls(folder, lock_fd, journal, durable=True)

    @classmethod
    def in_session(cls, launch_id: str, folder: str, journal: dict[str, Any]) -> "Spool":
        """The fallback when the state folder cannot be used: the launch's own work folder
        (deleted with the kernel's session; nothing is journaled)."""
        return cls(folder, None, _new_journal(launch_id, journal), durable=False)

    @classmethod
    def claim(cls, folder: str) -> "Spool | None":
        """Lock a folder whose kernel is gone; None while its owner (or another recoverer) holds it."""
        try:
            lock_fd = _open(os.path.join(folder, LOCK), os.O_RDWR)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            if not _try_lock(lock_fd, fcntl.LOCK_EX):
                os.close(lock_fd)
                return None
            # Deleted by whoever held it before us: the lock is on a file no longer there.
            if os.fstat(lock_fd).st_nlink == 0:
                os.close(lock_fd)
                return None
            check_private(folder, _WHAT)
            return cls(folder, lock_fd, _read_json(folder), durable=True)
        except BaseException:  # the lock is ours to close whatever stopped it; re-raised
            os.close(lock_fd)
            raise

    @staticmethod
    def folders() -> list[str]:
        """Every launch folder of this user's spool (locked or not), oldest first."""
        root = spool_root(create=False)
        if root is None:
            return []
        found = []
        for entry in os.scandir(root):
            if entry.name.startswith(_NEW):
                _forget_if_stale(entry)
            elif entry.is_dir(follow_symlinks=False):
                found.append((entry.stat(follow_symlinks=False).st_mtime, entry.path))
        return [path for _, path in sorted(found)]

    # -- state ------------------------------------------------------------------------------------

    def update(self, **fields: Any) -> None:
        with self._mutex:
            self.journal.update(fields)
            if self.durable:
                _write_json(self.folder, self.journal)

    def sent(self, rank: int) -> int:
        return int(self.journal["sent"].get(str(rank), 0))

    def mark_sent(self, rank: int, offset: int, **fields: Any) -> None:
        """Rank's file was sent up to ``offset``; ``fields`` are journaled with it."""
        with self._mutex:
            self.journal["sent"][str(rank)] = offset
            self.journal.update(fields)
            if self.durable:
                _write_json(self.folder, self.journal)

    def ranks(self) -> list[int]:
        """Ranks that have a file here (a rank makes its file at its first call)."""
        ranks = []
        for name in os.listdir(self.folder):
            rank = spool_file_rank(name)
            if rank is not None:
                ranks.append(rank)
        return sorted(ranks)

    def ranks_alive(self) -> bool:
        """Whether a rank still holds its file (its kernel died, but it has not yet)."""
        for rank in self.ranks():
            fd = _open(spool_file(self.folder, rank), os.O_RDONLY)
            try:
                if not _try_lock(fd, fcntl.LOCK_EX):
                    return True
            finally:
                os.close(fd)
        return False

    def read_new(self, rank: int, limit: int) -> tuple[list[bytes], int]:
        """Whole lines of rank's file past what was sent (at most about ``limit`` bytes),
        and the offset just past them."""
        reader = TailReader(spool_file(self.folder, rank), self.sent(rank), opener=_open_to_read)
        try:
            lines = reader.read_lines(limit)
        except FileNotFoundError:
            return [], reader.offset
        return lines, reader.offset

    def pending_points(self) -> int:
        """Metric points not sent yet (for messages)."""
        count = 0
        for rank in self.ranks():
            with open(spool_file(self.folder, rank), "rb") as handle:
                handle.seek(self.sent(rank))
                data = handle.read()
            mark = f"{METRIC}\t".encode()
            count += data.startswith(mark) + data.count(b"\n" + mark)
        return count

    def logs(self) -> list[str]:
        folder = os.path.join(self.folder, LOGS)
        return sorted(os.path.join(folder, n) for n in os.listdir(folder)) if os.path.isdir(folder) else []

    def copy_logs(self, paths: list[str]) -> None:
        """Keep the ranks' logs with the points, for whoever sends them later."""
        if not self.durable or self.journal.get("logs_copied"):
            return
        folder = os.path.join(self.folder, LOGS)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        for path in paths:
            if os.path.exists(path):
                shutil.copyfile(path, os.path.join(folder, os.path.basename(path)))
        self.update(logs_copied=True)

    # -- the end -----------------------------------------------------------------------------------

    def release(self) -> None:
        """Let go of the lock (the folder stays for recovery unless removed first)."""
        with self._mutex:
            if self.lock_fd is not None:
                os.close(self.lock_fd)
                self.lock_fd = None

    def remove(self) -> None:
        """Everything was sent: delete the folder, then let go of the lock."""
        if self.durable:
            # The lock file goes last, so that a recoverer waiting on it sees it unlinked.
            for entry in os.scandir(self.folder):
                if entry.name != LOCK:
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        _unlink(entry.path)
            _unlink(os.path.join(self.folder, LOCK))
            try:
                os.rmdir(self.folder)
            except OSError:
                pass
        self.release()


def _new_journal(launch_id: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {
        "status": None,
        "logs_copied": False,
        "logs_sent": False,
        "sent": {},
        **fields,
        "format": _FORMAT,
        "launch_id": launch_id,
        "kernel_pid": os.getpid(),
        "created_at": time.time(),
    }


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _forget_if_stale(entry: "os.DirEntry[str]") -> None:
    # A kernel killed in the millisecond between mkdir and rename leaves a folder with
    # nothing in it worth keeping: no rank was started for it.
    try:
        if time.time() - entry.stat(follow_symlinks=False).st_mtime > 86400:
            shutil.rmtree(entry.path, ignore_errors=True)
    except OSError:
        pass


def iter_lines(lines: list[bytes]) -> Iterator[tuple[Any, ...]]:
    for line in lines:
        item = parse_line(line)
        if item is not None:
            yield item
