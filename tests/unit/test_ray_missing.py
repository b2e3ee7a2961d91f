"""Without Ray installed, ``backend="ray"`` says how to install it, at decoration."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# `sys.modules["ray"] = None` is how Python marks a module as not importable.
_PROGRAM = """
import sys
sys.modules["ray"] = None
from air_magic import distributed
from air_magic.errors import ConfigurationError
try:
    distributed(num_accelerators=2, backend="ray")
except ConfigurationError as exc:
    print(exc)
else:
    print("no error")
"""


def test_backend_ray_without_ray_says_how_to_install_it() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "backend='ray' needs Ray, which is not installed in the environment this kernel runs in: "
        "pip install 'ray[default]>=2.40' (and the same on every node of the cluster)."
    )


def test_the_local_backend_never_imports_ray() -> None:
    program = (
        "import sys\nfrom air_magic import distributed\ndistributed(num_accelerators=2)\n"
        "import air_magic.kernel.launcher\nprint('ray' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
