"""What moves between rooms must not break: the files a rank names by path."""

from __future__ import annotations

import os

import air_magic
from air_magic.rank.inspect import debugger
from air_magic.rank.pool.interrupts import safe_point

PACKAGE = os.path.dirname(os.path.abspath(air_magic.__file__)) + os.sep


def test_the_debugger_skips_every_frame_of_air_magic_s_own_files() -> None:
    assert debugger._PACKAGE == PACKAGE


def test_the_interrupt_knows_the_debugger_s_file_where_it_is() -> None:
    ours = [f for f in safe_point._debugger_files() if f.startswith(PACKAGE)]
    assert ours == [os.path.abspath(debugger.__file__)]


def test_where_each_rank_was_skips_air_magic_s_own_frames_wherever_the_stacks_module_lives() -> None:
    from air_magic.kernel.inspect import stacks

    assert stacks._PACKAGE_ROOT == PACKAGE
    assert not stacks._is_user_frame(os.path.join(PACKAGE, "rank", "pool", "serve.py"))
    assert stacks._is_user_frame("/home/someone/train.py")


def test_a_rank_s_error_leaves_out_air_magic_s_own_frames() -> None:
    from air_magic.rank import main

    assert main._PACKAGE_ROOT == PACKAGE
