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
#                (the steps' own limits add to 590 s; in practice they end well inside)
#   by hand:     OUT=/tmp/gpu_check bash bench/gpu_check.sh
#   some steps:  STEPS="forward e2e" bash bench/gpu_check.sh
#   more points: CORRUPTION=0,0.1,0.2,0.35,0.5,0.8 STEPS=e2e bash bench/gpu_check.sh
#                (e2e-overlapped, not run by default: the e2e step with the actors' forwards
#                overlapped on the one GPU instead of taking turns; e2e-restart: that with
#                restart trees, STEPS="e2e-overlapped e2e-restart")
#
# At most 8 files come back from $OUT: env.txt, pytest_gpu.log, bench_kernels.log
# (its table also in kernels_table.md), kernels.json, gpu_forward.json,
# gpu_e2e.log (with gpu_forward's output), gpu_e2e_async_gpu.json and its PNG.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
STEPS=${STEPS:-tests kernels forward e2e}
CORRUPTION=${CORRUPTION:-0,0.2,0.5,0.8}      # the e2e steps' replay corruption rates
status=0
t0=$SECONDS
want() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }

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
if want tests; then
  echo "== pytest tests/gpu ($((SECONDS - t0)) s)"
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider --durations=8 tests/gpu 2>&1 | tee "$OUT/pytest_gpu.log"
  test "${PIPESTATUS[0]}" -eq 0 || status=1
fi

# ---- 2. kernel benchmark (table on stdout, JSON + table under $OUT)
if want kernels; then
  echo "== bench/kernel_bench.py ($((SECONDS - t0)) s)"
  timeout 150 "$PY" bench/kernel_bench.py --out "$OUT" --budget-s 110 2>&1 | tee "$OUT/bench_kernels.log"
  test "${PIPESTATUS[0]}" -eq 0 || status=1
fi

# ---- 3. one target forward in-process: wall vs device time, launches, top operators
if want forward; then
  echo "== bench/gpu_forward.py ($((SECONDS - t0)) s)"
  timeout 90 "$PY" bench/gpu_forward.py --out "$OUT" 2>&1 | tee "$OUT/gpu_e2e.log"
  test "${PIPESTATUS[0]}" -eq 0 || status=1
fi

# ---- 4. end-to-end benchmark: the async pipeline on an 8B-shaped target and a 1B-shaped
# draft (random weights, benchmark-only corrupted-replay drafter: acceptance is set by the
# corruption rate), speedup vs acceptance beside Eq. 3.2 (bench/gpu_e2e.py). In float32:
# a random 8B's top two logits are close enough that bf16 rounding differences between a
# 1-token and a (K+1)-token forward flip greedy tokens within a few steps (seen on an H200:
# outputs left the recorded continuation at token 2-5), after which the replay has
# nothing to replay and the figure says nothing about acceptance. The JSON is rewritten
# after every point, so a run cut short still brings its points back.
if want e2e; then
  echo "== bench/gpu_e2e.py ($((SECONDS - t0)) s)"
  timeout 200 "$PY" bench/gpu_e2e.py --tag gpu --dtype float32 --max-tokens 64 --prompts 2 --ray-logs \
    --corruption "$CORRUPTION" 2>&1 | tee -a "$OUT/gpu_e2e.log"
  test "${PIPESTATUS[0]}" -eq 0 || status=1
  cp bench/results/gpu_e2e_async_gpu.json "$OUT/" 2>/dev/null || status=1
  cp bench/results/gpu_e2e_async_speedup_vs_acceptance_gpu.png "$OUT/" 2>/dev/null || status=1
fi

# ---- 5. (not in the default STEPS) the same end-to-end run with the two actors' forwards
# overlapped on the one GPU (lockstep_shared_gpu off), beside step 4's lockstep
if want e2e-overlapped; then
  echo "== bench/gpu_e2e.py --no-lockstep-shared-gpu ($((SECONDS - t0)) s)"
  timeout 200 "$PY" bench/gpu_e2e.py --tag gpu-overlapped --no-lockstep-shared-gpu --dtype float32 \
    --max-tokens 64 --prompts 2 --corruption "$CORRUPTION" 2>&1 | tee -a "$OUT/gpu_e2e.log"
  test "${PIPESTATUS[0]}" -eq 0 || status=1
  cp bench/results/gpu_e2e_async_gpu-overlapped.json "$OUT/" 2>/dev/null || status=1
fi

# ---- 6. (not in the default STEPS) step 5 with restart trees instead of bridges after a
# contradicted outcome (restart_depth 1), to set beside step 5's run
if want e2e-restart; then
  echo "== bench/gpu_e2e.py --no-lockstep-shared-gpu --restart-depth 1 ($((SECONDS - t0)) s)"
  timeout 200 "$PY" bench/gpu_e2e.py --tag gpu-restart --no-lockstep-shared-gpu --restart-depth 1 \
    --dtype float32 --max-tokens 64 --prompts 2 --corruption "$CORRUPTION" 2>&1 | tee -a "$OUT/gpu_e2e.log"
  test "${PIPESTATUS[0]}" -eq 0 || status=1
  cp bench/results/gpu_e2e_async_gpu-restart.json "$OUT/" 2>/dev/null || status=1
fi

echo "== gpu_check done in $((SECONDS - t0)) s, status $status"
exit $status
