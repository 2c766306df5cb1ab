#!/usr/bin/env bash
# One prepared call for a lent GPU machine (the device tool's `run`): the CUDA
# tests, then the kernel benchmark, everything written under $OUT. It installs
# nothing: the machine has no network; its image's python3 holds torch, triton,
# pytest, tqdm and transformers, and this repository is used from the working
# tree through PYTHONPATH.
#
#   device run:  bash bench/gpu_check.sh   (timeout_s 600; the steps' own limits add to 740 s,
#                in practice steps 1-2 end well inside theirs)
#   by hand:     OUT=/tmp/gpu_check bash bench/gpu_check.sh
#
# At most 8 files come back from $OUT: env.txt, pytest_gpu.log, bench_kernels.log,
# kernels.json, kernels_table.md, gpu_e2e.log, gpu_e2e_async_gpu.json and its PNG.
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
echo "== bench/kernel_bench.py"
timeout 280 "$PY" bench/kernel_bench.py --out "$OUT" --budget-s 220 2>&1 | tee "$OUT/bench_kernels.log"
test "${PIPESTATUS[0]}" -eq 0 || status=1

# ---- 3. end-to-end benchmark: the async pipeline on an 8B-shaped target and a 1B-shaped
# draft (random bf16 weights, benchmark-only corrupted-replay drafter: acceptance is set
# by the corruption rate), speedup vs acceptance beside Eq. 3.2 (bench/gpu_e2e.py).
echo "== bench/gpu_e2e.py"
timeout 240 "$PY" bench/gpu_e2e.py --tag gpu --max-tokens 64 --prompts 2 2>&1 | tee "$OUT/gpu_e2e.log"
test "${PIPESTATUS[0]}" -eq 0 || status=1
cp bench/results/gpu_e2e_async_gpu.json bench/results/gpu_e2e_async_speedup_vs_acceptance_gpu.png "$OUT/" 2>/dev/null || status=1

echo "== gpu_check done, status $status"
exit $status
