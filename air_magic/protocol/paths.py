"""The files of a launch's private work folder, by name: both sides find them here."""

from __future__ import annotations

import os

# -- paths in a launch's private work folder -----------------------------------------------------


def payload_path(work_dir: str) -> str:
    """The pickled function or cell, written by the kernel, read by every rank."""
    return os.path.join(work_dir, "payload.pkl")


def log_dir(work_dir: str) -> str:
    """The folder of the ranks' logs (kept after the launch; the rest is deleted)."""
    return os.path.join(work_dir, "logs")


def log_path(logs: str, rank: int) -> str:
    """``rank``'s stdout and stderr, in the launch's log folder."""
    return os.path.join(logs, f"rank-{rank}.log")


def stderr_ranges_path(log: str) -> str:
    """Beside a rank's log: where in it the rank's ``sys.stderr`` wrote, as pairs of
    little-endian int64 (start, end), so that its output is shown on the streams it was
    written to (a hidden file: the log is the user's to read)."""
    folder, name = os.path.split(log)
    return os.path.join(folder, f".{name}.stderr")


def result_path(work_dir: str, rank: int) -> str:
    """Where ``rank`` of the launch with this work folder leaves its record."""
    return os.path.join(work_dir, f"result-{rank}.pkl")


def stack_path(work_dir: str, rank: int) -> str:
    """Where ``rank`` writes its threads' stacks when it gets ``STACK_SIGNAL``."""
    return os.path.join(work_dir, f"stack-{rank}.txt")


def stack_request_path(work_dir: str, rank: int) -> str:
    """The named pipe on which ``rank`` takes stack requests: a thread of the rank waits
    on it and answers without touching the thread that runs the user's code."""
    return os.path.join(work_dir, f"stack-{rank}.ask")


def collectives_path(work_dir: str, rank: int) -> str:
    """Where ``rank``'s stack thread writes its collectives when asked (see
    :mod:`air_magic.rank.inspect.collectives`)."""
    return os.path.join(work_dir, f"collectives-{rank}.json")


def joined_path(work_dir: str, rank: int) -> str:
    """Made when ``rank`` enters init_process_group(): the kernel tells a rank that ended
    without joining (the others would wait for it until the timeout) by its absence."""
    return os.path.join(work_dir, f"joined-{rank}")


LEFT_PREFIX = "left-"


def left_path(work_dir: str, rank: int) -> str:
    """Made by the kernel when ``rank`` returned without joining the process group: a
    rank that enters it later fails at once instead of waiting."""
    return os.path.join(work_dir, f"{LEFT_PREFIX}{rank}")


def rendezvous_path(work_dir: str) -> str:
    """The ranks' ``FileStore`` for ``init_process_group()``."""
    return os.path.join(work_dir, "rendezvous.store")


def elastic_error_path(work_dir: str, rank: int) -> str:
    """Where torch.distributed.elastic's ``@record`` would write ``rank``'s failure."""
    return os.path.join(work_dir, f"elastic-error-{rank}.json")


def spool_file_name(rank: int) -> str:
    """The name of ``rank``'s tracking spool file (its MLflow calls, a line each)."""
    return f"tracking-{rank}.tsv"


def spool_file(folder: str, rank: int) -> str:
    return os.path.join(folder, spool_file_name(rank))


def spool_file_rank(name: str) -> int | None:
    """``'tracking-3.tsv'`` -> 3; None for any other name."""
    if name.startswith("tracking-") and name.endswith(".tsv"):
        try:
            return int(name[len("tracking-") : -len(".tsv")])
        except ValueError:
            return None
    return None
