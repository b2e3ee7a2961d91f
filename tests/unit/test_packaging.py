"""What the package carries to an index: the license named in pyproject.toml, as a file in
the wheel, and a description page whose links work there (no link relative to the repo)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_the_license_is_a_file_of_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_description_on_an_index_has_no_link_into_the_repository() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    page = (ROOT / project["readme"]).read_text()
    links = re.findall(r"\]\(([^)]+)\)", page) + re.findall(r'(?:src|href)="([^"]+)"', page)
    assert [link for link in links if not re.match(r"https?://", link)] == []
    assert "%load_ext air_magic" in page and "@distributed" in page
