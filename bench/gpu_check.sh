#!/usr/bin/env bash
# One prepared call for a lent GPU machine (the device tool's `run`): the CUDA
# tests, then the kernel benchmark, everything written under $OUT. It installs
# nothing: the machine has no network; its image's python3 holds torch, triton,
# pytest, tqdm and transformers, and this repository is used from the working
# tree through PYTHONPATH.
#
#   device run:  bash bench/gpu_check.sh   (timeout_s 560; steps 1-2 take at most ~8.5 min)
#   by hand:     OUT=/tmp/gpu_check bash bench/gpu_check.sh
#
# At most 8 files come back from $OUT: env.txt, pytest_gpu.log, bench_kernels.log,
# kernels.json, kernels_table.md (and, later, the end-to-end files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__); print(torch.cuda.get_device_name(0))'
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ---- 1. CUDA tests (kernels at serving sizes, sampler bit equality and distribution)
echo "== pytest tests/gpu"
timeout 220 "$PY" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/pytest_gpu.log"
test "${PIPESTATUS[0]}" -eq 0 || status=1

# ---- 2. kernel benchmark (table on stdout, JSON + table under $OUT)
echo "== bench/kernels.py"
timeout 280 "$PY" bench/kernels.py --out "$OUT" --budget-s 220 2>&1 | tee "$OUT/bench_kernels.log"
test "${PIPESTATUS[0]}" -eq 0 || status=1

# ---- 3. end-to-end benchmark: TO BE ADDED (another issue)
# The pipeline benchmark (speedup of drafter + verifier over the target alone,
# acceptance rate, verifier idle fraction; DESIGN.md §8) goes here, writing at
# most 3 more files under $OUT so the total stays within the 8 that come back.
# Keep steps 1-3 inside the device call's 600 s: shrink step 2 (--budget-s) if needed.

echo "== gpu_check done, status $status"
exit $status
