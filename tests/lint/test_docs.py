"""The migration guide's rule table (docs/guides/migrate.md) lists every rule with its fix level."""

from __future__ import annotations

import re
from pathlib import Path

from air_magic.lint import RULES

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "migrate.md"


def _table() -> dict[str, list[str]]:
    section = GUIDE.read_text()
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| (AM\d{3}) \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split(" | ")]
    return rows


def test_every_rule_is_in_the_guide_s_table_with_its_fix_level() -> None:
    rows = _table()
    assert list(rows) == [r.code for r in RULES]
    for r in RULES:
        what, fix, example = rows[r.code]
        assert fix == str(r.fix), r.code
        assert "→" in example, r.code


def test_the_guide_shows_the_cli_and_the_magic() -> None:
    text = GUIDE.read_text()
    for usage in ("air-magic lint --fix", "air-magic lint --diff", "--format json", "%air_lint --history"):
        assert usage in text
