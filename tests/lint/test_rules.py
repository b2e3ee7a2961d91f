"""Every rule has a fixture: its input, the findings, and the fixed output."""

from __future__ import annotations

from typing import Any

import pytest
from lint_support import FIXTURES, Fixture, read_cells, render

from air_magic.lint import RULES, Applicability
from air_magic.lint.rules import RULES_BY_CODE


def _fixtures() -> list[Fixture]:
    return [Fixture(r.code, FIXTURES / r.fixture) for r in RULES]


@pytest.mark.parametrize("fixture", _fixtures(), ids=lambda f: f.code)
def test_fixture(fixture: Fixture) -> None:
    findings = fixture.lint()
    assert fixture.code in {d.code for d in findings}, f"{fixture.code} is not found in its own fixture"
    assert render(findings) == fixture.expected("findings.txt", render(findings))

    fixed = fixture.fix()
    assert fixed == fixture.expected(f"expected{fixture.suffix}", fixed)
    # Fixing again changes nothing, and the fixed code still parses.
    assert fixture.fix(fixed) == fixed
    if fixture.code != "AM001":  # that fixture is a syntax error on purpose
        if fixture.notebook:
            assert all(d.code != "AM001" for d in fixture.lint(fixed))
        else:
            compile(fixed, f"{fixture.code}/expected.py", "exec")

    rule = RULES_BY_CODE[fixture.code]
    left = [d for d in fixture.lint(fixed) if d.code == fixture.code]
    if rule.fix is Applicability.DISPLAY_ONLY:
        assert left, "a display-only finding stays until fixed by hand"
    else:
        assert not [d for d in left if d.fixable], f"--fix left a fixable {fixture.code} behind"


@pytest.mark.parametrize(
    "fixture", [f for f in _fixtures() if RULES_BY_CODE[f.code].fix is Applicability.UNSAFE], ids=lambda f: f.code
)
def test_unsafe_fixes_need_the_flag(fixture: Fixture) -> None:
    safe_only = fixture.fix(unsafe=False)
    assert fixture.code in {d.code for d in fixture.lint(safe_only)}


def test_every_fixture_folder_belongs_to_a_rule() -> None:
    folders = {p.name for p in FIXTURES.iterdir() if p.is_dir()} - {"seeds"}
    assert folders == {r.fixture for r in RULES}


def test_cells_format_round_trips() -> None:
    assert read_cells("# %%\na = 1\n# %%\n%%time\nb\n") == ["a = 1", "%%time\nb"]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_each_rule_example_is_found_and_fixed_as_shown(rule: Any) -> None:
    from air_magic.lint import fix_source, lint_cell, lint_source
    from air_magic.lint.notebook import fix_cells

    cell = rule.before.startswith("%%")
    found = lint_cell(rule.before) if cell else lint_source(rule.before)
    assert rule.code in {d.code for d in found}
    if rule.fix is Applicability.DISPLAY_ONLY:
        assert rule.code not in {d.code for d in (lint_cell(rule.after) if cell else lint_source(rule.after))}
        return
    fixed = fix_cells([rule.before], unsafe=True).sources[0] if cell else fix_source(rule.before, unsafe=True)
    assert fixed == rule.after
