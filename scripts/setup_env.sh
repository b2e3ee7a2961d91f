#!/usr/bin/env bash
# Create .venv in the repository and install air_magic with its test tools.
# torch: on a machine without an NVIDIA GPU the pinned CPU-friendly release is installed
# first; with a GPU, pip picks the CUDA build that `torch>=2.4` resolves to.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip -q is silent for minutes: a line per step says what runs, and how long set-up took so far.
step() { echo "[setup $(printf '%3d' "$SECONDS") s] $*" >&2; }
step "creating the virtual environment .venv"
python3 -m venv .venv
. .venv/bin/activate
step "upgrading pip"
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    step "installing torch>=2.4 (a GPU is here: pip picks its CUDA build, a download of some GB)"
    python -m pip install -q "torch>=2.4"
  else
    step "installing ${AIR_MAGIC_TORCH:-torch==2.13.0} (no NVIDIA GPU here: the CPU build)"
    python -m pip install -q "${AIR_MAGIC_TORCH:-torch==2.13.0}"
  fi
fi
# The test extra brings DeepSpeed and transformers (every notebook runs in the suite) and Ray
# (ray_init() and the Ray tests). DeepSpeed installs as pure Python with DS_BUILD_OPS=0 (its ops
# are built when first used), and nothing may replace the torch installed above: it is pinned
# for this step.
export DS_BUILD_OPS="${DS_BUILD_OPS:-0}"
pin="$(mktemp)"
python -W ignore -c "import torch; print('torch==' + torch.__version__)" > "$pin"
step "installing air_magic and its test tools (MLflow, JupyterLab, DeepSpeed, transformers, Ray...): the longest step"
# setuptools prints an "Editable installation" notice (folders named like the package may
# shadow it): here the air_magic/ folder it means is the installed package itself.
echo "             (setuptools' \"Editable installation\" notice below is harmless: the air_magic/ folder it warns of is this package)" >&2
python -m pip install -q -e ".[test]" -c "$pin"
rm -f "$pin"
# An editable install does not place the data files Jupyter reads (a regular `pip install .`
# does): link the prebuilt JupyterLab extension and switch the server extension on.
step "linking the JupyterLab extension"
prefix="$(python -c 'import sys; print(sys.prefix)')"
mkdir -p "$prefix/share/jupyter/labextensions" "$prefix/etc/jupyter/jupyter_server_config.d"
ln -sfn "$PWD/air_magic/labextension" "$prefix/share/jupyter/labextensions/air-magic-labextension"
cp jupyter-config/jupyter_server_config.d/air_magic.json "$prefix/etc/jupyter/jupyter_server_config.d/"
step "done: .venv is ready"
