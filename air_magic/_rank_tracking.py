"""The ranks' side of MLflow tracking: fluent calls become one line in a file.

A direct ``mlflow.log_metric`` from every rank into the default sqlite store costs
tens of milliseconds a call and makes ranks fight over one database file.  Here
the kernel is the single writer: when a rank imports ``mlflow``, the fluent
logging functions are replaced by ones that append a tab-separated line to the
rank's own ``tracking-<rank>.tsv`` (one ``write`` system call, a few microseconds;
the bytes survive even a SIGKILL of the rank).  The kernel reads those files and
writes them with MLflow's batch API into the launch's run (:mod:`air_magic.tracking`).

With tracking off, the same functions do nothing, so no stray runs are created.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import shutil
import sys
import time
from types import ModuleType, SimpleNamespace
from typing import Any

_FD: int | None = None
_RUN_ID: str | None = None
_ARTIFACT_DIR: str | None = None
_ENABLED = False


def _clean(text: object) -> str:
    return str(text).replace("\t", " ").replace("\n", " ")


def _emit(kind: str, *fields: object) -> None:
    if _FD is not None:
        if kind in _NAME_CHECKS and (kind, fields[0]) not in _GOOD_NAMES:
            _check_name(kind, fields[0])
        os.write(_FD, ("\t".join((kind, *map(_clean, fields))) + "\n").encode())


#: Names MLflow accepted, by kind: each is checked once per rank.
_GOOD_NAMES: set[tuple[str, object]] = set()
_NAME_CHECKS = {"m": "_validate_metric_name", "p": "_validate_param_name", "t": "_validate_tag_name"}


def _check_name(kind: str, name: object) -> None:
    # A name MLflow would refuse raises here, in the rank, at the call, as MLflow's own
    # call does; reaching the kernel it would make the store refuse the whole batch.
    from mlflow.utils import validation

    getattr(validation, _NAME_CHECKS[kind])(name)
    _GOOD_NAMES.add((kind, name))


def _check_run_id(run_id: str | None) -> None:
    if run_id is not None and run_id != _RUN_ID:
        raise RuntimeError(
            f"air_magic: this rank logs to the launch's MLflow run {_RUN_ID}; run_id={run_id!r} is "
            "another run. Remove run_id=..., or log to that run from the notebook."
        )


def log_metric(key: str, value: float, step: int | None = None, timestamp: int | None = None,
               run_id: str | None = None, **_: Any) -> None:
    _check_run_id(run_id)
    # Whole numbers in the file, as MLflow stores them (a step may come as 1.0 or a tensor).
    _emit("m", key, float(value), int(step or 0), int(timestamp or time.time() * 1000))


def log_metrics(metrics: dict[str, float], step: int | None = None, timestamp: int | None = None,
                run_id: str | None = None, **_: Any) -> None:
    _check_run_id(run_id)
    now, step = int(timestamp or time.time() * 1000), int(step or 0)
    for key, value in metrics.items():
        _emit("m", key, float(value), step, now)


def log_param(key: str, value: Any, **_: Any) -> Any:
    _emit("p", key, value)
    return value


def log_params(params: dict[str, Any], **_: Any) -> None:
    for key, value in params.items():
        _emit("p", key, value)


def set_tag(key: str, value: Any, **_: Any) -> None:
    _emit("t", key, value)


def set_tags(tags: dict[str, Any], **_: Any) -> None:
    for key, value in tags.items():
        _emit("t", key, value)


def log_artifact(local_path: str, artifact_path: str | None = None, **_: Any) -> None:
    if _ARTIFACT_DIR is None:
        return
    target = os.path.join(_ARTIFACT_DIR, f"{len(os.listdir(_ARTIFACT_DIR)):05d}")
    os.makedirs(target)
    shutil.copy2(local_path, target)
    _emit("a", os.path.join(target, os.path.basename(local_path)), artifact_path or "")


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


def _active_run_object() -> Any:
    return _ActiveRun(info=SimpleNamespace(run_id=_RUN_ID, run_name=None), data=SimpleNamespace())


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


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        patch(module)


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
    """Route this rank's fluent MLflow calls to the kernel (or nowhere when ``run_id`` is None)."""
    global _FD, _RUN_ID, _ARTIFACT_DIR, _ENABLED
    _ENABLED = run_id is not None
    _RUN_ID = run_id
    if _ENABLED:
        _FD = os.open(os.path.join(work_dir, f"tracking-{rank}.tsv"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        _ARTIFACT_DIR = os.path.join(work_dir, f"artifacts-{rank}")
        os.makedirs(_ARTIFACT_DIR, exist_ok=True)
    if "mlflow" in sys.modules:
        patch(sys.modules["mlflow"])
    else:
        sys.meta_path.insert(0, _MlflowFinder())
