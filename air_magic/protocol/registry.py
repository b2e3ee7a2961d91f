"""The machine's list of launches and pools: one small record per live launch, in one folder
for the whole machine, read by ``air-magic ps`` / ``stop`` and the sidebar (standard library
only)::

    /tmp/air-magic-launches/             drwxrwxrwt (sticky, as /tmp), whoever made it, whatever
                                         TMPDIR says (AIR_MAGIC_REGISTRY moves it, for tests)
        <launch id>.json                 one record, owned by the launch's user (0644), written
                                         whole then renamed; its holder (the kernel, or air-magic
                                         run) keeps it open with a shared flock while it lives
        <launch id>.stop.<random>        one stop request (air-magic stop, the sidebar's Stop):
                                         who asked; a new name each time, so nobody can take it first

A record is a **description**, never a claim: GPUs are claimed by locks on their device nodes
(:mod:`air_magic.protocol.gpu_locks`), which no other user can remove, free or fake, so what the
folder holds (and who made it first) decides nothing about who gets a GPU.  What a record says is
believed only as far as its file's owner goes: its ``uid`` is the file's owner, and the processes
it names (its holder, its ranks) are that user's; a record that is a link, is not a regular file,
is larger than :data:`MAX_BYTES`, is not a record, names another id than its file's or names
another user's processes is skipped, with a line saying why.  A stop request is believed only from
a regular file owned by the launch's owner or root, opened without following a link and without
blocking.  A dead record is removed by its owner's next look and skipped by everyone's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import re
import socket
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "REGISTRY_ENV",
    "MAX_BYTES",
    "Record",
    "Holder",
    "folder",
    "publish",
    "records",
    "process_start",
    "user_name",
    "request_stop",
    "stop_request",
    "describe_stop",
    "process_owner",
    "DEFAULT_FOLDER",
]

#: Where the records are (default ``<tempdir>/air-magic-launches``).
REGISTRY_ENV = "AIR_MAGIC_REGISTRY"
#: A record larger than this is not one.
MAX_BYTES = 64 << 10
_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass
class Record:
    """One launch or pool: who, where, what it holds."""

    id: str
    uid: int
    user: str
    holder_pid: int  # the kernel (or air-magic run) that started it
    holder_start: int | None  # that process's start time (clock ticks since boot): no pid reuse
    kind: str  # "launch", "pool" or "run"
    ranks: int
    pids: list[int] = field(default_factory=list)
    pid_starts: list[int | None] = field(default_factory=list)  # each rank's start time: no pid reuse
    gpus: list[dict[str, Any]] = field(default_factory=list)  # {"index": int, "uuid": str}
    notebook: str = ""
    kernel: str = ""
    label: str = ""  # the cell or function (its owner sees it; others do not)
    state: str = "starting"
    started: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)
    pidns: str = field(default_factory=lambda: _pidns())  # the holder's pid namespace

    @classmethod
    def parse(cls, data: Any) -> "Record":
        """A record from JSON, every field's type checked (ValueError otherwise)."""
        if not isinstance(data, dict):
            raise ValueError("not an object")
        types: dict[str, Any] = {
            "id": str, "uid": int, "user": str, "holder_pid": int, "kind": str, "ranks": int, "pids": list,
            "gpus": list, "notebook": str, "kernel": str, "label": str, "state": str, "started": (int, float),
            "host": str,
        }  # fmt: skip
        for name, kind in types.items():
            if not isinstance(data.get(name), kind) or isinstance(data.get(name), bool):
                raise ValueError(f"{name} is missing or of the wrong type")
        if not isinstance(data.get("pidns", ""), str):
            raise ValueError("pidns is of the wrong type")
        if not (data.get("holder_start") is None or isinstance(data["holder_start"], int)):
            raise ValueError("holder_start is of the wrong type")
        if not _ID.fullmatch(data["id"]) or data["kind"] not in ("launch", "pool", "run"):
            raise ValueError("id or kind is not one of a record")
        if not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in data["pids"]):
            raise ValueError("pids are not process ids")
        starts = data.get("pid_starts", [])
        if not isinstance(starts, list) or not all(
            s is None or (isinstance(s, int) and not isinstance(s, bool)) for s in starts
        ):
            raise ValueError("pid_starts are not start times")
        for gpu in data["gpus"]:
            if not (isinstance(gpu, dict) and isinstance(gpu.get("index"), int) and isinstance(gpu.get("uuid"), str)):
                raise ValueError("gpus are not GPUs")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def age(self) -> float:
        return max(0.0, time.time() - self.started)


#: The machine's list, the same for every user and every TMPDIR.
DEFAULT_FOLDER = "/tmp/air-magic-launches"


def folder() -> str:
    """The records' folder, made (sticky, writable by all) if missing; refused where it is not
    a real folder (a link someone put there) or is writable by others without the sticky bit.
    Who made it does not matter: nothing in it is a claim."""
    path = os.environ.get(REGISTRY_ENV) or DEFAULT_FOLDER
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o1777)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{path} is not a folder (a link or a file is in its place)")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise OSError(f"{path} is writable by every user without the sticky bit: records there cannot be trusted")
    return path


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks after boot), or None where it is not visible here
    (or has died and waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()
    if fields and fields[0] in (b"Z", b"X"):  # a zombie: dead, not yet reaped by its parent
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def request_stop(launch_id: str, who: dict[str, Any]) -> str | None:
    """Write a stop request for ``launch_id`` (``who``: via, user, uid, pid, host, at) under a
    name nobody could have taken first; its path, or None where it cannot be written."""
    for _ in range(3):
        path = os.path.join(folder(), f"{launch_id}.stop.{os.getpid()}-{os.urandom(6).hex()}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            continue
        except OSError:
            return None
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, json.dumps(who).encode())
        finally:
            os.close(fd)
        return path
    return None


def stop_request(launch_id: str, owner: int | None = None) -> dict[str, Any] | None:
    """Who asked ``air-magic stop`` (or the sidebar's Stop) for ``launch_id``: the request's
    fields, or None where there is none to believe.  Each request file is opened without
    following a link and without blocking (a FIFO answers nothing), and believed only when it is
    a regular file owned by the launch's owner (``owner``, this process's user by default) or by
    root, small, and a request (``via``, ``user``, ``pid``, ``host``, ``at``)."""
    owner = os.getuid() if owner is None else owner
    prefix = f"{launch_id}.stop."
    try:
        names = sorted(n for n in os.listdir(folder()) if n.startswith(prefix))
    except OSError:
        return None
    for name in names:
        try:
            fd = os.open(os.path.join(folder(), name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid not in (owner, 0) or info.st_size > MAX_BYTES:
                continue
            data = json.loads(os.read(fd, MAX_BYTES + 1))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        finally:
            os.close(fd)
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("via", "user", "host", "at")):
            continue
        if not isinstance(data.get("pid"), int) or isinstance(data.get("pid"), bool):
            continue
        return data
    return None


def describe_stop(request: dict[str, Any]) -> str:
    """``air-magic stop by root (pid 123 on gpu-box) at 12:00:01``."""
    return f"{request['via']} by {request['user']} (pid {request['pid']} on {request['host']}) at {request['at']}"


class Holder:
    """A published record, kept alive (a shared flock on its file) until :meth:`close`."""

    def __init__(self, record: Record, path: str, fd: int) -> None:
        self.record = record
        self.path = path
        self._fd: int | None = fd

    def update(self, **fields: Any) -> None:
        """Rewrite the record with ``fields`` changed (whole, then renamed: never half-written)."""
        for name, value in fields.items():
            setattr(self.record, name, value)
        if self._fd is None:
            return
        fd = _write(self.path, self.record)
        fcntl.flock(fd, fcntl.LOCK_SH)
        old, self._fd = self._fd, fd
        os.close(old)

    def close(self) -> None:
        """The launch has ended: its record goes (and the stop requests its user wrote)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        _remove_requests(self.record.id)
        os.close(self._fd)
        self._fd = None


def _remove_requests(launch_id: str) -> None:
    """Stop requests of this user's for ``launch_id`` (another user's stay: theirs to remove)."""
    try:
        names = [n for n in os.listdir(folder()) if n.startswith(f"{launch_id}.stop.")]
    except OSError:
        return
    for name in names:
        path = os.path.join(folder(), name)
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
        except OSError:
            pass


def _write(path: str, record: Record) -> int:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, json.dumps(asdict(record)).encode())
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return fd


def publish(record: Record) -> Holder:
    """Write ``record`` into the machine's list and hold it alive."""
    path = os.path.join(folder(), f"{record.id}.json")
    fd = _write(path, record)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return Holder(record, path, fd)


def _alive(record: Record, fd: int) -> bool:
    start = process_start(record.holder_pid)
    if start is not None:  # the holder's pid is visible here: it is the holder if it started then
        return record.holder_start is None or start == record.holder_start
    if record.host == socket.gethostname() and record.pidns == _pidns():
        return False  # this machine's, this pid namespace's, and no such process
    try:  # another pid namespace (a container): the holder's lock says
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def process_owner(pid: int) -> int | None:
    """The uid ``pid`` runs as, or None where it is not visible here."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _foreign_process(record: Record) -> tuple[int, int] | None:
    """A process the record names (its holder, its ranks: each one that still runs since the
    start time the record gives) that runs as another user than the record's: ``(pid, its
    uid)``; None when every one visible here is the record's user's."""
    named = [(record.holder_pid, record.holder_start), *zip(record.pids, record.pid_starts)]
    for pid, start in named:
        if start is None or process_start(pid) != start:
            continue  # gone (its pid may be another process's now), or not visible here
        uid = process_owner(pid)
        if uid is not None and uid != record.uid:
            return pid, uid
    return None


def _pidns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def records(remove_dead: bool = True) -> tuple[list[Record], list[str]]:
    """The live records, oldest first, and a line for each file skipped (forged, truncated,
    too large).  Dead records of this user are removed."""
    where = folder()
    found: list[Record] = []
    skipped: list[str] = []
    me = os.getuid()
    for name in sorted(os.listdir(where)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(where, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                skipped.append(f"{name}: not a record (a link)")
            continue  # gone meanwhile, or not ours to read
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
                skipped.append(f"{name}: not a record (not a plain file, or {info.st_size} bytes)")
                continue
            try:
                record = Record.parse(json.loads(os.read(fd, MAX_BYTES + 1)))
            except (ValueError, TypeError, UnicodeDecodeError) as exc:
                skipped.append(f"{name}: not a record ({exc})")
                continue
            if f"{record.id}.json" != name:
                skipped.append(f"{name}: not a record (it names the launch {record.id!r})")
                continue
            if record.uid != info.st_uid:
                skipped.append(f"{name}: forged (it names uid {record.uid}; the file is uid {info.st_uid}'s)")
                continue
            if not _alive(record, fd):
                if remove_dead and me in (info.st_uid, 0):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                continue
            other = _foreign_process(record)
            if other is not None:
                pid, uid = other
                skipped.append(
                    f"{name}: forged (it names process {pid}, which is uid {uid}'s; the file is uid {info.st_uid}'s)"
                )
                continue
            found.append(record)
        finally:
            os.close(fd)
    found.sort(key=lambda r: r.started)
    return found, skipped
