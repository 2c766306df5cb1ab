#!/usr/bin/env bash
# One prepared call for a lent GPU machine (the device tool's `run`): the CUDA
# tests, the forward benchmark and the end-to-end benchmark, everything written
# under $OUT. It installs nothing from the network: the machine has none; its
# image's python3 holds torch, triton, pytest, tqdm, transformers, msgpack and
# grpcio, and this repository is used from the working tree through PYTHONPATH.
# Ray and pydantic, which the image lacks, travel packed by bench/device_site.sh
# as .whl/site.tar.xz and are unpacked to /tmp/site.
#
#   here:        bash bench/device_site.sh          (once; needs the package registry)
#   device run:  bash bench/gpu_check.sh   with carry [".whl"], timeout_s 560
#                (the default steps' own limits add to 480 s: env, tests 140, forward 70,
#                e2e 270; a 15-minute budget holds it with a rerun's room to spare)
#   by hand:     OUT=/tmp/gpu_check bash bench/gpu_check.sh
#   some steps:  STEPS="forward e2e" bash bench/gpu_check.sh
#   more points: CORRUPTION=0,0.1,0.2,0.35,0.5,0.8 STEPS=e2e bash bench/gpu_check.sh
#   not run by default (each ~2-4 min): kernels (the kernel table), e2e-layered (the e2e
#                step with the 1B-shaped layered draft instead of the EAGLE head),
#                e2e-overlapped (the actors' forwards overlapped on the one GPU instead of
#                taking turns), e2e-restart (that with restart trees)
#
# The default e2e step: bf16 end to end, an 8B-shaped target and a one-layer EAGLE-style
# head (random weights; bench/replay.py's corrupted replay sets acceptance), every shape
# the planner can choose a CUDA graph captured at the actors' start-up; exactness against
# the target alone through the same (K+1)-row forwards, near-ties judged by bench/ties.py.
#
# What comes back from $OUT with the default steps (at most 8 files): env.txt,
# pytest_gpu.log, gpu_forward.json, gpu_e2e.log (gpu_forward's output too),
# gpu_e2e_async_gpu.json and its PNG; kernels adds bench_kernels.log, kernels.json and
# kernels_table.md (then leave a step out or 8 is exceeded).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
STEPS=${STEPS:-tests forward e2e}
CORRUPTION=${CORRUPTION:-0,0.1,0.2,0.5}      # the e2e steps' replay corruption rates
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

# ---- 1. CUDA tests (kernels at serving sizes, sampler bit equality and distribution, graphs)
if want tests; then
  echo "== pytest tests/gpu ($((SECONDS - t0)) s)"
  timeout 140 "$PY" -m pytest -q -p no:cacheprovider --durations=8 tests/gpu 2>&1 | tee "$OUT/pytest_gpu.log"
  test "${PIPESTATUS[0]}" -eq 0 || status=1
fi

# ---- 2. one target forward in-process, bf16: wall vs device time, launches, top operators,
# eager and graphed, for the rows the planner's chains use (1, 2, K+1 = 5, 8)
if want forward; then
  echo "== bench/gpu_forward.py ($((SECONDS - t0)) s)"
  timeout 70 "$PY" bench/gpu_forward.py --out "$OUT" --dtypes bfloat16 --tokens 1 2 5 8 2>&1 | tee "$OUT/gpu_e2e.log"
  test "${PIPESTATUS[0]}" -eq 0 || status=1
fi

# e2e steps: bench/gpu_e2e.py into $OUT (the JSON is rewritten after every point, so a run
# cut short still brings its points back); $1 the tag, the rest its own flags
e2e() {
  local tag=$1; shift
  echo "== bench/gpu_e2e.py --tag $tag $* ($((SECONDS - t0)) s)"
  timeout 270 "$PY" bench/gpu_e2e.py --tag "$tag" --dtype bfloat16 --out "$OUT" --ray-logs \
    --forward-json "$OUT/gpu_forward.json" --corruption "$CORRUPTION" "$@" 2>&1 | tee -a "$OUT/gpu_e2e.log"
  test "${PIPESTATUS[0]}" -eq 0 || status=1
}

# ---- 3. end to end: the async pipeline, bf16, 8B-shaped target, one-layer EAGLE-style head
want e2e && e2e gpu --draft eagle
# ---- (not by default) the same with the 1B-shaped layered draft, to set beside it
want e2e-layered && e2e gpu-layered --draft layered
# ---- (not by default) the actors' forwards overlapped on the one GPU (lockstep_shared_gpu off)
want e2e-overlapped && e2e gpu-overlapped --draft eagle --no-lockstep-shared-gpu
# ---- (not by default) that with restart trees instead of bridges after a contradicted outcome
want e2e-restart && e2e gpu-restart --draft eagle --no-lockstep-shared-gpu --restart-depth 1

# ---- (not by default) kernel benchmark (table on stdout, JSON + table under $OUT)
if want kernels; then
  echo "== bench/kernel_bench.py ($((SECONDS - t0)) s)"
  timeout 150 "$PY" bench/kernel_bench.py --out "$OUT" --budget-s 110 2>&1 | tee "$OUT/bench_kernels.log"
  test "${PIPESTATUS[0]}" -eq 0 || status=1
fi

echo "== gpu_check done in $((SECONDS - t0)) s, status $status"
exit $status
