#!/usr/bin/env bash
# Build the documentation site into docs/_build/html, warnings as errors (nitpicky references,
# internal links checked). --serve: then serve it at http://127.0.0.1:${PORT:-8000} (loopback only).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
"$python" -m sphinx -W --keep-going -n -q -b html -d docs/_build/doctrees docs docs/_build/html
echo "docs: $(pwd)/docs/_build/html/index.html" >&2
if [ "${1:-}" = "--serve" ]; then
  exec "$python" -m http.server --bind 127.0.0.1 --directory docs/_build/html "${PORT:-8000}"
fi
