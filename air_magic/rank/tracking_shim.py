"""The ranks' side of MLflow tracking: fluent calls become one line in a file.

A direct ``mlflow.log_metric`` from every rank into the default sqlite store costs
tens of milliseconds a call and makes ranks fight over one database file.  Here
the kernel is the single writer: when a rank imports ``mlflow``, the fluent
logging functions are replaced by ones that append a line to the rank's own
``tracking-<rank>.tsv`` (one ``write`` system call, a few microseconds; the bytes
survive even a SIGKILL of the rank).  The file lives in the launch's spool folder,
which outlives the kernel too (:mod:`air_magic.protocol.spool` has the layout,
:mod:`air_magic.protocol` the line format).  The kernel reads those files and writes them with MLflow's batch API into
the launch's run (:mod:`air_magic.tracking`).

The ranks start before the launch's run exists (the kernel makes it beside them).  The
calls above never need its id; a call that does (``mlflow.active_run().info.run_id``,
``log_artifacts``, ``log_figure``, ``log_model``, autologging: MLflow's own functions
that go through ``_get_or_start_run``) reads it from the spool folder, where the kernel
publishes it, waiting for it if it must (``AIR_MAGIC_RUN_WAIT`` seconds at most).

With tracking off, the same functions do nothing, so no stray runs are created.
"""

from __future__ import annotations

import fcntl
import importlib.abc
import importlib.machinery
import os
import re
import shutil
import sys
import threading
import time
from types import ModuleType, SimpleNamespace
from typing import Any

from air_magic.protocol import (
    ARTIFACT,
    METRIC,
    PARAM,
    TAG,
    call_end_line,
    call_line,
    metric_line,
    spool_file,
    text_field,
    text_line,
)
from air_magic.protocol.spool import SPOOL_DIR_ENV, artifact_dir, read_run, run_fields

#: ``0``: a rank's ``import mlflow`` imports the real package at once (no stand-in,
#: :class:`_LazyMlflow`, answering the logging calls until more is asked of it).
LAZY_ENV = "AIR_MAGIC_LAZY_MLFLOW"

_FD: int | None = None
_RUN_ID: str | None = None
_RUN_DETAILS: dict[str, object] = {}  # what the kernel told of the run besides its id
_FOLDER: str | None = None  # the spool folder: the kernel publishes the run's id there
_ARTIFACT_DIR: str | None = None
_ENABLED = False
_write = os.write
_now = time.time

#: Metric names MLflow accepted, each as written in a line (checked once per rank).
_METRIC_FIELDS: dict[Any, str] = {}
#: Param and tag names MLflow accepted, by kind.
_GOOD_NAMES: set[tuple[str, object]] = set()
_NAME_CHECKS = {METRIC: "_validate_metric_name", PARAM: "_validate_param_name", TAG: "_validate_tag_name"}


#: A name every MLflow accepts (letters, digits, ``_ - . : /`` and spaces, at most 250, no
#: ``..``, no ``.`` path part, no leading or doubled ``/``): taken without asking MLflow, so that
#: logging needs no import of it.  Any other name is for MLflow's own check to accept or refuse.
_PLAIN_NAME = re.compile(r"(?!/)(?!.*//)(?!.*\.\.)(?!(?:.*/)?\.(?:/|$))[A-Za-z0-9_\-. :/]{1,250}")


def _check_name(kind: str, name: object) -> None:
    # A name MLflow would refuse raises here, in the rank, at the call, as MLflow's own
    # call does; reaching the kernel it would only be skipped there.
    if isinstance(name, str) and _PLAIN_NAME.fullmatch(name) and not name.endswith("/"):
        _GOOD_NAMES.add((kind, name))
        return
    from mlflow.utils import validation

    getattr(validation, _NAME_CHECKS[kind])(name)
    _GOOD_NAMES.add((kind, name))


def _metric_field(key: Any) -> str:
    _check_name(METRIC, key)
    field = _METRIC_FIELDS[key] = text_field(str(key))
    return field


def _emit(kind: str, key: Any, value: Any) -> None:
    """A param, tag or artifact line: both fields as text that round-trips whole."""
    if _FD is not None:
        if kind in _NAME_CHECKS and (kind, key) not in _GOOD_NAMES:
            _check_name(kind, key)
        _write(_FD, text_line(kind, str(key), str(value)).encode())


def begin_call(call: int, label: str) -> None:
    """A pool's call begins on this rank: what it logs goes to the call's child run."""
    if _FD is not None:
        _write(_FD, call_line(call, label).encode())


def end_call(call: int, status: str) -> None:
    """A pool's call ended on this rank (``FINISHED``, ``FAILED`` or ``KILLED``)."""
    if _FD is not None:
        _write(_FD, call_end_line(call, status).encode())


def launch_run_id() -> str | None:
    """The launch's run id (None with tracking off), waiting for the kernel to make the run."""
    global _RUN_ID
    if _RUN_ID is not None or not _ENABLED or _FOLDER is None:
        return _RUN_ID
    wait = float(os.environ.get("AIR_MAGIC_RUN_WAIT") or 30)
    deadline = time.monotonic() + wait
    pause = 0.001
    told_at = time.monotonic() + 1.0  # a wait over a second says what it waits for
    while True:
        text = read_run(_FOLDER)
        if text:
            break
        if told_at and time.monotonic() > told_at:
            told_at = 0.0
            sys.stderr.write(
                f"[air_magic] rank {os.environ.get('RANK', '?')}: waiting for MLflow to make the launch's run "
                "(this call needs its id)…\n"
            )
            sys.stderr.flush()
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"air_magic: the launch's MLflow run was not made within {wait:g} s (its store does not answer), "
                "and this call needs its id. mlflow.log_metric, log_param, set_tag and log_artifact need no "
                "id: what they log waits on disk and reaches the run when the store is back."
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    if text.startswith("!"):
        raise RuntimeError(f"air_magic: this launch has no MLflow run: {text[1:]}")
    _RUN_ID, details = run_fields(text)
    _RUN_DETAILS.update(details)
    os.environ["MLFLOW_RUN_ID"] = _RUN_ID  # MLflow's own start_run() resumes the launch's run
    return _RUN_ID


def _check_run_id(given: str | None) -> None:
    if given is not None and _ENABLED:
        ours = launch_run_id()
        if given != ours:
            raise RuntimeError(
                f"air_magic: this rank logs to the launch's MLflow run {ours}; run_id={given!r} is "
                "another run. Remove run_id=..., or log to that run from the notebook."
            )


def log_metric(
    key: str, value: float, step: int | None = None, timestamp: int | None = None, run_id: str | None = None, **_: Any
) -> None:
    # The hot path (it is measured): one dict lookup, one f-string, one write system call.
    if run_id is not None:
        _check_run_id(run_id)
    if _FD is not None:
        field = _METRIC_FIELDS.get(key) or _metric_field(key)
        # Whole numbers in the file, as MLflow stores them (a step may come as 1.0 or a tensor).
        _write(_FD, metric_line(field, value, step or 0, timestamp or _now() * 1000).encode())


def log_metrics(
    metrics: dict[str, float],
    step: int | None = None,
    timestamp: int | None = None,
    run_id: str | None = None,
    **_: Any,
) -> None:
    _check_run_id(run_id)
    if _FD is None:
        return
    step, timestamp = int(step or 0), int(timestamp or _now() * 1000)
    lines = [
        metric_line(_METRIC_FIELDS.get(key) or _metric_field(key), value, step, timestamp)
        for key, value in metrics.items()
    ]
    _write(_FD, "".join(lines).encode())


def log_param(key: str, value: Any, **_: Any) -> Any:
    _emit(PARAM, key, value)
    return value


def log_params(params: dict[str, Any], **_: Any) -> None:
    for key, value in params.items():
        _emit(PARAM, key, value)


def set_tag(key: str, value: Any, **_: Any) -> None:
    _emit(TAG, key, value)


def set_tags(tags: dict[str, Any], **_: Any) -> None:
    for key, value in tags.items():
        _emit(TAG, key, value)


def log_artifact(local_path: str, artifact_path: str | None = None, **_: Any) -> None:
    if _ARTIFACT_DIR is None:
        return
    # A copy in the spool: the file may change or go before the kernel sends it.
    target = os.path.join(_ARTIFACT_DIR, f"{len(os.listdir(_ARTIFACT_DIR)):05d}")
    os.makedirs(target, mode=0o700)
    shutil.copy2(local_path, target)
    _emit(ARTIFACT, os.path.join(target, os.path.basename(local_path)), artifact_path or "")


def set_experiment(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "air_magic: mlflow.set_experiment() was called inside the distributed code. Each launch "
        "logs to one run, chosen in the notebook: call mlflow.set_experiment(...) in the notebook "
        "before launching, or pass experiment=... to @distributed (--experiment on %%distributed)."
    )


class _ActiveRun(SimpleNamespace):
    def __enter__(self) -> "_ActiveRun":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _RunInfo:
    """``info`` of the launch's run, as MLflow's ``RunInfo`` has it; each field is read
    (waited for: the kernel makes the run beside the ranks) when asked."""

    status = "RUNNING"
    end_time = None
    lifecycle_stage = "active"

    @property
    def run_id(self) -> str | None:
        return launch_run_id()

    run_uuid = run_id

    def _detail(self, name: str) -> Any:
        return _RUN_DETAILS.get(name) if launch_run_id() is not None else None

    @property
    def experiment_id(self) -> Any:
        return self._detail("experiment_id")

    @property
    def artifact_uri(self) -> Any:
        return self._detail("artifact_uri")

    @property
    def run_name(self) -> Any:
        return self._detail("run_name")

    @property
    def user_id(self) -> Any:
        return self._detail("user_id")

    @property
    def start_time(self) -> Any:
        return self._detail("start_time")


def _active_run_object() -> Any:
    # ``data`` as MLflow's fluent active_run() has it: the run's data when it was fetched (at its
    # start), not updated as the run logs (read what was logged with MlflowClient in the notebook).
    return _ActiveRun(info=_RunInfo(), data=SimpleNamespace(params={}, metrics={}, tags={}))


def start_run(run_id: str | None = None, **_: Any) -> Any:
    _check_run_id(run_id)
    return _active_run_object() if _ENABLED else _ActiveRun(info=SimpleNamespace(run_id=None), data=None)


def active_run() -> Any:
    return _active_run_object() if _ENABLED else None


def end_run(*_: Any, **__: Any) -> None:
    """The kernel ends the launch's run once every rank is done."""


_PATCHES = {
    "log_metric": log_metric,
    "log_metrics": log_metrics,
    "log_param": log_param,
    "log_params": log_params,
    "set_tag": set_tag,
    "set_tags": set_tags,
    "log_artifact": log_artifact,
    "set_experiment": set_experiment,
    "start_run": start_run,
    "active_run": active_run,
    "end_run": end_run,
}


def patch(module: ModuleType) -> None:
    for name, function in _PATCHES.items():
        setattr(module, name, function)
    fluent = sys.modules.get("mlflow.tracking.fluent")
    original = getattr(fluent, "_get_or_start_run", None)
    if original is not None and not getattr(original, "_air_magic", False):

        def _get_or_start_run() -> Any:
            # MLflow's functions that need the run (log_artifacts, log_figure, log_model,
            # autologging) start or resume it here: the launch's, once the kernel made it.
            if _ENABLED:
                launch_run_id()
            return original()

        _get_or_start_run._air_magic = True  # type: ignore[attr-defined]
        fluent._get_or_start_run = _get_or_start_run  # type: ignore[union-attr]


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        patch(module)


class _LazyMlflow(ModuleType):
    """``mlflow`` in a rank until something needs the real package: the fluent calls above
    are answered at once (an ``import mlflow`` costs nothing, the logging nothing more);
    any other attribute (``mlflow.pytorch``, ``MlflowClient``, ``__version__``, a submodule's
    import, which asks for ``__path__``) imports the real package (patched on import by
    :class:`_MlflowFinder`) in its place and is read from it."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_real_mlflow(), name)

    def __dir__(self) -> list[str]:
        return dir(_real_mlflow())


_REAL_LOCK = threading.RLock()


def _real_mlflow() -> ModuleType:
    with _REAL_LOCK:
        module = sys.modules.get("mlflow")
        if isinstance(module, _LazyMlflow):
            del sys.modules["mlflow"]
            try:
                return importlib.import_module("mlflow")
            except BaseException:
                sys.modules.setdefault("mlflow", module)
                raise
        return importlib.import_module("mlflow")


def _lazy_mlflow() -> ModuleType | None:
    """The stand-in, where the real package is installed (its spec found, nothing imported)."""
    try:
        spec = importlib.machinery.PathFinder.find_spec("mlflow")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    module = _LazyMlflow("mlflow", "MLflow (air_magic's stand-in until more than its fluent logging is used)")
    module.__spec__ = spec  # find_spec("mlflow") works as for the real one (transformers asks)
    module.__loader__ = spec.loader
    module.__file__ = spec.origin
    for name, function in _PATCHES.items():
        setattr(module, name, function)
    return module


class _MlflowFinder(importlib.abc.MetaPathFinder):
    """Patches ``mlflow`` the moment the user's code imports it."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "mlflow":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


def install(work_dir: str, rank: int, run_id: str | None) -> None:
    """Route this rank's fluent MLflow calls to the kernel (or nowhere when ``run_id`` is None).

    ``run_id`` is ``""`` when the launch's run does not exist yet (the kernel makes it
    while the ranks start): the calls are kept all the same, and :func:`launch_run_id`
    reads it when a call needs it.  The file goes to the spool folder the kernel named in
    ``AIR_MAGIC_TRACKING_DIR`` (it outlives the kernel), else to ``work_dir``.
    """
    global _FD, _RUN_ID, _ARTIFACT_DIR, _ENABLED, _FOLDER
    _ENABLED = run_id is not None
    _RUN_ID = run_id or None
    if _ENABLED:
        folder = _FOLDER = os.environ.get(SPOOL_DIR_ENV) or work_dir
        _FD = os.open(spool_file(folder, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        # Held while this rank lives: a kernel that finds the launch orphaned waits for
        # every rank to be gone before it sends the rest.
        fcntl.flock(_FD, fcntl.LOCK_SH)
        _ARTIFACT_DIR = artifact_dir(folder, rank)
        os.makedirs(_ARTIFACT_DIR, mode=0o700, exist_ok=True)
    if "mlflow" in sys.modules:
        patch(sys.modules["mlflow"])
        return
    sys.meta_path.insert(0, _MlflowFinder())
    if os.environ.get(LAZY_ENV, "1") != "0":
        lazy = _lazy_mlflow()
        if lazy is not None:
            sys.modules["mlflow"] = lazy
