"""Sending what launches left on disk: a kernel that died mid-launch, a store that was down.

Every launch keeps its ranks' MLflow calls in a spool folder with a journal
(:mod:`air_magic.protocol.spool`).  While its kernel lives, the folder is locked.  A folder
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

The lines are sent by the same :class:`~air_magic.tracking.upload.SpoolUploader` as a live
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

from air_magic.protocol.spool import Spool

__all__ = ["Recovered", "recover_in_background", "recover_pending", "upload_pending"]


@dataclass(frozen=True)
class Recovered:
    """What became of one orphaned launch's spool."""

    launch_id: str
    tracking_uri: str
    run_id: str | None
    #: ``"sent"``: everything is in the run, the spool is gone; ``"waiting"``: the store
    #: did not answer, the spool stays; ``"dropped"``: its local store no longer exists;
    #: ``"kept"``: its local store's folder no longer exists: the spool was moved to
    #: ``kept_at`` and is not tried again; ``"failed"``: the store refused to make the run
    #: (``reason``), the spool stays.
    outcome: str
    points: int  # metric points sent now ("sent"), or still waiting ("waiting", "dropped")
    status: str | None = None  # the status the run was given
    reason: str | None = None
    skipped: str | None = None  # what the store refused, by name
    #: The store is one air_magic does not write to as it is (another user's, half-made):
    #: told once on this machine, not once per kernel, until it changes.
    unusable: bool = False
    origin: str = ""  # what launched it: "train in work/train.ipynb"
    kept_at: str = ""  # ("kept") where its spool was moved: it is never tried again

    def line(self) -> str:
        """The one line a user sees about it."""
        from air_magic.tracking.store import store_name

        if self.outcome == "sent":
            origin = f"of {self.origin}, " if self.origin else ""
            text = (
                f"MLflow run {self.run_id} ({origin}{_points(self.points)} sent, marked {self.status}) "
                f"in {store_name(self.tracking_uri)}"
            )
            return text + (f"; skipped what the store refused: {self.skipped}" if self.skipped else "")
        if self.outcome == "dropped":
            return f"dropped {_points(self.points)} of launch {self.launch_id}: {self.reason}"
        if self.outcome == "kept":
            return (
                f"launch {self.launch_id} left {_points(self.points)} for {store_name(self.tracking_uri)}, and "
                f"{self.reason}: they are kept in {self.kept_at} and not tried again"
            )
        if self.outcome == "waiting":
            return f"{store_name(self.tracking_uri)} is still unreachable ({self.reason})"
        return f"could not send launch {self.launch_id} to {store_name(self.tracking_uri)}: {self.reason}"


def _points(count: int) -> str:
    return f"{count} point{'s' if count != 1 else ''}"


_lock = threading.Lock()
_thread: threading.Thread | None = None
_told: set[tuple[str, str]] = set()  # (outcome, uri or launch) told in the background already


def recover_pending(later: list[str] | None = None) -> list[Recovered]:
    """One pass over this user's spool: every orphan that can be claimed now is sent.

    ``later`` gets the folders of orphans whose ranks are still on their way out (a kernel
    killed a moment ago): a pass a second later sends them."""
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
            if spool.ranks_alive():  # (released below) its kernel is gone, a rank not yet
                if later is not None:
                    later.append(folder)
                continue
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
    from air_magic.tracking.store import StoreUnusable, Unreachable, bounded_requests, local_store_path, make_client
    from air_magic.tracking.upload import SpoolUploader

    journal = spool.journal
    uri = str(journal["tracking_uri"])
    launch_id = str(journal["launch_id"])
    status = str(journal.get("status") or "KILLED")
    path = local_store_path(uri)
    if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        # The store's own folder was deleted (a test run's, a project removed): no kernel could
        # ever send these, so they are moved out of the way, kept, and said once.
        waiting = _count_points(spool)
        kept = _keep(spool)
        return Recovered(
            launch_id,
            uri,
            journal.get("run_id"),
            "kept",
            waiting,
            reason=f"the folder of its store, {os.path.dirname(os.path.abspath(path))}, no longer exists",
            kept_at=kept,
        )
    # A store told unusable was moved away as its line said: a new one is made there.  A
    # store the launch's writer never made (its kernel died first) is made now; only one that
    # existed and is gone was deleted by the user, and its points go with it.
    deleted = journal.get("store_existed", True) and not journal.get("store_unusable")
    if path is not None and not os.path.exists(path) and deleted:
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
                # Copies in the spool, else the launch's own logs (kept in the user's log folder)
                uploader.send_logs(spool.logs() or [p for p in journal.get("log_paths") or () if os.path.exists(p)])
                spool.update(logs_sent=True)
            uploader.finish(status)
        except Unreachable as exc:
            if isinstance(exc, StoreUnusable):
                spool.update(store_unusable=exc.reason)
            return Recovered(
                launch_id,
                uri,
                journal.get("run_id"),
                "waiting",
                _count_points(spool),
                reason=exc.reason,
                unusable=isinstance(exc, StoreUnusable),
            )
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
        origin=str(journal.get("origin") or ""),
    )


def _keep(spool: Spool) -> str:
    """Move a spool no store will take out of the folder every kernel looks in (it stays on
    disk, in the user's state folder); where it went."""
    from air_magic.protocol.private import private_dir
    from air_magic.protocol.spool import state_dir

    kept = private_dir(os.path.join(private_dir(state_dir(), "state"), "unsent"), "state")
    target = os.path.join(kept, os.path.basename(spool.folder))
    os.replace(spool.folder, target)
    return target


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
        if background and group[0].unusable and not _first_time_told(uri, str(group[0].reason)):
            continue  # another kernel said it already
        launches = f"{len(group)} earlier launch{'es' if len(group) != 1 else ''}"
        lines.append(
            f"[air_magic] {group[0].line()}: {_points(sum(r.points for r in group))} of {launches} stay on disk; "
            "air_magic.tracking.upload_pending() sends them once it is back."
        )
    return lines


def _first_time_told(uri: str, reason: str) -> bool:
    """Whether this is the first time this user is told ``reason`` about ``uri``'s store as
    it is now (a mark in the user's private state folder; a changed file is told again)."""
    import hashlib

    from air_magic.protocol.private import private_dir
    from air_magic.protocol.spool import state_dir
    from air_magic.tracking.store import local_store_path

    path = local_store_path(uri)
    try:
        st = os.stat(path) if path else None
    except OSError:
        st = None
    what = f"{uri}\0{reason}\0{st.st_ino if st else ''}\0{st.st_mtime_ns if st else ''}"
    try:
        folder = private_dir(os.path.join(private_dir(state_dir(), "state"), "told"), "state")
        mark = os.path.join(folder, hashlib.sha256(what.encode()).hexdigest()[:32])
        os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        return False
    except OSError:  # no state folder to keep the mark in: told in every kernel, as before
        return True
    return True


#: Seconds between passes while an orphan's ranks are still ending, and while a store that
#: holds orphans does not answer (the points reach it within this long once it is back).
_AGAIN_SOON = 1.0
_AGAIN = 10.0
_pass_lock = threading.Lock()  # one pass at a time in this process (the thread, upload_pending)
_wake = threading.Event()  # a new launch or %load_ext: look again now
_stop = threading.Event()  # stop_background(): no more passes
#: Passes for a store that does not answer, before the thread leaves it to the next launch,
#: %load_ext or upload_pending() (five minutes).
_MAX_WAITS = 30


def _background_passes() -> None:
    """Passes until nothing is left that this kernel could send later: again a second later
    for orphans whose ranks were still ending, again every few seconds while a store that
    holds orphans does not answer, for as long as the kernel lives."""
    waits = 0
    while not _stop.is_set():
        later: list[str] = []
        try:
            with _pass_lock:
                results = recover_pending(later)
        except Exception as exc:  # never a traceback from a background thread
            sys.stderr.write(f"[air_magic] could not look for MLflow points left by earlier launches: {exc}\n")
            return
        lines = _lines(results, background=True)
        if lines:  # nothing at all otherwise: in a kernel, a thread's first write opens a socket kept for good
            sys.stderr.write("".join(line + "\n" for line in lines))
            sys.stderr.flush()
        if later:
            delay = _AGAIN_SOON
        elif any(r.outcome == "waiting" and not r.unusable for r in results) and waits < _MAX_WAITS:
            delay, waits = _AGAIN, waits + 1  # (an unusable store waits for the user's fix)
        else:
            return
        _wake.wait(delay)
        _wake.clear()


def stop_background(timeout: float = 60.0) -> None:
    """End the background passes (after the one under way) and wait for their thread."""
    with _lock:
        running = _thread
    if running is None:
        return
    _stop.set()
    _wake.set()
    try:
        running.join(timeout)
    finally:
        _stop.clear()


def recover_in_background() -> None:
    """Send what dead kernels (or an unreachable store) left, in a background thread.

    Cheap when there is nothing to send (a folder listing); never delays the caller.  The
    launcher calls it at each launch with tracking on; ``%load_ext air_magic`` should too.
    """
    global _thread
    with _lock:
        if _thread is not None and _thread.is_alive():
            _wake.set()  # it waits for its next pass: now
            return
        _thread = threading.Thread(target=_background_passes, name="air_magic-mlflow-recovery", daemon=True)
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
    with _pass_lock:  # after a background pass under way, never beside it
        results = recover_pending()
    lines = _lines(results, background=False) or ["[air_magic] nothing is waiting to be sent to MLflow."]
    for line in lines:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()
    return results
