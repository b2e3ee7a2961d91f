"""The frameworks guide's Accelerate and Lightning examples, taken from the page and run as it
says (``air-magic run SCRIPT -n 2``, on CPU ranks): each prints what the page says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_run import environment

pytestmark = pytest.mark.process

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "frameworks.md"


def _block(section: str) -> str:
    """The first python block under ``## SECTION`` of the guide."""
    text = GUIDE.read_text()
    part = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", part, re.S)
    assert found is not None, section
    return found.group(1)


@pytest.mark.parametrize(
    ("section", "script", "printed"),
    [
        ("Accelerate", "acc.py", "processes=2 device=cpu:0"),
        ("Lightning", "fit.py", "DDPStrategy world_size=2 steps=8"),
    ],
)
def test_the_guide_s_example_prints_what_the_guide_says(
    tmp_path: Path, section: str, script: str, printed: str
) -> None:
    (tmp_path / script).write_text(_block(section))
    assert f"`air-magic run {script} -n 2` prints `{printed}`" in " ".join(GUIDE.read_text().split())
    done = subprocess.run(
        [sys.executable, "-m", "air_magic.cli", "run", script, "-n", "2", "--no-tracking"],
        cwd=tmp_path,
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert printed in done.stdout.splitlines(), (done.stdout[-2000:], done.stderr[-2000:])
