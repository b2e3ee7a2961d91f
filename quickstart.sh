#!/usr/bin/env bash
# Set up this machine and run the quickstart notebook headless in a real kernel:
# the DDP training example on every GPU (or 2 CPU ranks), its per-rank results and
# its MLflow run.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup_env.sh
. .venv/bin/activate
mkdir -p .quickstart && cd .quickstart
echo "[quickstart] running notebooks/quickstart.ipynb in a real kernel; each cell's output shows as it runs" >&2
python ../scripts/run_notebook.py ../notebooks/quickstart.ipynb --output quickstart.executed.ipynb
