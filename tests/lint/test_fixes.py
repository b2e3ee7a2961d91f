"""Applying fixes: byte edits, no overlaps, a fixpoint, and an error when it never settles."""

from __future__ import annotations

import pytest

from air_magic.lint import Applicability, ConvergenceError, Diagnostic, Edit, Fix, fix_source, lint_source
from air_magic.lint.fixes import MAX_PASSES, apply_fixes, fix_until_stable


def fix(*edits: tuple[int, int, str]) -> Fix:
    return Fix(Applicability.SAFE, tuple(Edit(*e) for e in edits))


def test_edits_apply_from_the_end_and_overlaps_wait_for_the_next_pass() -> None:
    text, applied = apply_fixes("abcdef", [fix((0, 1, "A")), fix((0, 2, "XX")), fix((4, 4, "-")), fix((5, 6, "F"))])
    assert (text, applied) == ("Abcd-eF", [0, 2, 3])


def test_an_identical_edit_in_two_fixes_is_made_once() -> None:
    shared = (0, 0, "import x\n")
    text, applied = apply_fixes("a\nb\n", [fix(shared, (0, 1, "A")), fix(shared, (2, 3, "B"))])
    assert (text, applied) == ("import x\nA\nB\n", [0, 1])


def test_two_different_insertions_at_one_place_are_not_both_made() -> None:
    text, applied = apply_fixes("ab", [fix((1, 1, "x")), fix((1, 1, "y"))])
    assert (text, applied) == ("axb", [0])


def test_offsets_are_utf8_bytes() -> None:
    source = 'note = "größe"\nfrom serverless_gpu import distributed\n@distributed(gpus=2)\ndef f(): ...\n'
    assert fix_source(source) == (
        'note = "größe"\nfrom air_magic import distributed\n@distributed(num_accelerators=2)\ndef f(): ...\n'
    )


def test_windows_line_endings_are_kept() -> None:
    source = (
        "import serverless_gpu\r\nfrom pyspark.ml.torch.distributor import TorchDistributor\r\n\r\n"
        "def train():\r\n    return 1\r\n\r\nTorchDistributor(num_processes=2).run(train)\r\n"
    )
    fixed = fix_source(source)
    assert (
        fixed == "from air_magic import distributed\r\n\r\ndef train():\r\n    return 1\r\n\r\n"
        "distributed(num_accelerators=2)(train).distributed()\r\n"
    )


def test_unrelated_lines_keep_their_exact_text() -> None:
    source = (
        "from serverless_gpu import distributed  #   odd   spacing   kept\n"
        "x  =  [1,\n"
        "      2 ]   # aligned\n"
        "@distributed( gpus = 8 ,\n"
        "              timeout = None )\n"
        "def f( a ,b ):\n"
        "\treturn  a+b\n"
    )
    assert fix_source(source) == (
        "from air_magic import distributed  #   odd   spacing   kept\n"
        "x  =  [1,\n"
        "      2 ]   # aligned\n"
        "@distributed( num_accelerators = 8 ,\n"
        "              timeout = None )\n"
        "def f( a ,b ):\n"
        "\treturn  a+b\n"
    )


def test_fixes_that_never_settle_raise_and_name_the_codes() -> None:
    def flip(source: str) -> list[Diagnostic]:
        new = "b" if source == "a" else "a"
        return [Diagnostic("AM201", "m", "p", None, 1, 1, Applicability.SAFE, fix=fix((0, 1, new)))]

    with pytest.raises(ConvergenceError) as info:
        fix_until_stable("a", flip, path="flip.py")
    assert str(info.value) == (
        f"flip.py: fixes did not settle after {MAX_PASSES} passes (still changing: AM201); nothing was "
        "written. Please report this with the file."
    )


def test_unsafe_fixes_wait_for_the_flag() -> None:
    source = 'import os\nos.environ["MASTER_PORT"] = "29500"\n'
    assert fix_source(source) == source
    assert fix_source(source, unsafe=True) == "import os\n"
    assert [d.applicability for d in lint_source(source)] == [Applicability.UNSAFE]
