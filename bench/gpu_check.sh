#!/usr/bin/env bash
# One prepared call for a lent GPU machine (the device tool's `run`): the CUDA
# tests, the kernel benchmark and the end-to-end benchmark, everything written
# under $OUT. It installs nothing from the network: the machine has none; its
# image's python3 holds torch, triton, pytest, tqdm, transformers, msgpack and
# grpcio, and this repository is used from the working tree through PYTHONPATH.
# Ray and pydantic, which the image lacks, travel packed by bench/device_site.sh
# as .whl/site.tar.xz and are unpacked to /tmp/site.
#
#   here:        bash bench/device_site.sh          (once; needs the package registry)
#   device run:  bash bench/gpu_check.sh   with carry [".whl"], timeout_s 560
#                (the steps' own limits add to 530 s)
#   by hand:     OUT=/tmp/gpu_check bash bench/gpu_check.sh
#
# At most 8 files come back from $OUT: env.txt, pytest_gpu.log, bench_kernels.log,
# kernels.json, kernels_table.md, gpu_e2e.log, gpu_e2e_async_gpu.json and its PNG.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0
t0=$SECONDS

site=""
if [ -f .whl/site.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .whl/site.tar.xz -C /tmp/site && site=/tmp/site
fi
export PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__); print(torch.cuda.get_device_name(0))'
  "$PY" -c 'import ray; print("ray", ray.__version__)' || echo "ray missing: run bench/device_site.sh here and carry .whl"
  df -h /dev/shm /tmp 2>/dev/null | tail -n +2
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ---- 1. CUDA tests (kernels at serving sizes, sampler bit equality and distribution)
echo "== pytest tests/gpu ($((SECONDS - t0)) s)"
timeout 170 "$PY" -m pytest -q -p no:cacheprovider --durations=8 tests/gpu 2>&1 | tee "$OUT/pytest_gpu.log"
test "${PIPESTATUS[0]}" -eq 0 || status=1

# ---- 2. kernel benchmark (table on stdout, JSON + table under $OUT)
echo "== bench/kernel_bench.py ($((SECONDS - t0)) s)"
timeout 150 "$PY" bench/kernel_bench.py --out "$OUT" --budget-s 110 2>&1 | tee "$OUT/bench_kernels.log"
test "${PIPESTATUS[0]}" -eq 0 || status=1

# ---- 3. end-to-end benchmark: the async pipeline on an 8B-shaped target and a 1B-shaped
# draft (random bf16 weights, benchmark-only corrupted-replay drafter: acceptance is set
# by the corruption rate), speedup vs acceptance beside Eq. 3.2 (bench/gpu_e2e.py).
# The JSON is rewritten after every point, so a run cut short still brings its points back.
echo "== bench/gpu_e2e.py ($((SECONDS - t0)) s)"
timeout 210 "$PY" bench/gpu_e2e.py --tag gpu --max-tokens 96 --prompts 3 2>&1 | tee "$OUT/gpu_e2e.log"
test "${PIPESTATUS[0]}" -eq 0 || status=1
cp bench/results/gpu_e2e_async_gpu.json "$OUT/" 2>/dev/null || status=1
cp bench/results/gpu_e2e_async_speedup_vs_acceptance_gpu.png "$OUT/" 2>/dev/null || status=1

echo "== gpu_check done in $((SECONDS - t0)) s, status $status"
exit $status
