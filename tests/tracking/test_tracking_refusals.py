"""What the store refuses costs only itself: launches from this process into a sqlite store
whose ranks log one item MLflow cannot keep among many it can, and text of every kind."""

from __future__ import annotations

import os
import sys
from typing import Any

import cloudpickle
import pytest
from tracking_support import Store, one_run_id

from air_magic import distributed

pytestmark = pytest.mark.process

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Text that a line-based format tends to cut or change.
NASTY = {
    "tab": "a\tb",
    "newline": "a\nb",
    "carriage": "a\rb",
    "formfeed": "a\x0cb",
    "separators": "a\x1cb\x1dc\x1ed\x85e",
    "unicode_line": "a\u2028b\u2029c",
    "quote": '"quoted" \\ backslash',
    "accents": "é 漢字",
}


@distributed(num_accelerators=2)
def log_one_bad_step_and_one_bad_artifact_path() -> int:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(100):
        mlflow.log_metric("loss", rank + step / 100, step=step)
    if rank == 0:
        mlflow.log_metric("far", 1.0, step=2**70)  # no sqlite INTEGER holds it
        with open("notes.txt", "w") as handle:
            handle.write("notes\n")
        mlflow.log_artifact("notes.txt", "../outside")  # MLflow refuses the path
        mlflow.log_artifact("notes.txt", "kept")
    for step in range(100, 150):
        mlflow.log_metric("loss", rank + step / 100, step=step)
    return rank


def test_a_refused_point_and_artifact_are_skipped_by_name_and_the_rest_is_stored(store: Store, capsys: Any) -> None:
    assert log_one_bad_step_and_one_bad_artifact_path.distributed() == [0, 1]
    captured = capsys.readouterr()
    run_id = one_run_id(captured)
    run = store.run(run_id)
    assert run.info.status == "FINISHED"
    assert store.by_rank(run_id, "loss", 2) == {
        rank: [(step, rank + step / 100) for step in range(150)] for rank in (0, 1)
    }
    assert store.artifacts(run_id, "kept") == ["kept/notes.txt"]
    assert store.artifacts(run_id, "logs") == ["logs/rank-0.log", "logs/rank-1.log"]
    skipped = (
        "1 point of metric 'far' (Python int too large to convert to SQLite INTEGER), "
        "artifact 'notes.txt' to '../outside' (Invalid artifact path: '../outside'. Names may be treated as "
        "files in certain cases, and must not resolve to other names when treated as such. This name would "
        "resolve to '../outside')"
    )
    assert run.data.tags["air_magic.skipped"] == skipped
    assert [line for line in captured.err.splitlines() if "reached MLflow" in line] == [
        f"[air_magic] not everything the ranks logged reached MLflow run {run_id}: skipped what the store "
        f"refused: {skipped}. Everything else was stored."
    ]


@distributed(num_accelerators=2)
def log_text_of_every_kind(values: dict[str, str]) -> None:
    import os

    import mlflow

    if os.environ["RANK"] == "0":
        mlflow.log_params(values)
        for key, value in values.items():
            mlflow.set_tag(f"tag.{key}", value)


def test_params_and_tags_keep_every_character(store: Store, capsys: Any) -> None:
    log_text_of_every_kind.distributed(NASTY)
    captured = capsys.readouterr()
    run = store.run(one_run_id(captured))
    assert {k: v for k, v in run.data.params.items() if k in NASTY} == NASTY
    assert {k[len("tag.") :]: v for k, v in run.data.tags.items() if k.startswith("tag.")} == NASTY
    assert "reached MLflow" not in captured.err


@distributed(num_accelerators=2)
def log_a_few() -> int:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(10):
        mlflow.log_metric("loss", rank + step / 10, step=step)
    return rank


def test_a_state_folder_others_can_read_is_refused_and_tracking_still_works(
    store: Store, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    state = tmp_path / "shared-state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    monkeypatch.setenv("AIR_MAGIC_STATE_DIR", str(state))
    assert log_a_few.distributed() == [0, 1]
    captured = capsys.readouterr()
    run_id = one_run_id(captured)
    assert [line for line in captured.err.splitlines() if "for MLflow points" in line] == [
        f"[air_magic] cannot use {state} for MLflow points: others may read or write it (mode 0o755); "
        "chmod 700 it. Set AIR_MAGIC_STATE_DIR to a folder only you can use; until then this launch's points "
        "are kept in the kernel's session folder and are lost if the kernel dies."
    ]
    assert store.run(run_id).info.status == "FINISHED"
    assert len(store.all_ranks(run_id, "loss", 2)) == 20
    assert os.listdir(state) == []
