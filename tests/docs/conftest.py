"""The documentation site, built once per session as ``scripts/build_docs.sh`` builds it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built HTML site (warnings are errors, every reference checked): its folder."""
    out = tmp_path_factory.mktemp("docs")
    command = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-n", "-q", "-b", "html"]
    done = subprocess.run(
        [*command, "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"the docs build failed:\n{done.stdout}\n{done.stderr}"
    return out / "html"
