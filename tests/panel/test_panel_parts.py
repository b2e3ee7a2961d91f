"""The panel's modules on their own: formatting, the linter's text, the ipykernel workarounds."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from air_magic.lint.diagnostics import Diagnostic
from air_magic.lint.rules import Applicability
from air_magic.panel import _format, _ipykernel, _lint


def test_formatting() -> None:
    assert _format._fmt_bytes(None) == "?"
    assert _format._fmt_bytes(999) == "999 B"
    assert _format._fmt_bytes(12_345_678_901) == "12.3 GB"
    assert _format._fmt_elapsed(12.34) == "12.3 s"
    assert _format._fmt_clock(3723.9) == "1:02:03"
    assert _format._fmt_clock(62) == "1:02"
    assert _format._fmt_value(float("nan")) == "nan"
    assert _format._clip("x" * 200, 10) == "x" * 9 + "…"
    assert _format._esc('<a href="x">') == "&lt;a href=&quot;x&quot;&gt;"
    progress = {"desc": "train", "pct": 45.0, "n": "450", "total": "1000", "rate": "300it/s", "eta": "00:02"}
    assert _format._progress_text(progress, None) == "train · 45% 450/1000 · 300it/s · eta 00:02"
    assert _format._progress_text(progress, None, running=False) == "train · 45% 450/1000 · 300it/s"
    assert _format._progress_text(None, 7) == "step 7"
    assert [_format._number(t) for t in ("450", "4.50k", "1.2M", "12it", "?")] == [450, 4500, 1.2e6, 12, None]
    assert _format._rate_per_second("299.91it/s") == (299.91, "it")
    assert _format._rate_per_second("3.00kbatch/s") == (3000.0, "batch")
    assert _format._rate_per_second("2.00s/it") == (0.5, "it")
    assert _format._rate_per_second("?it/s") is None
    assert [_format._fmt_rate(v, "it") for v in (0.5, 42.0, 600.0, 1234.0)] == [
        "0.5 it/s",
        "42 it/s",
        "600 it/s",
        "1.2k it/s",
    ]
    assert _format._metrics_text({"a": (1, 0.5), "b": (1, 2.0)}, 1) == "b=2"


def test_a_diagnostic_as_a_finding() -> None:
    found = Diagnostic("AM101", "use air_magic", "<cell>", None, 2, 0, Applicability.SAFE)
    assert _lint._diagnostic_text(found) == "AM101 line 2: use air_magic"


def test_a_finding_keeps_its_hint_and_what_fixes_it() -> None:
    from air_magic.lint.diagnostics import Edit, Fix

    edit = (Edit(0, 1, ""),)
    safe = Diagnostic(
        "AM101",
        "use air_magic",
        "<cell>",
        None,
        2,
        0,
        Applicability.SAFE,
        "Import it",
        fix=Fix(Applicability.SAFE, edit),
    )
    unsafe = Diagnostic(
        "AM305", "x", "<cell>", None, 2, 0, Applicability.UNSAFE, "Remove it", fix=Fix(Applicability.UNSAFE, edit)
    )
    advice = Diagnostic("AM305", "x", "<cell>", None, 2, 0, Applicability.DISPLAY_ONLY, "Remove it")
    no_fix = Diagnostic("AM305", "x", "<cell>", None, 2, 0, Applicability.UNSAFE, "Remove it")  # fix=None
    assert [(_lint._finding(d).fix, _lint._finding(d).hint) for d in (safe, unsafe, advice, no_fix)] == [
        ("safe", "Import it"),
        ("unsafe", "Remove it"),
        ("", "Remove it"),
        ("", "Remove it"),
    ]


def test_subshells_are_read_from_the_kernels_manager() -> None:
    def shell(subshells: Any) -> Any:
        manager = SimpleNamespace(list_subshell=lambda: subshells)
        return SimpleNamespace(kernel=SimpleNamespace(shell_channel_thread=SimpleNamespace(manager=manager)))

    assert _ipykernel.subshells_active(shell(["a"])) is True
    assert _ipykernel.subshells_active(shell([])) is False
    assert _ipykernel.subshells_active(None) is False
    broken = SimpleNamespace(list_subshell=lambda: 1 / 0)
    kernel = SimpleNamespace(shell_channel_thread=SimpleNamespace(manager=broken))
    assert _ipykernel.subshells_active(SimpleNamespace(kernel=kernel)) is False


def test_clicks_stay_on_the_subshell_they_came_on() -> None:
    comm = SimpleNamespace(_reply_subshell_for=lambda data, default: "main")
    _ipykernel.clicks_where_sent(SimpleNamespace(comm=comm))
    assert comm._reply_subshell_for({}, "subshell-1") == "subshell-1"
    _ipykernel.clicks_where_sent(SimpleNamespace(comm=None))  # no comm: nothing to do


def test_a_threads_iopub_socket_is_closed_as_it_ends() -> None:
    closed: list[bool] = []
    local = threading.local()
    local.event_pipe = SimpleNamespace(close=lambda: closed.append(True))
    pipes = {threading.current_thread(): local.event_pipe}
    pub = SimpleNamespace(_local=local, _event_pipes=pipes, _event_pipe_gc_lock=threading.Lock(), _events=[])
    _ipykernel.release_iopub(SimpleNamespace(kernel=SimpleNamespace(iopub_thread=pub)))
    assert closed == [True] and pipes == {} and not hasattr(local, "event_pipe")
    _ipykernel.release_iopub(None)  # not a kernel: nothing to do
