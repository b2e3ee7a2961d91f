#!/usr/bin/env bash
# Create benchmarks/launch/.venv with a pinned CPU torch and every launcher
# that run.py compares. Safe to rerun: it reuses an existing venv.
#
#   bash benchmarks/launch/setup_env.sh            # from anywhere
#   PYTHON=python3.11 bash benchmarks/launch/setup_env.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="$HERE/.venv"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"

# Peer versions under test. Keep in sync with README.md.
PEERS=(
  "accelerate==1.15.0"
  "torchpod==0.1.2"
  "nbdistributed==0.1.0"
  "ipyparallel==9.2.0"
  "jupyter-distributed==0.1.1"
)
HARNESS=(ipykernel jupyter_client psutil cloudpickle)

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip setuptools wheel

# 1. torch first, pinned. A constraints file keeps every later install from
#    replacing it (a peer that asks for another torch then fails loudly
#    instead of silently pulling a different build).
echo "[setup] installing $TORCH_PIN"
"${PIP[@]}" install -q "$TORCH_PIN"
CONSTRAINTS="$VENV/torch-constraint.txt"
echo "$TORCH_PIN" > "$CONSTRAINTS"

# 2. harness deps and peers, all resolved against the torch pin.
#    No peer needs --no-deps with torch 2.13.0 (checked below).
echo "[setup] installing harness deps and peers: ${PEERS[*]}"
"${PIP[@]}" install -q -c "$CONSTRAINTS" "${HARNESS[@]}" "${PEERS[@]}"

# 3. air_magic from the repo root, editable, if the package is there yet.
if [ -f "$ROOT/pyproject.toml" ]; then
  echo "[setup] installing air_magic (editable) from $ROOT"
  "${PIP[@]}" install -q -c "$CONSTRAINTS" -e "$ROOT"
else
  echo "[setup] $ROOT/pyproject.toml not found: air_magic not installed;"
  echo "        run.py will skip it. Rerun this script once the package exists."
fi

# 4. check the pin held.
got="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
case "$got" in
  2.13.0*) echo "[setup] torch $got OK" ;;
  *) echo "[setup] ERROR: torch is $got, expected 2.13.0" >&2; exit 1 ;;
esac
"$VENV/bin/python" -m pip check || echo "[setup] (pip check reported the above; see README)"
"$VENV/bin/python" -m ipykernel --version >/dev/null
echo "[setup] done: $VENV"
