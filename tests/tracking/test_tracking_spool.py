"""The spool that outlives a kernel, without processes: its private folder, its line format,
its lock, and the recovery of an orphaned launch into a real sqlite store.

An "orphan" here is made the way a dead kernel leaves one: a locked, journaled folder with
rank files written in the ranks' format, whose lock is then let go.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from typing import Any, Iterator

import pytest
from tracking_support import Store, sqlite_uri

from air_magic.protocol import spool as _spool
from air_magic.protocol.private import PrivateFolderError
from air_magic.protocol.spool import Spool, parse_line, spool_file, text_field

NASTY = [
    "plain",
    "tab\there",
    "new\nline",
    "carriage\rreturn",
    "form\x0cfeed",
    "line\u2028separator",
    "file\x1cgroup\x1drecord\x1eunit\x1f",
    "next\x85line",
    '"starts with a quote',
    "back\\slash \\t not a tab",
    "accents é and 漢字",
    "",
]


@pytest.fixture
def state(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A state folder of the test's own; a recovery pass that an earlier launch of this
    process started in the background is over before the test makes orphans."""
    from air_magic.tracking import recovery as _tracking_recovery

    _tracking_recovery.stop_background(60)
    folder = tmp_path / "state"
    monkeypatch.setenv("AIR_MAGIC_STATE_DIR", str(folder))
    yield str(folder)


def orphan(store_uri: str, lines: dict[int, list[str]], **journal: Any) -> Spool:
    """A launch folder as a dead kernel leaves it (lock let go)."""
    record = {
        "tracking_uri": store_uri,
        "experiment_id": None,
        "experiment_name": "orphans",
        "run_name": None,
        "tags": {"air_magic.launch_id": "0001-deadbeef"},
        "params": {"air_magic.num_accelerators": str(len(lines))},
        "run_id": None,
        "params_logged": False,
    }
    record.update(journal)
    spool = Spool.create("0001-deadbeef", record)
    for rank, rank_lines in lines.items():
        with open(spool_file(spool.folder, rank), "w", encoding="utf-8") as handle:
            handle.writelines(line + "\n" for line in rank_lines)
    spool.release()
    return spool


def metric_lines(key: str, count: int, rank: int = 0) -> list[str]:
    return [f"m\t{key}\t{rank + step / 1000!r}\t{step}\t{1_700_000_000_000 + step}" for step in range(count)]


# -- the line format ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", NASTY)
def test_any_text_round_trips_through_a_spool_line(text: str) -> None:
    line = f"t\t{text_field(text)}\t{text_field(text)}\n".encode()
    assert line.count(b"\n") == 1 and line.endswith(b"\n")
    assert parse_line(line[:-1]) == ("t", text, text)


def test_a_metric_line_keeps_its_numbers_whole() -> None:
    assert parse_line(b"m\tloss\tnan\t1180591620717411303424\t1700000000000") is not None
    key, value, step, ts = parse_line(b"m\tloss\t0.1\t7\t1700000000001")[1:]  # type: ignore[index]
    assert (key, value, step, ts) == ("loss", 0.1, 7, 1700000000001)
    assert parse_line(b"m\tloss\tnot-a-number\t1\t2") is None
    assert parse_line(b"garbage") is None


# -- the private folder ------------------------------------------------------------------------------


def test_the_state_folder_defaults_to_xdg_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.delenv("AIR_MAGIC_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert _spool.state_dir() == str(tmp_path / "xdg" / "air_magic")
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _spool.state_dir() == str(tmp_path / "home" / ".local" / "state" / "air_magic")


def test_spool_folders_and_files_are_private(state: str) -> None:
    spool = Spool.create("0007-cafecafe", {"tracking_uri": "sqlite:////nowhere.db"})
    try:
        for folder in (state, os.path.join(state, "tracking"), spool.folder):
            st = os.lstat(folder)
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, folder
        for name in ("lock", "journal.json"):
            assert stat.S_IMODE(os.lstat(os.path.join(spool.folder, name)).st_mode) == 0o600
        with open(os.path.join(spool.folder, "journal.json")) as handle:
            journal = json.load(handle)
        assert journal["launch_id"] == "0007-cafecafe" and journal["kernel_pid"] == os.getpid()
        assert journal["status"] is None and journal["sent"] == {}
    finally:
        spool.remove()
    assert os.listdir(os.path.join(state, "tracking")) == []


def test_a_symlinked_state_folder_is_refused(state: str, tmp_path: Any) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    os.symlink(target, state)
    with pytest.raises(PrivateFolderError) as info:
        Spool.create("0001-aaaaaaaa", {})
    assert str(info.value) == f"cannot use {state} for MLflow points: it is a symbolic link."
    assert os.listdir(target) == []


def test_a_state_folder_others_can_read_is_refused(state: str) -> None:
    os.mkdir(state, 0o700)
    os.chmod(state, 0o755)
    with pytest.raises(PrivateFolderError) as info:
        Spool.create("0001-aaaaaaaa", {})
    assert str(info.value) == (
        f"cannot use {state} for MLflow points: others may read or write it (mode 0o755); chmod 700 it."
    )


def test_a_state_path_that_is_a_file_is_refused(state: str) -> None:
    with open(state, "w"):
        pass
    with pytest.raises(PrivateFolderError) as info:
        Spool.create("0001-aaaaaaaa", {})
    assert str(info.value) == f"cannot use {state} for MLflow points: it is not a folder."


def test_a_state_folder_that_cannot_be_made_is_refused(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("")
    state = tmp_path / "a-file" / "state"
    monkeypatch.setenv("AIR_MAGIC_STATE_DIR", str(state))
    with pytest.raises(NotADirectoryError):
        Spool.create("0001-aaaaaaaa", {})


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_state_folder_of_another_user_is_refused(state: str) -> None:
    os.mkdir(state, 0o700)
    os.chown(state, 4242, -1)
    with pytest.raises(PrivateFolderError) as info:
        Spool.create("0001-aaaaaaaa", {})
    assert str(info.value) == (f"cannot use {state} for MLflow points: it belongs to uid 4242, not to you (uid 0).")


def test_symlinks_inside_a_spool_are_not_followed(state: str, tmp_path: Any) -> None:
    from air_magic.tracking.recovery import recover_pending

    victim = tmp_path / "victim.txt"
    victim.write_text("m\tloss\t1.0\t0\t0\n")
    spool = orphan(sqlite_uri(tmp_path), {})
    os.symlink(victim, spool_file(spool.folder, 0))
    with pytest.raises(OSError) as info:
        spool.read_new(0, 100)
    assert info.value.errno == errno.ELOOP
    os.unlink(os.path.join(spool.folder, "lock"))
    os.symlink(victim, os.path.join(spool.folder, "lock"))
    assert recover_pending() == []  # not claimed: nothing read, locked, sent or deleted
    assert victim.read_text() == "m\tloss\t1.0\t0\t0\n"
    assert os.path.isdir(spool.folder)


def test_a_spool_whose_journal_is_not_a_file_is_left_alone(state: str, tmp_path: Any) -> None:
    from air_magic.tracking.recovery import recover_pending

    spool = orphan(sqlite_uri(tmp_path), {0: metric_lines("loss", 3)})
    journal = os.path.join(spool.folder, "journal.json")
    os.unlink(journal)
    os.mkdir(journal)
    with pytest.raises(PrivateFolderError) as info:
        Spool.claim(spool.folder)
    assert str(info.value) == f"refusing {journal}: not a file of yours"
    assert recover_pending() == []
    assert os.path.isdir(journal) and os.path.exists(spool_file(spool.folder, 0))


def test_an_orphan_with_a_symlinked_rank_file_is_reported_and_kept(state: str, tmp_path: Any, capsys: Any) -> None:
    from air_magic.tracking import upload_pending

    victim = tmp_path / "victim.txt"
    victim.write_text("m\tloss\t1.0\t0\t0\n")
    uri = sqlite_uri(tmp_path)
    Store(uri).client.search_experiments()
    spool = orphan(uri, {})
    os.symlink(victim, spool_file(spool.folder, 0))
    capsys.readouterr()
    [result] = upload_pending()
    assert result.outcome == "failed"
    rank_file = spool_file(spool.folder, 0)
    assert capsys.readouterr().err == (
        f"[air_magic] could not send launch 0001-deadbeef to MLflow store {uri}: [Errno 40] Too many levels of "
        f"symbolic links: '{rank_file}'; it stays in {spool.folder}.\n"
    )
    assert os.path.islink(rank_file) and victim.read_text() == "m\tloss\t1.0\t0\t0\n"


# -- the lock ----------------------------------------------------------------------------------------


def test_a_held_spool_cannot_be_claimed_and_a_released_one_can(state: str) -> None:
    spool = Spool.create("0002-cccccccc", {"tracking_uri": "sqlite:////nowhere.db"})
    assert Spool.folders() == [spool.folder]
    assert Spool.claim(spool.folder) is None  # its kernel is alive
    spool.release()
    claimed = Spool.claim(spool.folder)
    assert claimed is not None and claimed.journal["launch_id"] == "0002-cccccccc"
    assert Spool.claim(spool.folder) is None  # one recoverer at a time
    claimed.remove()
    assert Spool.folders() == []


# -- recovery into a real store ---------------------------------------------------------------------


def test_an_orphan_becomes_a_killed_run_with_every_point(state: str, tmp_path: Any, capsys: Any) -> None:
    from air_magic.tracking import upload_pending

    uri = sqlite_uri(tmp_path)
    Store(uri).client.search_experiments()  # the store exists (the dead kernel had made it)
    orphan(
        uri,
        {
            0: metric_lines("loss", 300, 0) + [f"p\tlr\t{text_field('0.1')}"],
            1: metric_lines("loss", 250, 1) + [f"t\tnote\t{text_field(NASTY[6])}"],
        },
    )
    capsys.readouterr()
    results = upload_pending()
    assert [(r.outcome, r.points, r.status) for r in results] == [("sent", 550, "KILLED")]
    run_id = results[0].run_id
    assert capsys.readouterr().err == (  # (a journal of an older air_magic: no origin in it)
        f"[air_magic] recovered what earlier launches left on disk: MLflow run {run_id} "
        f"(550 points sent, marked KILLED) in MLflow store {uri}.\n"
    )
    store = Store(uri)
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert store.experiment_name(run_id) == "orphans"
    assert run.data.tags["air_magic.launch_id"] == "0001-deadbeef"
    assert run.data.params == {"air_magic.num_accelerators": "2", "lr": "0.1"}
    assert run.data.tags["note"] == NASTY[6]
    # Rank 0's curve under "loss", rank 1's under "rank1/loss", as a live kernel names them.
    assert store.by_rank(run_id, "loss", 2) == {
        rank: [(step, rank + step / 1000) for step in range(count)] for rank, count in ((0, 300), (1, 250))
    }
    assert Spool.folders() == []
    upload_pending()
    assert capsys.readouterr().err == "[air_magic] nothing is waiting to be sent to MLflow.\n"


def param_line(key: str, value: str) -> str:
    return f"p\t{text_field(key)}\t{text_field(value)}"


def tag_line(key: str, value: str) -> str:
    return f"t\t{text_field(key)}\t{text_field(value)}"


def test_the_names_of_several_ranks_items() -> None:
    from air_magic.tracking.upload import metric_name, place

    assert [metric_name(rank, "loss") for rank in range(3)] == ["loss", "rank1/loss", "rank2/loss"]
    # A key already named for the rank that logs it is kept; one named for another rank is not.
    assert metric_name(2, "rank2/loss") == "rank2/loss"
    assert metric_name(1, "rank0/loss") == "rank1/rank0/loss"
    assert metric_name(1, "rank10/loss") == "rank1/rank10/loss"
    assert metric_name(0, "rank1/loss") == "rank1/loss"  # rank 0's keys stay as written
    params: dict[str, tuple[int, str]] = {}
    sent = [
        place(params, False, rank, key, value)
        for rank, key, value in [
            (1, "seed", "1001"),  # first sent: rank 1 holds "seed"
            (0, "seed", "1000"),  # another value: kept as rank0/seed
            (2, "seed", "1001"),  # the value stored: nothing to send
            (0, "seed", "1000"),  # rank 0's again: nothing to send
            (0, "seed", "7"),  # rank 0 changes its own: sent to its name, for the store to refuse
            (1, "seed", "9"),  # rank 1 changes its own: sent under "seed", for the store to refuse
        ]
    ]
    assert sent == ["seed", "rank0/seed", None, None, "rank0/seed", "seed"]
    assert params == {"seed": (1, "1001"), "rank0/seed": (0, "1000")}
    tags: dict[str, tuple[int, str]] = {}
    sent = [
        place(tags, True, rank, key, value)
        for rank, key, value in [
            (0, "phase", "train"),
            (1, "phase", "train"),  # a copy
            (0, "phase", "eval"),  # rank 0 changes its tag: MLflow overwrites it
            (1, "phase", "done"),  # another value: rank 1's own from now on
            (1, "phase", "eval"),  # ... even when it matches rank 0's
        ]
    ]
    assert sent == ["phase", None, "phase", "rank1/phase", "rank1/phase"]
    assert tags == {"phase": (0, "eval"), "rank1/phase": (1, "eval")}


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_keeps_its_own_name_and_rank_0s_curve_is_alone_under_the_key(
    state: str, tmp_path: Any, ranks: int
) -> None:
    from air_magic.tracking.recovery import recover_pending

    store = Store(sqlite_uri(tmp_path))
    store.client.search_experiments()
    lines = {
        rank: [param_line("batch_size", "32"), param_line("seed", str(1000 + rank))]
        + [tag_line("host", "node-a"), tag_line("role", "leader" if rank == 0 else "worker")]
        + metric_lines("loss", 30, rank)
        + [f"m\trank{rank}/grad_norm\t{rank}.5\t0\t1700000000000"]  # named for its rank already
        for rank in range(ranks)
    }
    orphan(store.uri, lines)
    [result] = recover_pending()
    assert (result.outcome, result.points) == ("sent", 31 * ranks)
    run_id = result.run_id
    assert run_id is not None
    assert [(m.step, m.value) for m in store.history(run_id, "loss")] == [(step, step / 1000) for step in range(30)]
    for rank in range(1, ranks):
        assert [(m.step, m.value) for m in store.history(run_id, f"rank{rank}/loss")] == [
            (step, rank + step / 1000) for step in range(30)
        ]
    metrics = set(store.run(run_id).data.metrics)
    assert metrics == {"loss"} | {f"rank{r}/loss" for r in range(1, ranks)} | {
        f"rank{r}/grad_norm" for r in range(ranks)
    }
    run = store.run(run_id)
    # The same value from every rank is one param; another value is kept under the rank's name.
    assert run.data.params == {
        "air_magic.num_accelerators": str(ranks),
        "batch_size": "32",
        "seed": "1000",
        **{f"rank{r}/seed": str(1000 + r) for r in range(1, ranks)},
    }
    assert run.data.tags["host"] == "node-a" and "rank1/host" not in run.data.tags
    assert run.data.tags["role"] == "leader"
    assert {r: run.data.tags.get(f"rank{r}/role") for r in range(1, ranks)} == dict.fromkeys(range(1, ranks), "worker")
    assert result.skipped is None


def test_recovery_names_params_as_the_dead_kernel_did(state: str, tmp_path: Any) -> None:
    from air_magic.tracking.recovery import recover_pending

    store = Store(sqlite_uri(tmp_path))
    client = store.client
    run_id = client.create_run(client.create_experiment("named")).info.run_id
    client.log_param(run_id, "seed", "7")  # sent by the dead kernel, from rank 1's line
    lines = {0: [param_line("seed", "5"), param_line("lr", "0.1")], 1: [param_line("seed", "7")]}
    sent = {"0": 0, "1": len(lines[1][0]) + 1}
    names = {"p": {"seed": [1, "7"]}, "t": {}}
    orphan(store.uri, lines, run_id=run_id, params_logged=True, sent=sent, names=names)
    [result] = recover_pending()
    assert (result.outcome, result.skipped) == ("sent", None)
    assert store.run(run_id).data.params == {"seed": "7", "rank0/seed": "5", "lr": "0.1"}


def test_a_rank_that_changes_its_own_param_is_refused_as_in_mlflow(state: str, tmp_path: Any) -> None:
    from air_magic.tracking.recovery import recover_pending

    store = Store(sqlite_uri(tmp_path))
    store.client.search_experiments()
    lines = {0: [param_line("lr", "0.1"), param_line("lr", "0.1"), param_line("lr", "0.2")]}
    lines[1] = [param_line("lr", "0.3"), param_line("lr", "0.4"), tag_line("phase", "a"), tag_line("phase", "b")]
    orphan(store.uri, lines)
    [result] = recover_pending()
    assert result.outcome == "sent"
    assert result.skipped is not None
    assert result.skipped.startswith("param 'lr' (") and "param 'rank1/lr' (" in result.skipped
    run = store.run(result.run_id)
    assert {k: v for k, v in run.data.params.items() if "lr" in k} == {"lr": "0.1", "rank1/lr": "0.3"}
    assert run.data.tags["phase"] == "b"  # a tag its rank may change, as in MLflow


def test_recovery_sends_only_what_was_not_sent_and_keeps_the_launchs_status(state: str, tmp_path: Any) -> None:
    from air_magic.tracking.recovery import recover_pending

    store = Store(sqlite_uri(tmp_path))
    client = store.client
    experiment_id = client.create_experiment("half-sent")
    run_id = client.create_run(experiment_id).info.run_id
    lines = metric_lines("loss", 100)
    sent = sum(len(line) + 1 for line in lines[:60])
    orphan(store.uri, {0: lines}, run_id=run_id, params_logged=True, sent={"0": sent}, status="FINISHED")
    [result] = recover_pending()
    assert (result.outcome, result.run_id, result.points, result.status) == ("sent", run_id, 40, "FINISHED")
    assert [m.step for m in store.history(run_id, "loss")] == list(range(60, 100))
    assert store.run(run_id).info.status == "FINISHED"


def test_an_orphan_whose_local_store_is_gone_is_dropped_and_said_so(state: str, tmp_path: Any, capsys: Any) -> None:
    from air_magic.tracking import upload_pending

    (tmp_path / "deleted").mkdir()  # the store's folder is there, its file was deleted
    uri = sqlite_uri(tmp_path / "deleted")
    orphan(uri, {0: metric_lines("loss", 12)})
    capsys.readouterr()
    [result] = upload_pending()
    assert result.outcome == "dropped"
    path = os.path.join(str(tmp_path / "deleted"), "mlflow.db")
    assert capsys.readouterr().err == (
        f"[air_magic] dropped 12 points of launch 0001-deadbeef: its store {path} no longer exists.\n"
    )
    assert not os.path.exists(path) and Spool.folders() == []


def test_an_orphan_whose_store_s_folder_is_gone_is_kept_said_once_and_never_tried_again(
    state: str, tmp_path: Any, capsys: Any
) -> None:
    from air_magic.tracking import upload_pending
    from air_magic.tracking.recovery import recover_pending

    uri = sqlite_uri(tmp_path / "a-test-run-s-folder")  # deleted with the folder (never made here)
    orphan(uri, {0: metric_lines("loss", 12)})
    capsys.readouterr()
    [result] = upload_pending()
    kept = os.path.join(state, "unsent", "0001-deadbeef")
    assert (result.outcome, result.points, result.kept_at) == ("kept", 12, kept)
    assert capsys.readouterr().err == (
        f"[air_magic] launch 0001-deadbeef left 12 points for MLflow store {uri}, "
        f"and the folder of its store, {tmp_path / 'a-test-run-s-folder'}, no longer exists: they are kept in {kept} and "
        "not tried again.\n"
    )
    assert os.path.isdir(kept) and Spool.folders() == []
    assert recover_pending() == []  # every later kernel: nothing to try, nothing said


def test_one_refused_point_in_a_thousand_costs_only_itself(state: str, tmp_path: Any) -> None:
    from air_magic.tracking.recovery import recover_pending

    store = Store(sqlite_uri(tmp_path))
    store.client.search_experiments()
    lines = metric_lines("loss", 1500)
    lines[1200] = "m\tloss\t1.0\t1180591620717411303424\t1700000000000"  # step 2**70: no sqlite INTEGER
    orphan(store.uri, {0: lines})
    [result] = recover_pending()
    assert (result.outcome, result.points) == ("sent", 1499)
    assert result.skipped == "1 point of metric 'loss' (Python int too large to convert to SQLite INTEGER)"
    run = store.run(result.run_id)
    assert run.data.tags["air_magic.skipped"] == result.skipped
    assert len(store.history(result.run_id, "loss")) == 1499


def test_recover_in_background_sends_orphans_without_waiting(state: str, tmp_path: Any) -> None:
    from air_magic.tracking import recover_in_background
    from air_magic.tracking import recovery as _tracking_recovery

    store = Store(sqlite_uri(tmp_path))
    store.client.search_experiments()
    orphan(store.uri, {0: metric_lines("loss", 20)})
    started = time.perf_counter()
    recover_in_background()
    assert time.perf_counter() - started < 0.1
    assert _tracking_recovery._thread is not None
    _tracking_recovery._thread.join(60)
    [run] = store.runs()
    assert run.info.status == "KILLED" and len(store.history(run.info.run_id, "loss")) == 20


class _Shell:
    def register_magics(self, *magics: Any) -> None:
        pass


def test_load_ext_alone_recovers_what_a_dead_kernel_left(
    state: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import air_magic

    monkeypatch.setenv("AIR_MAGIC_WARM", "0")
    store = Store(sqlite_uri(tmp_path))
    store.client.search_experiments()
    orphan(store.uri, {0: metric_lines("loss", 20)})
    air_magic.load_ipython_extension(_Shell())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        runs = store.runs()
        if runs and runs[0].info.status == "KILLED":
            break
        time.sleep(0.2)
    assert [r.info.status for r in store.runs()] == ["KILLED"]
