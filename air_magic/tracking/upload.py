"""Sending a spool to MLflow: bounded requests, refused items skipped one by one.

Used by the kernel's writer thread during a launch (:mod:`air_magic.tracking`) and by
the recovery of launches a kernel left behind (:mod:`air_magic.tracking.recovery`)::

    spool folder ──read_new──> lines ──parse──> Metric/Param/RunTag/artifact
        │                                          │ log_batch (1000 a call), log_artifact
        │<── mark_sent(offset) ── the store took them (or refused some: skipped, named)
        └── store unreachable: nothing is marked, the lines wait for the next try

Two kinds of failure, told apart (:mod:`air_magic.tracking.store` reaches the store):

* the store cannot be reached (connection refused or reset, a timeout, a locked sqlite
  file): :class:`~air_magic.tracking.store.Unreachable` is raised and nothing is marked sent;
* the store refuses something (a step too large for it, an artifact path it rejects, a
  param whose value changed): the batch is split in halves until the refused items
  are alone; they are skipped and named, everything else is stored.  Before an item is
  called refused, the store is asked for the run: if that fails too, it is unreachable.

Names, when several ranks log under one key (decided here, where a line of rank ``r``
becomes an MLflow item; the spool keeps the keys as written, and the live panel reads
them so)::

    metric "loss" of rank 0   -> "loss"          the chart of "loss" is rank 0's curve
    metric "loss" of rank 3   -> "rank3/loss"    (MLflow groups the keys by "rank3/")
    metric "rank3/loss" of rank 3 -> "rank3/loss"  (already named for its rank: kept)
    param/tag "lr" = "0.1", first sent           -> "lr"
    param/tag "lr" = "0.1" again, from any rank  -> nothing more to store
    param/tag "lr" = "0.2" from rank 2 afterwards -> "rank2/lr"   (kept, not dropped)

A param or tag key holds the first value sent (the first rank to send it "owns" it); a
rank whose value differs gets its own ``rank<r>/<key>`` from then on, so every value
logged is kept.  A rank that changes the value of its own param is refused by the store
as in a plain MLflow run (skipped, named); its own tag it may change (MLflow
overwrites tags).  Who owns which key is kept in the journal with the offsets sent, so a
later kernel that sends the rest names things the same way.  MLflow's system metrics
(``system/...``) are the kernel's machine's, logged once, not per rank.

A pool's spool (its ranks stay across calls) has call markers: what a rank logs between
``c <call> <label>`` and ``e <call> <status>`` goes to that call's *child run* (tag
``mlflow.parentRunId``: the pool's run; named by the call: ``Cell In[5]``), made when the
first item of the call comes — a call that logs nothing makes no run.  Once every rank's
``e`` line is sent the child ends with the worst status of them (``FAILED`` over
``KILLED`` over ``FINISHED``); the pool's run ending ends those still open with its own.
Which call each rank's lines are of, and each child's id, names and endings, are kept in
the journal with the offsets sent, so recovery sends a dead kernel's calls to the same runs.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable

from air_magic.protocol import CALL, CALL_END
from air_magic.protocol.spool import Spool, iter_lines
from air_magic.tracking.store import (
    Unreachable,
    short_error,
    unreachable_reason,
)

__all__ = ["SpoolUploader", "metric_name", "rank_name", "place"]

_BATCH = {"metrics": 1000, "params": 100, "tags": 100}  # MLflow's limits per log_batch call
_READ = 1 << 20  # bytes of one rank's file read per round
_PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests a child run under its parent

# -- names of several ranks' items ------------------------------------------------------------------


def rank_name(rank: int, key: str) -> str:
    """``rank<r>/<key>``; a key that already starts with ``rank<r>/`` (this rank's) is kept."""
    prefix = f"rank{rank}/"
    return key if key.startswith(prefix) else prefix + key


def metric_name(rank: int, key: str) -> str:
    """Where rank ``rank``'s points of metric ``key`` go: rank 0's under ``key`` as written,
    every other rank's under ``rank<r>/<key>``."""
    return key if rank == 0 else rank_name(rank, key)


#: Params and tags sent, by kind ("p", "t"): key -> (the rank whose value it holds, the value).
Names = dict[str, dict[str, tuple[int, str]]]


def _load_names(saved: Any) -> Names:
    names: Names = {"p": {}, "t": {}}
    if isinstance(saved, dict):
        for kind, table in saved.items():
            if kind in names and isinstance(table, dict):
                names[kind] = {key: (int(held[0]), str(held[1])) for key, held in table.items()}
    return names


def place(table: dict[str, tuple[int, str]], tag: bool, rank: int, key: str, value: str) -> str | None:
    """The name under which rank ``rank``'s param (or tag) ``key`` = ``value`` is sent, or
    None when the store holds that value there already; ``table`` is updated."""
    own = rank_name(rank, key)
    mine = table.get(own)
    if own != key and mine is not None and mine[0] == rank:
        name = own  # this rank's values of key go to its own name already
    elif key not in table or table[key][0] == rank:
        name = key
    elif table[key][1] == value:
        return None  # another rank's copy of the value stored
    else:
        name = own  # another value than the one stored: kept under the rank's name
    held = table.get(name)
    if held is not None and held[1] == value:
        return None
    if held is None or tag:
        # A param keeps its first value: a changed one is sent, and refused by the store
        # (skipped and named) as in a plain MLflow run.
        table[name] = (rank, value)
    return name


# -- one spool, one run -------------------------------------------------------------------------------


class SpoolUploader:
    """Sends one launch's spool to its run; makes the run first when it does not exist yet."""

    def __init__(self, spool: Spool, client: Any) -> None:
        self.spool = spool
        self.client = client
        self.names = _load_names(spool.journal.get("names"))  # params and tags sent, by rank
        self.skipped: dict[str, list[Any]] = {}  # what the store refused: label -> [count, error]
        self.points = 0  # metric points sent by this uploader
        self._store_answers = False  # the store answered a probe since the last refusal
        #: A pool's calls: the call each rank's next lines are of ("0": the pool's own run)...
        self.calls: dict[str, int] = {str(k): int(v) for k, v in (spool.journal.get("calls") or {}).items()}
        #: ... and each call's child run: {"run_id", "label", "names", "ended": {rank: status}, "done"}.
        self.children: dict[str, dict[str, Any]] = dict(spool.journal.get("children") or {})
        self._child_names: dict[str, Names] = {c: _load_names(e.get("names")) for c, e in self.children.items()}

    @property
    def run_id(self) -> str | None:
        return self.spool.journal.get("run_id")  # type: ignore[no-any-return]

    @property
    def run_name(self) -> str | None:
        """The run's name once it is made (MLflow makes one up when none was asked for)."""
        return self.spool.journal.get("run_name") if self.run_id else None

    def _call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One request; Unreachable when the store did not answer."""
        try:
            value = function(*args, **kwargs)
        except Exception as exc:  # any client error: sorted into unreachable or refused below
            reason = unreachable_reason(exc)
            if reason is not None:
                raise Unreachable(reason) from exc
            raise
        return value

    # -- the run --------------------------------------------------------------------------------

    def ensure_run(self) -> str:
        journal = self.spool.journal
        if not journal.get("run_id"):
            experiment_id = journal.get("experiment_id") or self._experiment_id(journal["experiment_name"])
            run = self._call(
                self.client.create_run,
                experiment_id,
                start_time=int(journal["created_at"] * 1000),
                tags=journal.get("tags") or {},
                run_name=journal.get("run_name"),
            )
            self.spool.update(
                run_id=run.info.run_id,
                experiment_id=experiment_id,
                run_name=run.info.run_name,
                artifact_uri=run.info.artifact_uri,
                user_id=run.info.user_id,
                start_time=run.info.start_time,
            )
        if not journal.get("params_logged"):
            from mlflow.entities import Param

            params = [Param(k, v) for k, v in (journal.get("params") or {}).items()]
            self._send("params", params)
            self.spool.update(params_logged=True)
        return str(journal["run_id"])

    def _experiment_id(self, name: str) -> str:
        experiment = self._call(self.client.get_experiment_by_name, name)
        if experiment is not None:
            return str(experiment.experiment_id)
        try:
            return str(self._call(self.client.create_experiment, name))
        except Unreachable:
            raise
        except Exception:  # created meanwhile by another kernel
            experiment = self._call(self.client.get_experiment_by_name, name)
            if experiment is None:
                raise
            return str(experiment.experiment_id)

    # -- the lines --------------------------------------------------------------------------------

    def pump(self, until_empty: bool = False) -> int:
        """Send what the ranks wrote since the last call; the number of lines sent.

        During a launch a round sends at most a few MiB of each rank's file, so that a
        rank that logs fast does not keep the others waiting; ``until_empty`` sends all.
        """
        total = 0
        self._store_answers = False
        for rank in self.spool.ranks():
            rounds = 0
            while until_empty or rounds < 4:
                lines, end = self.spool.read_new(rank, _READ)
                if not lines:
                    break
                names = self._send_lines(rank, lines)
                for call, table in self._child_names.items():
                    self.children[call]["names"] = table
                self.spool.mark_sent(rank, end, names=names, calls=dict(self.calls), children=self.children)
                self.names = names
                total += len(lines)
                rounds += 1
        return total

    def _send_lines(self, rank: int, lines: list[bytes]) -> Names:
        """Send rank ``rank``'s lines; the params and tags sent, with these (to keep once
        the lines are marked sent)."""
        from mlflow.entities import Metric, Param, RunTag

        names: Names = {kind: dict(table) for kind, table in self.names.items()}
        metrics: list[Any] = []
        params: list[Any] = []
        tags: list[Any] = []
        artifacts: list[tuple[str, str | None]] = []
        key = str(rank)

        def flush() -> None:
            if not (metrics or params or tags or artifacts):
                return
            call = self.calls.get(key, 0)
            run_id = self._child_run(call) if call else self.run_id
            self._send("metrics", metrics, run_id)
            # Sent apart from the points: a refused param must cost nothing but itself.
            self._send("params", params, run_id)
            self._send("tags", tags, run_id)
            for local_path, artifact_path in artifacts:
                self._send_artifact(local_path, artifact_path, run_id)
            del metrics[:], params[:], tags[:], artifacts[:]

        for item in iter_lines(lines):
            kind = item[0]
            if kind in (CALL, CALL_END):
                flush()
                entry = self.children.setdefault(str(item[1]), {"run_id": None, "label": "", "ended": {}})
                if kind == CALL:
                    self.calls[key] = item[1]
                    entry["label"] = item[2]
                else:
                    self.calls[key] = 0
                    entry["ended"][key] = item[2]
                    self._maybe_end_child(str(item[1]))
                continue
            call = self.calls.get(key, 0)
            table = names if not call else self._child_names.setdefault(str(call), _load_names(None))
            if kind == "m":
                metrics.append(Metric(metric_name(rank, item[1]), item[2], item[4], item[3]))
            elif kind == "p":
                name = place(table["p"], False, rank, item[1], item[2])
                if name is not None:
                    params.append(Param(name, item[2]))
            elif kind == "t":
                name = place(table["t"], True, rank, item[1], item[2])
                if name is not None:
                    tags.append(RunTag(name, item[2]))
            else:
                artifacts.append((item[1], item[2]))
        flush()
        return names

    # -- a pool's calls: child runs -----------------------------------------------------------------

    def _child_run(self, call: int) -> str:
        """The run of a pool's call, made now if this is the first thing it logs."""
        entry = self.children.setdefault(str(call), {"run_id": None, "label": "", "ended": {}})
        if not entry.get("run_id"):
            journal = self.spool.journal
            parent = self.ensure_run()
            label = entry.get("label") or f"call {call}"
            run = self._call(
                self.client.create_run,
                journal["experiment_id"],
                start_time=int(time.time() * 1000),
                tags={
                    _PARENT_TAG: parent,
                    "air_magic.call": str(call),
                    "air_magic.launch_id": journal.get("tags", {}).get("air_magic.launch_id", ""),
                },
                run_name=label,
            )
            entry["run_id"] = run.info.run_id
            self.spool.update(children=self.children)
        return str(entry["run_id"])

    def _maybe_end_child(self, call: str) -> None:
        """End a call's child run once every rank's end of it is sent."""
        entry = self.children[call]
        if entry.get("done") or len(entry["ended"]) < len(self.spool.journal.get("sent") or {}):
            return
        if entry.get("run_id"):
            statuses = set(entry["ended"].values())
            status = next((s for s in ("FAILED", "KILLED") if s in statuses), "FINISHED")
            self._call(self.client.set_terminated, entry["run_id"], status)
        entry["done"] = True

    def end_children(self, status: str) -> None:
        """End the child runs still open (the pool's run ends with ``status``)."""
        for entry in self.children.values():
            if entry.get("run_id") and not entry.get("done"):
                self._call(self.client.set_terminated, entry["run_id"], status)
                entry["done"] = True
        if self.children:
            self.spool.update(children=self.children)

    def _send(self, kind: str, items: list[Any], run_id: str | None = None) -> None:
        size = _BATCH[kind]
        for start in range(0, len(items), size):
            self._send_batch(kind, items[start : start + size], run_id or self.run_id)

    def _send_batch(self, kind: str, items: list[Any], run_id: str | None = None) -> None:
        if not items:
            return
        run_id = run_id or self.run_id
        try:
            self._call(self.client.log_batch, run_id, **{kind: items})
            if kind == "metrics":
                self.points += len(items)
            return
        except Unreachable:
            raise
        except Exception as exc:  # the store refused the batch: find the point it refuses
            if len(items) == 1:
                self._refused(_label(kind, items[0]), exc)
                return
        middle = len(items) // 2
        self._send_batch(kind, items[:middle], run_id)
        self._send_batch(kind, items[middle:], run_id)

    def _send_artifact(self, local_path: str, artifact_path: str | None, run_id: str | None = None) -> None:
        try:
            self._call(self.client.log_artifact, run_id or self.run_id, local_path, artifact_path)
        except Unreachable:
            raise
        except Exception as exc:  # the store refused the file (too large, a bad path...)
            target = f" to '{artifact_path}'" if artifact_path else ""
            self._refused(f"artifact '{os.path.basename(local_path)}'{target}", exc)

    def _refused(self, label: str, exc: Exception) -> None:
        if not self._store_answers:
            # A refusal, or a store that fails everything (a server whose database is down
            # answers 500)? Ask it something that must work.
            try:
                self._call(self.client.get_run, self.run_id)
            except Unreachable:
                raise
            except Exception as probe:  # whatever the store says, it does not take things
                raise Unreachable(f"it fails: {short_error(probe)}") from probe
            self._store_answers = True
        entry = self.skipped.setdefault(label, [0, short_error(exc)])
        entry[0] += 1

    def send_logs(self, paths: list[str]) -> None:
        """Each rank's log under ``logs/``: in one call (a folder of links to them: one
        look-up of the run's artifact location, not one per rank), else one by one (a
        refused file is then named, and the others still stored)."""
        present = [p for p in paths if os.path.exists(p)]
        names = {os.path.basename(p) for p in present}
        if len(present) > 1 and len(names) == len(present):
            folder = os.path.join(os.path.dirname(present[0]), f".logs-upload-{os.getpid()}-{time.monotonic_ns()}")
            try:
                os.mkdir(folder, 0o700)
                for path in present:
                    target = os.path.join(folder, os.path.basename(path))
                    try:
                        os.link(path, target)
                    except OSError:  # another file system, or links refused: a copy
                        shutil.copyfile(path, target)
                self._call(self.client.log_artifacts, self.run_id, folder, "logs")
                return
            except Unreachable:
                raise
            except Exception:  # one by one below, which names what the store refuses
                pass
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        for path in present:
            self._send_artifact(path, "logs")

    def finish(self, status: str, tag_skipped: bool = True) -> None:
        """Name what was skipped on the run, then end it with ``status``."""
        from mlflow.entities import RunTag

        self.end_children(status)
        if tag_skipped and self.skipped:
            text = self.skipped_text()
            self._send("tags", [RunTag("air_magic.skipped", text if len(text) <= 5000 else text[:4997] + "...")])
        self._call(self.client.set_terminated, self.run_id, status)
        self._store_answers = False

    def skipped_text(self) -> str:
        """``1 point of metric 'x' (why), param 'y' (why)`` — at most 10 names."""
        parts = []
        for label, (count, error) in list(self.skipped.items())[:10]:
            if label.startswith("metric "):
                label = f"{count} point{'s' if count != 1 else ''} of {label}"
            parts.append(f"{label} ({error})")
        more = len(self.skipped) - 10
        return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def _label(kind: str, item: Any) -> str:
    return {"metrics": "metric", "params": "param", "tags": "tag"}[kind] + f" '{item.key}'"
