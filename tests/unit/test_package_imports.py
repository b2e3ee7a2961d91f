"""``import air_magic`` stays light, and every public name and submodule is still reached from it."""

from __future__ import annotations

import json
import subprocess
import sys


def _fresh(code: str) -> object:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_import_air_magic_imports_no_launcher_decorator_torch_or_ipython() -> None:
    loaded = _fresh("import json, sys, air_magic; print(json.dumps(sorted(sys.modules)))")
    for heavy in ("air_magic.decorator", "air_magic.kernel", "air_magic.capture", "torch", "IPython", "mlflow"):
        assert heavy not in loaded, heavy


def test_every_public_name_and_submodule_resolves_after_a_plain_import() -> None:
    names = _fresh(
        "import json, air_magic\n"
        "found = {n: type(getattr(air_magic, n)).__name__ for n in air_magic.__all__}\n"
        "found['tracking.flush'] = type(air_magic.tracking.flush).__name__\n"
        "found['settings'] = type(air_magic.settings).__name__\n"
        "print(json.dumps(found))"
    )
    assert isinstance(names, dict)
    assert names["distributed"] == "function" and names["Pool"] == "type" and names["tracking.flush"] == "function"
    assert names["settings"] == "module"
    import air_magic

    try:
        air_magic.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert str(exc) == "module 'air_magic' has no attribute 'no_such_name'"
    else:
        raise AssertionError("an unknown name resolved")
