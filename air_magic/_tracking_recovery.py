"""Sending what launches left on disk: a kernel that died mid-launch, a store that was down.

Every launch keeps its ranks' MLflow calls in a spool folder with a journal
(:mod:`air_magic._spool`).  While its kernel lives, the folder is locked.  A folder
whose lock is free is an orphan: its kernel died (killed, restarted), or its launch
ended while the store did not answer.  Recovery takes the lock, waits for no rank (a
rank still alive holds its file), makes the run if it was never made, sends the lines
past the journal's offsets and the ranks' logs, marks the run with the launch's
status (KILLED when the kernel died first) and deletes the folder::

    %load_ext air_magic / a launch          upload_pending()
          |  recover_in_background()              |  waits for a pass under way, then one pass
          v                                       v
    for each orphan folder: claim (flock) -> make the run? -> send -> status -> delete
          |                                       |
          v                                       v
    one line: what was recovered (run, points); a store still down: said once per store

The lines are sent by the same :class:`~air_magic._mlflow_upload.SpoolUploader` as a live
launch's, so the ranks' items get the same names (rank 0's metrics under their keys, rank
r's under ``rank<r>/<key>``); which rank holds which param or tag key is in the journal,
saved with the offsets sent, so a recovery goes on where the dead kernel stopped.

Nothing here imports MLflow until there is an orphan to send.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

from ._spool import Spool

__all__ = ["Recovered", "recover_in_background", "recover_pending", "upload_pending"]


@dataclass(frozen=True)
class Recovered:
    """What became of one orphaned launch's spool."""

    launch_id: str
    tracking_uri: str
    run_id: str | None
    #: ``"sent"``: everything is in the run, the spool is gone; ``"waiting"``: the store
    #: did not answer, the spool stays; ``"dropped"``: its local store no longer exists;
    #: ``"failed"``: the store refused to make the run (``reason``), the spool stays.
    outcome: str
    points: int  # metric points sent now ("sent"), or still waiting ("waiting", "dropped")
    status: str | None = None  # the status the run was given
    reason: str | None = None
    skipped: str | None = None  # what the store refused, by name

    def line(self) -> str:
        """The one line a user sees about it."""
        from ._mlflow_upload import store_name

        if self.outcome == "sent":
            text = f"MLflow run {self.run_id} ({_points(self.points)} sent, marked {self.status})"
            return text + (f"; skipped what the store refused: {self.skipped}" if self.skipped else "")
        if self.outcome == "dropped":
            return f"dropped {_points(self.points)} of launch {self.launch_id}: {self.reason}"
        if self.outcome == "waiting":
            return f"{store_name(self.tracking_uri)} is still unreachable ({self.reason})"
        return f"could not send launch {self.launch_id} to {store_name(self.tracking_uri)}: {self.reason}"


def _points(count: int) -> str:
    return f"{count} point{'s' if count != 1 else ''}"


_lock = threading.Lock()
_thread: threading.Thread | None = None
_told: set[tuple[str, str]] = set()  # (outcome, uri or launch) told in the background already


def recover_pending() -> list[Recovered]:
    """One pass over this user's spool: every orphan that can be claimed now is sent."""
    try:
        folders = Spool.folders()
    except OSError:  # PrivateFolderError included
        return []  # the launch that uses the folder says what is wrong with it
    results = []
    for folder in folders:
        try:
            spool = Spool.claim(folder)
        except (OSError, ValueError):
            continue  # not a spool of ours, or half-written: leave it alone
        if spool is None:
            continue  # its kernel (or another recovery) holds it
        try:
            result = _recover(spool)
        except OSError as exc:  # a file in it is not what it should be
            journal = spool.journal
            result = Recovered(
                str(journal.get("launch_id")),
                str(journal.get("tracking_uri")),
                journal.get("run_id"),
                "failed",
                0,
                reason=f"{exc}; it stays in {spool.folder}",
            )
        finally:
            spool.release()
        if result is not None:
            results.append(result)
    return results


def _recover(spool: Spool) -> Recovered | None:
    from ._mlflow_upload import SpoolUploader, Unreachable, bounded_requests, local_store_path, make_client

    journal = spool.journal
    if spool.ranks_alive():
        return None  # its kernel is gone but a rank is not yet: next time
    uri = str(journal["tracking_uri"])
    launch_id = str(journal["launch_id"])
    status = str(journal.get("status") or "KILLED")
    path = local_store_path(uri)
    if path is not None and not os.path.exists(path):
        waiting = _count_points(spool)
        spool.remove()
        return Recovered(
            launch_id, uri, journal.get("run_id"), "dropped", waiting, reason=f"its store {path} no longer exists"
        )
    uploader = None
    with bounded_requests():
        try:
            uploader = SpoolUploader(spool, make_client(uri))
            uploader.ensure_run()
            uploader.pump(until_empty=True)
            if not journal.get("logs_sent"):
                uploader.send_logs(spool.logs())
                spool.update(logs_sent=True)
            uploader.finish(status)
        except Unreachable as exc:
            return Recovered(launch_id, uri, journal.get("run_id"), "waiting", _count_points(spool), reason=exc.reason)
        except Exception as exc:  # one launch's failure is reported; the others are still recovered
            return Recovered(
                launch_id,
                uri,
                journal.get("run_id"),
                "failed",
                _count_points(spool),
                reason=f"{type(exc).__name__}: {exc}",
            )
    spool.remove()
    return Recovered(
        launch_id,
        uri,
        journal.get("run_id"),
        "sent",
        uploader.points,
        status=status,
        skipped=uploader.skipped_text() or None,
    )


def _count_points(spool: Spool) -> int:
    try:
        return spool.pending_points()
    except OSError:
        return 0


def _lines(results: list[Recovered], background: bool) -> list[str]:
    lines = []
    sent = [r.line() for r in results if r.outcome == "sent"]
    if sent:
        lines.append("[air_magic] recovered what earlier launches left on disk: " + "; ".join(sent) + ".")
    waiting: dict[str, list[Recovered]] = {}
    for result in results:
        if result.outcome == "waiting":
            waiting.setdefault(result.tracking_uri, []).append(result)
        elif result.outcome != "sent":
            key = (result.outcome, result.launch_id)
            if not background or key not in _told:
                _told.add(key)
                lines.append(f"[air_magic] {result.line()}.")
    for uri, group in waiting.items():
        key = ("waiting", uri)
        if background and key in _told:
            continue
        _told.add(key)
        launches = f"{len(group)} earlier launch{'es' if len(group) != 1 else ''}"
        lines.append(
            f"[air_magic] {group[0].line()}: {_points(sum(r.points for r in group))} of {launches} stay on disk; "
            "air_magic.tracking.upload_pending() sends them once it is back."
        )
    return lines


def _background_pass() -> None:
    try:
        results = recover_pending()
    except Exception as exc:  # never a traceback from a background thread
        sys.stderr.write(f"[air_magic] could not look for MLflow points left by earlier launches: {exc}\n")
        return
    lines = _lines(results, background=True)
    if lines:  # nothing at all otherwise: in a kernel, a thread's first write opens a socket kept for good
        sys.stderr.write("".join(line + "\n" for line in lines))
        sys.stderr.flush()


def recover_in_background() -> None:
    """Send what dead kernels (or an unreachable store) left, in a background thread.

    Cheap when there is nothing to send (a folder listing); never delays the caller.  The
    launcher calls it at each launch with tracking on; ``%load_ext air_magic`` should too.
    """
    global _thread
    with _lock:
        if _thread is not None and _thread.is_alive():
            return
        _thread = threading.Thread(target=_background_pass, name="air_magic-mlflow-recovery", daemon=True)
        _thread.start()


def upload_pending() -> list[Recovered]:
    """Send now what earlier launches left on disk for MLflow; say what became of it.

    A launch leaves its ranks' MLflow calls on disk when its kernel dies mid-launch or
    when its tracking server does not answer.  They are sent at the next launch in any
    kernel; this sends them now (for instance once the server is back).

    Returns
    -------
    list of Recovered
        One entry per launch found: its run, how many points were sent, and whether
        everything is in the run (``outcome == "sent"``) or still waits.

    Examples
    --------
    In [1]: import air_magic.tracking
    In [2]: air_magic.tracking.upload_pending()
    [air_magic] recovered what earlier launches left on disk: MLflow run 5e6f... (312 points sent, marked KILLED).
    """
    with _lock:
        running = _thread
    if running is not None:
        running.join()
    results = recover_pending()
    lines = _lines(results, background=False) or ["[air_magic] nothing is waiting to be sent to MLflow."]
    for line in lines:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()
    return results
