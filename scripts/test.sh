#!/usr/bin/env bash
# Install everything, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY="${VIRTUAL_ENV:-$PWD/.venv}/bin/python"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
# --durations: the slowest tests in every CI log, to keep the run under 20 minutes
exec "$PY" -m pytest -q --durations=40 "$@"
