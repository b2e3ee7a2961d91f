"""Reaching an MLflow store: requests bounded in air_magic's own threads, failures told apart,
and a store made and trusted before it is used.

Two kinds of failure, told apart:

* the store cannot be reached (connection refused or reset, a timeout, a locked sqlite
  file): :class:`Unreachable` is raised and nothing is marked sent;
* the store refuses something (a step too large for it, an artifact path it rejects, a
  param whose value changed): :mod:`air_magic.tracking.upload` splits the batch until the
  refused items are alone.

Requests made by air_magic's own threads use MLflow's own settings
(``MLFLOW_HTTP_REQUEST_TIMEOUT``, ``..._MAX_RETRIES``, ``..._BACKOFF_FACTOR``,
``..._BACKOFF_JITTER``) with short values, so a dead server costs seconds; every other
thread of the kernel (the user's own MLflow calls) keeps the user's settings.

A local sqlite store is trusted only when this user owns it (a file or link of another
user is :class:`StoreUnusable`, said at once), and a new one is made whole in a temporary
file beside it, then linked into place, so no kernel ever finds one half made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

#: MLflow's HTTP settings inside air_magic's threads: about 5 s for a server that hangs,
#: well under a second for one that refuses connections.
REQUEST_LIMITS: dict[str, Any] = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": 5,
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": 1,
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 0,
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": 0.0,
}

_local = threading.local()
_limits_installed = False
_install_lock = threading.Lock()


def _bounded() -> bool:
    return getattr(_local, "depth", 0) > 0


class _OwnThreadsOnly(logging.Filter):
    """Drops what MLflow and urllib3 log from air_magic's own threads (retries, the
    system-metrics monitor giving up on a dead server): the user is told once, by us."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _bounded() or record.levelno >= logging.CRITICAL


def _install_limits() -> None:
    global _limits_installed
    with _install_lock:
        if _limits_installed:
            return
        from mlflow import environment_variables

        for name, value in REQUEST_LIMITS.items():
            variable = getattr(environment_variables, name)
            users = variable.get  # the user's setting (their environment, else MLflow's default)

            def get(users: Callable[[], Any] = users, value: Any = value) -> Any:
                return value if _bounded() else users()

            variable.get = get  # read by MLflow at every request
        quiet = _OwnThreadsOnly()
        for logger in (
            "urllib3.connectionpool",
            "mlflow.system_metrics.system_metrics_monitor",
            "mlflow.utils.rest_utils",
        ):
            logging.getLogger(logger).addFilter(quiet)
        _limits_installed = True


@contextlib.contextmanager
def bounded_requests() -> Iterator[None]:
    """MLflow requests made by this thread inside the block use :data:`REQUEST_LIMITS`."""
    _install_limits()
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def bounded(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run with :func:`bounded_requests` (for a thread MLflow starts for us)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with bounded_requests():
            return function(*args, **kwargs)

    return run


# -- telling failures apart -------------------------------------------------------------------------


class Unreachable(Exception):
    """The store did not answer; ``reason`` says how, in a few words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def unreachable_reason(exc: BaseException) -> str | None:
    """How the store failed to answer, or None when it answered (and refused)."""
    import requests

    for link in _chain(exc):
        if isinstance(link, (requests.exceptions.Timeout, TimeoutError)):
            return f"no answer in {REQUEST_LIMITS['MLFLOW_HTTP_REQUEST_TIMEOUT']} s"
        if isinstance(link, (requests.exceptions.ConnectionError, ConnectionError)):
            text = str(link).lower()
            if "refused" in text:
                return "connection refused"
            if "reset" in text or "aborted" in text or "remotedisconnected" in text:
                return "connection lost"
            return "cannot connect"
        if "database is locked" in str(link):
            return "database is locked"
    return None


def short_error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


# -- stores --------------------------------------------------------------------------------------------


def absolute_uri(uri: str) -> str:
    """The tracking URI with a local path made absolute (a later kernel may start elsewhere)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///") :])
    if "://" not in uri and not uri.startswith(("databricks", "file:")):
        return os.path.abspath(uri)
    return uri


def local_store_path(uri: str) -> str | None:
    if uri.startswith("sqlite:///"):
        return uri[len("sqlite:///") :]
    if uri.startswith("file://"):
        return uri[len("file://") :]
    if "://" not in uri and os.path.isabs(uri):
        return uri
    return None


def store_name(uri: str) -> str:
    """``MLflow server http://...`` or ``MLflow store sqlite:///...`` (for messages)."""
    return f"MLflow {'server' if uri.startswith(('http://', 'https://')) else 'store'} {uri}"


class StoreUnusable(Unreachable):
    """A local store air_magic does not write to as it is: another user's file, or one left
    half-made; ``reason`` names it and says what to do.  The spool waits, as for a store
    that does not answer."""


def make_client(uri: str) -> Any:
    """An ``MlflowClient`` of ``uri`` whose store is open (a sqlite store that does not exist
    yet is made first, whole, see :func:`_create_sqlite_store`)."""
    from mlflow import MlflowClient

    path = uri[len("sqlite:///") :] if uri.startswith("sqlite:///") else None
    if path is not None:
        path = os.path.abspath(path)
        _check_owner(path)
        with _creation_lock(path):  # this process's threads (the warm-up, a writer) make it once
            if not os.path.lexists(path):
                _create_sqlite_store(path)
    try:
        client = MlflowClient(uri)
        client._tracking_client.store  # noqa: B018 - opens the store (checks its tables)
        return client
    except Exception as exc:  # a store's client raises anything (sqlalchemy, requests, MlflowException)
        reason = unreachable_reason(exc)
        if reason is not None:
            raise Unreachable(reason) from exc
        if path is not None and _half_made(exc) and _being_written(path):
            # Another process (a plain MLflow client) is making it in place right now.
            raise Unreachable("it is being made by another process") from exc
        if path is not None and _half_made(exc):
            raise StoreUnusable(
                f"it was left half-made ({short_error(exc)}), by a process stopped while it created the "
                f"store: move it away (mv {path} {path}.broken) and the next launch makes a new one"
            ) from exc
        raise


def _being_written(path: str) -> bool:
    """Whether another connection holds a write transaction on the sqlite file ``path`` now:
    MLflow makes (and migrates) a store in one transaction, so a store in the making is
    locked for writing, and a half-made one left by a stopped process is not."""
    import sqlite3

    try:
        db = sqlite3.connect(path, timeout=0.2, isolation_level=None)
    except sqlite3.Error:
        return False
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError as exc:
        return "locked" in str(exc) or "busy" in str(exc)
    finally:
        db.close()


def _check_owner(path: str) -> None:
    """A store file (or a link at its path) that is not this user's is never written to."""
    uid = os.getuid()
    for check in (os.lstat, os.stat):
        try:
            owner = check(path).st_uid
        except OSError:  # none yet (it is made below), or a link to nothing
            continue
        if owner != uid:
            raise StoreUnusable(
                f"{path} belongs to {_user(owner)}, not to you: air_magic does not write your runs into "
                "another user's file. Set MLFLOW_TRACKING_URI to a store of your own (for example "
                "sqlite:///$HOME/mlflow.db), or move the file away"
            )


def _user(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _half_made(exc: BaseException) -> bool:
    text = " ".join(str(link) for link in _chain(exc))
    return "_alembic_tmp" in text or "already exists" in text or "no such table" in text or "duplicate column" in text


#: A store being made: ``.<name>.air_magic-<random>.tmp`` beside it, until it is linked into place.
_TEMP_MARK = ".air_magic-"
_STALE_TEMP = 600.0  # seconds: a temp store older than this was left by a process that died


_creation_locks: dict[str, threading.Lock] = {}


def _creation_lock(path: str) -> threading.Lock:
    with _install_lock:
        return _creation_locks.setdefault(path, threading.Lock())


def _migrate(path: str) -> None:
    """MLflow creates and migrates its tables in the sqlite file ``path`` (seconds)."""
    from mlflow import MlflowClient

    store = MlflowClient(f"sqlite:///{path}")._tracking_client.store
    engine = getattr(store, "engine", None)
    if engine is not None:
        engine.dispose()  # no connection stays open on the file


#: ``0``: every new sqlite store is migrated by MLflow itself, not copied from the template.
TEMPLATE_ENV = "AIR_MAGIC_STORE_TEMPLATE"


def template_path() -> str | None:
    """The empty store of the installed MLflow, made by MLflow once per machine and user,
    in the user's private cache (``~/.cache/air_magic/stores/mlflow-<version>.db``); None
    where it cannot be had (no cache folder of the user's own, MLflow not installed)."""
    if os.environ.get(TEMPLATE_ENV, "1") == "0":
        return None
    import importlib.metadata

    from air_magic.protocol.private import private_dir, user_cache_dir

    try:
        version = importlib.metadata.version("mlflow")
        folder = private_dir(os.path.join(user_cache_dir(), "stores"), "the empty MLflow stores new folders start from")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    path = os.path.join(folder, f"mlflow-{version}.db")
    if not os.path.lexists(path):
        fd, temp = tempfile.mkstemp(prefix=f".mlflow-{version}{_TEMP_MARK}", suffix=".tmp", dir=folder)
        os.close(fd)
        try:
            _migrate(temp)
            try:
                os.link(temp, path)
            except FileExistsError:
                pass  # another process made it meanwhile: the same store
        finally:
            os.unlink(temp)
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return None  # the folder is the user's own: this cannot be another's file
    return path


def _copy_template(temp: str) -> bool:
    """Fill the new store ``temp`` from the template, as MLflow would have made it here: its
    Default experiment's artifact location and times are set as MLflow sets them (the
    location is MLflow's default artifact root, resolved in the working folder, + ``/0``).
    False where there is no template or it cannot be used (MLflow then makes the store)."""
    import shutil
    import sqlite3

    try:
        template = template_path()
        if template is None:
            return False
        from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
        from mlflow.utils.uri import append_to_uri_path, resolve_uri_if_local

        location = append_to_uri_path(resolve_uri_if_local(DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH), "0")
        shutil.copyfile(template, temp)
        now = int(time.time() * 1000)
        db = sqlite3.connect(temp)
        try:
            changed = db.execute(
                "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                "WHERE experiment_id = 0",
                (location, now, now),
            ).rowcount
            db.commit()
        finally:
            db.close()
        return changed == 1
    except Exception:  # MLflow's own creation is the way that always works
        return False


def _create_sqlite_store(path: str) -> None:
    """Make a new sqlite store whole: a copy of the template (:func:`template_path`; MLflow's
    migrations run once per machine, not per folder), else MLflow creates and migrates its
    tables; either in a temp file beside it (private, a name nobody can guess, opened
    with ``O_EXCL``), which is then linked into place (``link`` never replaces: a store
    another process made meanwhile wins, and is used).  A process stopped half-way leaves
    a temp file, never a half-made store; the next creation removes such files of this user's."""
    folder, name = os.path.split(path)
    _remove_stale_temps(folder, name)
    fd, temp = tempfile.mkstemp(prefix=f".{name}{_TEMP_MARK}", suffix=".tmp", dir=folder)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # the mode sqlite itself would have given the store
        os.close(fd)
        if not _copy_template(temp):
            _migrate(temp)
        try:
            os.link(temp, path)
        except FileExistsError:
            pass  # made meanwhile by another process: theirs is the store
    finally:
        try:
            os.unlink(temp)
        except OSError:
            pass


def _remove_stale_temps(folder: str, name: str) -> None:
    prefix, uid, now = f".{name}{_TEMP_MARK}", os.getuid(), time.time()
    try:
        entries = [e for e in os.scandir(folder) if e.name.startswith(prefix) and e.name.endswith(".tmp")]
    except OSError:
        return
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_uid == uid and now - st.st_mtime > _STALE_TEMP:
                os.unlink(entry.path)
        except OSError:
            pass
