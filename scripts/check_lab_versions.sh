#!/usr/bin/env bash
# The lab extension's browser tests (tests/lab/test_lab_browser.py) against the oldest
# JupyterLab and Notebook it supports (docs/guides/panel.md, "JupyterLab extension").
#
# A throwaway virtual environment holds that JupyterLab and Notebook and air_magic installed
# from this checkout as a user installs it (`pip install`: the prebuilt assets under
# share/jupyter/labextensions, the server extension switched on); its Jupyter server serves
# the pages (AIR_MAGIC_UI_SERVER_PYTHON), while the notebooks' kernels and the tests run in
# the active environment (the one scripts/setup_env.sh makes, with torch).
#
#   scripts/check_lab_versions.sh [pytest arguments]
#   AIR_MAGIC_LAB_VERSIONS="jupyterlab==4.5.11 notebook==7.5.8" scripts/check_lab_versions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"  # the active environment's
versions="${AIR_MAGIC_LAB_VERSIONS:-jupyterlab==4.4.10 notebook==7.4.7}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
server="$work/venv/bin/python"
pip() { env -u PYTHONPATH "$server" -m pip --disable-pip-version-check "$@"; }  # its own packages only
# air_magic without its dependencies: the server imports only `import air_magic`'s
# (cloudpickle) and its lint package's (libcst, nbformat); torch, MLflow and the rest stay
# with the kernels. jupyterlab_widgets draws the live panel, as ipywidgets brings it into a
# user's environment.
# shellcheck disable=SC2086
pip install -q $versions jupyterlab_widgets cloudpickle libcst nbformat
# From a copy of the checkout as it is (tracked and new files, not what git ignores): pip
# builds in the source folder and leaves build/ and air_magic.egg-info there.
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
  | tar --null -T - -cf - | tar -xf - -C "$work/src"
pip install -q --no-deps "$work/src"
pip list 2>/dev/null | grep -iE "^(jupyterlab|notebook|jupyter.server|air.magic) "
env -u PYTHONPATH "$server" -m jupyter labextension list 2>&1 | grep -F "air-magic-labextension"
AIR_MAGIC_UI_SERVER_PYTHON="$server" "$python" -m pytest -q -p no:cacheprovider tests/lab/test_lab_browser.py "$@"
