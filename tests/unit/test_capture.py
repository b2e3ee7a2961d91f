"""Which names a cell sends to the ranks, and what cannot be sent."""

from __future__ import annotations

import ast
import threading

import pytest

from air_magic import CaptureError
from air_magic.capture import CaptureWarning, cell_payload, free_names, function_payload, settings


def names(source: str) -> set[str]:
    return free_names(ast.parse(source))


def test_free_names_in_execution_order() -> None:
    assert names("y = x + 1\nprint(y)") == {"x", "print"}
    assert names("x = 1\nx") == set()
    assert names("x += 1") == {"x"}
    assert names("import torch\ntorch.ones(1)") == set()
    assert names("for i in data:\n    total = i") == {"data"}
    assert names("def f():\n    return helper(z)\nf()") == {"helper", "z"}
    assert names("def f():\n    return later\nlater = 1") == set()
    assert names("[a * k for a in items]") == {"items", "k"}
    assert names("class A(Base):\n    size = n\n    def m(self):\n        return q") == {"Base", "n", "q"}
    assert names("try:\n    pass\nexcept Err as e:\n    e") == {"Err"}
    assert names("with open(p) as fh:\n    fh.read()") == {"open", "p"}
    assert names("lam = lambda v: v + w") == {"w"}
    assert names("if (n := compute()):\n    n") == {"compute"}


def test_cell_sends_only_what_it_reads() -> None:
    namespace = {"used": 1, "unused": threading.Lock(), "lock": threading.Lock()}
    payload = cell_payload("lock = 2\nlock + used", namespace, display="Cell In[1]", filename="<c1>")
    assert sorted(payload.data["names"]) == ["used"]


def test_every_unpicklable_name_is_reported() -> None:
    namespace = {"conn": threading.Lock(), "other": threading.RLock(), "fine": 3}
    with pytest.raises(CaptureError) as info:
        cell_payload("conn, other, fine", namespace, display="Cell In[2]", filename="<c2>")
    message = str(info.value)
    assert message.startswith("cannot send 'conn', 'other' to the ranks: they cannot be pickled.")
    assert "  - conn (_thread.lock): TypeError: cannot pickle '_thread.lock' object" in message
    assert "  - other (_thread.RLock)" in message
    assert message.endswith("Create them inside the cell instead (load data, open files and connections on each rank).")
    assert [p[0] for p in info.value.problems] == ["conn", "other"]


def test_function_globals_and_arguments_are_named() -> None:
    lock = threading.Lock()

    def train(arg: object) -> object:
        return lock, arg

    with pytest.raises(CaptureError) as info:
        function_payload(train, (threading.Lock(),), {})
    message = str(info.value)
    assert "'lock'" in message and "'argument 0'" in message
    assert "Create them inside 'test_function_globals_and_arguments_are_named.<locals>.train'" in message


def test_large_capture_warns_with_name_and_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings, "warn_mb", 1.0)
    with pytest.warns(CaptureWarning, match="'dataset' is 3 MB once pickled and is sent to every rank"):
        cell_payload("len(dataset)", {"dataset": b"x" * 3_000_000}, display="Cell In[3]", filename="<c3>")


def test_syntax_error_before_launch() -> None:
    with pytest.raises(SyntaxError) as info:
        cell_payload("x = = 1", {}, display="Cell In[4]", filename="<c4>")
    assert info.value.lineno == 2  # the line in the notebook cell, under the %%distributed header


def test_import_air_magic_is_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, air_magic; heavy = [m for m in ('torch', 'mlflow', 'IPython', 'ipywidgets') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
