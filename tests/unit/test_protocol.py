"""The kernel <-> helper <-> rank protocol (air_magic.protocol): messages, requests, lines, tails."""

from __future__ import annotations

import ast
import os
import pickle
import sys
from typing import Any

import pytest

from air_magic import protocol as p


def _request() -> p.LaunchRequest:
    return p.LaunchRequest(
        launch_id="0001-abc",
        world_size=2,
        env={"A": "1"},
        cwd="/tmp",
        sys_path=["/tmp"],
        payload_path="/w/payload.pkl",
        work_dir="/w",
        shm_dir=None,
        log_paths=["/w/logs/rank-0.log", "/w/logs/rank-1.log"],
        timeout=None,
        sources={},
        argv=None,
        umask=0o22,
        rlimits={},
    )


@pytest.mark.parametrize(
    "message, wire",
    [
        (p.Exited("L", 1, 3, 5.0), ("exit", "L", 1, 3, 5.0)),
        (p.Started("L", {0: 10}), ("started", "L", {0: 10})),
        (p.Stopping("L", "failure", 1.0), ("stopping", "L", "failure", 1.0)),
        (p.Done("L"), ("done", "L")),
        (p.StartFailed("L", "tb"), ("error", "L", "tb")),
        (p.Ready(), ("ready",)),
        (p.Stop("L", "cancel"), ("stop", "L", "cancel")),
        (p.Shutdown(), ("shutdown",)),
    ],
)
def test_messages_travel_as_the_tuples_they_always_were(message: Any, wire: tuple[Any, ...]) -> None:
    assert p.encode(message) == wire
    assert p.decode(wire) == message


def test_a_launch_request_survives_pickling_inside_its_message() -> None:
    wire = pickle.loads(pickle.dumps(p.encode(p.StartLaunch(_request()))))
    assert p.decode(wire) == p.StartLaunch(_request())


def test_unknown_or_malformed_messages_are_a_value_error() -> None:
    for wire in [("nonsense", 1), (), ("exit",), ("done", "L", "extra")]:
        with pytest.raises(ValueError):
            p.decode(wire)


def test_paths_and_spool_names() -> None:
    assert p.result_path("/w", 3) == "/w/result-3.pkl"
    assert p.stack_path("/w", 3) == "/w/stack-3.txt"
    assert p.joined_path("/w", 3) == "/w/joined-3"
    assert p.left_path("/w", 3) == "/w/left-3"
    assert p.log_path(p.log_dir("/w"), 0) == "/w/logs/rank-0.log"
    assert p.spool_file("/s", 2) == "/s/tracking-2.tsv"
    assert [p.spool_file_rank(n) for n in ("tracking-2.tsv", "tracking-x.tsv", "run")] == [2, None, None]


def test_spool_lines_round_trip() -> None:
    line = p.metric_line(p.text_field("loss"), 0.5, 3, 1700000000000.7)
    assert line == "m\tloss\t0.5\t3\t1700000000000\n"
    assert p.parse_line(line[:-1].encode()) == ("m", "loss", 0.5, 3, 1700000000000)
    odd = "a\tb\nc"
    assert p.parse_line(p.text_line(p.TAG, odd, odd)[:-1].encode()) == ("t", odd, odd)
    assert p.parse_line(p.text_line(p.ARTIFACT, "/x/f", "")[:-1].encode()) == ("a", "/x/f", None)


def test_tail_reader_reads_whole_new_lines(tmp_path: Any) -> None:
    path = str(tmp_path / "log")
    reader = p.TailReader(path)
    assert reader.read() == b""  # not there yet
    with open(path, "ab") as f:
        f.write(b"one\ntw")
    assert reader.read() == b"one\n"
    assert reader.read() == b""
    with open(path, "ab") as f:
        f.write(b"o\rthree")
    assert reader.read(ends=(b"\n", b"\r")) == b"tw" + b"o\r"
    assert reader.read(final=True) == b"three"
    assert reader.offset == os.path.getsize(path)


def test_tail_reader_lines_and_catching_up(tmp_path: Any) -> None:
    path = str(tmp_path / "spool")
    with open(path, "wb") as f:
        f.write(b"x" * 100 + b"\nb\nc")
    reader = p.TailReader(path)
    assert reader.read_lines(10) == [b"x" * 100, b"b"]  # a line longer than the limit is read whole
    assert reader.offset == 103
    behind = p.TailReader(path)
    with open(path, "ab") as f:
        f.write(b"\nd\n")
    assert behind.read_recent(6) == b"c\nd\n"  # the backlog skipped, from a line start


def test_the_protocol_imports_only_the_standard_library() -> None:
    folder = os.path.dirname(p.__file__)
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        names = {
            alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree)), name
        # of air_magic, only protocol/'s own modules
        names |= {m.split(".")[0] for m in modules if not m.startswith("air_magic.protocol")}
        assert names <= set(sys.stdlib_module_names) | {"__future__"}, (name, names)
